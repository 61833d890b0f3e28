"""``shared_prefix``: the leading whole blocks two prompts have in common, as the store's lookup counts
them (at most the first prompt's length minus one), against a token-by-token reference."""

from __future__ import annotations

import random

import pytest

from torch_kvoffload.core.prefix import shared_prefix


def _reference(prompt: list[int], other: list[int], block: int) -> int:
    same = 0
    while same < min(len(prompt), len(other)) and prompt[same] == other[same]:
        same += 1
    return min(same, len(prompt) - 1) // block * block


@pytest.mark.parametrize("block", [1, 4, 16])
def test_random_prompts_match_the_token_by_token_reference(block):
    rng = random.Random(block)
    for _ in range(300):
        base = [rng.randrange(5) for _ in range(rng.randrange(1, 70))]
        prompt = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(5))]
        other = base[: rng.randrange(0, len(base) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(5))]
        assert shared_prefix(prompt, other, block) == _reference(prompt, other, block), (prompt, other)


def test_edges():
    p = list(range(16))
    assert shared_prefix(p, p, 4) == 12  # one token left to compute: the last whole block is not taken
    assert shared_prefix([*p, 0], p, 4) == 16
    assert shared_prefix(p, p[:7], 4) == 4  # only the other's full blocks
    assert shared_prefix([1], [1], 1) == 0 and shared_prefix(p, [], 4) == 0
    assert shared_prefix(p, [9, *p[1:]], 4) == 0

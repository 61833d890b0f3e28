"""Block runs of a forward's block tables and the bundle byte ranges they select."""

from __future__ import annotations

import random

import pytest
import torch
from support.kvpp_helpers import consecutive_runs, small_allocation

from torch_kvoffload.kvpp import block_runs, run_byte_ranges


def _random_tables(rng: random.Random, num_blocks: int) -> list[list[int]]:
    tables = []
    for _ in range(rng.randint(1, 6)):
        start = rng.randrange(num_blocks)
        length = rng.randint(1, 5)
        table = [b for b in range(start, min(start + length, num_blocks))]
        table += rng.sample(range(num_blocks), rng.randint(0, min(3, num_blocks)))  # a few scattered blocks
        tables.append(table)
    return tables


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("num_blocks", [1, 7, 64])
def test_runs_are_the_union_in_consecutive_runs(seed: int, num_blocks: int) -> None:
    rng = random.Random(seed * 100 + num_blocks)
    tables = _random_tables(rng, num_blocks)
    wanted = {b for t in tables for b in t}
    assert block_runs(tables, num_blocks) == consecutive_runs(wanted)
    # the same tables as a padded tensor [requests, max blocks] with -1 padding
    width = max(len(t) for t in tables) + 1
    padded = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    assert block_runs(padded, num_blocks) == consecutive_runs(wanted)
    assert block_runs([], num_blocks) == [] == block_runs(torch.full((2, 3), -1), num_blocks)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("max_runs", [1, 2, 3, 5])
def test_max_runs_merges_the_smallest_gaps(seed: int, max_runs: int) -> None:
    rng = random.Random(seed)
    num_blocks = 200
    wanted = set(rng.sample(range(num_blocks), rng.randint(1, 30)))
    natural = consecutive_runs(wanted)
    runs = block_runs([sorted(wanted)], num_blocks, max_runs=max_runs)
    assert len(runs) == min(max_runs, len(natural))
    covered = [b for s, t in runs for b in range(s, t)]
    assert len(covered) == len(set(covered)) and covered == sorted(covered)  # disjoint, sorted
    assert wanted <= set(covered)
    assert runs[0][0] == min(wanted) and runs[-1][1] == max(wanted) + 1
    # the extra blocks are exactly the smallest gaps a budget of max_runs runs must fill
    gaps = sorted(natural[i + 1][0] - natural[i][1] for i in range(len(natural) - 1))
    must_merge = max(0, len(natural) - max_runs)
    assert len(covered) - len(wanted) == sum(gaps[:must_merge])


def test_block_runs_reject_bad_tables() -> None:
    with pytest.raises(ValueError, match=r"block 8, out of range \[0, 8\)"):
        block_runs(torch.tensor([[1, 8]]), 8)
    with pytest.raises(ValueError, match="-2"):
        block_runs(torch.tensor([[1, -2]]), 8)
    with pytest.raises(ValueError, match=r"block_tables\[1\] entry must be <= 7, got 9"):
        block_runs([[1], [9]], 8)
    with pytest.raises(TypeError, match="integer tensor"):
        block_runs(torch.zeros(2, 2), 8)
    with pytest.raises(TypeError, match=r"block_tables\[0\] must be a sequence"):
        block_runs([3], 8)
    with pytest.raises(TypeError, match="must be an int"):
        block_runs([[1.5]], 8)
    with pytest.raises(ValueError, match="max_runs must be >= 1"):
        block_runs([[1]], 8, max_runs=0)


@pytest.mark.parametrize("runs", [[(0, 1)], [(1, 3), (5, 6)], [(0, 7)], [(2, 4), (6, 7)], [(0, 2), (4, 7)]])
def test_byte_ranges_select_exactly_the_runs_of_every_component(runs) -> None:
    per_block, num_blocks = [12, 4, 20], 7
    offsets = [0, 12 * num_blocks, 16 * num_blocks]  # component-major, written out
    want = {
        offsets[c] + b * per_block[c] + k
        for c in range(3)
        for s, t in runs
        for b in range(s, t)
        for k in range(per_block[c])
    }
    ranges = run_byte_ranges(per_block, num_blocks, runs)
    got = [x for begin, end in ranges for x in range(begin, end)]
    assert len(got) == len(set(got)) and set(got) == want
    assert all(ranges[i][1] < ranges[i + 1][0] for i in range(len(ranges) - 1))  # touching ones merged
    if runs == [(0, 7)]:
        assert ranges == [(0, 36 * 7)]
    with pytest.raises(ValueError, match="after the previous run"):
        run_byte_ranges(per_block, num_blocks, [(3, 5), (4, 6)])
    with pytest.raises(ValueError, match="non-empty"):
        run_byte_ranges(per_block, num_blocks, [(3, 3)])


def test_allocation_run_spans_are_slices_of_the_bundle_span() -> None:
    alloc = small_allocation(5, 2, 1, num_blocks=6)
    for layer in (0, 3):  # a scratch layer and an owned one
        span = alloc.bundle_span(layer)
        whole = alloc.run_spans(layer)
        assert len(whole) == 1 and whole[0].data_ptr() == span.data_ptr() and whole[0].numel() == span.numel()
        spans = alloc.run_spans(layer, [(1, 2), (4, 6)])
        per_block = [4 * 16 * 4, 4 * 8 * 4, 4 * 8 * 4]  # block_size x dim x fp32
        assert [s.numel() for s in spans] == [per_block[c] * n for c in range(3) for n in (1, 2)]
        for s in spans:
            assert s.dtype == torch.uint8 and s.is_contiguous()
            assert (
                span.data_ptr() <= s.data_ptr() and s.data_ptr() + s.numel() <= span.data_ptr() + span.numel()
            )
        # writing the spans writes exactly blocks 1, 4, 5 of every component view
        span.zero_()
        for s in spans:
            s.fill_(1)
        for v in alloc.views(layer).values():
            touched = [b for b in range(6) if bool((v.view(torch.uint8)[b] == 1).all())]
            untouched = [b for b in range(6) if bool((v.view(torch.uint8)[b] == 0).all())]
            assert touched == [1, 4, 5] and untouched == [0, 2, 3]

"""``KVCore`` forwards with padding anywhere: right, inside, whole rows, in later forwards and decode steps.

A padding position keeps no KV but its query attends over its request's real tokens before it (what the
Hugging Face model computes for it); one that sees none gets zero. The reference is pure PyTorch over
each request's own rows: the lightning indexer's top-k (``index_topk`` below the context, so the selection
is really sparse) then a softmax over the selected rows, or a dense causal softmax without an indexer.
"""

from __future__ import annotations

import pytest
import torch
from support.core_driver import CORE_CONFIGS, TOY_SCALE, CoreDriver, toy_spec

from torch_kvoffload.core.config import OffloadConfig
from torch_kvoffload.core.kv import KVCore
from torch_kvoffload.kv.forward import visible_padding
from torch_kvoffload.kv.spec import ModelSpec

BS, TOPK = 4, 5
SCALE = TOY_SCALE


def _spec(indexer: bool) -> ModelSpec:
    return toy_spec(indexer, top_k=TOPK)


CONFIGS = {**CORE_CONFIGS, "layerwise-indexed": (True, {"layerwise": {}})}


def _driver(core: KVCore, seed: int = 0) -> CoreDriver:
    """Checks every position, padding included, against the reference (outputs NaN before attention;
    positive indexer keys and queries: no score is exactly 0, the top-k has no ties)."""
    return CoreDriver(core, scale=SCALE, seed=seed, positive_index=True, fill=float("nan"), padding="check")


def _forward(drv: CoreDriver, requests, mask: torch.Tensor):
    """One forward of random tokens at the true positions of ``mask``."""
    return drv.forward(requests, drv.random_tokens(*mask.sum(1).tolist()), mask)


def _m(*rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_visible_padding_matches_a_loop():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        B, S = torch.randint(1, 5, (2,), generator=g).tolist()
        mask = torch.rand(B, S, generator=g) < 0.5
        old = torch.randint(0, 3, (B,), generator=g).tolist()
        want_at, want_len = [], []
        for b in range(B):
            for s in range(S):
                v = old[b] + int(mask[b, : s + 1].sum())
                if not mask[b, s] and v > 0:
                    want_at.append(b * S + s)
                    want_len.append(v)
        at, lens = visible_padding(mask, old)
        assert at.tolist() == want_at and lens.tolist() == want_len


@pytest.mark.parametrize("name", list(CONFIGS))
def test_padding_anywhere_in_every_forward(name):
    indexer, cfg = CONFIGS[name]
    core = KVCore(_spec(indexer), OffloadConfig(**cfg, block_size=BS), name=f"pad-{name}")
    try:
        core.size(3, 24)
        reqs = core.admit(3)
        drv = _driver(core)
        # right padding, padding inside, a row with no real token
        first = [0] * 10
        _forward(drv, reqs, _m([1, 1, 1, 1, 1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 1, 1, 1, 0, 1], first))
        assert drv.last.n_pad > 0 and not drv.last.decode
        # a padded chunk of a later forward (row 1 has no real token in it)
        _forward(drv, reqs, _m([1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 1, 1, 0, 1, 0]))
        # decode steps: all rows, then one row skipping its step, then all rows again
        _forward(drv, reqs, _m([1], [1], [1]))
        assert drv.last.decode == ("sparse" in cfg)
        _forward(drv, reqs, _m([1], [0], [1]))
        assert not drv.last.decode and drv.last.n_pad == 1
        _forward(drv, reqs, _m([1], [1], [1]))
        # left padding in a later forward sees the earlier tokens
        _forward(drv, reqs, _m([0, 0, 1], [0, 1, 1], [1, 1, 1]))
        assert [r.length for r in reqs] == [13, 10, 9]
    finally:
        core.close()


LAYERWISE = [n for n in CONFIGS if "layerwise" in n]


@pytest.mark.parametrize("name", LAYERWISE)
def test_rows_without_new_tokens_in_layerwise_forwards(name):
    """Rows with no token yet, then rows with no new token whose earlier tokens fill whole blocks (all
    loaded from the store, none computed again) or end in a partial block (kept in the device tail)."""
    indexer, cfg = CONFIGS[name]
    core = KVCore(_spec(indexer), OffloadConfig(**cfg, block_size=BS), name=f"pad-idle-{name}")
    try:
        core.size(3, 24)
        reqs = core.admit(3)
        drv = _driver(core, seed=1)
        _forward(drv, reqs, _m([1] * 8, [0] * 8, [0, 1, 1, 1, 1, 1, 0, 0]))  # row 1: no token yet
        _forward(drv, reqs, _m([0, 0, 0], [0, 0, 0], [0, 0, 0]))  # no new token anywhere
        assert [r.length for r in reqs] == [8, 0, 5]
        # row 0 (two full blocks) and row 2 (a partial block) skip, row 1 gets its first tokens
        _forward(drv, reqs, _m([0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]))
        _forward(drv, reqs, _m([1, 1, 0], [0, 0, 0], [0, 1, 1]))
        _forward(drv, reqs, _m([1], [0], [1]))  # a decode step where row 1 skips (after 4 + 0 tokens)
        _forward(drv, reqs, _m([1], [1], [1]))
        assert [r.length for r in reqs] == [12, 6, 9]
    finally:
        core.close()


def test_padding_queries_off_plans_no_padding_attention() -> None:
    from torch_kvoffload.kv.forward import plan_forward
    from torch_kvoffload.kv.layout import KVLayout
    from torch_kvoffload.kv.requests import Request

    layout = KVLayout(2, 16, 4)
    reqs = [Request(0, 0, [1, 2]), Request(1, 1)]
    mask = torch.tensor([[True, False, False], [True, True, True]])  # right padding after request 0's token
    kw = dict(decode=False, layerwise=False, device=torch.device("cpu"))
    on = plan_forward(reqs, [2, 0], mask, layout, **kw)
    off = plan_forward(reqs, [2, 0], mask, layout, padding_queries=False, **kw)
    assert on.n_pad == 2 and on.pad_sel.tolist() == [1, 2] and on.pad_len.tolist() == [3, 3]
    assert off.n_pad == 0 and off.pad_sel.numel() == 0
    assert torch.equal(on.sel, off.sel) and torch.equal(on.phys, off.phys)

"""The index tensors of a forward's plan, against a loop over the requests' tokens: batched (padding
anywhere, decode steps) and packed, of few positions (computed from Python ints) and of many (tensor ops)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from torch_kvoffload.kv.forward import plan_forward, plan_packed
from torch_kvoffload.kv.layout import KVLayout
from torch_kvoffload.kv.requests import Request

BS = 4


def _reference(requests, old_len, real: list[list[int]], width: int, layout: KVLayout):
    """Per real position, in request-major order: (flat index, logical position, request row, paged row,
    per-request-cache row); and the tables, from the definitions."""
    M, (page, pages) = layout.blocks_per_request, layout.page
    sel, pos, row, phys, index_phys = [], [], [], [], []
    for b, (r, old, places) in enumerate(zip(requests, old_len, real, strict=True)):
        for i, s in enumerate(places):
            p = old + i
            sel.append(s if width is None else b * width + s)
            pos.append(p)
            row.append(b)
            phys.append(r.slot * M * BS + p)
            index_phys.append(r.slot * pages * page + p)
    table = [[r.slot * M + j for j in range(M)] for r in requests]
    index_table = [[r.slot * pages + j for j in range(pages)] for r in requests]
    return sel, pos, row, phys, index_phys, table, index_table


def _check(fwd, ref, old_len, n_new):
    sel, pos, row, phys, index_phys, table, index_table = ref
    assert fwd.sel.tolist() == sel and fwd.pos.tolist() == pos and fwd.row.tolist() == row
    assert fwd.phys.tolist() == phys and fwd.index_phys.tolist() == index_phys
    assert fwd.block_table.tolist() == table and fwd.index_table.tolist() == index_table
    assert fwd.block_table.dtype == fwd.index_table.dtype == torch.int32
    assert fwd.cu_seqlens_q.tolist() == [sum(n_new[:i]) for i in range(len(n_new) + 1)]
    assert fwd.seq_lens_k.tolist() == [o + n for o, n in zip(old_len, n_new, strict=True)]
    assert fwd.cu_seqlens_q.dtype == fwd.seq_lens_k.dtype == torch.int32
    for t in (fwd.sel, fwd.pos, fwd.row, fwd.phys, fwd.index_phys):
        assert t.dtype == torch.int64 and t.is_contiguous()


@pytest.mark.parametrize("batch", [1, 3, 70])  # a decode batch of few rows, and one of more than 64
def test_a_batched_plan_indexes_every_real_position(batch):
    rng = random.Random(batch)
    layout = KVLayout(slots=batch + 2, tokens=48, block_size=BS)
    slots = rng.sample(range(batch + 2), batch)
    requests = [Request(i, s) for i, s in enumerate(slots)]
    old_len = [rng.randrange(1, 30) for _ in range(batch)]
    # a decode step (one real token each), a chunk with padding anywhere, an unpadded chunk
    for width, density in ((1, 1.0), (5, 0.6), (4, 1.0)):
        mask = torch.rand(batch, width, generator=torch.Generator().manual_seed(batch)) < density
        real = [[s for s in range(width) if mask[b, s]] for b in range(batch)]
        n_new = [len(p) for p in real]
        fwd = plan_forward(requests, old_len, mask, layout, decode=False, layerwise=False, device="cpu")
        _check(fwd, _reference(requests, old_len, real, width, layout), old_len, n_new)
        assert fwd.shape == (batch, width) and fwd.packed == bool(mask.all())


@pytest.mark.parametrize("counts", [[1, 1, 1], [3, 0, 5], [40, 30, 2], [0]])  # few and many positions
def test_a_packed_plan_indexes_every_new_token(counts):
    layout = KVLayout(slots=4, tokens=128, block_size=BS)
    requests = [Request(i, 3 - i) for i in range(len(counts))]
    old_len = [7 * (i + 1) for i in range(len(counts))]
    real, start = [], 0
    for n in counts:
        real.append(list(range(start, start + n)))
        start += n
    fwd = plan_packed(requests, old_len, counts, layout, decode=False, layerwise=False, device="cpu")
    _check(fwd, _reference(requests, old_len, real, None, layout), old_len, counts)
    assert fwd.shape == (1, sum(counts)) and fwd.packed


def test_plans_of_the_same_slots_share_tables_that_nothing_writes():
    layout = KVLayout(slots=2, tokens=16, block_size=BS)
    requests = [Request(0, 1), Request(1, 0)]
    one = torch.ones(2, 1, dtype=torch.bool)
    a = plan_forward(requests, [3, 4], one, layout, decode=True, layerwise=False, device="cpu")
    b = plan_forward(requests, [4, 5], one, layout, decode=True, layerwise=False, device="cpu")
    assert a.block_table is b.block_table  # made once for a batch's decode steps
    with torch.inference_mode():  # a plan made in inference mode keeps tables autograd may read later
        c = plan_forward(requests[::-1], [1, 1], one, layout, decode=True, layerwise=False, device="cpu")
    assert not c.block_table.is_inference() and not c.pad_sel.is_inference()
    assert c.block_table.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # the last KEPT_TABLES sets of slots are kept, with the layout (a resized core plans with a new one)
    cpu = torch.device("cpu")
    for n in range(1, KVLayout.KEPT_TABLES + 3):
        assert layout.tables((0,) * n, cpu)[0].tolist() == [[0, 1, 2, 3]] * n
    assert len(layout._tables) == KVLayout.KEPT_TABLES and ((0,), cpu) not in layout._tables
    other = KVLayout(slots=2, tokens=16, block_size=BS)
    assert other == layout and other.tables((1, 0), torch.device("cpu"))[0] is not a.block_table
    grown = dataclasses.replace(layout, tokens=32)  # how a core grows its layout: tables of 8 blocks
    last = (0,) * (KVLayout.KEPT_TABLES + 2)  # kept by `layout`, not by `grown`
    assert grown.tables(last, cpu)[0].tolist() == [list(range(8))] * len(last)

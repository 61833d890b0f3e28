"""KVPP groups, ownership, bundle layout, the per-rank plan / budget and the physical allocation."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from torch_kvoffload._utils import round_up
from torch_kvoffload.kvpp import (
    SCRATCH_ALIGNMENT,
    BundleSpec,
    ComponentSpec,
    KVPPAllocation,
    KVPPPlan,
    assign_owners,
    bundle_layout,
    extract_layer_index,
    kvpp_groups,
    owned_layers,
)

# --------------------------------------------------------------------------------------------- groups


def _coords(rank: int, dp: int, pp: int, pcp: int, tp: int) -> tuple[int, ...]:
    rank, t = divmod(rank, tp)
    rank, c = divmod(rank, pcp)
    rank, p = divmod(rank, pp)
    e, d = divmod(rank, dp)
    return e, d, p, c, t


@pytest.mark.parametrize(
    ("world", "dp", "pp", "pcp", "tp"),
    [
        (2, 1, 1, 1, 2),
        (8, 1, 1, 1, 8),
        (8, 2, 2, 1, 2),
        (16, 2, 2, 2, 2),
        (24, 1, 3, 2, 2),
        (12, 3, 1, 1, 2),
        (6, 1, 1, 1, 2),
    ],
)
def test_groups_follow_the_rank_layout(world: int, dp: int, pp: int, pcp: int, tp: int) -> None:
    groups = kvpp_groups(world, dp, pp, pcp, tp)
    assert sorted(itertools.chain.from_iterable(groups)) == list(range(world))
    assert all(len(g) == pcp * tp for g in groups)
    assert len(groups) == world // (pcp * tp)
    for g in groups:
        coords = [_coords(r, dp, pp, pcp, tp) for r in g]
        # one (external DP, DP, PP) per group, never crossing them
        assert len({c[:3] for c in coords}) == 1
        # group-local id = flattened (PCP, TP) position
        assert [c[3] * tp + c[4] for c in coords] == list(range(pcp * tp))
    # every (ext DP, DP, PP) combination has exactly one group
    assert len({_coords(g[0], dp, pp, pcp, tp)[:3] for g in groups}) == len(groups)


def test_groups_reject_bad_sizes() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        kvpp_groups(6, 1, 2, 1, 4)
    with pytest.raises(ValueError, match="'tp'"):
        kvpp_groups(4, 1, 1, 1, 0)
    with pytest.raises(ValueError, match="'world_size'"):
        kvpp_groups(-2, 1, 1, 1, 2)


# ------------------------------------------------------------------------------------------ ownership


@pytest.mark.parametrize(
    ("n", "size"), [(61, 2), (61, 4), (61, 8), (4, 4), (3, 4), (0, 2), (7, 3), (1, 1), (10, 1)]
)
def test_ownership_contiguous_balanced(n: int, size: int) -> None:
    layers = list(range(5, 5 + n))  # a PP stage's global layer indices
    owners = assign_owners(layers, size)
    assert set(owners) == set(layers)
    base, rem = divmod(n, size)
    for rank in range(size):
        mine = owned_layers(owners, rank)
        assert len(mine) == base + (1 if rank < rem else 0)
        assert mine == list(range(mine[0], mine[0] + len(mine))) if mine else True
    # contiguity across ranks: owner ids never decrease along the sorted layers
    ranks = [owners[layer] for layer in sorted(layers)]
    assert ranks == sorted(ranks)
    if size > n:
        assert all(not owned_layers(owners, r) for r in range(n, size))


def test_ownership_deterministic_and_excludes_drafts() -> None:
    layers = list(range(10, 30))
    drafts = [30, 31]
    expected = assign_owners(layers, 4)
    rng = random.Random(0)
    for _ in range(5):
        shuffled = layers + drafts
        rng.shuffle(shuffled)
        got = assign_owners(shuffled, 4, draft_layers=drafts)
        assert got == expected
        assert not set(got) & set(drafts)


def test_ownership_errors() -> None:
    with pytest.raises(ValueError, match="repeats"):
        assign_owners([1, 2, 2], 2)
    with pytest.raises(ValueError, match="'size'"):
        assign_owners([1, 2], 0)


def test_extract_layer_index() -> None:
    assert extract_layer_index("model.layers.17.self_attn.attn") == 17
    assert extract_layer_index("transformer.h.3.attn") == 3
    assert extract_layer_index("decoder.5") == 5
    with pytest.raises(ValueError, match="layer index"):
        extract_layer_index("lm_head")


# --------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("num_blocks", [0, 1, 7, 128])
def test_bundle_layout_contiguous(num_blocks: int) -> None:
    per_block = [128 * 512 * 2, 128 * 64 * 2, 128 * 128, 128 * 4]
    spans, total = bundle_layout(per_block, num_blocks)
    cursor = 0
    for (offset, length), pb in zip(spans, per_block, strict=True):
        assert offset == cursor and length == pb * num_blocks
        cursor += length
    assert total == sum(per_block) * num_blocks


def test_bundle_layout_errors() -> None:
    with pytest.raises(ValueError, match="component 1"):
        bundle_layout([4, 0], 3)
    with pytest.raises(ValueError, match="num_blocks"):
        bundle_layout([4], -1)


def test_bundle_spec_bytes() -> None:
    v3 = BundleSpec.mla(128, 512, 64, torch.bfloat16, index_dim=128)
    assert v3.bytes_per_block == 128 * (512 + 64 + 128) * 2
    c8 = BundleSpec.mla(
        128, 512, 64, torch.bfloat16, index_dim=128, index_dtype=torch.int8, index_scales=True
    )
    assert c8.bytes_per_block == 128 * (512 + 64) * 2 + 128 * 128 + 128 * 4
    with pytest.raises(ValueError, match="distinct"):
        BundleSpec((ComponentSpec("a", 4, torch.float32), ComponentSpec("a", 4, torch.float32)), 4)


# ----------------------------------------------------------------------------------------------- plan


def _formula(bpb: dict[int, int], owners: dict[int, int], rank: int, draft: int) -> int:
    owned = sum(b for layer, b in bpb.items() if owners[layer] == rank)
    return owned + draft + 2 * max(bpb.values())


def _pad(n: int) -> int:
    """``n`` rounded up to a multiple of 2 MiB."""
    return round_up(n, 2 * 1024 * 1024)


def _alloc_bytes(bpb: dict[int, int], owners: dict[int, int], rank: int, draft: int, n: int) -> int:
    """Persistent bundles + drafts for ``n`` blocks, plus two 2 MiB-padded scratch buffers."""
    owned = sum(b for layer, b in bpb.items() if owners[layer] == rank)
    return (owned + draft) * n + 2 * _pad(max(bpb.values()) * n)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_plan_budget_formula(size: int) -> None:
    rng = random.Random(size)
    layers = list(range(3, 3 + 13))
    bpb = {layer: rng.choice([1024, 2048, 4096, 3000]) for layer in layers}
    owners = assign_owners(layers, size)
    for rank in range(size):
        plan = KVPPPlan(bpb, owners, rank, draft_bytes_per_block=512)
        expected = _formula(bpb, owners, rank, 512)
        assert plan.bytes_per_block == expected
        available = 10 * 1024**3 + 12345
        n = plan.num_blocks(available)
        floor = available // expected
        # the floor formula, less only the blocks the 2 MiB scratch padding needs
        assert floor - math.ceil(2 * SCRATCH_ALIGNMENT / expected) <= n <= floor
        assert (
            _alloc_bytes(bpb, owners, rank, 512, n) <= available < _alloc_bytes(bpb, owners, rank, 512, n + 1)
        )
        assert plan.allocation_bytes(n) == _alloc_bytes(bpb, owners, rank, 512, n)
        # when the padding fits in the floor's remainder, exactly the floor
        k = 1 << 20
        padded = _alloc_bytes(bpb, owners, rank, 512, k)
        assert padded - k * expected < 2 * SCRATCH_ALIGNMENT
        assert plan.num_blocks(k * expected + (padded - k * expected)) == k
    worst = min(KVPPPlan(bpb, owners, r, 512).num_blocks(available) for r in range(size))
    assert plan.group_num_blocks(available, size) == worst


def test_plan_num_blocks_never_overcommits_for_padding() -> None:
    plan = KVPPPlan({0: 1000, 1: 1000}, {0: 0, 1: 1}, 0)
    assert plan.bytes_per_block == 3000
    # floor(available / 3000) = 100 but two scratch buffers padded to 2 MiB each do not fit
    assert plan.num_blocks(300_000) == 0
    available = 2 * SCRATCH_ALIGNMENT + 1000 * 5
    n = plan.num_blocks(available)
    bpb, owners = {0: 1000, 1: 1000}, {0: 0, 1: 1}
    assert _alloc_bytes(bpb, owners, 0, 0, n) <= available < _alloc_bytes(bpb, owners, 0, 0, n + 1)
    with pytest.raises(ValueError, match="available_bytes"):
        plan.num_blocks(-1)


def test_plan_placement() -> None:
    layers = [4, 5, 6, 7, 8]
    owners = assign_owners(layers, 2)  # 4,5,6 -> 0 ; 7,8 -> 1
    plan = KVPPPlan(dict.fromkeys(layers, 100), owners, 1)
    assert plan.owned == [7, 8]
    assert [plan.is_persistent(layer) for layer in layers] == [False, False, False, True, True]
    assert [plan.scratch_index(layer) for layer in layers] == [0, 1, 0, 1, 0]
    assert plan.is_persistent(9)  # a draft layer is always local
    assert plan.next_target(6) == 7 and plan.next_target(8) is None
    with pytest.raises(KeyError, match="not a target layer"):
        plan.scratch_index(9)
    with pytest.raises(ValueError, match="mismatch"):
        KVPPPlan({1: 10}, {2: 0}, 0)
    with pytest.raises(ValueError, match="'rank'"):
        KVPPPlan({1: 10}, {1: 0}, -1)


# ----------------------------------------------------------------------------------------- allocation


def _specs(block_size: int = 4) -> dict[int, BundleSpec]:
    big = BundleSpec.mla(block_size, 16, 8, torch.float32, index_dim=8)
    small = BundleSpec.mla(
        block_size, 8, 4, torch.bfloat16, index_dim=8, index_dtype=torch.int8, index_scales=True
    )
    return {0: big, 1: small, 2: big, 3: small, 4: big}


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_allocation_bytes_equal_the_plan(rank: int) -> None:
    specs = _specs()
    drafts = {5: BundleSpec.mla(4, 16, 8, torch.float32)}
    owners = assign_owners(specs, 3)
    plan = KVPPPlan({k: s.bytes_per_block for k, s in specs.items()}, owners, rank, drafts[5].bytes_per_block)
    largest = max(s.bytes_per_block for s in specs.values())
    num_blocks = math.lcm(largest, SCRATCH_ALIGNMENT) // largest  # scratch = exactly 2 MiB x k: no padding
    assert (largest * num_blocks) % SCRATCH_ALIGNMENT == 0
    alloc = KVPPAllocation(plan, specs, num_blocks, "cpu", drafts)
    owned = sum(specs[layer].bytes_per_block for layer in plan.owned)
    assert alloc.persistent_bytes == (owned + drafts[5].bytes_per_block) * num_blocks
    draft = drafts[5].bytes_per_block
    assert alloc.allocated_bytes == (owned + draft + 2 * largest) * num_blocks
    # with padding
    alloc2 = KVPPAllocation(plan, specs, 3, "cpu", drafts)
    assert alloc2.scratch[0].numel() == _pad(largest * 3) == 2 * 1024 * 1024
    assert alloc2.allocated_bytes == (owned + draft) * 3 + 2 * _pad(largest * 3)


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_allocation_views_alias_scratch_and_never_leak() -> None:
    specs = _specs()
    owners = assign_owners(specs, 2)  # 0,1,2 -> 0 ; 3,4 -> 1
    plan = KVPPPlan({k: s.bytes_per_block for k, s in specs.items()}, owners, 1)
    drafts = {9: BundleSpec.mla(4, 16, 8, torch.float32)}
    plan = KVPPPlan(plan.bundle_bytes_per_block, owners, 1, drafts[9].bytes_per_block)
    alloc = KVPPAllocation(plan, specs, 5, "cpu", drafts)
    assert [alloc.buffer_kind(layer) for layer in range(5)] == [
        "scratch0",
        "scratch1",
        "scratch0",
        "persistent",
        "persistent",
    ]
    assert alloc.buffer_kind(9) == "draft"
    for layer, spec in {**specs, **drafts}.items():
        views = alloc.views(layer)
        for comp in spec.components:
            v = views[comp.name]
            assert v.shape == (5, 4, comp.dim) and v.dtype == comp.dtype
        # the components tile the bundle span exactly, in order
        span = alloc.bundle_span(layer)
        starts = [views[c.name].data_ptr() - span.data_ptr() for c in spec.components]
        spans, total = spec.layout(5)
        assert starts == [o for o, _ in spans] and total == span.numel()

    snapshot = {
        k: t.clone() for k, t in [*alloc.persistent.items(), *((f"d{k}", t) for k, t in alloc.draft.items())]
    }
    scratch_before = [s.clone() for s in alloc.scratch]
    # write through layer 0 (scratch 0): visible through layer 2 (same scratch, same component layout)
    v0 = alloc.views(0)["k_pe"]
    v0.copy_(torch.randn_like(v0))
    assert torch.equal(alloc.views(2)["k_pe"], v0)
    # layer 1 and 3 have a different layout in the same scratch 1 / persistent: write through layer 1
    v1 = alloc.views(1)["index_k"]
    v1.copy_(torch.randint(-100, 100, v1.shape, dtype=torch.int8))
    lo, hi = _storage_range(v1)
    raw = alloc.scratch[1]
    off = lo - raw.data_ptr()
    assert torch.equal(raw[off : off + (hi - lo)].view(torch.int8).view_as(v1), v1)
    # nothing leaked into the other buffers
    for k, t in alloc.persistent.items():
        assert torch.equal(t, snapshot[k])
    for k, t in alloc.draft.items():
        assert torch.equal(t, snapshot[f"d{k}"])
    assert not torch.equal(alloc.scratch[0], scratch_before[0])
    assert torch.equal(
        alloc.scratch[0][len(alloc.bundle_span(0)) :], scratch_before[0][len(alloc.bundle_span(0)) :]
    )
    # writes to persistent / draft layers stay in their own buffers
    before = [s.clone() for s in alloc.scratch]
    alloc.views(3)["c_kv"].fill_(7)
    alloc.views(3)["index_scale"].fill_(3.0)
    alloc.views(4)["k_pe"].fill_(2.0)
    alloc.views(9)["c_kv"].fill_(5.0)
    assert all(torch.equal(a, b) for a, b in zip(alloc.scratch, before, strict=True))
    assert torch.equal(alloc.persistent[4], snapshot[4].index_fill(0, torch.arange(0), 0)) is False
    assert torch.equal(
        alloc.persistent[3][: 5 * 4 * 8 * 2].view(torch.bfloat16),
        torch.full((5 * 4 * 8,), 7.0, dtype=torch.bfloat16),
    )
    assert torch.equal(alloc.draft[9], snapshot["d9"]) is False
    assert torch.equal(alloc.views(4)["c_kv"], torch.zeros(5, 4, 16))


def test_allocation_owner_of_everything_has_no_scratch() -> None:
    specs = _specs()
    plan = KVPPPlan({k: s.bytes_per_block for k, s in specs.items()}, dict.fromkeys(specs, 0), 0)
    alloc = KVPPAllocation(plan, specs, 3)
    assert alloc.scratch_bytes == 0
    assert alloc.persistent_bytes == sum(s.bytes_per_block for s in specs.values()) * 3


def test_allocation_errors() -> None:
    specs = _specs()
    owners = assign_owners(specs, 2)
    plan = KVPPPlan({k: s.bytes_per_block for k, s in specs.items()}, owners, 0)
    with pytest.raises(ValueError, match="plan expects"):
        KVPPAllocation(plan, {**specs, 0: specs[1]}, 3)
    with pytest.raises(ValueError, match="targets"):
        KVPPAllocation(plan, {k: specs[k] for k in (0, 1)}, 3)
    with pytest.raises(ValueError, match="draft bundles"):
        KVPPAllocation(plan, specs, 3, "cpu", {7: specs[0]})
    with pytest.raises(ValueError, match="num_blocks"):
        KVPPAllocation(plan, specs, 0)


def test_group_local_ids_map_to_global_ranks() -> None:
    from torch_kvoffload.kvpp import KVPPGroup, kvpp_size

    assert kvpp_size(2, 4) == 8
    g = KVPPGroup((4, 5, 6, 7), 2, 1)
    assert [g.global_rank(i) for i in range(4)] == [4, 5, 6, 7]
    assert g.size == 4
    with pytest.raises(ValueError, match="owner id 4"):
        g.global_rank(4)

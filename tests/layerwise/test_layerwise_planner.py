"""Layer buffer planning, allocation and LayerwiseConfig."""

from __future__ import annotations

import pytest
import torch

from torch_kvoffload.layerwise import (
    LayerCacheSpec,
    LayerwiseConfig,
    TensorSpec,
    allocate_layer_buffers,
    build_layerwise_runtime,
    plan_layer_buffers,
)


def _spec(nb=8, bs=4, rank=16, rope=8, indexer: int | None = None, dtype=torch.float32, mtp=False):
    main = (TensorSpec((nb, bs, rank), dtype), TensorSpec((nb, bs, rope), dtype))
    idx = None if indexer is None else (TensorSpec((nb, bs, indexer), torch.bfloat16),)
    return LayerCacheSpec(main, idx, mtp)


def _check_invariants(plan, n: int) -> None:
    """Independent check of a plan: a partition of the layers, with consistent previous users."""
    assert sorted(x for s in plan.slots for x in s) == list(range(n))
    for s, layers in enumerate(plan.slots):
        assert layers == sorted(layers)
        for j, layer in enumerate(layers):
            assert plan.slot_of[layer] == s
            assert plan.previous_user[layer] == (layers[j - 1] if j else None)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 61])
@pytest.mark.parametrize("b", [1, 2, 3, 4, 100])
def test_uniform_count_formula(n: int, b: int) -> None:
    plan = plan_layer_buffers(n, b)
    independent = 1
    r = n - independent
    assert plan.num_physical_buffers == independent + min(b, r)
    assert plan.footprint_ratio == pytest.approx(plan.num_physical_buffers / n)
    _check_invariants(plan, n)
    # round robin: reusable layer k (in order) goes to shared buffer k % min(b, r)
    shared = [s for s in plan.slots if s[0] != 0]
    reusable = list(range(1, n))
    for k, layer in enumerate(reusable):
        assert layer in shared[k % len(shared)]


def test_example_n8_b2() -> None:
    plan = plan_layer_buffers(8, 2)
    assert plan.slots == [[0], [1, 3, 5, 7], [2, 4, 6]]
    assert plan.previous_user == {0: None, 1: None, 2: None, 3: 1, 4: 2, 5: 3, 6: 4, 7: 5}
    assert plan.slot_of[7] == 1


def test_independent_layers_negative_and_all() -> None:
    plan = plan_layer_buffers(6, 2, [0, -1])
    assert plan.independent_layers == (0, 5)
    assert plan.num_physical_buffers == 4
    assert [5] in plan.slots and [0] in plan.slots
    _check_invariants(plan, 6)
    plan = plan_layer_buffers(4, 2, "all")
    assert plan.slots == [[0], [1], [2], [3]] and plan.footprint_ratio == 1.0
    plan = plan_layer_buffers(4, 3, [])
    assert plan.num_physical_buffers == 3
    _check_invariants(plan, 4)


def test_specs_uniform_bytes_and_ratio() -> None:
    specs = [_spec() for _ in range(8)]
    plan = plan_layer_buffers(specs, 2)
    layer_bytes = 8 * 4 * (16 + 8) * 4
    assert plan.main_bytes == 3 * layer_bytes
    assert plan.logical_main_bytes == 8 * layer_bytes
    assert plan.footprint_ratio == pytest.approx(3 / 8)
    assert plan.indexer_bytes == 0


def test_mixed_specs_never_share_and_split() -> None:
    # layers 1..6 one spec, 7 (MTP) another spec: bucket split with at least one buffer each
    specs = [_spec() for _ in range(7)] + [_spec(rank=32, mtp=True)]
    plan = plan_layer_buffers(specs, 3)
    _check_invariants(plan, 8)
    for layers in plan.slots:
        assert len({specs[x].main for x in layers}) == 1
    assert [7] in plan.slots
    # B=3 over buckets of 6 and 1 layers: 2 + 1
    assert plan.num_physical_buffers == 1 + 3
    assert plan.slots == [[0], [1, 3, 5], [2, 4, 6], [7]]
    # B smaller than the number of buckets: every bucket still gets one
    plan = plan_layer_buffers(specs, 1)
    assert plan.num_physical_buffers == 3
    # the footprint counts each buffer with its own spec
    expect = specs[0].main_nbytes * 2 + specs[7].main_nbytes
    assert plan.main_bytes == expect
    assert plan.footprint_ratio == pytest.approx(expect / sum(s.main_nbytes for s in specs))


def test_mtp_with_same_spec_joins_the_bucket() -> None:
    specs = [_spec() for _ in range(5)] + [_spec(mtp=True)]
    plan = plan_layer_buffers(specs, 2)
    assert plan.num_physical_buffers == 3
    assert plan.slot_of[5] == plan.slot_of[1]


def test_split_goes_to_the_most_loaded_bucket() -> None:
    specs = [_spec()] + [_spec(rank=16)] * 2 + [_spec(rank=32)] * 6
    plan = plan_layer_buffers(specs, 4)
    counts = {}
    for layers in plan.slots[1:]:
        counts[specs[layers[0]].main] = counts.get(specs[layers[0]].main, 0) + 1
    assert counts[specs[1].main] == 1 and counts[specs[3].main] == 3
    _check_invariants(plan, 9)


def test_indexer_follows_main_buffer() -> None:
    # odd layers have an indexer: slot of [1,3,5,7] needs one, slot of [2,4,6] does not
    specs = [_spec(indexer=(128 if i % 2 else None)) for i in range(8)]
    plan = plan_layer_buffers(specs, 2)
    assert plan.slots == [[0], [1, 3, 5, 7], [2, 4, 6]]
    assert plan.slot_indexer_specs[0] is None
    assert plan.slot_indexer_specs[1] == specs[1].indexer
    assert plan.slot_indexer_specs[2] is None
    assert plan.indexer_bytes == 8 * 4 * 128 * 2
    # a slot where only some layers have an indexer still gets one
    specs = [_spec(indexer=(128 if i == 4 else None)) for i in range(8)]
    plan = plan_layer_buffers(specs, 2)
    assert plan.slot_indexer_specs[2] == specs[4].indexer


def test_allocation_bytes_equal_plan() -> None:
    specs = [_spec(indexer=(64 if i in (0, 3, 5) else None)) for i in range(7)] + [_spec(rank=32)]
    plan = plan_layer_buffers(specs, 2)
    bufs = allocate_layer_buffers(plan, "cpu")
    assert bufs.allocated_bytes() == plan.main_bytes + plan.indexer_bytes
    # independent recount from the allocated tensors
    total = sum(t.nbytes for group in bufs.main for t in group)
    total += sum(t.nbytes for group in bufs.indexer if group is not None for t in group)
    assert total == plan.main_bytes + plan.indexer_bytes
    for layer in range(8):
        main = bufs.layer_main(layer)
        assert tuple(TensorSpec.of(t) for t in main) == specs[layer].main
        idx = bufs.layer_indexer(layer)
        assert (idx is None) == (specs[layer].indexer is None)
        if idx is not None:
            assert tuple(TensorSpec.of(t) for t in idx) == specs[layer].indexer
    # shared layers really share storage
    a, b = plan.slots[1][:2]
    assert bufs.layer_main(a)[0].data_ptr() == bufs.layer_main(b)[0].data_ptr()
    assert bufs.layer_caches(3) == bufs.layer_main(3) + bufs.layer_indexer(3)


def test_allocation_needs_specs() -> None:
    with pytest.raises(ValueError, match="layer count"):
        allocate_layer_buffers(plan_layer_buffers(4, 2))


def test_from_tensors() -> None:
    spec = LayerCacheSpec.from_tensors([torch.zeros(4, 2, 3), torch.zeros(4, 2, 1)], [torch.zeros(4, 2, 5)])
    assert spec.main_nbytes == 4 * 2 * 4 * 4 and spec.indexer_nbytes == 4 * 2 * 5 * 4


# -------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((8, 0), ValueError, "num_shared_buffers' must be at least 1"),
        ((8, -2), ValueError, "at least 1"),
        ((8, True), TypeError, "num_shared_buffers' must be an int"),
        ((8, 2.0), TypeError, "must be an int"),
        ((True, 2), TypeError, "got bool"),
        ((0, 2), ValueError, "'layers' must be at least 1"),
        ((8, 2, [8]), ValueError, r"independent_layers\[0\]' is 8"),
        ((8, 2, [-9]), ValueError, "is -9"),
        ((8, 2, [1, 1]), ValueError, "more than once"),
        ((8, 2, [7, -1]), ValueError, "more than once"),
        ((8, 2, [True]), TypeError, "must be an int"),
        ((8, 2, [1.0]), TypeError, "must be an int"),
        ((8, 2, "some"), ValueError, "or 'all'"),
        ((8, 2, 3), TypeError, "sequence of ints"),
        (([], 2), ValueError, "empty"),
        (("abc", 2), TypeError, "layer count"),
        (([object()], 2), TypeError, "LayerCacheSpec"),
    ],
)
def test_plan_errors(args, exc, match) -> None:
    with pytest.raises(exc, match=match):
        plan_layer_buffers(*args)


def test_spec_errors() -> None:
    bad_lead = LayerCacheSpec((TensorSpec((8, 4, 16), torch.float32), TensorSpec((8, 2, 8), torch.float32)))
    with pytest.raises(ValueError, match=r"main\[1\] has \[num_blocks, block_size\] = \[8, 2\]"):
        plan_layer_buffers([_spec(), bad_lead], 1)
    bad_idx = LayerCacheSpec(_spec().main, (TensorSpec((9, 4, 16), torch.bfloat16),))
    with pytest.raises(ValueError, match=r"indexer\[0\]"):
        plan_layer_buffers([_spec(), bad_idx], 1)
    with pytest.raises(ValueError, match="positive int"):
        plan_layer_buffers([LayerCacheSpec((TensorSpec((8, 0, 4), torch.float32),))], 1)
    with pytest.raises(ValueError, match="num_blocks, block_size"):
        plan_layer_buffers([LayerCacheSpec((TensorSpec((8,), torch.float32),))], 1)
    with pytest.raises(TypeError, match="dtype"):
        plan_layer_buffers([LayerCacheSpec((TensorSpec((8, 2), "float32"),))], 1)
    with pytest.raises(ValueError, match="at least one component"):
        plan_layer_buffers([LayerCacheSpec(())], 1)
    with pytest.raises(ValueError, match="empty tuple"):
        plan_layer_buffers([LayerCacheSpec(_spec().main, ())], 1)


def test_incompatible_indexer_layouts_in_one_buffer() -> None:
    specs = [_spec(indexer=128) for _ in range(8)]
    specs[3] = _spec(indexer=64)  # shares buffer with layer 1 under B=2
    with pytest.raises(ValueError, match="layers 1 and 3 share physical buffer 1 but have different indexer"):
        plan_layer_buffers(specs, 2)
    # with enough buffers the two never share: fine
    plan = plan_layer_buffers(specs, 7)
    assert plan.num_physical_buffers == 8


def test_count_plan_has_no_bytes() -> None:
    plan = plan_layer_buffers(4, 1)
    with pytest.raises(ValueError, match="layer count"):
        _ = plan.main_bytes


# -------------------------------------------------------------------------------------------- config


def test_config_defaults_and_parse() -> None:
    cfg = LayerwiseConfig()
    assert cfg.num_shared_buffers == 2 and cfg.independent_layers == [0] and cfg.prefetch_depth == 2
    assert cfg.store.kind == "local"
    cfg = LayerwiseConfig.from_json(
        '{"num_shared_buffers": 4, "independent_layers": "all", "prefetch_depth": 1, '
        '"store": {"kind": "local", "capacity_bytes": "1MiB"}, "model_id": "m"}'
    )
    assert cfg.independent_layers == "all" and cfg.store.capacity_bytes == 1 << 20


def test_config_builds_a_runtime() -> None:
    cfg = LayerwiseConfig(num_shared_buffers=2, independent_layers=[0, -1], store={"capacity_bytes": 1 << 20})
    rt = build_layerwise_runtime(cfg, [_spec() for _ in range(6)], device="cpu")
    try:
        assert rt.plan.num_physical_buffers == 4 and rt.plan.independent_layers == (0, 5)
        assert rt.store.capacity_bytes == 1 << 20 and rt.prefetch_depth == 2
        assert rt.buffers.allocated_bytes() == rt.plan.main_bytes
    finally:
        rt.close()
    with pytest.raises(ValueError, match="independent_layers"):
        build_layerwise_runtime(LayerwiseConfig(independent_layers=[9]), [_spec()] * 4, device="cpu")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_shared_buffers": 0},
        {"num_shared_buffers": True},
        {"num_shared_buffers": "2"},
        {"prefetch_depth": 0},
        {"prefetch_depth": 1.5},
        {"independent_layers": [1, 1]},
        {"independent_layers": "some"},
        {"independent_layers": [1.5]},
        {"store": {"kind": "redis"}},
        {"store": {"capacity_bytes": -1}},
        {"store": {"kind": "local", "device_id": 1}},
        {"unknown_key": 1},
    ],
)
def test_config_invalid(kwargs) -> None:
    with pytest.raises(ValueError):
        LayerwiseConfig(**kwargs)

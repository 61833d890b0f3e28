"""KVPPConfig: lax boolean switch, group size, and each deployment limit with its own message."""

from __future__ import annotations

import pytest
import torch

from torch_kvoffload._utils import round_up
from torch_kvoffload.kvpp import BundleSpec, KVPPConfig, KVPPGroup, build_kvpp_runtime
from torch_kvoffload.ops.kvpp import runtimes


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("true", True),
        ("False", False),
        ("TRUE", True),
        (" false ", False),
        (1, True),
        (0, False),
        (True, True),
        ("1", True),
    ],
)
def test_enable_kvpp_lax_bool(raw, expected) -> None:
    cfg = KVPPConfig(enable_kvpp=raw, tp_size=2)
    assert cfg.enable_kvpp is expected
    assert cfg.size == (2 if expected else 1)


@pytest.mark.parametrize("raw", ["maybe", 2, "tru", None, 1.5])
def test_enable_kvpp_rejects_non_bool(raw) -> None:
    with pytest.raises(ValueError, match="enable_kvpp") as info:
        KVPPConfig(enable_kvpp=raw)
    assert repr(raw) in str(info.value)


@pytest.mark.parametrize(("tp", "pcp"), [(1, 1), (2, 1), (4, 2), (8, 1), (1, 4)])
def test_size_is_tp_times_pcp_when_enabled(tp: int, pcp: int) -> None:
    on = KVPPConfig(enable_kvpp="true", tp_size=tp, pcp_size=pcp)
    off = KVPPConfig(enable_kvpp="false", tp_size=tp, pcp_size=pcp)
    assert on.size == tp * pcp
    assert on.active == (tp * pcp > 1)
    assert off.size == 1 and not off.active


def test_from_dict_and_json() -> None:
    cfg = KVPPConfig.from_dict({"enable_kvpp": "True", "tp_size": 4})
    assert cfg.size == 4
    assert KVPPConfig.from_json('{"enable_kvpp": "false", "tp_size": 4}').size == 1
    with pytest.raises(ValueError, match="extra"):
        KVPPConfig.from_dict({"enable_kvpp": True, "tp": 4})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dcp_size": 2}, "KVPP and DCP cannot be enabled at the same time"),
        ({"graph_mode": "full"}, "eager execution or piecewise"),
        ({"graph_mode": "FULL_AND_PIECEWISE"}, "eager execution or piecewise"),
        ({"attention": "mha"}, "only MLA / SFA models"),
        ({"hybrid_model": "true"}, "non-hybrid MLA"),
        ({"speculative_method": "eagle", "num_speculative_tokens": 2}, "fixed number of tokens"),
        (
            {"speculative_method": "mtp", "dynamic_speculative_tokens": True},
            "fixed number of speculative tokens",
        ),
        ({"kv_role": "kv_consumer"}, "decode-only node"),
    ],
)
def test_limits_rejected_each_with_its_message(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVPPConfig(enable_kvpp=True, tp_size=2, **fields)
    # the same deployment without KVPP is fine
    assert KVPPConfig(enable_kvpp=False, tp_size=2, **fields).size == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"graph_mode": "piecewise"},
        {"graph_mode": "Eager"},
        {"attention": "sfa"},
        {"speculative_method": "mtp", "num_speculative_tokens": 1},
        {"speculative_method": "dspark", "num_speculative_tokens": 3},
        {"kv_role": "kv_producer"},
        {"kv_role": "kv_both"},
        {"pcp_size": 2},
    ],
)
def test_supported_deployments_accepted(fields: dict) -> None:
    assert KVPPConfig(enable_kvpp="true", tp_size=2, **fields).active


def test_bad_field_values() -> None:
    with pytest.raises(ValueError, match="kv_role"):
        KVPPConfig(kv_role="decoder")
    with pytest.raises(ValueError, match="tp_size"):
        KVPPConfig(tp_size=0)
    with pytest.raises(ValueError, match="hybrid_model"):
        KVPPConfig(hybrid_model="sometimes")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_speculative_tokens": 2}, "needs a speculative_method"),
        ({"speculative_method": "mtp"}, "needs num_speculative_tokens >= 1"),
        ({"max_broadcast_runs": 0}, "max_broadcast_runs"),
        ({"wait_timeout_s": 0}, "wait_timeout_s"),
        ({"wait_timeout_s": float("inf")}, "wait_timeout_s"),
    ],
)
def test_more_bad_combinations(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVPPConfig(enable_kvpp=True, tp_size=2, **fields)


# --------------------------------------------------------------------------------- build_kvpp_runtime

MIB2 = 2 * 1024 * 1024


def _spec(index: bool = False, block_size: int = 4) -> BundleSpec:
    return BundleSpec.mla(
        block_size, 16, 8, torch.float32, index_dim=8 if index else 0, index_dtype=torch.float32
    )


def _group(size: int = 2, rank: int = 1, backend: str = "gloo") -> KVPPGroup:
    # a stand-in process group: building a runtime issues no collective
    return KVPPGroup(tuple(range(size)), rank, 0, process_group=object(), backend=backend)


@pytest.mark.parametrize(
    ("cfg", "group", "kwargs", "error", "message"),
    [
        (KVPPConfig(tp_size=2), _group(), {}, ValueError, r"KVPP is disabled \(enable_kvpp=False\)"),
        (
            KVPPConfig(enable_kvpp=True),
            _group(1, 0),
            {},
            ValueError,
            r"is 1 \(1 \* 1\), which means KVPP is off",
        ),
        (
            KVPPConfig(enable_kvpp=True, tp_size=2, pcp_size=2),
            _group(),
            {},
            ValueError,
            r"has 2 ranks, the config expects tp_size \* pcp_size = 2 \* 2 = 4",
        ),
        (KVPPConfig(enable_kvpp=True, tp_size=2), (0, 1), {}, TypeError, "'group' must be a KVPPGroup"),
        (
            KVPPConfig(enable_kvpp=True, tp_size=2),
            _group(backend="nccl"),
            {},
            ValueError,
            "needs a gloo group",
        ),
        (
            KVPPConfig(enable_kvpp=True, tp_size=2, attention="sfa"),
            _group(),
            {},
            ValueError,
            r"attention='sfa' needs an 'index_k' component in every bundle; layers \[0, 1, 2\]",
        ),
        (
            KVPPConfig(enable_kvpp=True, tp_size=2),
            _group(),
            {"bundles": dict.fromkeys(range(3), _spec(index=True))},
            ValueError,
            "attention='mla' bundles have no indexer",
        ),
        (
            KVPPConfig(enable_kvpp=True, tp_size=2),
            _group(),
            {"draft_bundles": {3: _spec()}},
            ValueError,
            r"draft bundles \[3\] given, but speculative_method is None",
        ),
        (
            KVPPConfig(enable_kvpp=True, tp_size=2),
            _group(),
            {"bundles": {0: _spec(), 1: _spec(block_size=8)}},
            ValueError,
            r"same block_size, got \[4, 8\]",
        ),
        (
            KVPPConfig(enable_kvpp=True, tp_size=2),
            _group(),
            {"bundles": {}},
            ValueError,
            "holds no target layer",
        ),
        (KVPPConfig(enable_kvpp=True, tp_size=2), _group(), {"num_blocks": 4}, ValueError, "exactly one of"),
        (
            KVPPConfig(enable_kvpp=True, tp_size=2),
            _group(),
            {"available_bytes": None},
            ValueError,
            "exactly one of",
        ),
        (
            KVPPConfig(enable_kvpp=True, tp_size=2),
            _group(),
            {"available_bytes": 100},
            ValueError,
            "holds no block",
        ),
        (
            KVPPConfig(enable_kvpp=True, tp_size=2),
            _group(),
            {"available_bytes": -1},
            ValueError,
            "available_bytes must be >= 0",
        ),
        (
            KVPPConfig(enable_kvpp=True, tp_size=2),
            _group(),
            {"bundles": {0: "c_kv"}},
            TypeError,
            r"bundles\[0\] must be a BundleSpec",
        ),
    ],
)
def test_build_runtime_refuses_what_it_cannot_build(cfg, group, kwargs, error, message) -> None:
    args = {"bundles": dict.fromkeys(range(3), _spec()), "available_bytes": 8 * MIB2, **kwargs}
    names = runtimes.names()
    with pytest.raises(error, match=message):
        build_kvpp_runtime(cfg, group, args.pop("bundles"), args.pop("available_bytes"), name="never", **args)
    assert runtimes.names() == names


def _blocks_for(available: int, owned_layers: int, bundle: int, draft: int) -> int:
    """Largest n with (owned bundles + drafts) x n + two scratch buffers of bundle x n padded to 2 MiB."""
    n = available // ((owned_layers + 2) * bundle + draft)
    while n > 0 and (owned_layers * bundle + draft) * n + 2 * round_up(bundle * n, MIB2) > available:
        n -= 1
    return n


@pytest.mark.parametrize("rank", [0, 1])
def test_build_runtime_consumes_every_field(rank: int) -> None:
    cfg = KVPPConfig(
        enable_kvpp="true",
        tp_size=2,
        attention="sfa",
        speculative_method="mtp",
        num_speculative_tokens=1,
        max_broadcast_runs=3,
        wait_timeout_s=7.5,
    )
    spec = _spec(index=True)
    bundle = 4 * (16 + 8 + 8) * 4  # block_size x (c_kv + k_pe + index_k) x fp32
    available = 12 * MIB2 + 12345
    rt = build_kvpp_runtime(
        cfg, _group(2, rank), dict.fromkeys(range(5), spec), available, draft_bundles={5: spec}, name="cfg-rt"
    )
    try:
        assert runtimes.get("cfg-rt") is rt.scheduler and rt.name == "cfg-rt"
        # 5 layers over 2 ranks: 3 and 2 owned; every rank takes the fullest rank's block count
        expected = min(_blocks_for(available, owned, bundle, bundle) for owned in (3, 2))
        assert rt.allocation.num_blocks == expected > 0
        assert rt.plan.owned == ([0, 1, 2] if rank == 0 else [3, 4])
        assert rt.allocation.persistent_bytes == (len(rt.plan.owned) + 1) * bundle * expected
        assert rt.scheduler.wait_timeout == 7.5 and rt.scheduler.max_runs == 3
        assert [t.shape for t in rt.caches(4)] == [(expected, 4, 16), (expected, 4, 8), (expected, 4, 8)]
        with pytest.raises(ValueError, match="'cfg-rt' is already registered"):
            build_kvpp_runtime(
                cfg, _group(2, rank), dict.fromkeys(range(5), spec), num_blocks=2, name="cfg-rt"
            )
    finally:
        rt.close()
    assert "cfg-rt" not in runtimes.names()
    rt = build_kvpp_runtime(cfg, _group(2, rank), dict.fromkeys(range(5), spec), num_blocks=9)
    assert rt.allocation.num_blocks == 9 and rt.name is None
    rt.close()

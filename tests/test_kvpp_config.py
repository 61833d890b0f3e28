"""KVPPConfig: lax boolean switch, group size, and each deployment limit with its own message."""

from __future__ import annotations

import pytest

from torch_kvoffload.kvpp import KVPPConfig


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

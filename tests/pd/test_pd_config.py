"""PDConfig rejections, the rank / port mapping, and the control-plane messages."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch

from torch_kvoffload.pd import PDConfig, decode_rank_of, endpoint_port, split_range
from torch_kvoffload.pd.messages import (
    Bye,
    Compatibility,
    Heartbeat,
    Hello,
    HelloAck,
    LayerEntry,
    LayerReady,
    ProtocolError,
    ReadDone,
    ReadFailed,
    decode_message,
    encode_message,
)


def test_defaults_detect_a_dead_peer_in_about_two_seconds() -> None:
    cfg = PDConfig(role="decode")
    assert cfg.handshake_timeout_s == 100.0
    assert cfg.transport == "shm"
    assert 1.5 <= cfg.heartbeat_interval_s * cfg.heartbeat_misses <= 2.5
    assert cfg.dead_after_s == cfg.heartbeat_interval_s * cfg.heartbeat_misses


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(prefill_tp_size=1, decode_tp_size=2), "smaller than decode TP"),
        (dict(prefill_tp_size=6, decode_tp_size=4), "not a multiple"),
        (dict(kv_port=65535, decode_tp_size=2, prefill_tp_size=2), "1..65535"),
        (dict(kv_port=65000, decode_tp_size=4, prefill_tp_size=4, decode_dp_size=200), "1..65535"),
        (dict(kv_port=0), "1..65535"),
        (dict(transport="rdma-magic"), "unknown transport"),
        (dict(kvpp_enabled="true"), "KVPP"),
        (dict(transport="memfabric"), "memfabric_store_url"),
        (dict(heartbeat_interval_s=0), "heartbeat_interval_s expected a finite number of seconds"),
        (dict(read_retries=-1), r"read_retries expected an int in 0\.\.100"),
        (dict(unknown_field=1), "unknown_field"),
    ],
)
def test_rejections(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PDConfig(role="decode", **kw)


def test_kvpp_allowed_on_prefill_and_highest_port_accepted() -> None:
    PDConfig(role="prefill", kvpp_enabled=True)
    cfg = PDConfig(role="decode", kv_port=65535 - 7, decode_tp_size=4, prefill_tp_size=8, decode_dp_size=2)
    assert cfg.port(1, 3) == 65535
    with pytest.raises(ValueError, match="dp_rank"):
        cfg.port(2, 0)


def test_endpoint_port_rule() -> None:
    assert endpoint_port(5000, 0, 0, 4) == 5000
    assert endpoint_port(5000, 2, 3, 4) == 5011
    ports = {endpoint_port(7000, dp, tp, 4) for dp in range(3) for tp in range(4)}
    assert len(ports) == 12  # DP and TP endpoints never overlap
    with pytest.raises(ValueError, match="tp_rank 4 out of range"):
        endpoint_port(5000, 0, 4, 4)
    with pytest.raises(ValueError, match="dp_rank must be >= 0"):
        endpoint_port(5000, -1, 0, 4)
    with pytest.raises(ValueError, match="port 65536 out of range"):
        endpoint_port(65535, 0, 1, 4)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (4, 2), (8, 2), (8, 8), (16, 4)])
def test_decode_rank_of_matches_the_formula(p_tp: int, d_tp: int) -> None:
    ratio = p_tp // d_tp
    groups: dict[int, list[int]] = {}
    for p in range(p_tp):
        d, m = decode_rank_of(p, p_tp, d_tp)
        assert (d, m) == (p // ratio, p % ratio)
        groups.setdefault(d, []).append(m)
    assert sorted(groups) == list(range(d_tp))
    assert all(sorted(ms) == list(range(ratio)) for ms in groups.values())


def test_decode_rank_of_rejects_bad_topologies() -> None:
    with pytest.raises(ValueError, match="multiple"):
        decode_rank_of(0, 6, 4)
    with pytest.raises(ValueError, match="p_rank"):
        decode_rank_of(4, 4, 2)
    with pytest.raises(TypeError, match="p_tp"):
        decode_rank_of(0, 2.0, 1)


def test_endpoint_port_rule_never_overlaps() -> None:
    kv_port, d_tp, d_dp = 20000, 4, 3
    ports = {endpoint_port(kv_port, dp, tp, d_tp) for dp in range(d_dp) for tp in range(d_tp)}
    assert ports == set(range(kv_port, kv_port + d_tp * d_dp))
    assert endpoint_port(kv_port, 2, 1, d_tp) == kv_port + 2 * d_tp + 1
    with pytest.raises(ValueError, match="out of range"):
        endpoint_port(65535, 0, 1, 2)


@pytest.mark.parametrize("n", [0, 1, 2, 5, 17])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_split_range_is_a_disjoint_cover(n: int, parts: int) -> None:
    ranges = [split_range(n, parts, i) for i in range(parts)]
    covered = [x for lo, hi in ranges for x in range(lo, hi)]
    assert covered == list(range(n))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1


def _compat(**kw) -> Compatibility:
    base = dict(library_version="0.1.0", model_fingerprint="m", kv_dtype="bf16", num_layers=3, block_size=4,
                main_layout=[[[16], "bf16"], [[8], "bf16"]], indexer_layout=[[[8], "int8"], [[1], "fp32"]])  # fmt: skip
    base.update(kw)
    return Compatibility(**base)


def _messages() -> list:
    rng = random.Random(0)
    blocks = [rng.randrange(100) for _ in range(7)]
    return [
        Hello(
            _compat(), 1, 2, 1, "shm", {"kind": "shm", "regions": {}}, [{"main": ["a"], "indexer": []}], 24
        ),
        HelloAck(False, "mismatch", 0, 1),
        LayerReady(5, 2, 1, 1, 2, [256, 64], [], [LayerEntry(3, 9, blocks, blocks[::-1], [], [])]),
        ReadDone(5, 2, [3, 4]),
        ReadFailed(5, 2, [3], "bad sizes"),
        Heartbeat(123.5),
        Bye("closing"),
    ]


@pytest.mark.parametrize("msg", _messages(), ids=lambda m: m.TYPE)
def test_messages_roundtrip(msg) -> None:
    assert decode_message(encode_message(msg)) == msg


def test_malformed_messages_are_rejected_with_the_field_named() -> None:
    good = LayerReady(1, 0, 0, 0, 1, [1], [], [LayerEntry(1, 1, [1], [2], [], [])]).to_wire()
    for key, value, match in [
        ("layer", "0", "'layer' must be int"),
        ("main_block_bytes", [1, "x"], "list of ints"),
        ("seq", True, "must be int, got bool"),
    ]:
        bad = dict(good, **{key: value})
        with pytest.raises(ProtocolError, match=match):
            decode_message(msgpack.packb(bad))
    missing = {k: v for k, v in good.items() if k != "slot"}
    with pytest.raises(ProtocolError, match="missing field 'slot'"):
        decode_message(msgpack.packb(missing))
    bad_entry = dict(good, entries=[{"request_id": 1}])
    with pytest.raises(ProtocolError, match="entry: missing field 'generation'"):
        decode_message(msgpack.packb(bad_entry))
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode_message(msgpack.packb({"type": "NOPE"}))
    with pytest.raises(ProtocolError, match="must be a map"):
        decode_message(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_message(b"\xc1\xc1")


def test_compatibility_mismatches_name_each_field() -> None:
    a = _compat()
    assert a.mismatches(_compat()) == []
    b = _compat(num_layers=4, indexer_layout=[], model_fingerprint="other")
    diffs = a.mismatches(b)
    assert {d.split(":")[0] for d in diffs} == {"num_layers", "indexer_layout", "model_fingerprint"}
    # a wire round trip (lists for tuples) does not make a difference
    assert a.mismatches(Compatibility.from_wire(msgpack.unpackb(msgpack.packb(a.to_wire())))) == []


def test_fp8_rows_and_the_models_values_refuse_each_other_by_the_formats_name() -> None:
    """A decode host pool of FP8 latent rows describes one ``uint8`` component (the RoPE values inside) with
    ``kv_dtype`` ``"fp8_e4m3"``: a prefill sending bf16 ``kv_c`` / ``k_pe`` differs by that name and by the
    layout, and the destinations check their own record."""
    from torch_kvoffload.ops.fp8 import kv_row_bytes
    from torch_kvoffload.pd import main_components, make_compatibility
    from torch_kvoffload.pd.decode_destinations import Destinations
    from torch_kvoffload.sparse.host_pool import HostKVPool

    row = kv_row_bytes(128, 16)
    pool = HostKVPool.create(2, 3, 4, row, 0, torch.uint8)
    main = main_components(pool, 0)
    assert [(tuple(t.shape), t.dtype) for t in main] == [((3, 4, row), torch.uint8)]
    fp8 = make_compatibility(model_fingerprint="m", num_layers=2, block_size=4, main=main)
    bf16 = make_compatibility(
        model_fingerprint="m", num_layers=2, block_size=4,
        main=[torch.zeros(3, 4, 128, dtype=torch.bfloat16), torch.zeros(3, 4, 16, dtype=torch.bfloat16)],
    )  # fmt: skip
    diffs = fp8.mismatches(bf16)
    assert "kv_dtype: 'fp8_e4m3' != 'bf16'" in diffs and any(d.startswith("main_layout") for d in diffs)
    assert len(Destinations("decode", pool, fp8, None).main_block_bytes) == 1
    with pytest.raises(ValueError, match="main_layout"):
        Destinations("decode", pool, bf16, None)


# ------------------------------------------------------------------- secret and message-size fields
def test_secret_is_hidden_from_repr_and_json_but_kept_where_the_config_travels() -> None:
    import pickle

    from torch_kvoffload import OffloadConfig

    value = f"s3cr3t-{random.getrandbits(32):08x}"
    cfg = PDConfig(role="decode", secret=value)
    assert cfg.secret.get_secret_value() == value
    for text in (repr(cfg), str(cfg), cfg.model_dump_json(), repr(cfg.model_dump())):
        assert value not in text
    # to another process (pickle), through a python dump and inside an OffloadConfig it survives
    assert pickle.loads(pickle.dumps(cfg)).secret.get_secret_value() == value
    assert PDConfig(**cfg.model_dump()).secret.get_secret_value() == value
    assert OffloadConfig(sparse={}, pd=cfg).pd.secret.get_secret_value() == value
    # a JSON dump holds the mask: reloading it is an error, not a config with a wrong secret
    with pytest.raises(ValueError, match="mask"):
        PDConfig.model_validate_json(cfg.model_dump_json())
    assert PDConfig(role="decode", secret_file="/etc/kv.key").secret_file == "/etc/kv.key"
    assert PDConfig(role="decode").max_message_bytes == 1 << 20


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(secret=""), "secret is empty"),
        (dict(secret="**********"), "mask"),
        (dict(secret="a", secret_file="/k"), "not both"),
        (dict(secret_file=""), "secret_file must be a path"),
        (dict(max_message_bytes=1024), "max_message_bytes"),
        (dict(max_message_bytes=(1 << 30) + 1), "max_message_bytes"),
        (dict(max_message_bytes=-1), "max_message_bytes"),
    ],
)
def test_secret_and_message_size_rejections(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PDConfig(role="decode", **kw)
    PDConfig(role="decode", max_message_bytes=1025)
    PDConfig(role="decode", max_message_bytes=1 << 30)


# ---------------------------------------------------------------- values that are not what they claim
_TIME_FIELDS = ["handshake_timeout_s", "layer_ack_timeout_s", "heartbeat_interval_s"]


@pytest.mark.parametrize("field", _TIME_FIELDS)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), "inf", "nan", 0, -1.0, 1e9])
def test_time_fields_must_be_finite_positive_seconds(field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"{field}.*expected.*got"):
        PDConfig(role="decode", **{field: value})


@pytest.mark.parametrize("field", _TIME_FIELDS)
def test_time_fields_accept_sane_values(field: str) -> None:
    assert getattr(PDConfig(role="decode", **{field: 0.05}), field) == 0.05
    assert getattr(PDConfig(role="decode", **{field: "2.5"}), field) == 2.5


@pytest.mark.parametrize(
    ("field", "value"),
    [("read_retries", -1), ("read_retries", 101), ("read_retries", 10**9),
     ("heartbeat_misses", 0), ("heartbeat_misses", 101), ("heartbeat_misses", -3)],
)  # fmt: skip
def test_retry_counts_are_bounded(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"{field}.*expected.*got {value}"):
        PDConfig(role="decode", **{field: value})
    PDConfig(role="decode", **{field: 100})


@pytest.mark.parametrize(
    "host",
    ["", " ", "127.0.0.1 ", "local host", "*", "0.0.0.0", "tcp://127.0.0.1", "127.0.0.1:5555",
     "http://example.com", "host/path", "-bad.example", "bad-.example", "a" * 64 + ".example",
     "x." * 127 + "y", "256.1.1.1", "1.2.3", "224.0.0.1", "255.255.255.255", "::1", "[::1]", "h\x00st",
     "under_score.example"],
)  # fmt: skip
def test_host_must_be_an_ipv4_address_or_a_host_name(host: str) -> None:
    with pytest.raises(ValueError, match=r"host.*expected.*got"):
        PDConfig(role="decode", host=host)


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "localhost", "node-7.cluster.local", "eth0", "a1"])
def test_good_hosts_are_kept(host: str) -> None:
    assert PDConfig(role="decode", host=host).host == host


@pytest.mark.parametrize("protocol", ["", "udp", "rdma-magic", "tcp://", "nvlink ", "*"])
def test_unknown_mooncake_protocol_rejected(protocol: str) -> None:
    with pytest.raises(ValueError, match=r"mooncake_protocol.*expected.*got"):
        PDConfig(role="decode", mooncake_protocol=protocol)


@pytest.mark.parametrize(("given", "kept"), [("tcp", "tcp"), ("rdma", "rdma"), ("RDMA", "rdma")])
def test_mooncake_protocols_accepted(given: str, kept: str) -> None:
    assert PDConfig(role="decode", mooncake_protocol=given).mooncake_protocol == kept


@pytest.mark.parametrize(
    "where",
    ["", "   ", "ftp://host/x", "file:///tmp/rdv", "zmq://h:1", "http://", "http:///metadata",
     "http://host:0/metadata", "http://host:99999/metadata", "http://host:port/metadata",
     "http://ho st/metadata", "https://*/metadata", "http://u:p@host/metadata", "/tmp/a\x00b",
     "http:/host/metadata", "HTTPS:host"],
)  # fmt: skip
def test_rendezvous_must_be_a_directory_or_an_http_url(where: str) -> None:
    with pytest.raises(ValueError, match=r"rendezvous.*expected.*got"):
        PDConfig(role="decode", rendezvous=where)


@pytest.mark.parametrize(
    "where", [None, "/tmp/kv-rdv", "relative/dir", "http://127.0.0.1:8080/metadata", "https://meta.example/m"]
)
def test_good_rendezvous_kept(where) -> None:
    assert PDConfig(role="decode", rendezvous=where).rendezvous == where


@pytest.mark.parametrize(
    ("field", "value"),
    [("mooncake_metadata_server", ""), ("mooncake_metadata_server", "p2p"),
     ("mooncake_metadata_server", "ftp://h:1"), ("mooncake_metadata_server", "http://"),
     ("memfabric_store_url", "http://127.0.0.1:1"), ("memfabric_store_url", "tcp://127.0.0.1"),
     ("memfabric_store_url", "tcp://*:5"), ("memfabric_store_url", "tcp://127.0.0.1:70000"),
     ("memfabric_store_url", "127.0.0.1:5")],
)  # fmt: skip
def test_service_addresses_rejected(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=rf"{field}.*expected.*got"):
        PDConfig(role="decode", **{field: value})


def test_service_addresses_accepted() -> None:
    for server in ("P2PHANDSHAKE", "http://10.0.0.1:8080/metadata", "etcd://10.0.0.1:2379",
                   "redis://meta.example:6379"):  # fmt: skip
        assert PDConfig(role="decode", mooncake_metadata_server=server).mooncake_metadata_server == server
    cfg = PDConfig(role="decode", transport="memfabric", memfabric_store_url="tcp://10.0.0.2:7000")
    assert cfg.memfabric_store_url == "tcp://10.0.0.2:7000"


def test_a_rejection_then_a_good_config() -> None:
    with pytest.raises(ValueError, match="handshake_timeout_s"):
        PDConfig(role="decode", handshake_timeout_s=float("nan"))
    assert PDConfig(role="decode", handshake_timeout_s=3.0).handshake_timeout_s == 3.0


# ------------------------------------------------------- multi-process test deadlines from the config
def test_test_deadlines_follow_the_configured_timeouts() -> None:
    import support.pd_helpers as h

    rng = random.Random(5)
    for _ in range(20):
        kw = dict(handshake_timeout_s=rng.uniform(0.1, 200), layer_ack_timeout_s=rng.uniform(0.1, 60),
                  heartbeat_interval_s=rng.uniform(0.01, 2), heartbeat_misses=rng.randint(1, 100))  # fmt: skip
        cfg = PDConfig(role="decode", **kw)
        layers, work = rng.randint(1, 64), rng.uniform(0, 3)
        want = kw["handshake_timeout_s"] + layers * (work + kw["layer_ack_timeout_s"])
        want += kw["heartbeat_interval_s"] * kw["heartbeat_misses"]
        assert h.verdict_s(cfg, layers, work) == pytest.approx(want)
        assert h.dead_peer_detect_s(cfg) == pytest.approx(
            kw["heartbeat_interval_s"] * (kw["heartbeat_misses"] + 1)
        )
    # the dead-peer timing tests keep their 2.5 s bound, now a formula of their window
    assert 2 * h.dead_peer_detect_s(h.config("prefill", **h.DEAD_PEER)) == pytest.approx(2.5)


_DEADLINE_CALLS = {"join", "wait", "get", "wait_request", "lookup", "put"}


def _fixed_deadlines(path) -> list[str]:
    """``file:line call`` of every call in ``path`` that waits a hard-coded time of more than a poll."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in _DEADLINE_CALLS:
            continue
        values = [kw.value for kw in node.keywords if kw.arg == "timeout"]
        if node.func.attr in ("join", "wait"):
            values += node.args[:1]
        for v in values:
            if isinstance(v, ast.Constant) and isinstance(v.value, int | float) and v.value > 0.2:
                found.append(f"{path.name}:{node.lineno} {node.func.attr}({v.value})")
    return found


@pytest.mark.parametrize(
    "name",
    ["support/pd_helpers.py", "hf/test_pd_hf.py", "pd/test_pd_transfer.py", "pd/test_pd_transports.py",
     "pd/test_pd_rendezvous.py", "pd/test_pd_prefill.py", "pd/test_pd_fs_security.py"],
)  # fmt: skip
def test_multi_process_tests_wait_no_fixed_wall_time(name: str) -> None:
    import pathlib

    assert _fixed_deadlines(pathlib.Path(__file__).parents[1] / name) == []

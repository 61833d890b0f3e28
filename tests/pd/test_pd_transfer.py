"""Prefill and decode in two processes on loopback: bit-for-bit transfer for non-uniform TP over both
transports, and each fault ending with an error in bounded time and nothing partial readable.

Decode checks its host pool and every rank's indexer against :func:`pd_helpers.block_data` — the KV the
prefill ranks wrote, computed independently of the transfer code.
"""

from __future__ import annotations

import pytest
from support.pd_helpers import DEAD_PEER, config, dead_peer_detect_s, run_pair


def _mooncake_missing() -> str | None:
    try:
        import mooncake.engine  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mooncake TransferEngine not usable (pip install mooncake-transfer-engine-non-cuda; apt-get install libibverbs1): {exc}"
    return None


_MOONCAKE = _mooncake_missing()
TRANSPORTS = [
    "shm",
    pytest.param("mooncake", marks=pytest.mark.skipif(_MOONCAKE is not None, reason=_MOONCAKE or "")),
]


def _prefill_errors(pre: dict) -> dict[int, str]:
    return {r: v.get("error", "") for r, v in pre.get("ranks", {}).items() if not v.get("ok")}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (4, 2)])
def test_non_uniform_tp_transfer_is_bit_exact(tmp_path, transport: str, p_tp: int, d_tp: int) -> None:
    pre, dec = run_pair(tmp_path, transport=transport, p_tp=p_tp, d_tp=d_tp)
    assert "fatal" not in dec, dec.get("trace")
    assert _prefill_errors(pre) == {} and len(pre["ranks"]) == p_tp, pre
    assert all(states == ["done"] * d_tp for states in dec["states"].values()), dec
    assert dec["mismatches"] == []
    counters = dec["counters"]
    # every member of every group sent every layer (empty batches included): L * ratio per decode rank
    assert [c["layers_received"] for c in counters] == [6 * (p_tp // d_tp)] * d_tp
    assert all(c["requests_done"] == 3 and c["read_failures"] == 0 for c in counters)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_size_mismatched_metadata_fails_the_layer_on_both_sides(tmp_path, transport: str) -> None:
    pre, dec = run_pair(tmp_path, transport=transport, p_tp=2, d_tp=1, prefill_fault="bad-metadata:2")
    errors = _prefill_errors(pre)
    assert set(errors) == {0, 1}
    assert "ReadFailedError" in errors[0] and "layer 2" in errors[0] and "main KV metadata" in errors[0]
    assert "[258, 64]" in errors[0] and "[256, 64]" in errors[0]
    assert all(s == ["failed"] for s in dec["states"].values())
    assert all("layer 2" in e for e in dec["errors"].values())
    assert dec["leftovers"] == []  # invalidated destinations hold nothing readable


def test_incompatible_handshake_is_an_error_on_both_sides(tmp_path) -> None:
    pre, dec = run_pair(
        tmp_path, transport="shm", p_tp=2, d_tp=1, fingerprint="another-model", decode_wait_s=1.0
    )
    errors = _prefill_errors(pre)
    assert set(errors) == {0, 1}
    assert all("HandshakeError" in e and "model_fingerprint" in e for e in errors.values())
    assert len(dec["handshake_errors"]) == 2 and "another-model" in dec["handshake_errors"][0]
    assert all(s == ["pending"] for s in dec["states"].values())  # no data moved
    assert sum(c["layers_received"] for c in dec["counters"]) == 0


def test_dropped_ack_hits_the_layer_deadline(tmp_path) -> None:
    pre, dec = run_pair(
        tmp_path, transport="shm", p_tp=2, d_tp=1, decode_fault="drop-ack:2", layer_ack_timeout_s=1.0
    )
    errors = _prefill_errors(pre)
    assert set(errors) == {0, 1}
    for e in errors.values():
        assert (
            "AckTimeoutError" in e and "layer 2 of requests [7, 11, 12]" in e and "decode dp 0 (tcp://" in e
        )
    assert all(s == ["failed"] for s in dec["states"].values())  # prefill gave up: decode must not schedule


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decode_killed_mid_transfer_fails_prefill_within_the_heartbeat_window(
    tmp_path, transport: str
) -> None:
    pre, dec = run_pair(
        tmp_path,
        transport=transport,
        p_tp=2,
        d_tp=1,
        decode_fault="die-at:3",
        layer_sleep=0.1,
        **DEAD_PEER,
    )
    assert dec.get("exitcode") == 3
    killed_at = float((tmp_path / "killed_at").read_text())
    errors = _prefill_errors(pre)
    assert set(errors) == {0, 1}
    for rank in (0, 1):
        assert "PeerDeadError" in errors[rank] and "layer 3" in errors[rank] and "silent" in errors[rank]
        # the error within twice the worst-case detection time (the second for scheduling on a loaded
        # machine): 2 * (4 missed 0.25 s heartbeats + one tick) = 2.5 s
        assert pre["ranks"][rank]["at"] - killed_at < 2 * dead_peer_detect_s(config("prefill", **DEAD_PEER))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_killed_mid_transfer_invalidates_decode(tmp_path, transport: str) -> None:
    pre, dec = run_pair(
        tmp_path,
        transport=transport,
        p_tp=2,
        d_tp=1,
        prefill_fault="die-after:2",
        layer_sleep=0.1,
        **DEAD_PEER,
    )
    assert pre.get("exitcode") == 3
    assert all(s == ["failed"] for s in dec["states"].values()), dec
    for e in dec["errors"].values():
        assert "silent" in e and "prefill rank" in e and "layers 0..2" in e
    assert dec["leftovers"] == []

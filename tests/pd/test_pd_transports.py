"""The P/D transports: shm (same host), Mooncake TransferEngine over TCP on loopback (two processes), and
the memfabric adapter against a recording fake of memfabric_hybrid's API."""

from __future__ import annotations

import random
import sys

import pytest
import torch
from support.pd_helpers import PRELOAD, FakeMemFabric, export_region_main, mp_context, process_s

from torch_kvoffload.pd import PDConfig, ShmTransport, TransportError, make_transport
from torch_kvoffload.pd.transports import ReadOp


def _mooncake_missing() -> str | None:
    try:
        import mooncake.engine  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mooncake TransferEngine not usable (pip install mooncake-transfer-engine-non-cuda; apt-get install libibverbs1): {exc}"
    return None


_MOONCAKE = _mooncake_missing()


def _random_ops(rng: random.Random, src_size: int, dst_size: int, n: int) -> list[ReadOp]:
    """Non-overlapping destination ranges (equal-size blocks and odd lengths) into region "d"."""
    ops, cursor = [], 0
    for _ in range(n):
        length = rng.choice([16, 16, 16, 7, 33])
        if cursor + length > dst_size:
            break
        if length == 16 and cursor % 16:
            cursor += 16 - cursor % 16
            if cursor + length > dst_size:
                break
        src = (
            rng.randrange(0, (src_size - length) // 16) * 16
            if length == 16
            else rng.randrange(0, src_size - length)
        )
        ops.append(ReadOp("r", src, "d", cursor, length))
        cursor += length + rng.choice([0, 0, 16, 5])
    rng.shuffle(ops)
    return ops


def _reference(src: torch.Tensor, dst: torch.Tensor, ops: list[ReadOp]) -> torch.Tensor:
    out = dst.clone()
    for op in ops:
        out[op.local_offset : op.local_offset + op.nbytes] = src[
            op.remote_offset : op.remote_offset + op.nbytes
        ]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shm_reads_match_a_slicing_reference(seed: int) -> None:
    rng = random.Random(seed)
    exporter, reader = ShmTransport(), ShmTransport()
    try:
        size = rng.choice([4096, 10000])
        src = exporter.allocate("r", (size,), torch.uint8)
        src.copy_(
            torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        )
        dst = torch.randint(0, 256, (3000,), dtype=torch.uint8)
        reader.register("d", dst)
        peer = reader.connect(exporter.describe(), "exporter")
        ops = _random_ops(rng, size, dst.numel(), 40)
        want = _reference(src, dst, ops)
        reader.read(peer, ops)
        assert torch.equal(dst, want)
    finally:
        exporter.close()
        reader.close()


def test_shm_out_of_bounds_batch_copies_nothing() -> None:
    exporter, reader = ShmTransport(), ShmTransport()
    try:
        exporter.allocate("r", (256,), torch.uint8).fill_(7)
        dst = torch.zeros(64, dtype=torch.uint8)
        reader.register("d", dst)
        peer = reader.connect(exporter.describe(), "exporter")
        good, bad_remote, bad_local = (
            ReadOp("r", 0, "d", 0, 16),
            ReadOp("r", 250, "d", 16, 16),
            ReadOp("r", 0, "d", 60, 16),
        )
        for bad, match in ((bad_remote, "leaves region 'r'"), (bad_local, "leaves local region 'd'")):
            with pytest.raises(TransportError, match=match):
                reader.read(peer, [good, bad])
            assert int(dst.sum()) == 0
        with pytest.raises(TransportError, match="no region 'x'"):
            reader.read(peer, [ReadOp("x", 0, "d", 0, 1)])
        with pytest.raises(ValueError, match="already registered"):
            reader.register("d", dst)
    finally:
        exporter.close()
        reader.close()


def test_shm_connect_to_missing_files_fails_clearly() -> None:
    exporter = ShmTransport()
    exporter.allocate("r", (64,), torch.uint8)
    desc = exporter.describe()
    exporter.close()  # removes the files
    with pytest.raises(TransportError, match="does not exist"):
        ShmTransport().connect(desc, "gone")
    with pytest.raises(TransportError, match="not shm"):
        ShmTransport().connect({"kind": "mooncake"}, "other")


@pytest.mark.slow
@pytest.mark.skipif(_MOONCAKE is not None, reason=_MOONCAKE or "")
def test_mooncake_two_process_transfer_on_loopback() -> None:
    from torch_kvoffload.pd.transports.mooncake import MooncakeTransport

    ctx = mp_context()
    out_q, stop = ctx.Queue(), ctx.Event()
    size, seed = 1 << 16, 5
    limit = process_s((*PRELOAD, "mooncake.engine"))  # the exporter's start, or its exit once stopped
    proc = ctx.Process(
        target=export_region_main, args=("mooncake", size, seed, out_q, stop, limit), daemon=True
    )
    proc.start()
    try:
        desc = out_q.get(timeout=limit)
        reader = MooncakeTransport()
        dst = torch.zeros(5000, dtype=torch.uint8)
        reader.register("d", dst)
        peer = reader.connect(desc, "exporter")  # a real probe read: initialize() returning 0 proves nothing
        ops = _random_ops(random.Random(seed), size, dst.numel(), 60)
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        want = _reference(src, dst, ops)
        reader.read(peer, ops)
        assert torch.equal(dst, want)
        with pytest.raises(TransportError, match="leaves region"):
            reader.read(peer, [ReadOp("r", size - 4, "d", 0, 8)])
        stop.set()
        proc.join(limit)
        with pytest.raises(TransportError, match="returned"):  # the peer is gone: the read fails, loudly
            reader.read(peer, [ReadOp("r", 0, "d", 0, 8)])
        reader.close()
    finally:
        stop.set()
        proc.join(limit)
        if proc.is_alive():
            proc.kill()


@pytest.mark.skipif(_MOONCAKE is not None, reason=_MOONCAKE or "")
def test_mooncake_probe_detects_a_peer_that_moves_no_data() -> None:
    from torch_kvoffload.pd.transports.mooncake import MooncakeTransport

    a, b = MooncakeTransport(), MooncakeTransport()
    desc = a.describe()
    a._probe.zero_()  # what a transport that "initialized" but never moves data would leave
    with pytest.raises(TransportError, match="probe read"):
        b.connect(desc, "a")
    a.close()
    b.close()


def test_memfabric_adapter_against_a_recording_fake(monkeypatch) -> None:
    fake = FakeMemFabric()
    monkeypatch.setitem(sys.modules, "memfabric_hybrid", fake)
    cfg_p = PDConfig(role="prefill", transport="memfabric", memfabric_store_url="tcp://127.0.0.1:9000")
    cfg_d = PDConfig(role="decode", transport="memfabric", memfabric_store_url="tcp://127.0.0.1:9000")
    exporter = make_transport(cfg_p, rank_name="p0")
    reader = make_transport(cfg_d, rank_name="d0")
    src = exporter.allocate("r", (512,), torch.uint8)
    src.copy_(torch.arange(512, dtype=torch.int64).remainder(251).to(torch.uint8))
    dst = torch.zeros(128, dtype=torch.uint8)
    reader.register("d", dst)
    peer = reader.connect(exporter.describe(), "p0")
    ops = [ReadOp("r", 100, "d", 0, 16), ReadOp("r", 0, "d", 64, 0), ReadOp("r", 300, "d", 32, 40)]
    reader.read(peer, ops)
    assert torch.equal(dst, _reference(src, torch.zeros(128, dtype=torch.uint8), ops))
    inits = [c for c in fake.calls if c[0] == "initialize"]
    assert [c[1] for c in inits] == ["tcp://127.0.0.1:9000"] * 2 and [c[3] for c in inits] == [
        "prefill",
        "decode",
    ]
    read = [c for c in fake.calls if c[0] == "batch_transfer_sync_read"][-1]
    assert read[1] == exporter.unique_id
    assert read[4] == [16, 40]  # zero-length ops are not sent
    assert read[2] == [dst.data_ptr(), dst.data_ptr() + 32]
    assert read[3] == [src.data_ptr() + 100, src.data_ptr() + 300]
    fake.fail_reads = True
    with pytest.raises(TransportError, match="returned -1"):
        reader.read(peer, ops)
    reader.close()
    exporter.close()
    assert ("destroy", exporter.unique_id) in fake.calls


def test_memfabric_missing_package_names_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "memfabric_hybrid", None)
    cfg = PDConfig(role="decode", transport="memfabric", memfabric_store_url="tcp://127.0.0.1:9000")
    with pytest.raises(TransportError, match=r"memfabric_hybrid 1\.3\.0"):
        make_transport(cfg, rank_name="d0")


def test_remove_stale_exports_removes_only_dead_processes_files() -> None:
    import os

    from torch_kvoffload.pd.transports.shm import remove_stale_exports

    dead_pid = next(p for p in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{p}"))
    stale = f"/dev/shm/kvoffload-pd-{dead_pid}-test-0"
    open(stale, "wb").close()
    live = ShmTransport()
    live.allocate("r", (16,), torch.uint8)
    try:
        removed = remove_stale_exports()
        assert os.path.basename(stale) in removed and not os.path.exists(stale)
        assert all(not name.startswith(f"kvoffload-pd-{os.getpid()}-") for name in removed)
        assert os.path.exists(f"/dev/shm/{live.describe()['regions']['r']['file']}")
    finally:
        live.close()
        if os.path.exists(stale):
            os.unlink(stale)

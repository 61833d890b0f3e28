"""MooncakeKVStore against a real loopback Mooncake master: semantics, quota, and two client processes.

Needs the Mooncake client (``pip install '.[mooncake]'``) and the RDMA verbs library it links against
(``apt-get install libibverbs1``); skipped with the reason and the install commands otherwise — except
under ``CI=true``, where a missing Mooncake fails the module instead of skipping it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.mooncake import LEASE_MS, mooncake_client, mooncake_missing

from torch_kvoffload.store.base import KVStore, StoreUnavailableError

_MISSING = mooncake_missing()
if _MISSING is not None and os.environ.get("CI") == "true":
    # CI must run every test: a Mooncake test that would skip there is a broken set-up
    pytest.fail(f"CI=true and the Mooncake tests cannot run: {_MISSING}", pytrace=False)
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")


@pytest.fixture(scope="module")
def client(master):
    store = mooncake_client(master, 1 << 20)
    yield store
    store.close()


def test_round_trip_overwrite_and_errors(client) -> None:
    assert isinstance(client, KVStore)
    for i, (shape, dtype) in enumerate(
        [((7,), torch.float32), ((4, 3, 5), torch.bfloat16), ((2, 64, 9), torch.int8)]
    ):
        value = (
            torch.randn(shape).to(dtype)
            if dtype.is_floating_point
            else torch.randint(-9, 9, shape, dtype=dtype)
        )
        key = f"rt/{i}"
        client.put(key, value)
        out = torch.empty_like(value)
        assert client.get(key, out) and torch.equal(out, value)
    # overwrite replaces, including with a different size
    client.put("rt/0", torch.full((7,), 5.0))
    out = torch.empty(7)
    assert client.get("rt/0", out) and torch.equal(out, torch.full((7,), 5.0))
    client.put("rt/0", torch.full((9,), 6.0))
    out9 = torch.empty(9)
    assert client.get("rt/0", out9) and torch.equal(out9, torch.full((9,), 6.0))
    # size mismatch: ValueError, out untouched; a batch with one mismatch copies nothing
    probe = torch.full((7,), -1.0)
    with pytest.raises(ValueError, match="holds 36 bytes but out has 28 bytes"):
        client.get("rt/0", probe)
    assert torch.equal(probe, torch.full((7,), -1.0))
    good = torch.full((7,), -1.0)
    with pytest.raises(ValueError, match="rt/0"):
        client.batch_get(["rt/1", "rt/0"], [torch.empty(4, 3, 5, dtype=torch.bfloat16), good])
    assert client.get("absent/key", good) is False and torch.equal(good, torch.full((7,), -1.0))
    with pytest.raises(ValueError, match="empty values"):
        client.put("e", torch.empty(0))
    with pytest.raises(ValueError, match="does not fit"):
        client.put("big", torch.empty((1 << 20) + 1, dtype=torch.uint8))


def test_exists_remove_and_read_lease(client) -> None:
    client.put("lease/a", torch.arange(16, dtype=torch.int32))
    assert client.batch_exists(["lease/a", "lease/none"]) == [True, False]
    assert client.get("lease/a", torch.empty(16, dtype=torch.int32))
    assert client.remove("lease/a") is False  # a read lease protects it for LEASE_MS
    assert client.exists("lease/a")
    time.sleep(LEASE_MS / 1000 + 0.3)
    assert client.remove("lease/a") is True
    assert not client.exists("lease/a")
    assert client.remove("lease/a") is False
    assert client.get("lease/a", torch.empty(16, dtype=torch.int32)) is False


def test_batch_and_client_quota(master) -> None:
    block = 4096
    store = mooncake_client(master, 4 * block)
    try:
        keys = [f"q/{i}" for i in range(4)]
        vals = [torch.randint(0, 255, (block,), dtype=torch.uint8) for _ in keys]
        store.batch_put(keys, vals)
        assert store.used_bytes == 4 * block
        outs = [torch.empty(block, dtype=torch.uint8) for _ in range(5)]
        assert store.batch_get([*keys, "q/none"], outs) == [True] * 4 + [False]
        assert all(torch.equal(o, v) for o, v in zip(outs, vals, strict=False))
        time.sleep(LEASE_MS / 1000 + 0.3)  # let the read leases lapse so the quota can evict
        store.get("q/0", outs[0])  # q/0 is now the most recently used (and leased again)
        store.put("q/4", torch.zeros(block, dtype=torch.uint8))
        assert store.batch_exists([*keys, "q/4"]) == [True, False, True, True, True]  # q/1 was the LRU
        assert store.used_bytes == 4 * block and store.counters.get("evictions") == 1
        c = store.counters.snapshot()
        assert c["hits"] == 5 and c["misses"] == 1 and c["bytes_got"] == 5 * block
    finally:
        store.close()


@pytest.mark.slow  # the Mooncake client waits out its connection attempts (seconds)
def test_bad_master_is_reported() -> None:
    from torch_kvoffload._utils import free_port
    from torch_kvoffload.store.mooncake import MooncakeKVStore

    with pytest.raises(StoreUnavailableError, match="setup returned"):
        MooncakeKVStore(
            1 << 20,
            master_server_addr=f"127.0.0.1:{free_port()}",  # nothing listens there
            metadata_server=f"http://127.0.0.1:{free_port()}/metadata",
            global_segment_size=0,
            setup_retries=1,
        )
    with pytest.raises(ValueError, match="global_segment_size must be 0 or >="):
        MooncakeKVStore(1 << 20, master_server_addr="x:1", metadata_server="y", global_segment_size=1 << 10)
    with pytest.raises(ValueError, match="protocol"):
        MooncakeKVStore(1 << 20, master_server_addr="x:1", metadata_server="y", protocol="udp")


# ----------------------------------------------------------------------------------- two processes


def _values(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 9, generator=g).to(torch.bfloat16) for _ in range(n)]


def _child(role: str, master_addr: str, metadata: str) -> None:
    """Runs in a separate process: ``writer`` puts and waits; ``reader`` checks and answers."""
    from torch_kvoffload.store.mooncake import MooncakeKVStore

    # the reader lends no memory: what it puts lands in the writer's segment, which outlives the reader
    segment = None if role == "writer" else 0
    store = MooncakeKVStore(
        1 << 22, master_server_addr=master_addr, metadata_server=metadata, global_segment_size=segment
    )
    n = 8
    keys = [f"xp/{i}" for i in range(n)]
    if role == "writer":
        store.batch_put(keys, _values(1234, n))
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()  # the reader has finished: read what it wrote
        out = torch.empty(64, 9, dtype=torch.bfloat16)
        got = store.get("xp/from-reader", out)
        ok = got and torch.equal(out, _values(99, 1)[0])
        print(json.dumps({"from_reader": bool(ok), "removed_gone": not store.exists("xp/7")}), flush=True)
    else:
        sys.stdin.readline()  # the writer's data is in place
        outs = [torch.empty(64, 9, dtype=torch.bfloat16) for _ in range(n - 1)]
        hits = store.batch_get(keys[:-1], outs)
        same = [torch.equal(o, v) for o, v in zip(outs, _values(1234, n), strict=False)]
        removed = store.remove("xp/7")  # never read, so no lease: the reader may remove the writer's key
        store.put("xp/from-reader", _values(99, 1)[0])
        print(json.dumps({"hits": hits, "same": same, "removed": removed}), flush=True)
    store.close()


def _spawn(role: str, master) -> subprocess.Popen:
    from support import ROOT, TOOLS_DIR

    # the child runs this file as a script: it imports mooncake_master from tools/ and support from tests/
    env = dict(os.environ)
    paths = (str(TOOLS_DIR), str(ROOT / "tests"), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), role, master.master_addr, master.metadata_server],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def _read_json(proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"child exited early with code {proc.wait(5)}")
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError("child timed out")


@pytest.mark.slow
def test_two_processes_share_data(master) -> None:
    writer = _spawn("writer", master)
    reader = _spawn("reader", master)  # starts up (imports, setup) while the writer writes
    try:
        assert _read_json(writer, 60) == {"ready": True}
        assert reader.stdin is not None
        reader.stdin.write("go\n")
        reader.stdin.flush()
        res = _read_json(reader, 60)
        assert res["hits"] == [True] * 7
        assert res["same"] == [True] * 7  # bytes written by one process, read back by the other
        assert res["removed"] is True
        assert reader.wait(30) == 0
        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert _read_json(writer, 60) == {"from_reader": True, "removed_gone": True}
        assert writer.wait(30) == 0
    finally:
        for proc in (writer, reader):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3])


def test_factory_builds_mooncake(master) -> None:
    from torch_kvoffload.store import MooncakeKVStore, create_store

    store = create_store(
        "mooncake",
        capacity_bytes="1MiB",
        master_server_addr=master.master_addr,
        metadata_server=master.metadata_server,
    )
    try:
        assert isinstance(store, MooncakeKVStore)
        store.put("factory/a", torch.arange(10))
        out = torch.empty(10, dtype=torch.int64)
        assert store.get("factory/a", out) and torch.equal(out, torch.arange(10))
    finally:
        store.close()


def test_records_and_leases_through_the_default_path(client) -> None:
    """batch_put_blocks / batch_get_blocks (staging + the pool's batch calls) and lease (no pinning)."""
    from torch_kvoffload.store.base import RecordLayout

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 4, 8, generator=g), torch.randint(-9, 9, (6, 4, 3), dtype=torch.int8, generator=g)
    lay = RecordLayout([a, b], [0, 128], 144)
    keys = ["rec/0", "rec/1", "rec/2"]
    client.batch_put_blocks(keys, lay, [5, 0, 3])
    da, db = torch.zeros_like(a), torch.zeros_like(b)
    hits = client.batch_get_blocks([*keys, "rec/none"], RecordLayout([da, db], [0, 128], 144), [1, 2, 4, 0])
    assert hits == [True, True, True, False]
    for src, dst in ((a, da), (b, db)):
        assert torch.equal(dst[[1, 2, 4]], src[[5, 0, 3]]) and not dst[[0, 3, 5]].any()
    lease = client.lease([*keys, "rec/none"])
    assert not lease.pinned and lease.found == [True, True, True, False]
    lease.release()

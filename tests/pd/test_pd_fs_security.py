"""What a hostile local user can plant in the filesystem paths P/D trusts: the rendezvous directory and its
records, and the ``/dev/shm`` regions a peer names. Each planted path is refused with a clear error and
left untouched; the honest path keeps working, bit for bit."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
import uuid

import pytest
import torch
from support.pd_helpers import export_region_main, mp_context, process_s

from torch_kvoffload._utils import free_port
from torch_kvoffload.pd import FileRendezvous, PDConfig, ShmTransport, TransportError, make_rendezvous
from torch_kvoffload.pd.rendezvous import decode_key
from torch_kvoffload.pd.transports import ReadOp

NOBODY = 65534


def _other_uid_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root to give a file to another user (uid 65534)"
    return None


_NO_OTHER_UID = _other_uid_missing()
KEY = decode_key(30000, 0, 0)
RECORD = {"endpoint": "tcp://127.0.0.1:30000", "dp_rank": 0, "tp_rank": 0}
EVIL = {"endpoint": "tcp://127.0.0.1:6666", "dp_rank": 0, "tp_rank": 0}


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ------------------------------------------------------------------------------ rendezvous directory
def test_created_directory_is_private_and_records_are_0600(tmp_path) -> None:
    where = tmp_path / "a" / "rdv"
    rdv = FileRendezvous(str(where))
    assert _mode(where) == 0o700
    rdv.publish(KEY, RECORD)
    record = where / f"{KEY}.json"
    assert _mode(record) == 0o600 and os.lstat(record).st_uid == os.geteuid()
    assert rdv.lookup(KEY, timeout=0) == RECORD
    assert [p.name for p in where.iterdir()] == [record.name]  # no temp file left behind


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o720, 0o702])
def test_precreated_writable_directory_is_refused(tmp_path, mode: int) -> None:
    where = tmp_path / "rdv"
    where.mkdir()
    where.chmod(mode)
    with pytest.raises(PermissionError, match=rf"{where}.*writable by its group or others.*{oct(mode)}"):
        FileRendezvous(str(where))
    assert _mode(where) == mode  # left as found
    where.chmod(0o750)  # the user fixes it: accepted
    FileRendezvous(str(where)).publish(KEY, RECORD)


def test_default_directory_precreated_by_another_user_is_refused(tmp_path) -> None:
    """The default ``<tmp>/kvoffload-pd-<uid>-<kv_port>``: another user creates it first (world writable)
    and would receive the records; make_rendezvous refuses it."""
    import tempfile

    port = free_port()
    where = os.path.join(tempfile.gettempdir(), f"kvoffload-pd-{os.geteuid()}-{port}")
    os.mkdir(where)
    try:
        os.chmod(where, 0o777)
        with pytest.raises(PermissionError, match="writable by its group or others"):
            make_rendezvous(PDConfig(role="decode", kv_port=port))
        if _NO_OTHER_UID is None:
            os.chmod(where, 0o700)
            os.chown(where, NOBODY, NOBODY)
            with pytest.raises(PermissionError, match=rf"owned by uid {NOBODY}"):
                make_rendezvous(PDConfig(role="prefill", kv_port=port))
    finally:
        os.rmdir(where)


@pytest.mark.skipif(_NO_OTHER_UID is not None, reason=_NO_OTHER_UID or "")
def test_directory_of_another_user_is_refused(tmp_path) -> None:
    where = tmp_path / "rdv"
    where.mkdir(mode=0o700)
    os.chown(where, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=rf"owned by uid {NOBODY}, not .*uid {os.geteuid()}"):
        FileRendezvous(str(where))


def test_directory_that_is_a_symlink_is_refused(tmp_path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "rdv"
    link.symlink_to(real)
    with pytest.raises(PermissionError, match="symbolic link"):
        FileRendezvous(str(link))


def test_directory_made_writable_after_construction_is_refused_at_use(tmp_path) -> None:
    where = tmp_path / "rdv"
    rdv = FileRendezvous(str(where))
    rdv.publish(KEY, RECORD)
    where.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by its group or others"):
        rdv.lookup(KEY, timeout=0)
    with pytest.raises(PermissionError, match="writable by its group or others"):
        rdv.publish(KEY, RECORD)
    where.chmod(0o700)
    assert rdv.lookup(KEY, timeout=0) == RECORD


# ------------------------------------------------------------------------------- rendezvous records
def _planted(tmp_path):
    rdv = FileRendezvous(str(tmp_path / "rdv"))
    return rdv, tmp_path / "rdv" / f"{KEY}.json"


def test_record_that_is_a_symlink_is_refused(tmp_path) -> None:
    rdv, record = _planted(tmp_path)
    target = tmp_path / "evil.json"
    target.write_text(json.dumps(EVIL))
    target.chmod(0o600)
    record.symlink_to(target)
    with pytest.raises(PermissionError, match="symbolic link"):
        rdv.lookup(KEY, timeout=0)
    record.unlink()
    rdv.publish(KEY, RECORD)  # the honest record afterwards
    assert rdv.lookup(KEY, timeout=0) == RECORD


@pytest.mark.skipif(_NO_OTHER_UID is not None, reason=_NO_OTHER_UID or "")
def test_record_of_another_user_is_refused(tmp_path) -> None:
    rdv, record = _planted(tmp_path)
    rdv.publish(KEY, EVIL)
    os.chown(record, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=rf"owned by uid {NOBODY}"):
        rdv.lookup(KEY, timeout=0)
    rdv.publish(KEY, RECORD)  # replaced by the user's own record: accepted
    assert rdv.lookup(KEY, timeout=0) == RECORD


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_writable_record_is_refused(tmp_path, mode: int) -> None:
    rdv, record = _planted(tmp_path)
    rdv.publish(KEY, RECORD)
    record.chmod(mode)
    with pytest.raises(PermissionError, match="writable by its group or others"):
        rdv.lookup(KEY, timeout=0)


def test_record_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path) -> None:
    rdv, record = _planted(tmp_path)
    os.mkfifo(record, 0o600)  # a FIFO blocks a plain open() until a writer comes
    done = threading.Event()

    def writer() -> None:  # unblocks a reader that opened the FIFO (an empty record), never one that did not
        while not done.is_set():
            try:
                os.close(os.open(record, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                time.sleep(0.01)

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    try:
        with pytest.raises(PermissionError, match="not a regular file"):
            rdv.lookup(KEY, timeout=0)
    finally:
        done.set()
        th.join()
    record.unlink()
    record.mkdir(mode=0o700)
    with pytest.raises(PermissionError, match="not a regular file"):
        rdv.lookup(KEY, timeout=0)


@pytest.mark.parametrize("body", [b"x" * (2 << 20), b"[1, 2]", b"{not json"])
def test_oversized_or_malformed_record_is_refused(tmp_path, body: bytes) -> None:
    rdv, record = _planted(tmp_path)
    fd = os.open(record, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, body)
    os.close(fd)
    with pytest.raises(ValueError, match=KEY):
        rdv.lookup(KEY, timeout=0)


# ------------------------------------------------------------------------------------- shm regions
SHM = "/dev/shm"


def _shm_name() -> str:
    return f"kvoffload-pd-test-{os.getpid()}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def shm_files():
    """Paths under /dev/shm the test plants; removed afterwards."""
    made: list[str] = []
    yield made
    for path in made:
        if os.path.lexists(path):
            os.unlink(path)


def _plant(shm_files, data: bytes, mode: int = 0o600) -> str:
    name = _shm_name()
    path = os.path.join(SHM, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, data)
    os.close(fd)
    os.chmod(path, mode)
    shm_files.append(path)
    return name


def _describe(name: str, nbytes: int) -> dict:
    return {"kind": "shm", "regions": {"r": {"file": name, "nbytes": nbytes}}}


def _fingerprint(path: str) -> tuple:
    st = os.lstat(path)
    with open(path, "rb") as f:
        return st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode), st.st_uid, f.read()


def test_shm_region_that_is_a_symlink_is_refused(tmp_path, shm_files) -> None:
    secret = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    target = tmp_path / "private.key"
    target.write_bytes(secret.numpy().tobytes())
    target.chmod(0o600)
    name = _shm_name()
    os.symlink(target, os.path.join(SHM, name))
    shm_files.append(os.path.join(SHM, name))
    reader = ShmTransport()
    dst = torch.zeros(4096, dtype=torch.uint8)
    reader.register("d", dst)
    with pytest.raises(TransportError, match="symbolic link"):
        peer = reader.connect(_describe(name, 4096), "hostile")
        reader.read(peer, [ReadOp("r", 0, "d", 0, 4096)])  # what the old code did: copy the file
    assert int(dst.count_nonzero()) == 0


@pytest.mark.skipif(_NO_OTHER_UID is not None, reason=_NO_OTHER_UID or "")
def test_shm_region_of_another_user_is_refused(shm_files) -> None:
    name = _plant(shm_files, bytes(range(256)) * 4)
    path = os.path.join(SHM, name)
    os.chown(path, NOBODY, NOBODY)
    before = _fingerprint(path)
    with pytest.raises(TransportError, match=rf"owned by uid {NOBODY}"):
        ShmTransport().connect(_describe(name, 1024), "hostile")
    assert _fingerprint(path) == before


@pytest.mark.parametrize(("size", "announced"), [(4096, 1000), (4096, 4097), (0, 0), (0, 64), (64, 1 << 50)])
def test_shm_region_size_mismatch_is_refused_and_the_file_untouched(
    shm_files, size: int, announced: int
) -> None:
    name = _plant(shm_files, b"\x5a" * size, mode=0o444)
    path = os.path.join(SHM, name)
    before = _fingerprint(path)
    with pytest.raises(TransportError, match=rf"{name}"):
        ShmTransport().connect(_describe(name, announced), "hostile")
    assert _fingerprint(path) == before  # size, mtime, mode, owner and bytes


@pytest.mark.parametrize(
    "info",
    [{"file": ".", "nbytes": 1}, {"file": "..", "nbytes": 1}, {"file": "", "nbytes": 1},
     {"file": "a/b", "nbytes": 1}, {"file": "x\x00y", "nbytes": 1}, {"file": "ok", "nbytes": -1},
     {"file": "ok", "nbytes": True}, {"file": "ok", "nbytes": 1.0}, {"file": 3, "nbytes": 1}, "notamap"],
)  # fmt: skip
def test_shm_malformed_region_descriptions_are_refused(info) -> None:
    with pytest.raises(TransportError, match="bad region"):
        ShmTransport().connect({"kind": "shm", "regions": {"r": info}}, "hostile")


@pytest.mark.parametrize(
    ("description", "match"),
    [("shm", "not shm"), (["shm"], "not shm"), ({"kind": "shm", "regions": ["r"]}, "bad regions"),
     ({"kind": "shm", "regions": {3: {"file": "ok", "nbytes": 1}}}, "bad region 3")],
)  # fmt: skip
def test_shm_malformed_descriptions_are_refused(description, match: str) -> None:
    with pytest.raises(TransportError, match=match):
        ShmTransport().connect(description, "hostile")


def test_shm_read_only_region_is_read_without_write_access_or_growth(shm_files) -> None:
    data = torch.randint(0, 256, (3000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    name = _plant(shm_files, data.numpy().tobytes(), mode=0o444)
    path = os.path.join(SHM, name)
    before = _fingerprint(path)
    reader = ShmTransport()
    dst = torch.zeros(3000, dtype=torch.uint8)
    reader.register("d", dst)
    peer = reader.connect(_describe(name, 3000), "exporter")
    reader.read(peer, [ReadOp("r", 0, "d", 0, 3000)])
    assert torch.equal(dst, data)
    with open("/proc/self/maps") as f:
        perms = [line.split()[1] for line in f if line.rstrip().endswith(path)]
    assert perms and all(p.startswith("r-") for p in perms), perms  # mapped read-only, never read-write
    reader.disconnect(peer)
    reader.close()
    assert _fingerprint(path) == before


def test_shm_zero_byte_region_is_not_grown(shm_files) -> None:
    """An exporter's empty region is a 1-byte file; a planted 0-byte read-only one is refused, not grown."""
    exporter = ShmTransport()
    try:
        exporter.allocate("empty", (0,), torch.uint8)
        peer = ShmTransport().connect(exporter.describe(), "exporter")
        assert peer.sizes == {"empty": 0}
    finally:
        exporter.close()
    name = _plant(shm_files, b"", mode=0o444)
    before = _fingerprint(os.path.join(SHM, name))
    with pytest.raises(TransportError, match="size"):
        ShmTransport().connect(_describe(name, 0), "hostile")
    assert _fingerprint(os.path.join(SHM, name)) == before


def test_shm_two_process_transfer_is_bit_exact_after_a_refusal(shm_files) -> None:
    """A refused planted region first, then an exporter in another process read bit for bit."""
    name = _plant(shm_files, b"\x01" * 128)
    with pytest.raises(TransportError):
        ShmTransport().connect(_describe(name, 64), "hostile")
    ctx = mp_context()
    out_q, stop = ctx.Queue(), ctx.Event()
    nbytes, seed = 10_000, 11
    limit = process_s()  # the exporter's start, or its exit once stopped
    proc = ctx.Process(target=export_region_main, args=("shm", nbytes, seed, out_q, stop, limit), daemon=True)
    proc.start()
    reader = ShmTransport()
    try:
        desc = out_q.get(timeout=limit)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        reader.register("d", dst)
        peer = reader.connect(desc, "exporter")
        ops = [ReadOp("r", off, "d", off, 16) for off in range(0, nbytes, 16)]
        reader.read(peer, ops)
        want = torch.randint(
            0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
        )
        assert torch.equal(dst, want)
    finally:
        stop.set()
        proc.join(limit)
        if proc.is_alive():
            proc.kill()
        reader.close()


@pytest.mark.skipif(_NO_OTHER_UID is not None, reason=_NO_OTHER_UID or "")
def test_stale_export_cleanup_leaves_other_users_files(shm_files) -> None:
    from torch_kvoffload.pd.transports.shm import remove_stale_exports

    dead_pid = next(p for p in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{p}"))
    theirs, mine = (os.path.join(SHM, f"kvoffload-pd-{dead_pid}-{who}-0") for who in ("theirs", "mine"))
    for path in (theirs, mine):
        open(path, "wb").close()
        shm_files.append(path)
    os.chown(theirs, NOBODY, NOBODY)
    removed = remove_stale_exports()
    assert os.path.basename(mine) in removed and not os.path.exists(mine)
    assert os.path.basename(theirs) not in removed and os.path.exists(theirs)

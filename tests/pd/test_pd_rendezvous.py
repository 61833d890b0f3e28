"""Rendezvous: the embedded directory default, and Mooncake's HTTP metadata server — also as the
TransferEngine's metadata path — with a full P/D transfer through it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest
from support.pd_helpers import process_s, run_pair

from torch_kvoffload._utils import free_port
from torch_kvoffload.pd import FileRendezvous, MooncakeMetadataRendezvous, PDConfig, make_rendezvous
from torch_kvoffload.pd.rendezvous import decode_key


def _mooncake_missing() -> str | None:
    try:
        import aiohttp  # noqa: F401
        import mooncake.engine
        import mooncake.http_metadata_server  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mooncake (TransferEngine + http_metadata_server) not usable: {exc}"
    return None


_MOONCAKE = _mooncake_missing()


def _rendezvous_contract(rdv) -> None:
    key = decode_key(30000, 1, 2)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=key):
        rdv.lookup(key, timeout=0.2)
    assert time.monotonic() - t0 >= 0.2
    rdv.publish(key, {"endpoint": "tcp://127.0.0.1:30006", "d_tp": 4})
    assert rdv.lookup(key, timeout=0) == {"endpoint": "tcp://127.0.0.1:30006", "d_tp": 4}
    rdv.publish(key, {"endpoint": "tcp://127.0.0.1:30007"})  # republish replaces
    assert rdv.lookup(key, timeout=0)["endpoint"] == "tcp://127.0.0.1:30007"
    rdv.remove(key)
    with pytest.raises(TimeoutError):
        rdv.lookup(key, timeout=0.05)


def test_file_rendezvous(tmp_path) -> None:
    _rendezvous_contract(FileRendezvous(str(tmp_path / "rdv")))
    with pytest.raises(ValueError, match="bad key"):
        FileRendezvous(str(tmp_path)).publish("../x", {})


def test_make_rendezvous_picks_by_location(tmp_path) -> None:
    assert isinstance(make_rendezvous(PDConfig(role="decode", rendezvous=str(tmp_path))), FileRendezvous)
    http = make_rendezvous(PDConfig(role="decode", rendezvous="http://127.0.0.1:1/metadata"))
    assert isinstance(http, MooncakeMetadataRendezvous)
    default = make_rendezvous(PDConfig(role="decode", kv_port=31234))
    assert isinstance(default, FileRendezvous) and default.directory.endswith(
        f"kvoffload-pd-{os.geteuid()}-31234"
    )


@pytest.fixture
def metadata_server():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/metadata"
    start_s = process_s(("aiohttp", "mooncake.http_metadata_server"))  # a cold start of the server
    deadline = time.monotonic() + start_s
    while True:
        try:
            urllib.request.urlopen(f"{url}?key=probe", timeout=1)
            break
        except urllib.error.HTTPError:
            break  # it answers (404 for an unknown key)
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("mooncake.http_metadata_server did not start")
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(start_s)


@pytest.mark.skipif(_MOONCAKE is not None, reason=_MOONCAKE or "")
def test_mooncake_metadata_rendezvous(metadata_server) -> None:
    _rendezvous_contract(MooncakeMetadataRendezvous(metadata_server))


def test_unreachable_metadata_server_is_a_clear_error() -> None:
    rdv = MooncakeMetadataRendezvous(f"http://127.0.0.1:{free_port()}/metadata", timeout=1)
    with pytest.raises(ConnectionError, match="rendezvous: GET"):
        rdv.lookup("k", timeout=0.1)


@pytest.mark.skipif(_MOONCAKE is not None, reason=_MOONCAKE or "")
def test_transfer_through_mooncake_metadata_path(tmp_path, metadata_server) -> None:
    pre, dec = run_pair(
        tmp_path, transport="mooncake", p_tp=2, d_tp=1,
        rendezvous=metadata_server, mooncake_metadata_server=metadata_server,
    )  # fmt: skip
    assert all(v["ok"] for v in pre["ranks"].values()), pre
    assert all(s == ["done"] for s in dec["states"].values()) and dec["mismatches"] == []


@pytest.mark.skipif(_MOONCAKE is not None, reason=_MOONCAKE or "")
def test_metadata_record_that_is_not_a_json_object_is_refused(metadata_server) -> None:
    rdv = MooncakeMetadataRendezvous(metadata_server)
    key = decode_key(30000, 0, 0)
    for body, match in ((b"[1, 2]", "must be a JSON object"), (b"{oops", "is not JSON")):
        rdv._request("PUT", key, body)
        with pytest.raises(ValueError, match=match):
            rdv.lookup(key, timeout=0)
    rdv.publish(key, {"endpoint": "tcp://127.0.0.1:30000"})  # a good record afterwards
    assert rdv.lookup(key, timeout=0) == {"endpoint": "tcp://127.0.0.1:30000"}

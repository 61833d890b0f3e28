"""Where decode advertises its endpoints and topology and prefill finds them.

* :class:`FileRendezvous` — the embedded default for one host: one JSON file per decode rank in a
  directory, written atomically (temp file + rename); no service to run.
* :class:`MooncakeMetadataRendezvous` — Mooncake's HTTP metadata server (``mooncake.http_metadata_server``,
  the one a Mooncake deployment already runs): ``PUT`` / ``GET`` / ``DELETE`` ``<url>?key=<key>``.

Keys: :func:`decode_key` ``(kv_port, dp_rank, tp_rank)``.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

__all__ = ["FileRendezvous", "MooncakeMetadataRendezvous", "Rendezvous", "decode_key", "make_rendezvous"]

_POLL_S = 0.02


def decode_key(kv_port: int, dp_rank: int, tp_rank: int) -> str:
    return f"kvoffload-pd.{kv_port}.decode.{dp_rank}.{tp_rank}"


class Rendezvous(abc.ABC):
    """Publish / look up small JSON records by key."""

    @abc.abstractmethod
    def publish(self, key: str, record: dict) -> None: ...

    @abc.abstractmethod
    def _get(self, key: str) -> dict | None: ...

    @abc.abstractmethod
    def remove(self, key: str) -> None: ...

    def lookup(self, key: str, timeout: float) -> dict:
        """The record of ``key``, waiting up to ``timeout`` seconds for it; ``TimeoutError`` naming the
        key and where it was looked for otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            record = self._get(key)
            if record is not None:
                return record
            if time.monotonic() >= deadline:
                raise TimeoutError(f"rendezvous: no record {key!r} in {self} after {timeout:.1f} s")
            time.sleep(_POLL_S)


class FileRendezvous(Rendezvous):
    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def __repr__(self) -> str:
        return f"FileRendezvous({self.directory!r})"

    def _path(self, key: str) -> str:
        if "/" in key or key.startswith("."):
            raise ValueError(f"FileRendezvous: bad key {key!r}")
        return os.path.join(self.directory, key + ".json")

    def publish(self, key: str, record: dict) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self._path(key))

    def _get(self, key: str) -> dict | None:
        try:
            with open(self._path(key)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))


class MooncakeMetadataRendezvous(Rendezvous):
    """Records in a Mooncake HTTP metadata server at ``url`` (``http://host:port/metadata``)."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"MooncakeMetadataRendezvous: url must be http(s)://..., got {url!r}")
        self.url, self.timeout = url, timeout

    def __repr__(self) -> str:
        return f"MooncakeMetadataRendezvous({self.url!r})"

    def _request(self, method: str, key: str, body: bytes | None = None) -> bytes | None:
        full = f"{self.url}?key={urllib.parse.quote(key)}"
        req = urllib.request.Request(full, data=body, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise ConnectionError(f"rendezvous: {method} {full} failed: HTTP {exc.code}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ConnectionError(f"rendezvous: {method} {full} failed: {exc}") from exc

    def publish(self, key: str, record: dict) -> None:
        self._request("PUT", key, json.dumps(record).encode())

    def _get(self, key: str) -> dict | None:
        raw = self._request("GET", key)
        return None if raw is None else json.loads(raw)

    def remove(self, key: str) -> None:
        self._request("DELETE", key)


def make_rendezvous(config) -> Rendezvous:
    """The rendezvous of a :class:`~torch_kvoffload.pd.config.PDConfig`: ``rendezvous`` as an HTTP URL
    (Mooncake metadata server) or a directory; ``None``: ``<tmp>/kvoffload-pd-<kv_port>``."""
    where = config.rendezvous
    if where is None:
        where = os.path.join(tempfile.gettempdir(), f"kvoffload-pd-{config.kv_port}")
    if where.startswith(("http://", "https://")):
        return MooncakeMetadataRendezvous(where)
    return FileRendezvous(where)

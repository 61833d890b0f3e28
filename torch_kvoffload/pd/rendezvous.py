"""Where decode advertises its endpoints and topology and prefill finds them.

* :class:`FileRendezvous` — the embedded default for one host: one JSON file per decode rank in a
  directory, written atomically (temp file + rename); no service to run. The directory (created ``0700``)
  and every record (``0600``) must belong to the user and not be writable by group or others — another
  user able to plant a record could send prefill to its own endpoint — and are opened without following
  symbolic links; anything else is refused with :class:`PermissionError`.
* :class:`MooncakeMetadataRendezvous` — Mooncake's HTTP metadata server (``mooncake.http_metadata_server``,
  the one a Mooncake deployment already runs): ``PUT`` / ``GET`` / ``DELETE`` ``<url>?key=<key>``.

Keys: :func:`decode_key` ``(kv_port, dp_rank, tp_rank)``.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import secrets
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

from torch_kvoffload.pd._files import GROUP_OTHER_WRITE, check_owned, open_owned

__all__ = ["FileRendezvous", "MooncakeMetadataRendezvous", "Rendezvous", "decode_key", "make_rendezvous"]

_POLL_S = 0.02
#: The largest record a :class:`FileRendezvous` reads (records are a few hundred bytes).
MAX_RECORD_BYTES = 1 << 16


def decode_key(kv_port: int, dp_rank: int, tp_rank: int) -> str:
    return f"kvoffload-pd.{kv_port}.decode.{dp_rank}.{tp_rank}"


def _parse_record(raw: bytes, where: str) -> dict:
    """The JSON object in ``raw``; ``ValueError`` naming ``where`` for anything else."""
    try:
        record = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{where} is not JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(record).__name__}")
    return record


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
    """Records as ``<directory>/<key>.json``. The directory is created ``0700`` if missing and checked
    (owner, mode, not a symbolic link) here and before every operation; records are written ``0600``
    through a temp file and an atomic rename, and read with ``O_NOFOLLOW`` after an owner / mode /
    regular-file check of the opened file. Violations raise :class:`PermissionError` naming the path."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        parent = os.path.dirname(os.path.abspath(directory))
        os.makedirs(parent, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
            os.chmod(directory, 0o700)  # whatever the umask
        os.close(self._open_dir())

    def __repr__(self) -> str:
        return f"FileRendezvous({self.directory!r})"

    def _open_dir(self) -> int:
        """A descriptor of the checked directory (every record operation goes through it)."""
        what = "FileRendezvous"
        try:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            if os.path.islink(self.directory):
                raise PermissionError(
                    f"{what}: {self.directory} is a symbolic link; refusing to follow it (give the real "
                    "directory)"
                ) from None
            raise
        try:
            check_owned(what, self.directory, os.fstat(fd), directory=True, forbid=GROUP_OTHER_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _name(self, key: str) -> str:
        if not key or "/" in key or "\0" in key or key.startswith("."):
            raise ValueError(f"FileRendezvous: bad key {key!r}")
        return key + ".json"

    def publish(self, key: str, record: dict) -> None:
        name = self._name(key)
        data = json.dumps(record).encode()
        dfd = self._open_dir()
        try:
            tmp = f".tmp-{secrets.token_hex(8)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dfd)  # fmt: skip
            try:
                with os.fdopen(fd, "wb") as f:
                    os.fchmod(f.fileno(), 0o600)
                    f.write(data)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
        finally:
            os.close(dfd)

    def _get(self, key: str) -> dict | None:
        name = self._name(key)
        path = os.path.join(self.directory, name)
        dfd = self._open_dir()
        try:
            try:
                fd = open_owned(name, f"FileRendezvous: record in {self.directory}", forbid=GROUP_OTHER_WRITE,
                                dir_fd=dfd)  # fmt: skip
            except FileNotFoundError:
                return None
        finally:
            os.close(dfd)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_RECORD_BYTES + 1)
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"FileRendezvous: record {key!r} ({path}) exceeds {MAX_RECORD_BYTES} bytes")
        return _parse_record(raw, f"FileRendezvous: record {key!r} ({path})")

    def remove(self, key: str) -> None:
        name = self._name(key)
        dfd = self._open_dir()
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)


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
        if raw is None:
            return None
        return _parse_record(raw, f"rendezvous: record {key!r} from {self.url}")

    def remove(self, key: str) -> None:
        self._request("DELETE", key)


def make_rendezvous(config) -> Rendezvous:
    """The rendezvous of a :class:`~torch_kvoffload.pd.config.PDConfig`: ``rendezvous`` as an HTTP URL
    (Mooncake metadata server) or a directory; ``None``: ``<tmp>/kvoffload-pd-<uid>-<kv_port>`` (one per
    user: another user's deployment on the same port is not mistaken for this one's)."""
    where = config.rendezvous
    if where is None:
        where = os.path.join(tempfile.gettempdir(), f"kvoffload-pd-{os.geteuid()}-{config.kv_port}")
    if where.startswith(("http://", "https://")):
        return MooncakeMetadataRendezvous(where)
    return FileRendezvous(where)

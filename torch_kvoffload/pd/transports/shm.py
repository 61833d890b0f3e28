"""``shm``: same-host transfer through shared memory — the embedded default.

Prefill allocates its layer buffers as files under ``/dev/shm`` mapped ``MAP_SHARED``
(:meth:`ShmTransport.allocate`); decode maps the same files and copies from them straight into its
destinations, one ``copy_blocks`` kernel per (source region, destination region, block size) group.
Needs host-memory buffers on the prefill side.

A region a peer names is opened ``O_RDONLY | O_NOFOLLOW`` and mapped ``PROT_READ`` only after the opened
file is checked: a regular file owned by the current user, exactly the size the peer announced (bounded
by :data:`MAX_REGION_BYTES`). A file that fails is refused with :class:`TransportError` and left as it
was (never written, truncated or grown).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import uuid
import warnings
from collections import defaultdict

import torch

from torch_kvoffload.ops.copy import copy_blocks
from torch_kvoffload.pd._files import open_owned
from torch_kvoffload.pd.transports.base import ReadOp, RemotePeer, Transport, TransportError

__all__ = ["ShmTransport", "remove_stale_exports"]

_SHM_DIR = "/dev/shm"
#: The largest region a peer may announce (1 TiB): a bound on what one mapping may claim.
MAX_REGION_BYTES = 1 << 40
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


def _file_size(nbytes: int) -> int:
    """Bytes of the file backing a region of ``nbytes`` (an empty region still has a 1-byte file)."""
    return max(nbytes, 1)


def _map_read_only(path: str, nbytes: int, peer_name: str, region: str) -> torch.Tensor:
    """``path``'s first ``nbytes`` bytes mapped ``PROT_READ`` as a ``uint8`` tensor, after checking the
    opened file (no symbolic link, regular, owned by the current user, size ``_file_size(nbytes)``)."""
    where = f"ShmTransport.connect: region {region!r} of peer {peer_name} ({path})"
    try:
        fd = open_owned(path, where)
    except FileNotFoundError:
        raise TransportError(f"{where} does not exist (is the peer on another host?)") from None
    except OSError as exc:  # a link, another user's file, not a regular file
        raise TransportError(str(exc)) from None
    try:
        st = os.fstat(fd)
        if st.st_size != _file_size(nbytes):
            raise TransportError(
                f"{where} has size {st.st_size} bytes; the peer announced a {nbytes}-byte region "
                f"(a {_file_size(nbytes)}-byte file)"
            )
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        # read-only on purpose: the peer's memory is only ever a copy source
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=torch.uint8)


def remove_stale_exports() -> list[str]:
    """Remove the ``/dev/shm`` exports of processes of this PID namespace that no longer exist (a
    killed prefill cannot remove its own); return the removed names. Call it where no other PID
    namespace shares ``/dev/shm``."""
    removed = []
    for fname in os.listdir(_SHM_DIR):
        if not fname.startswith("kvoffload-pd-"):
            continue
        pid = fname.split("-")[2]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(os.path.join(_SHM_DIR, fname)).st_uid != os.geteuid():
                    continue  # another user's file: not this user's to remove
                os.unlink(os.path.join(_SHM_DIR, fname))
                removed.append(fname)
    return removed


class ShmTransport(Transport):
    """Regions are ``/dev/shm`` files named ``<prefix>-<n>``; the default prefix is unique per instance
    (``kvoffload-pd-<pid>-<tag>-<random>``)."""

    name = "shm"

    def __init__(self, prefix: str | None = None, tag: str = "") -> None:
        super().__init__()
        self.prefix = prefix or f"kvoffload-pd-{os.getpid()}-{tag}{'-' if tag else ''}{uuid.uuid4().hex[:10]}"
        if "/" in self.prefix:
            raise ValueError(f"ShmTransport: prefix must not contain '/', got {self.prefix!r}")
        self._files: dict[str, str] = {}  # region -> file name (exported regions)
        self._closed = False

    def allocate(self, region: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        fname = f"{self.prefix}-{len(self._files)}"
        path = os.path.join(_SHM_DIR, fname)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        try:
            raw = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
            t = raw[:nbytes].view(dtype).view(shape)
            self.register(region, t)
        except BaseException:
            os.unlink(path)
            raise
        self._files[region] = fname
        return t

    def describe(self) -> dict:
        return {
            "kind": self.name,
            "regions": {r: {"file": f, "nbytes": self._local[r].numel()} for r, f in self._files.items()},
        }

    def connect(self, description: dict, peer_name: str) -> RemotePeer:
        kind = description.get("kind") if isinstance(description, dict) else None
        if kind != self.name:
            raise TransportError(f"ShmTransport.connect: peer {peer_name} exports {kind!r} regions, not shm")
        regions = description.get("regions", {})
        if not isinstance(regions, dict):
            raise TransportError(f"ShmTransport.connect: bad regions from peer {peer_name}: {regions!r}")
        checked = {}
        for region, info in regions.items():
            fname = info.get("file") if isinstance(info, dict) else None
            nbytes = info.get("nbytes") if isinstance(info, dict) else None
            if (
                not isinstance(region, str)
                or not isinstance(fname, str)
                or not _NAME.fullmatch(fname)
                or type(nbytes) is not int
                or not 0 <= nbytes <= MAX_REGION_BYTES
            ):
                raise TransportError(
                    f"ShmTransport.connect: bad region {region!r} from peer {peer_name}: {info!r}; expected "
                    f"{{'file': a /dev/shm file name, 'nbytes': an int in 0..{MAX_REGION_BYTES}}}"
                )
            checked[region] = (os.path.join(_SHM_DIR, fname), nbytes)
        views, sizes = {}, {}
        for region, (path, nbytes) in checked.items():
            views[region] = _map_read_only(path, nbytes, peer_name, region)
            sizes[region] = nbytes
        return RemotePeer(peer_name, sizes, views)

    def _read(self, peer: RemotePeer, ops: list[ReadOp]) -> None:
        # whole equal-size blocks between two regions go through one copy_blocks call
        groups: dict[tuple[str, str, int], list[ReadOp]] = defaultdict(list)
        for op in ops:
            if op.nbytes and op.remote_offset % op.nbytes == 0 and op.local_offset % op.nbytes == 0:
                groups[(op.remote, op.local, op.nbytes)].append(op)
            elif op.nbytes:
                src = peer.state[op.remote][op.remote_offset : op.remote_offset + op.nbytes]
                self._local[op.local][op.local_offset : op.local_offset + op.nbytes].copy_(src)
        for (remote, local, n), group in groups.items():
            src, dst = peer.state[remote], self._local[local]
            src = src[: src.numel() // n * n].view(-1, n)
            dst = dst[: dst.numel() // n * n].view(-1, n)
            mapping = torch.tensor([[op.remote_offset // n, op.local_offset // n] for op in group])
            if len(set(mapping[:, 1].tolist())) != len(group):
                for op in group:  # overlapping destinations: in order, as given
                    self._local[local][op.local_offset : op.local_offset + n].copy_(
                        peer.state[remote][op.remote_offset : op.remote_offset + n]
                    )
                continue
            copy_blocks(src, dst, mapping)

    def disconnect(self, peer: RemotePeer) -> None:
        peer.state = {}

    def close(self) -> None:
        """Remove the exported files (mappings stay valid until their tensors are freed)."""
        if self._closed:
            return
        self._closed = True
        for fname in self._files.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(_SHM_DIR, fname))

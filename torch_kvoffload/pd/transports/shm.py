"""``shm``: same-host transfer through shared memory — the embedded default.

Prefill allocates its layer buffers as files under ``/dev/shm`` mapped ``MAP_SHARED``
(:meth:`ShmTransport.allocate`); decode maps the same files and copies from them straight into its
destinations, one ``copy_blocks`` kernel per (source region, destination region, block size) group.
Needs host-memory buffers on the prefill side.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections import defaultdict

import torch

from torch_kvoffload.ops.copy import copy_blocks
from torch_kvoffload.pd.transports.base import ReadOp, RemotePeer, Transport, TransportError

__all__ = ["ShmTransport", "remove_stale_exports"]

_SHM_DIR = "/dev/shm"


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
        if description.get("kind") != self.name:
            raise TransportError(
                f"ShmTransport.connect: peer {peer_name} exports {description.get('kind')!r} regions, not shm"
            )
        views, sizes = {}, {}
        for region, info in description.get("regions", {}).items():
            fname, nbytes = info.get("file"), info.get("nbytes")
            if not isinstance(fname, str) or "/" in fname or not isinstance(nbytes, int):
                raise TransportError(
                    f"ShmTransport.connect: bad region {region!r} from peer {peer_name}: {info}"
                )
            path = os.path.join(_SHM_DIR, fname)
            try:
                actual = os.stat(path).st_size
            except FileNotFoundError:
                raise TransportError(
                    f"ShmTransport.connect: region {region!r} of peer {peer_name} ({path}) does not exist "
                    "(is the peer on another host?)"
                ) from None
            if actual < nbytes:
                raise TransportError(
                    f"ShmTransport.connect: {path} has {actual} bytes, peer {peer_name} says {nbytes}"
                )
            views[region] = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)[
                :nbytes
            ]
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

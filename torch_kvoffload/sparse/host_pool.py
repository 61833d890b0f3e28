"""``HostKVPool``: the complete main (MLA latent) KV of every request, paged, in host memory.

Per layer two paged tensors: ``kv_c [num_blocks, block_size, kv_lora_rank]`` and ``k_pe [num_blocks,
block_size, rope_dim]`` of a floating dtype, or for FP8 rows (``sparse.kv_dtype="fp8_e4m3"``) ``uint8`` rows
of the row's bytes as ``kv_c`` and an empty ``k_pe`` (``rope_dim=0``). A request's logical position ``p`` lives at row ``slot = block_table[p //
block_size] * block_size + p % block_size`` of every layer.

Sharing across the TP ranks of one host (DESIGN §7): TP rank 0 creates the pool with ``shared=True`` —
its memory is a file under ``/dev/shm`` mapped ``MAP_SHARED`` — and is the only writer; the other ranks
:meth:`HostKVPool.attach` by name and read the same bytes. Block allocation is deterministic (the lowest
free block first), so ranks replaying the same ``allocate`` / ``free`` sequence (the same scheduler output)
hold identical block tables without exchanging them. With an accelerator, private pools are pinned
(``device.empty_host``) and shared ones are page-locked with ``cudaHostRegister`` on CUDA when possible.

Cross-process fence: the header holds one ``int64`` per layer, the sequence number of the last append
of that layer whose rows are completely in the pool. The writer :meth:`HostKVPool.publish`-es it after
the copy finished; a reader that replays the same appends (so it knows which sequence number the rows it
is about to read belong to) :meth:`HostKVPool.wait_published` for it before reading. On x86-64 an aligned
8-byte store is atomic and stores are not reordered with earlier stores, so a reader that sees the number
also sees the rows written before it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Sequence

import torch

from torch_kvoffload import device as kv_device
from torch_kvoffload._utils import check_int, parse_dtype, round_up
from torch_kvoffload.sparse._checks import check_layer
from torch_kvoffload.sparse.block_tables import BlockTables

logger = logging.getLogger(__name__)

__all__ = ["HostKVPool"]

_META_BYTES = 2048  # JSON description at the start of a shared pool's header
_ALIGN = 4096
_SHM_DIR = "/dev/shm"
_MAGIC = "torch_kvoffload.HostKVPool.v2"
_POLL_MAX_SECONDS = 1e-3
_FAILED = -1  # fence value of a layer whose append failed on the writer


def _part_bytes(
    num_layers: int, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype
) -> tuple[int, int]:
    """Bytes of the ``kv_c`` rows and of the ``k_pe`` rows of every layer."""
    rows = num_layers * num_blocks * block_size * dtype.itemsize
    return rows * kv_lora_rank, rows * rope_dim


def _pool_dtype(where: str, value: object) -> torch.dtype:
    """A pool's dtype: a floating dtype of the main KV, or ``uint8`` (the bytes of FP8 rows)."""
    if value is torch.uint8 or str(value).removeprefix("torch.") == "uint8":
        return torch.uint8
    dtype = parse_dtype(where, value)
    if not dtype.is_floating_point:
        raise ValueError(f"{where}: the main KV must be a floating dtype or uint8 (FP8 rows), got {value!r}")
    return dtype


def _header_bytes(num_layers: int) -> int:
    """Header of a shared pool: the JSON description, then the per-layer ``int64`` fence."""
    return round_up(_META_BYTES + 8 * num_layers, _ALIGN)


def _shared_bytes(
    num_layers: int, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype
) -> int:
    """Size of a shared pool's file: the header, the ``kv_c`` rows (aligned), the ``k_pe`` rows."""
    kv_bytes, pe_bytes = _part_bytes(num_layers, num_blocks, block_size, kv_lora_rank, rope_dim, dtype)
    return _header_bytes(num_layers) + round_up(kv_bytes, _ALIGN) + pe_bytes


class HostKVPool:
    """Paged host storage of the latent ``kv_c`` and rotary ``k_pe`` rows of ``num_layers`` layers.

    Use :meth:`create` (the owner, TP rank 0) or :meth:`attach` (the other ranks of the host).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: torch.dtype,
        storage: torch.Tensor,
        name: str | None,
        owner: bool,
    ) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_lora_rank, self.rope_dim, self.dtype = kv_lora_rank, rope_dim, dtype
        self.name, self.owner = name, owner
        self._storage = storage  # uint8, keeps the mapping alive
        if name is not None:
            off = _header_bytes(num_layers)
            self._fence = storage[_META_BYTES : _META_BYTES + 8 * num_layers].view(torch.int64)
        else:
            off = 0
            self._fence = torch.zeros(num_layers, dtype=torch.int64)
        # the same memory as a NumPy array: a scalar read or write costs no tensor op (one per append)
        self._fence_np = self._fence.numpy()
        kv_bytes, pe_bytes = _part_bytes(num_layers, num_blocks, block_size, kv_lora_rank, rope_dim, dtype)
        self._kv_c = (
            storage[off : off + kv_bytes].view(dtype).view(num_layers, num_blocks, block_size, kv_lora_rank)
        )
        off = off + round_up(kv_bytes, _ALIGN)
        self._k_pe = (
            storage[off : off + pe_bytes].view(dtype).view(num_layers, num_blocks, block_size, rope_dim)
        )
        # per-layer views made once (paged, and one row per slot): an append and a step of every layer read them
        self._kv_c_layers, self._k_pe_layers = self._kv_c.unbind(0), self._k_pe.unbind(0)
        slots = num_blocks * block_size
        self._rows = [
            (kv.view(slots, kv_lora_rank), pe.view(slots, rope_dim))
            for kv, pe in zip(self._kv_c_layers, self._k_pe_layers, strict=True)
        ]
        self.block_tables = BlockTables(num_blocks, block_size)
        self._registered_ptr: int | None = None
        self._closed = False

    # ------------------------------------------------------------------------------------ creation
    @classmethod
    def create(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        shared: bool = False,
        name: str | None = None,
    ) -> HostKVPool:
        """Allocate a pool; ``shared=True`` backs it by ``/dev/shm/<name>`` for :meth:`attach`."""
        for arg, v in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                       ("kv_lora_rank", kv_lora_rank)):  # fmt: skip
            check_int("HostKVPool.create", arg, v, minimum=1)
        check_int("HostKVPool.create", "rope_dim", rope_dim, minimum=0)  # 0: FP8 rows hold their RoPE part
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"HostKVPool.create: dtype must be a torch.dtype, got {dtype!r}")
        dtype = _pool_dtype("HostKVPool.create", dtype)
        dims = dict(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                    kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)  # fmt: skip
        kv_bytes, pe_bytes = _part_bytes(**dims, dtype=dtype)
        if not shared:
            storage = kv_device.empty_host((round_up(kv_bytes, _ALIGN) + pe_bytes,), torch.uint8)
            return cls(**dims, dtype=dtype, storage=storage, name=None, owner=True)
        name = name or f"kvoffload-pool-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        if "/" in name:
            raise ValueError(f"HostKVPool.create: name must not contain '/', got {name!r}")
        path = os.path.join(_SHM_DIR, name)
        total = _shared_bytes(**dims, dtype=dtype)
        header = json.dumps({"magic": _MAGIC, **dims, "dtype": str(dtype), "total": total}).encode()
        assert len(header) < _META_BYTES
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, total)  # zero-filled: every fence starts at 0
            os.pwrite(fd, header.ljust(_META_BYTES, b"\0"), 0)
        finally:
            os.close(fd)
        try:
            storage = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        except BaseException:
            os.unlink(path)
            raise
        pool = cls(**dims, dtype=dtype, storage=storage, name=name, owner=True)
        pool._register_pinned()
        logger.info("HostKVPool %s: %.1f MiB shared host pool", name, total / 2**20)
        return pool

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        num_layers: int | None = None,
        num_blocks: int | None = None,
        block_size: int | None = None,
        kv_lora_rank: int | None = None,
        rope_dim: int | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> HostKVPool:
        """Map the shared pool ``name`` created by another process of this host (read its rows).

        The pool's dims come from its header. Each dim given here is what the caller expects: one that
        differs from the header raises ``ValueError`` naming it. A header that does not describe the file
        (dims that are not positive ints, an unknown dtype, a size that is not the one its dims give, a
        file shorter than that) raises ``ValueError`` too: its views would read other rows.
        """
        where = "HostKVPool.attach"
        path = os.path.join(_SHM_DIR, name)
        try:
            with open(path, "rb") as f:
                raw = f.read(_META_BYTES)
                file_bytes = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            raise FileNotFoundError(f"{where}: no shared pool named {name!r} ({path})") from None
        try:
            meta = json.loads(raw.rstrip(b"\0").decode())
        except (UnicodeDecodeError, json.JSONDecodeError):
            meta = {}
        if not isinstance(meta, dict) or meta.get("magic") != _MAGIC:
            raise ValueError(f"{where}: {path} is not a HostKVPool")
        dims = cls._header_dims(path, meta)
        expected = {"num_layers": num_layers, "num_blocks": num_blocks, "block_size": block_size,
                    "kv_lora_rank": kv_lora_rank, "rope_dim": rope_dim}  # fmt: skip
        expected = {
            k: None if v is None else check_int(where, k, v, minimum=0 if k == "rope_dim" else 1)
            for k, v in expected.items()
        }
        if dtype is not None:
            expected["dtype"] = _pool_dtype(f"{where}: dtype", dtype)
        for field, want in expected.items():
            if want is not None and want != dims[field]:
                raise ValueError(
                    f"{where}: pool {name!r} has {field} = {dims[field]}, expected {want} "
                    f"(the pool holds {cls._describe(dims)})"
                )
        total = _shared_bytes(**dims)
        if meta.get("total") != total or file_bytes < total:
            raise ValueError(
                f"{where}: {path} has a header that disagrees with its size: {cls._describe(dims)} take "
                f"{total} bytes, the header says {meta.get('total')!r} and the file has {file_bytes} bytes"
            )
        storage = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        pool = cls(**dims, storage=storage, name=name, owner=False)
        pool._register_pinned()
        return pool

    @staticmethod
    def _header_dims(path: str, meta: dict) -> dict:
        """The dims of a shared pool's header, checked: positive ints (``rope_dim`` may be 0) and a known
        dtype (floating, or uint8 for FP8 rows)."""
        where = "HostKVPool.attach"
        dims: dict = {}
        for field in ("num_layers", "num_blocks", "block_size", "kv_lora_rank", "rope_dim"):
            v, least = meta.get(field), 0 if field == "rope_dim" else 1
            if type(v) is not int or v < least:
                raise ValueError(
                    f"{where}: {path} has a header with {field} = {v!r}, expected an int >= {least}"
                )
            dims[field] = v
        dims["dtype"] = _pool_dtype(f"{where}: {path} header dtype", meta.get("dtype"))
        return dims

    @staticmethod
    def _describe(dims: dict) -> str:
        return ", ".join(f"{k}={v}" for k, v in dims.items())

    def _register_pinned(self) -> None:
        if kv_device.accelerator_type() != "cuda":
            return
        try:
            ptr, size = self._storage.data_ptr(), self._storage.numel()
            rc = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
            if int(rc) == 0:
                self._registered_ptr = ptr
            else:
                logger.warning(
                    "HostKVPool %s: cudaHostRegister failed (%s); transfers are not async", self.name, rc
                )
        except (RuntimeError, AttributeError) as exc:
            logger.warning("HostKVPool %s: cannot page-lock the shared pool: %s", self.name, exc)

    def close(self) -> None:
        """Release the pool; the owner of a shared pool also removes its ``/dev/shm`` file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._registered_ptr is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            except (RuntimeError, AttributeError) as exc:
                logger.debug("cudaHostUnregister failed: %s", exc)
        if self.name is not None and self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(_SHM_DIR, self.name))

    def __enter__(self) -> HostKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # no module globals here: at interpreter exit they may already be None
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass

    # -------------------------------------------------------------------------------------- storage
    def kv_c(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, kv_lora_rank]`` view of layer ``layer``."""
        return self._kv_c_layers[layer]

    def k_pe(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, rope_dim]`` view of layer ``layer``."""
        return self._k_pe_layers[layer]

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ``kv_c [num_blocks * block_size, kv_lora_rank]`` and ``k_pe [.., rope_dim]``
        views: one row per pool slot (``block * block_size + offset``, what :meth:`slots` gives)."""
        return self._rows[layer]

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the pool maps (a shared pool's header included); the owner allocated them,
        a reader maps the owner's."""
        return self._storage.numel()

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row of one layer (``kv_c`` + ``k_pe``)."""
        return (self.kv_lora_rank + self.rope_dim) * self._kv_c.element_size()

    # ---------------------------------------------------------------------------------- allocation
    @property
    def free_blocks(self) -> int:
        return self.block_tables.free_blocks

    def blocks_of(self, request_id: int) -> list[int]:
        return list(self.block_tables.table(request_id))

    def knows(self, request_id: int) -> bool:
        """Whether this pool object allocated blocks for ``request_id`` (a rank that does not replay
        the allocations knows none)."""
        return self.block_tables.knows(request_id)

    def reserved_tokens(self, request_id: int) -> int:
        """Positions ``0..n-1`` of ``request_id`` have a row: ``n`` = its blocks x ``block_size``."""
        return len(self.block_tables.table(request_id)) * self.block_size

    def allocate(self, request_id: int, num_tokens: int) -> list[int]:
        """Make room for positions ``0..num_tokens-1`` of ``request_id``; return its blocks.

        ``request_id`` and ``num_tokens`` are ints ``>= 0`` (``TypeError`` / ``ValueError`` otherwise). A
        request never shrinks: fewer tokens than already allocated keep its blocks. Raises
        ``RuntimeError`` (nothing allocated) when the pool has too few free blocks (free blocks that
        copies-on-write of shared blocks may need do not count, see
        :mod:`~torch_kvoffload.sparse.block_tables`).
        """
        return self.block_tables.allocate(request_id, num_tokens)

    def free(self, request_id: int) -> None:
        """Drop every block of ``request_id`` (a block a fork still shares stays; unknown ids: ignored)."""
        self.block_tables.free(request_id)

    def fork(self, src_id: int, dst_id: int, num_tokens: int, *, copy: bool = True) -> int:
        """``dst_id`` (reserved) continues positions ``0..num_tokens-1`` of ``src_id`` in every layer: its
        table shares ``src_id``'s full blocks there (copy-on-write, :meth:`make_writable`) and the partial
        last block's rows are copied into its own block (``copy``: the writer; a reader rank replays the
        table change only). Returns the number of blocks shared. ``IndexError`` / ``ValueError`` as
        :meth:`BlockTables.share`, nothing changed. The caller makes sure no append to either is in flight.
        """
        where = "HostKVPool.fork"
        src_id = check_int(where, "src_id", src_id, minimum=0)
        dst_id = check_int(where, "dst_id", dst_id, minimum=0)
        before = self.block_tables.shared_blocks
        partial = self.block_tables.share(where, src_id, dst_id, num_tokens)
        if partial is not None and copy:
            self.copy_blocks([partial], num_tokens % self.block_size)
        return self.block_tables.shared_blocks - before

    def make_writable(self, where: str, request_id: int, block_indices: list[int]) -> list[tuple[int, int]]:
        """Table change of a copy-on-write before ``request_id`` writes into its blocks ``block_indices``:
        see :meth:`BlockTables.make_writable`; the writer :meth:`copy_blocks` the returned pairs before
        the write."""
        return self.block_tables.make_writable(where, request_id, block_indices)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]], rows: int | None = None) -> None:
        """Copy the first ``rows`` rows (default: all) of block ``old`` to block ``new`` for every
        ``(old, new)`` of ``pairs``, in every layer."""
        if not pairs:
            return
        old = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        new = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        rows = self.block_size if rows is None else rows
        for part in (self._kv_c, self._k_pe):
            part[:, new, :rows] = part[:, old, :rows]

    def copy_rows(self, src_id: int, dst_id: int, num_tokens: int) -> None:
        """Copy positions ``0..num_tokens-1`` of ``src_id`` to the same positions of ``dst_id``, in every
        layer. Both must have those positions allocated (``IndexError`` otherwise, nothing copied) and
        ``dst_id``'s blocks there must be its own (``ValueError``). The caller makes sure no append to
        either is in flight.
        """
        where = "HostKVPool.copy_rows"
        num_tokens = check_int(where, "num_tokens", num_tokens, minimum=0)
        pos = torch.arange(num_tokens, dtype=torch.int64)
        src, dst = self.slots(src_id, pos), self.slots(dst_id, pos)
        if src_id == dst_id or not num_tokens:
            return
        if any(
            self.block_tables.refs(b) > 1
            for b in self.block_tables.table(dst_id)[: (num_tokens - 1) // self.block_size + 1]
        ):
            raise ValueError(
                f"{where}: request {dst_id} shares blocks with another request; copy into a new one"
            )
        for part in (self._kv_c, self._k_pe):
            flat = part.view(self.num_layers, -1, part.shape[-1])
            flat.index_copy_(1, dst, flat.index_select(1, src))

    def block_table(self, request_ids: Sequence[int], max_blocks: int | None = None) -> torch.Tensor:
        """``int32 [len(request_ids), max_blocks]`` block tables (unused entries and ``-1`` rows: 0)."""
        tables = [self.block_tables.table(r) if r >= 0 else [] for r in request_ids]
        width = max_blocks if max_blocks is not None else max([len(t) for t in tables] + [1])
        out = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            if len(t) > width:
                raise ValueError(
                    f"HostKVPool.block_table: request {request_ids[i]} has {len(t)} blocks > {width}"
                )
            out[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return out

    def slots(self, request_id: int, positions: torch.Tensor) -> torch.Tensor:
        """``int64`` pool rows of ``positions`` of ``request_id`` (they must be allocated)."""
        request_id = check_int("HostKVPool.slots", "request_id", request_id, minimum=0)
        table = self.block_tables.table(request_id)
        pos = positions.to(torch.int64)
        if pos.numel() == 0:
            return pos
        limit = len(table or ()) * self.block_size
        if int(pos.min()) < 0 or int(pos.max()) >= limit:
            raise IndexError(
                f"HostKVPool.slots: positions of request {request_id} must lie in [0, {limit}), "
                f"got [{int(pos.min())}, {int(pos.max())}]"
            )
        blocks = torch.tensor(table, dtype=torch.int64)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    # --------------------------------------------------------------------------------------- fence
    def publish(self, layer: int, seq: int) -> None:
        """Writer: every row of ``layer``'s appends up to number ``seq`` is in the pool (monotone).

        A layer marked failed (:meth:`mark_failed`) stays failed.
        """
        if not (type(layer) is int and 0 <= layer < self.num_layers and type(seq) is int and seq >= 0):
            layer = check_layer("HostKVPool.publish", layer, self.num_layers)  # raises, naming what is wrong
            seq = check_int("HostKVPool.publish", "seq", seq, minimum=0)
        if int(self._fence_np[layer]) != _FAILED:
            self._fence_np[layer] = seq

    def mark_failed(self, layer: int) -> None:
        """Writer: an append of ``layer`` failed; its rows will never be complete, readers get an error."""
        layer = check_layer("HostKVPool.mark_failed", layer, self.num_layers)
        self._fence_np[layer] = _FAILED

    def published(self, layer: int) -> int:
        """The last sequence number the writer published for ``layer`` (0 before the first, -1 after a
        failed append)."""
        layer = check_layer("HostKVPool.published", layer, self.num_layers)
        return int(self._fence_np[layer])

    def wait_published(self, layer: int, seq: int, timeout: float) -> float:
        """Block until the writer published ``seq`` (or later) for ``layer``; return the seconds waited.

        Raises ``TimeoutError`` naming the pool, the layer and both sequence numbers after ``timeout``
        seconds (the writer fell behind or is gone), ``RuntimeError`` once the writer marked the layer
        failed.
        """
        got = self.published(layer)
        if got >= seq:
            return 0.0
        start = time.perf_counter()
        pause = 1e-5
        while True:
            now = time.perf_counter()
            got = self.published(layer)
            if got >= seq:
                return now - start
            if got == _FAILED:
                raise RuntimeError(
                    f"HostKVPool {self.name or '(private)'}: the writer's append of layer {layer} failed; "
                    f"the rows of append {seq} will never be in the pool"
                )
            if now - start >= timeout:
                raise TimeoutError(
                    f"HostKVPool {self.name or '(private)'}: layer {layer} append {seq} was not published "
                    f"within {timeout} s (the writer published up to {got}); the writing rank is behind, "
                    "failed or gone"
                )
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_SECONDS)

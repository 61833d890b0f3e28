"""``BlockTables``: which host-pool blocks each request's positions live in, with blocks shared by forks.

A request's position ``p`` lives in block ``table[p // block_size]``. Requests reserve their blocks at
admission (:meth:`BlockTables.allocate`). A fork (:meth:`BlockTables.share`) points the destination's
table at the source's full blocks of the forked range (one more reference each; the destination's own
blocks there go back to the free list) instead of copying them; a write into a block referenced more
than once first moves the writer onto a private copy (:meth:`BlockTables.make_writable`, copy-on-write).

Invariant: the table entries of every request together never exceed ``num_blocks``, i.e. the free list
holds at least one block per extra reference of a shared block (``free >= Σ (refs - 1)``). A fork keeps
it (each shared reference frees the destination's own block), a copy-on-write keeps it (one free block
taken, one extra reference gone) and :meth:`BlockTables.allocate` refuses to take the blocks it needs.
So a copy-on-write always finds a free block. Allocation is deterministic (the lowest free block first):
ranks replaying the same calls hold identical tables.
"""

from __future__ import annotations

import heapq
import math

from torch_kvoffload._utils import check_int

__all__ = ["BlockTables"]


class BlockTables:
    """Per-request block tables over ``num_blocks`` blocks of ``block_size`` positions, refcounted.

    ``shared_blocks`` counts the block references forks shared instead of copying, ``cow_copies`` the
    blocks copied on write (table changes: every rank replaying the calls counts them).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks))
        heapq.heapify(self._free)
        self._tables: dict[int, list[int]] = {}
        self._refs = [0] * num_blocks  # requests whose table holds the block (0: free)
        self._extra = 0  # Σ over blocks of (refs - 1): free blocks kept for copy-on-write
        self.version = 0  # bumped on every table change
        self.shared_blocks = 0
        self.cow_copies = 0

    # ---------------------------------------------------------------------------------- queries
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def refs(self, block: int) -> int:
        """Requests whose table holds ``block`` (0: free)."""
        return self._refs[block]

    def table(self, request_id: int) -> list[int]:
        """``request_id``'s blocks (the live list: do not modify; empty for an unknown id)."""
        return self._tables.get(request_id, [])

    def knows(self, request_id: int) -> bool:
        return request_id in self._tables

    # ------------------------------------------------------------------------------- allocation
    def allocate(self, request_id: int, num_tokens: int) -> list[int]:
        """See :meth:`torch_kvoffload.sparse.host_pool.HostKVPool.allocate`."""
        request_id = check_int("HostKVPool.allocate", "request_id", request_id, minimum=0)
        num_tokens = check_int("HostKVPool.allocate", "num_tokens", num_tokens, minimum=0)
        table = self._tables.get(request_id, [])
        need = math.ceil(num_tokens / self.block_size) - len(table)
        usable = len(self._free) - self._extra
        if need > usable:
            held = f", {self._extra} of them kept for copy-on-write of shared blocks" if self._extra else ""
            raise RuntimeError(
                f"HostKVPool.allocate: request {request_id} needs {need} more blocks for {num_tokens} tokens, "
                f"only {len(self._free)} of {self.num_blocks} are free{held}"
            )
        table = self._tables.setdefault(request_id, table)
        for _ in range(max(0, need)):
            b = heapq.heappop(self._free)
            self._refs[b] = 1
            table.append(b)
        self.version += 1
        return list(table)

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block]:
            self._extra -= 1
        else:
            heapq.heappush(self._free, block)

    def free(self, request_id: int) -> None:
        """Drop every block reference of ``request_id``; a block nobody references is free again."""
        request_id = check_int("HostKVPool.free", "request_id", request_id)
        for b in self._tables.pop(request_id, ()):
            self._drop(b)
        self.version += 1

    # ---------------------------------------------------------------------------- sharing, CoW
    def share(self, where: str, src_id: int, dst_id: int, num_tokens: int) -> tuple[int, int] | None:
        """``dst_id``'s positions ``0..num_tokens-1`` become ``src_id``'s: its table points at ``src_id``'s
        full blocks there (its own go back to the free list). Returns ``(src block, dst block)`` of the
        partial last block (positions ``num_tokens // block_size * block_size ..``) the caller copies, or
        ``None`` when ``num_tokens`` is a multiple of ``block_size``.

        Both must have the positions reserved (``IndexError``), ``dst_id``'s blocks there must be its own
        (``ValueError``: fork into a new request); nothing changes on an error.
        """
        num_tokens = check_int(where, "num_tokens", num_tokens, minimum=0)
        src, dst = self.table(src_id), self.table(dst_id)
        used = math.ceil(num_tokens / self.block_size)
        for rid, t in ((src_id, src), (dst_id, dst)):
            if used > len(t):
                raise IndexError(
                    f"{where}: positions of request {rid} must lie in [0, {len(t) * self.block_size}), "
                    f"got [0, {num_tokens - 1}]"
                )
        if src_id == dst_id:
            raise ValueError(f"{where}: src_id and dst_id must differ, got {src_id} for both")
        if any(self._refs[b] > 1 for b in dst[:used]):
            raise ValueError(
                f"{where}: request {dst_id} shares blocks with another request; fork into a new one"
            )
        full = num_tokens // self.block_size
        for i in range(full):
            old, dst[i] = dst[i], src[i]
            self._refs[src[i]] += 1
            self._extra += 1
            self._drop(old)
        self.shared_blocks += full
        self.version += 1
        return (src[full], dst[full]) if full < used else None

    def make_writable(self, where: str, request_id: int, block_indices: list[int]) -> list[tuple[int, int]]:
        """Before ``request_id`` writes into its blocks ``block_indices``: each one shared with another
        request is replaced in its table by a fresh block; returns the ``(old, new)`` pairs whose rows the
        caller copies before the write. ``RuntimeError`` (nothing changed) if the free list runs short."""
        table = self.table(request_id)
        shared = sorted({i for i in block_indices if self._refs[table[i]] > 1})
        if not shared:
            return []
        if len(shared) > len(self._free):  # cannot happen while the invariant holds (module docstring)
            raise RuntimeError(
                f"{where}: request {request_id} writes into {len(shared)} shared host-pool blocks, which "
                f"must be copied first, but only {len(self._free)} blocks are free"
            )
        pairs = []
        for i in shared:
            old, new = table[i], heapq.heappop(self._free)
            self._refs[new] = 1
            self._drop(old)
            table[i] = new
            pairs.append((old, new))
        self.cow_copies += len(pairs)
        self.version += 1
        return pairs

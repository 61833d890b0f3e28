"""``DeviceBlocks``: the resident requests' latent KV of hybrid sparse attention, in a device pool of blocks.

Per layer and component one tensor ``[num_blocks * block_size, width]`` (the model's ``kv_c`` / ``k_pe`` rows,
one ``uint8`` FP8 row, indexer keys; ``width`` ``None``: ``[num_blocks * block_size]``, a value per row); a request holds a list of blocks, its logical position ``p`` at flat row
``blocks[p // block_size] * block_size + p % block_size``. Blocks are taken from a free list as a request
grows and given back when it ends, is truncated or is spilled to the host pool, so the pool is shared by
however many requests fit in it, whatever their lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["DeviceBlocks"]


class DeviceBlocks:
    """A device pool of ``block_size``-row blocks for ``num_layers`` layers of ``components`` (``(width,
    dtype)`` each); empty until :meth:`allocate`."""

    def __init__(
        self,
        num_layers: int,
        components: Sequence[tuple[int | None, torch.dtype]],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.num_layers, self.components = num_layers, tuple(components)
        self.block_size, self.device = block_size, device
        self.layers: list[tuple[torch.Tensor, ...]] = []
        self._free: list[int] = []
        self._blocks: dict[int, list[int]] = {}  # request id -> its blocks, by logical block

    # ------------------------------------------------------------------------------ sizing
    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over every layer and component."""
        row = sum((w or 1) * dt.itemsize for w, dt in self.components)
        return row * self.block_size * self.num_layers

    @property
    def num_blocks(self) -> int:
        return self.layers[0][0].shape[0] // self.block_size if self.layers else 0

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> None:
        """``num_blocks`` blocks; the held ones keep their rows (copied, renumbered from 0). ``ValueError``
        when the requests hold more than ``num_blocks``."""
        held = sum(len(b) for b in self._blocks.values())
        if held > num_blocks:
            raise ValueError(f"DeviceBlocks.allocate: {held} blocks are held, {num_blocks} asked")
        if num_blocks == self.num_blocks:
            return
        bs = self.block_size
        new = [
            tuple(
                torch.zeros((num_blocks * bs, w), dtype=dt, device=self.device) for w, dt in self.components
            )
            for _ in range(self.num_layers if num_blocks else 0)
        ]
        order = [b for blocks in self._blocks.values() for b in blocks]
        if order:
            src = torch.tensor(order, dtype=torch.int64)
            src_rows = (src[:, None] * bs + torch.arange(bs)).flatten().to(self.device)
            for old_layer, new_layer in zip(self.layers, new, strict=True):
                for o, n in zip(old_layer, new_layer, strict=True):
                    n[: len(order) * bs] = o[src_rows]
        renum, at = {}, 0
        for rid, blocks in self._blocks.items():
            renum[rid] = list(range(at, at + len(blocks)))
            at += len(blocks)
        self.layers, self._blocks = new, renum
        self._free = list(range(num_blocks - 1, at - 1, -1))  # pop() takes the lowest first

    def free(self) -> None:
        self.layers, self._free, self._blocks = [], [], {}

    @property
    def built(self) -> bool:
        return bool(self.layers)

    # ---------------------------------------------------------------------------- requests
    def holds(self, request_id: int) -> bool:
        return request_id in self._blocks

    def held(self, request_id: int) -> int:
        """Blocks ``request_id`` holds."""
        return len(self._blocks.get(request_id, ()))

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def need(self, request_id: int, tokens: int) -> int:
        """More blocks ``request_id`` needs to hold ``tokens`` rows."""
        return max(0, self.blocks_for(tokens) - self.held(request_id))

    def ensure(self, request_id: int, tokens: int) -> bool:
        """Give ``request_id`` blocks for ``tokens`` rows (it becomes a holder, even of none); ``False``,
        nothing taken, when too few are free."""
        need = self.need(request_id, tokens)
        if need > len(self._free):
            return False
        blocks = self._blocks.setdefault(request_id, [])
        blocks.extend(self._free.pop() for _ in range(need))
        return True

    def shrink(self, request_id: int, tokens: int) -> None:
        """``request_id`` keeps the blocks of its first ``tokens`` rows."""
        blocks = self._blocks.get(request_id)
        if blocks is None:
            return
        keep = self.blocks_for(tokens)
        self._free.extend(reversed(blocks[keep:]))
        del blocks[keep:]

    def drop(self, request_id: int) -> None:
        """``request_id`` holds nothing any more."""
        blocks = self._blocks.pop(request_id, None)
        if blocks:
            self._free.extend(reversed(blocks))

    def holders(self) -> list[int]:
        return list(self._blocks)

    def blocks_of(self, request_id: int) -> list[int]:
        """The blocks ``request_id`` holds, in row order."""
        return list(self._blocks.get(request_id, ()))

    # ---------------------------------------------------------------------------- rows
    def rows(self, request_id: int, positions: torch.Tensor) -> torch.Tensor:
        """int64 flat rows of ``request_id``'s logical ``positions`` (int64, any shape, on any device; each
        within the blocks it holds)."""
        table = torch.tensor(self._blocks[request_id], dtype=torch.int64, device=positions.device)
        bs = self.block_size
        return table[positions // bs] * bs + positions % bs

    def flat_rows(self, keys: Sequence[int], positions: Sequence[int], device: torch.device) -> torch.Tensor:
        """int64 ``[N]``: the flat rows of ``(keys[i], positions[i])`` (host ints: cheaper than tensor indexing
        for the few rows of a decode step)."""
        bs, held = self.block_size, self._blocks
        return torch.tensor([held[k][p // bs] * bs + p % bs for k, p in zip(keys, positions, strict=True)],
                            dtype=torch.int64, device=device)  # fmt: skip

    def table(self, request_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        """int64 ``[B, max blocks]``: each request's blocks (0 past its own)."""
        held = [self._blocks.get(r, []) for r in request_ids]
        width = max(1, *(len(b) for b in held)) if held else 1
        return torch.tensor([b + [0] * (width - len(b)) for b in held], dtype=torch.int64, device=device)

    def write(self, layer: int, rows_at: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
        """Write ``values[c] [N, width]`` at flat rows ``rows_at int64 [N]`` of component ``c``."""
        for t, v in zip(self.layers[layer], values, strict=True):
            t.index_copy_(0, rows_at, v.to(t.dtype))

    def read(self, layer: int, request_id: int, start: int, end: int) -> list[torch.Tensor]:
        """Per component a copy of ``request_id``'s rows of positions ``start .. end - 1``."""
        at = self.rows(request_id, torch.arange(start, end, device=self.device))
        return [t[at] for t in self.layers[layer]]

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """``dst`` (holding blocks for ``n`` rows) gets ``src``'s first ``n`` rows in every layer."""
        pos = torch.arange(n, device=self.device)
        a, b = self.rows(src, pos), self.rows(dst, pos)
        for layer in self.layers:
            for t in layer:
                t[b] = t[a]

    def flat(self, layer: int) -> tuple[torch.Tensor, ...]:
        return self.layers[layer]

    def paged(self, layer: int) -> tuple[torch.Tensor, ...]:
        """``layer``'s components as ``[num_blocks, block_size, width]`` (``[num_blocks, block_size]``) views,
        the paged-cache layout the indexer ops read through a block table."""
        bs = self.block_size
        return tuple(t.view(-1, bs, *t.shape[1:]) for t in self.layers[layer])

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer]

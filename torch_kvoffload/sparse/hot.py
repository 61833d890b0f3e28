"""``HotBuffers``: the device side of the sparse decode runtime, its hot buffers and who holds them.

Per layer ``hot_kv_c [R, C, Dc]`` / ``hot_k_pe [R, C, Dr]`` (``R = max_rows`` residency rows of ``C =
capacity`` slots) and a :class:`~torch_kvoffload.sparse.residency.ResidencyTable` of their slots; one
:class:`~torch_kvoffload.sparse.rows.RowMap` of which request holds which residency rows, shared by every
layer.
"""

from __future__ import annotations

import torch

from torch_kvoffload.sparse.residency import ResidencyTable
from torch_kvoffload.sparse.rows import RowMap

__all__ = ["HotBuffers"]


class HotBuffers:
    """Hot buffers, residency tables and row map of ``num_layers`` layers; ``top_k`` rows selected per step.

    :meth:`resize` reallocates everything with new sizes (every residency row forgotten);
    :meth:`release` frees a request's rows, :meth:`truncate` forgets its resident positions from a length on.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        max_rows: int,
        capacity: int,
        top_k: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        policy: str,
    ) -> None:
        self.num_layers, self.max_rows = num_layers, max_rows
        self.kv_lora_rank, self.rope_dim, self.dtype, self.device = kv_lora_rank, rope_dim, dtype, device
        self.policy = policy
        self.resize(capacity, top_k)

    def resize(self, capacity: int, top_k: int) -> None:
        """Zeroed buffers of ``capacity`` slots per residency row, empty tables selecting ``top_k`` and no
        rows held."""
        R, dt, dev, L = self.max_rows, self.dtype, self.device, self.num_layers
        self.top_k, self.capacity = top_k, capacity
        self.kv_c = [torch.zeros(R, capacity, self.kv_lora_rank, dtype=dt, device=dev) for _ in range(L)]
        self.k_pe = [torch.zeros(R, capacity, self.rope_dim, dtype=dt, device=dev) for _ in range(L)]
        self.tables = [ResidencyTable(R, capacity, top_k, self.policy, dev) for _ in range(L)]
        self.rows = RowMap(R)

    def release(self, request_id: int) -> None:
        """Free ``request_id``'s residency rows in every layer; they are reset when a request takes them
        next, even if it reuses the id."""
        rows = self.rows.release(request_id)
        if rows:
            rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
            for table in self.tables:
                table.forget_rows(rows_t)

    def truncate(self, request_id: int, length: int) -> None:
        """Forget ``request_id``'s resident positions ``>= length`` in every layer (it keeps its rows)."""
        rows = self.rows.rows_of(request_id)
        if rows:
            rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
            for table in self.tables:
                table.forget_from(rows_t, length)

    def nbytes(self) -> int:
        """Bytes of the hot buffers of every layer."""
        return sum(t.numel() * t.element_size() for t in (*self.kv_c, *self.k_pe))

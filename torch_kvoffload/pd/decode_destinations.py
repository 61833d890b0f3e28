"""Decode side of P/D transfer: where one decode TP rank's received KV lands.

Main KV lands in the decode host pool (:class:`~torch_kvoffload.sparse.HostKVPool`, shared by the DP
rank's TP ranks): per layer ``kv_c [num_blocks, block_size, kv_lora_rank]`` and ``k_pe [num_blocks,
block_size, rope_dim]``, or for a pool of FP8 rows one component, the rows' bytes (:func:`main_components`). Indexer components land in rank-local caches ``[num_blocks, block_size, *row]``
(any dtype, host or device). A transport that reads only host memory lands a device indexer component in
a host staging copy first (:meth:`Destinations.land_staged` moves it to the device). Each destination is
registered with the transport under a region name the read ops use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_kvoffload.pd.compat import row_layout
from torch_kvoffload.pd.messages import Compatibility
from torch_kvoffload.pd.transports import Transport
from torch_kvoffload.sparse.host_pool import HostKVPool

__all__ = ["Destinations", "main_components"]


def main_components(pool: HostKVPool, layer: int) -> list[torch.Tensor]:
    """The main KV components of ``layer`` a transfer lands in: ``kv_c`` and ``k_pe``, or ``kv_c`` alone for
    DeepSeek's FP8 rows (``uint8 [num_blocks, block_size, Dc + 4 * Dc / 128 + 2 * Dr]``: the RoPE values
    inside; the pool's ``k_pe`` is empty)."""
    return [pool.kv_c(layer)] + ([pool.k_pe(layer)] if pool.rope_dim else [])


class Destinations:
    """The destinations of one decode TP rank: ``pool`` (main KV) and ``indexer`` (per layer a tuple of
    ``[num_blocks, block_size, *row]`` contiguous tensors, or ``None`` for a layer without indexer;
    ``None``: no indexer at all), checked against ``compat``. ``ValueError`` (prefixed ``where``) names
    what does not match."""

    def __init__(
        self,
        where: str,
        pool: HostKVPool,
        compat: Compatibility,
        indexer: Sequence[Sequence[torch.Tensor] | None] | None,
    ) -> None:
        if not isinstance(pool, HostKVPool):
            raise TypeError(f"{where}: 'pool' must be a HostKVPool, got {type(pool).__name__}")
        self.where = where
        self.pool = pool
        self.num_layers, self.block_size = pool.num_layers, pool.block_size
        own = row_layout(main_components(pool, 0))
        problems = []
        if compat.num_layers != pool.num_layers:
            problems.append(f"num_layers {compat.num_layers} != pool's {pool.num_layers}")
        if compat.block_size != pool.block_size:
            problems.append(f"block_size {compat.block_size} != pool's {pool.block_size}")
        if [list(x) for x in compat.main_layout] != own:
            problems.append(f"main_layout {compat.main_layout} != pool's {own}")
        self.indexer = self._check_indexer(indexer, compat, problems)
        if problems:
            raise ValueError(f"{where}: 'compat' does not describe the destinations: " + "; ".join(problems))
        #: bytes of one block of each main component (kv_c, k_pe; FP8 rows: one)
        self.main_block_bytes = [c[0].nbytes for c in main_components(pool, 0)]
        self._idx_bytes = [[] if comps is None else [c[0].nbytes for c in comps] for comps in self.indexer]
        self._staging: dict[int, torch.Tensor] = {}

    def _check_indexer(self, indexer, compat: Compatibility, problems: list[str]) -> list:
        if indexer is None:
            if compat.indexer_layout:
                problems.append(f"indexer_layout {compat.indexer_layout} but no indexer destinations")
            return [None] * self.num_layers
        indexer = list(indexer)
        if len(indexer) != self.num_layers:
            raise ValueError(f"{self.where}: 'indexer' has {len(indexer)} layers, the pool {self.num_layers}")
        for layer, comps in enumerate(indexer):
            if comps is None:
                continue
            for c in comps:
                if not isinstance(c, torch.Tensor) or c.dim() < 3 or c.shape[1] != self.block_size:
                    raise ValueError(
                        f"{self.where}: indexer of layer {layer} must be [num_blocks, {self.block_size}, ...] "
                        f"tensors, got {getattr(c, 'shape', c)}"
                    )
                if not c.is_contiguous():
                    raise ValueError(f"{self.where}: indexer of layer {layer} must be contiguous")
            layout = row_layout(comps)
            if [[list(r), d] for r, d in compat.indexer_layout] != layout:
                problems.append(f"indexer_layout {compat.indexer_layout} != layer {layer}'s {layout}")
        return [None if comps is None else tuple(comps) for comps in indexer]

    def register(self, transport: Transport) -> None:
        """Register every destination with ``transport`` (device indexer components through a host
        staging copy when the transport reads only host memory)."""
        for layer in range(self.num_layers):
            for c, t in enumerate(main_components(self.pool, layer)):
                transport.register(_main_region(layer, c), t)
        for layer, comps in enumerate(self.indexer):
            for c, t in enumerate(comps or ()):
                if t.device.type == "cpu" or transport.device_memory:
                    transport.register(_idx_region(layer, c), t)
                elif c not in self._staging:  # device destination, host-only transport: stage
                    self._staging[c] = torch.zeros(t.shape, dtype=t.dtype)
                    transport.register(_stage_region(c), self._staging[c])

    # ---------------------------------------------------------------------------------- layout
    @property
    def has_indexer(self) -> bool:
        return any(c is not None for c in self.indexer)

    @property
    def indexer_capacity(self) -> int:
        """Indexer blocks every layer's cache holds (0 without indexer)."""
        caps = [c[0].shape[0] for c in self.indexer if c is not None]
        return min(caps) if caps else 0

    def indexer_block_bytes(self, layer: int) -> list[int]:
        """Bytes of one block of each of ``layer``'s indexer components (empty: no indexer)."""
        return self._idx_bytes[layer]

    def main_region(self, layer: int, c: int) -> str:
        """The region of main component ``c`` (:func:`main_components`) of ``layer``."""
        return _main_region(layer, c)

    def indexer_region(self, layer: int, c: int) -> str:
        """The region a read of ``layer``'s indexer component ``c`` writes (its staging copy if staged)."""
        return _stage_region(c) if c in self._staging else _idx_region(layer, c)

    def is_staged(self, c: int) -> bool:
        return c in self._staging

    # ------------------------------------------------------------------------------- contents
    def land_staged(self, layer: int, staged: Sequence[tuple[int, list[int]]]) -> None:
        """Copy the staged blocks ``staged`` (``(component, blocks)`` pairs) of ``layer`` to the device."""
        for c, blocks in staged:
            dst = self.indexer[layer][c]
            index = torch.tensor(blocks, dtype=torch.int64)
            dst[index.to(dst.device)] = self._staging[c][index].to(dst.device)

    def zero(self, main_blocks: Sequence[int], indexer_blocks: Sequence[int]) -> None:
        """Zero pool blocks ``main_blocks`` and indexer blocks ``indexer_blocks`` of every layer."""
        main = torch.tensor(list(main_blocks), dtype=torch.int64)
        idx = torch.tensor(list(indexer_blocks), dtype=torch.int64)
        for layer in range(self.num_layers):
            if main.numel():
                for t in main_components(self.pool, layer):
                    t[main] = 0
            for c in self.indexer[layer] or ():
                if idx.numel():
                    c[idx.to(c.device)] = 0


def _main_region(layer: int, c: int) -> str:
    return f"main.{layer}.{c}"


def _idx_region(layer: int, c: int) -> str:
    return f"idx.{layer}.{c}"


def _stage_region(c: int) -> str:
    return f"stage.{c}"

"""Physical layout of a layer bundle: its components back to back, each holding every block.

A bundle is everything one layer caches — main KV ``c_kv`` and ``k_pe``, the indexer key, its int8
dequant scales — and is moved by one broadcast, so it must be one contiguous byte span:
``[component 0: all blocks][component 1: all blocks]...``, in bundle order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_kvoffload.ops.fp8 import index_row_bytes, kv_row_bytes

__all__ = ["BundleSpec", "ComponentSpec", "bundle_layout"]


def bundle_layout(component_bytes_per_block: list[int], num_blocks: int) -> tuple[list[tuple[int, int]], int]:
    """Byte ``(offset, length)`` of each component for ``num_blocks`` blocks, and the bundle's total.

    Component ``i`` occupies ``[offset_i, offset_i + bytes_per_block_i * num_blocks)``; offsets follow the
    bundle order without gaps.
    """
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
        raise ValueError(
            f"bundle_layout: argument 'num_blocks' must be a non-negative int, got {num_blocks!r}"
        )
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, per_block in enumerate(component_bytes_per_block):
        if not isinstance(per_block, int) or per_block <= 0:
            raise ValueError(
                f"bundle_layout: component {i} bytes per block must be a positive int, got {per_block!r}"
            )
        length = per_block * num_blocks
        spans.append((cursor, length))
        cursor += length
    return spans, cursor


@dataclass(frozen=True)
class ComponentSpec:
    """One cached tensor of a layer: ``[num_blocks, block_size, dim]`` of ``dtype`` (per token: ``dim``)."""

    name: str
    dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.dim * self.dtype.itemsize

    def describe(self) -> tuple[str, int, str]:
        return (self.name, self.dim, str(self.dtype))


@dataclass(frozen=True)
class BundleSpec:
    """A layer's bundle: its components in bundle order and the block size (tokens per block)."""

    components: tuple[ComponentSpec, ...]
    block_size: int

    def __post_init__(self) -> None:
        if not self.components:
            raise ValueError("BundleSpec: a bundle needs at least one component")
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ValueError(f"BundleSpec: component names must be distinct, got {names}")
        if self.block_size < 1:
            raise ValueError(f"BundleSpec: block_size must be positive, got {self.block_size}")
        for c in self.components:
            if c.dim < 1:
                raise ValueError(f"BundleSpec: component {c.name!r} dim must be positive, got {c.dim}")

    @classmethod
    def mla(
        cls,
        block_size: int,
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        index_dim: int = 0,
        index_dtype: torch.dtype = torch.bfloat16,
        index_scales: bool = False,
        kv_fp8: bool = False,
        index_fp8: bool = False,
    ) -> BundleSpec:
        """An MLA (``index_dim == 0``) or SFA bundle: c_kv, k_pe[, indexer key[, fp32 scales]]; ``kv_fp8``:
        one ``kv_fp8`` component of DeepSeek's FP8 latent rows (``uint8``, the RoPE values inside) instead
        of c_kv and k_pe; ``index_fp8``: the indexer key as DeepSeek's FP8 rows (``uint8``, scale inside)."""
        comps = (
            [ComponentSpec("kv_fp8", kv_row_bytes(kv_lora_rank, rope_dim), torch.uint8)]
            if kv_fp8
            else [ComponentSpec("c_kv", kv_lora_rank, dtype), ComponentSpec("k_pe", rope_dim, dtype)]
        )
        if index_dim and index_fp8:
            comps.append(ComponentSpec("index_k", index_row_bytes(index_dim), torch.uint8))
        elif index_dim:
            comps.append(ComponentSpec("index_k", index_dim, index_dtype))
            if index_scales:
                comps.append(ComponentSpec("index_scale", 1, torch.float32))
        return cls(tuple(comps), block_size)

    def component_bytes_per_block(self) -> list[int]:
        return [c.bytes_per_block(self.block_size) for c in self.components]

    @property
    def bytes_per_block(self) -> int:
        return sum(self.component_bytes_per_block())

    def layout(self, num_blocks: int) -> tuple[list[tuple[int, int]], int]:
        return bundle_layout(self.component_bytes_per_block(), num_blocks)

    def describe(self) -> tuple:
        """A picklable, comparable description (used to check that ranks agree)."""
        return (self.block_size, tuple(c.describe() for c in self.components))

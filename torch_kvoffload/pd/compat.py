"""Build the handshake's :class:`~torch_kvoffload.pd.messages.Compatibility` record from cache layouts."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_kvoffload._utils import dtype_name
from torch_kvoffload._version import __version__
from torch_kvoffload.kv.fp8_rows import FP8_KV
from torch_kvoffload.pd.messages import Compatibility

__all__ = ["make_compatibility", "row_layout"]


def row_layout(components: Sequence[torch.Tensor] | None) -> list:
    """``[[row_shape, dtype_name], ...]`` of paged ``[num_blocks, block_size, *row]`` components."""
    return [[list(c.shape[2:]), dtype_name(c.dtype)] for c in (components or ())]


def make_compatibility(
    *,
    model_fingerprint: str,
    num_layers: int,
    block_size: int,
    main: Sequence[torch.Tensor],
    indexer: Sequence[torch.Tensor] | None = None,
) -> Compatibility:
    """The record both sides compare: library version, model fingerprint, main KV dtype, layer count,
    block size, and the row layout of one layer's ``main`` and ``indexer`` components (examples:
    ``[num_blocks, block_size, kv_lora_rank]``, ``[..., rope_dim]``; ``[..., index_dim]`` int8 +
    ``[..., 1]`` fp32 scale). ``main`` of ``uint8`` holds DeepSeek's FP8 rows: its ``kv_dtype`` is
    ``"fp8_e4m3"``, so a side keeping FP8 rows and one keeping the model's values refuse each other by the
    format's name."""
    if not main:
        raise ValueError("make_compatibility: 'main' needs at least one component")
    return Compatibility(
        library_version=__version__,
        model_fingerprint=model_fingerprint,
        kv_dtype=FP8_KV if main[0].dtype == torch.uint8 else dtype_name(main[0].dtype),
        num_layers=num_layers,
        block_size=block_size,
        main_layout=row_layout(main),
        indexer_layout=row_layout(indexer),
    )

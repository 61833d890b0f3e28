"""DeepSeek's FP8 rows as KV formats: the latent format's name, the models that can keep it, and a forward's
new latent rows and indexer keys quantized once for every backend keeping them (resident KV, host pool,
indexer cache, layer buffers, KVPP bundles)."""

from __future__ import annotations

import torch

from torch_kvoffload.kv.backend import NewRows
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.kv.spec import ModelSpec
from torch_kvoffload.ops.fp8 import TILE, quantize_kv_fp8
from torch_kvoffload.ops.fp8_indexer import hadamard_quant_fp8

__all__ = ["FP8_KV", "check_indexer_format", "check_kv_format", "index_fp8_rows", "latent_fp8_rows"]

#: ``kv_dtype`` of the main KV kept as DeepSeek's FP8 rows (FlashMLA's 656-byte format): the resident KV, the
#: host pool and hot buffers of sparse decode offload, layerwise prefill's buffers, KVPP's bundles.
FP8_KV = "fp8_e4m3"


def check_kv_format(kv_dtype: str | None, spec: ModelSpec, where: str = "OffloadConfig.sparse") -> None:
    """``ValueError`` (naming ``where``) when ``spec``'s latent KV cannot be kept as ``kv_dtype``: FP8 rows
    quantize the latent values in tiles of 128 (a ``kv_lora_rank`` that is a multiple of 128)."""
    if kv_dtype == FP8_KV and spec.kv_lora_rank % TILE:
        raise ValueError(
            f"{where}: kv_dtype={FP8_KV!r} quantizes the latent KV in tiles of {TILE} values; "
            f"{spec.model_class} has kv_lora_rank={spec.kv_lora_rank}, not a multiple of {TILE}"
        )


def check_indexer_format(indexer_dtype: str | None, spec: ModelSpec, where: str = "sparse") -> None:
    """``ValueError`` (naming ``where``) when ``spec``'s indexer cannot be kept as ``indexer_dtype``: FP8 rows
    quantize 128-wide groups after a Hadamard rotation (a power-of-two ``index_head_dim`` of at least 128)."""
    d = spec.index_head_dim
    if indexer_dtype == FP8_KV and spec.has_indexer and (d < TILE or d & (d - 1)):
        raise ValueError(
            f"{where}: indexer_dtype={FP8_KV!r} keeps the indexer keys as FP8 rows (Hadamard-rotated, one fp32 "
            f"scale per {TILE} values), which needs a power-of-two index_head_dim of at least {TILE}; "
            f"{spec.model_class} has index_head_dim={d}"
        )


def latent_fp8_rows(fwd: ForwardPlan, layer: int, rows: NewRows) -> torch.Tensor:
    """``rows``' latent KV as FP8 rows ``uint8 [N, Dc + 4 * Dc / 128 + 2 * Dr]``: rows already kept as FP8
    (``kv_c`` ``uint8``, an empty ``k_pe``: a stored prefix written back) as they are, otherwise quantized
    (``quantize_kv_fp8``) once per forward part and layer, so that the layer buffers, the host pool and the
    resident KV of one forward hold the same bytes. Only the running layer's rows are remembered."""
    if rows.kv_c.dtype == torch.uint8:
        return rows.kv_c
    return _once(fwd, "latent_fp8_rows", layer, rows.kv_c, lambda: quantize_kv_fp8(rows.kv_c, rows.k_pe))


def index_fp8_rows(fwd: ForwardPlan, layer: int, rows: NewRows) -> torch.Tensor:
    """``rows``' indexer keys as DeepSeek's FP8 rows ``uint8 [N, Di + 4 * Di / 128]`` (Hadamard-rotated,
    ``hadamard_quant_fp8``): rows already kept so (``uint8``) as they are, otherwise quantized once per
    forward part and layer for the indexer cache and the layer buffers alike."""
    index_k = rows.index_k
    assert index_k is not None
    if index_k.dtype == torch.uint8:
        return index_k
    return _once(fwd, "index_fp8_rows", layer, index_k, lambda: hadamard_quant_fp8(index_k))


def _once(fwd: ForwardPlan, key: str, layer: int, source: torch.Tensor, make) -> torch.Tensor:
    """``make()`` for ``source`` of ``layer``, remembered in ``fwd.memo[key]`` for the running layer only."""
    held = fwd.memo.get(key)
    if held is not None and held[0] == layer and held[1] is source:
        return held[2]
    out = make()
    fwd.memo[key] = (layer, source, out)
    return out

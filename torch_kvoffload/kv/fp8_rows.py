"""DeepSeek's FP8 latent rows as a KV format: its name, the models that can keep it, and a forward's new rows
quantized once for every backend keeping them (resident KV, host pool, layer buffers, KVPP bundles)."""

from __future__ import annotations

import torch

from torch_kvoffload.kv.backend import NewRows
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.kv.spec import ModelSpec
from torch_kvoffload.ops.fp8 import TILE, quantize_kv_fp8

__all__ = ["FP8_KV", "check_kv_format", "latent_fp8_rows"]

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


_MEMO = "latent_fp8_rows"


def latent_fp8_rows(fwd: ForwardPlan, layer: int, rows: NewRows) -> torch.Tensor:
    """``rows``' latent KV as FP8 rows ``uint8 [N, Dc + 4 * Dc / 128 + 2 * Dr]``: rows already kept as FP8
    (``kv_c`` ``uint8``, an empty ``k_pe``: a stored prefix written back) as they are, otherwise quantized
    (``quantize_kv_fp8``) once per forward part and layer, so that the layer buffers, the host pool and the
    resident KV of one forward hold the same bytes. Only the running layer's rows are remembered."""
    if rows.kv_c.dtype == torch.uint8:
        return rows.kv_c
    held = fwd.memo.get(_MEMO)
    if held is not None and held[0] == layer and held[1] is rows.kv_c:
        return held[2]
    out = quantize_kv_fp8(rows.kv_c, rows.k_pe)
    fwd.memo[_MEMO] = (layer, rows.kv_c, out)
    return out

"""A forward's new latent rows as DeepSeek's FP8 rows, quantized once for every backend keeping them."""

from __future__ import annotations

import torch

from torch_kvoffload.kv.backend import NewRows
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.ops.fp8 import quantize_kv_fp8

__all__ = ["latent_fp8_rows"]

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

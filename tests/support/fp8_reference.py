"""DeepSeek's FP8 KV formats, written independently of the library, as references for the library's
``indexer_dtype="fp8_e4m3"`` and ``kv_dtype="fp8_e4m3"``:

* :func:`fp8_indexer`: the unmodified Hugging Face DSA indexer with its scores computed as DeepSeek-V3.2's
  inference code computes them (queries and keys rotated by the normalised Hadamard matrix, each 128-wide
  group quantised to ``float8_e4m3fn`` with a power-of-two scale, scores from the dequantised values);
* :func:`fp8_latent_kv`: the unmodified attention reading its latent KV as FlashMLA's FP8 rows give it
  back (each 128-wide tile of the normalised latent quantised with a power-of-two scale, the roped key
  rounded to bf16).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from support.hf_models import indexer_inputs

__all__ = [
    "act_quant_dequant",
    "decode_e4m3",
    "fp8_indexer",
    "fp8_latent_kv",
    "hadamard_matrix",
    "latent_quant_dequant",
]


def hadamard_matrix(d: int) -> torch.Tensor:
    """fp64 ``[d, d]`` Sylvester Hadamard matrix divided by ``√d`` (orthogonal, symmetric)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of e4m3fn bytes from their bit fields (sign, 4 exponent bits of bias 7, 3 mantissa
    bits; exponent 0 subnormal; 0x7F / 0xFF NaN), not through torch's float8 dtype."""
    c = codes.to(torch.int64)
    sign = torch.where(c >= 128, -1.0, 1.0).double()
    e, m = (c >> 3) & 0xF, (c & 7).double()
    normal = torch.ldexp(1.0 + m / 8, e - 7)
    sub = torch.ldexp(m / 8, torch.full_like(e, -6))
    v = sign * torch.where(e == 0, sub, normal)
    return torch.where((c & 0x7F) == 0x7F, math.nan, v)


def act_quant_dequant(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x [..., D]`` quantised per 128 values as DeepSeek's ``act_quant`` with ``scale_fmt="ue8m0"``
    (``scale = 2 ** ceil(log2(max(amax, 1e-4) / 448))``, values divided by it, clamped to ±448 and cast
    to e4m3fn), then dequantised."""
    groups = x.float().unflatten(-1, (-1, 128))
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4).double()
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0))).float()
    codes = (groups / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (codes * scale).flatten(-2)


@contextlib.contextmanager
def fp8_indexer() -> Iterator[None]:
    """Every ``DeepseekV32Indexer`` scores with FP8 queries and keys inside the block (see the module
    docstring); selection, masking and top-k as the unmodified forward."""
    import transformers.models.deepseek_v32.modeling_deepseek_v32 as v32

    original = v32.DeepseekV32Indexer.forward

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=None):
        q, k, w = indexer_inputs(self, hidden_states, q_resid, position_embeddings)
        if cache is not None:
            k = cache.update_indexer(k, self.layer_idx)
        rot = hadamard_matrix(self.head_dim).to(torch.float32)
        q8 = act_quant_dequant(q.float() @ rot)
        k8 = act_quant_dequant(k.float() @ rot)
        scores = torch.relu(q8 @ k8.transpose(-1, -2).unsqueeze(1) * self.softmax_scale)
        index_scores = (w.unsqueeze(-2) @ scores).squeeze(-2)
        if attention_mask.dtype == torch.bool:
            index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
        else:
            index_scores = index_scores + attention_mask
        topk = min(self.index_topk, index_scores.shape[-1])
        return index_scores.topk(topk, dim=-1).indices.to(torch.int32)

    v32.DeepseekV32Indexer.forward = forward
    try:
        yield
    finally:
        v32.DeepseekV32Indexer.forward = original


def latent_quant_dequant(x: torch.Tensor) -> torch.Tensor:
    """``x [..., Dc]`` through FlashMLA's FP8 latent row: per 128 values ``scale = 2 ** ceil(log2(max(amax /
    448, 1e-4)))``, values divided by it and cast to e4m3fn, then multiplied back (in ``x``'s dtype)."""
    tiles = x.float().unflatten(-1, (-1, 128))
    amax = tiles.abs().amax(dim=-1, keepdim=True).double()
    scale = torch.exp2(torch.ceil(torch.log2((amax / 448.0).clamp_min(1e-4)))).float()
    return ((tiles / scale).to(torch.float8_e4m3fn).float() * scale).flatten(-2).to(x.dtype)


@contextlib.contextmanager
def fp8_latent_kv(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, every attention layer of ``model`` (DeepseekV3 / V3.2) uses its normalised latent
    through :func:`latent_quant_dequant` and its roped key rounded to bf16, for every token (cached or not),
    as attention over FP8 rows sees them."""
    import transformers.models.deepseek_v32.modeling_deepseek_v32 as v32

    hooks = [
        m.kv_a_layernorm.register_forward_hook(lambda _m, _a, out: latent_quant_dequant(out))
        for m in model.modules()
        if hasattr(m, "kv_a_layernorm")
    ]
    original = v32.apply_rotary_pos_emb_interleave

    def rope(q, k, cos, sin, *args, **kwargs):
        q, k = original(q, k, cos, sin, *args, **kwargs)
        return q, k.to(torch.bfloat16).to(k.dtype)

    v32.apply_rotary_pos_emb_interleave = rope
    try:
        yield
    finally:
        v32.apply_rotary_pos_emb_interleave = original
        for h in hooks:
            h.remove()

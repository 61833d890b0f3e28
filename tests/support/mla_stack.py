"""A small MLA (DeepSeek-V2/V3 latent attention) decoder stack in plain PyTorch with a paged latent cache.

Per layer the cache holds ``c_kv [num_blocks, block_size, kv_lora_rank]`` (normalised latent) and
``k_pe [num_blocks, block_size, rope_dim]`` (rotary key). Attention is the absorbed form: queries are
projected into the latent space, scores ``q_lat · c_kv + q_pe · k_pe``, output ``p · c_kv`` then up-projected.
Prefill computes tokens ``[cached, len)`` of each request and attends to ``[0, len)`` read from the cache,
so a prefix loaded from a store is used exactly like a computed one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torch_kvoffload.layerwise import LayerCacheSpec, TensorSpec


@dataclass(frozen=True)
class MLAConfig:
    num_layers: int = 8
    vocab: int = 101
    d_model: int = 32
    n_heads: int = 2
    nope_dim: int = 8
    rope_dim: int = 8
    kv_lora_rank: int = 16
    v_dim: int = 8
    block_size: int = 4
    num_blocks: int = 48


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the last dim of ``x [T, ..., D]`` at positions ``pos [T]``."""
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class MLAStack:
    """Random-initialised MLA decoder (fp32). ``hooks`` (optional) get ``wait(layer, caches)`` before and
    ``save(layer, caches)`` after each layer's cache write — the layerwise runtime's hook methods, so a
    :class:`~torch_kvoffload.layerwise.LayerwiseOffloadRuntime` itself can be passed."""

    def __init__(self, cfg: MLAConfig, seed: int = 0) -> None:
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0] if len(shape) == 2 else shape[-2])

        c = cfg
        self.embed = torch.randn(c.vocab, c.d_model, generator=g)
        self.layers = []
        for _ in range(c.num_layers):
            self.layers.append(
                {
                    "ln1": 1 + 0.1 * torch.randn(c.d_model, generator=g),
                    "ln2": 1 + 0.1 * torch.randn(c.d_model, generator=g),
                    "kv_ln": 1 + 0.1 * torch.randn(c.kv_lora_rank, generator=g),
                    "w_q": w(c.d_model, c.n_heads * (c.nope_dim + c.rope_dim)),
                    "w_kva": w(c.d_model, c.kv_lora_rank + c.rope_dim),
                    "w_uk": w(c.n_heads, c.nope_dim, c.kv_lora_rank),
                    "w_uv": w(c.n_heads, c.kv_lora_rank, c.v_dim),
                    "w_o": w(c.n_heads * c.v_dim, c.d_model),
                    "w_up": w(c.d_model, 2 * c.d_model),
                    "w_down": w(2 * c.d_model, c.d_model),
                }
            )
        self.ln_f = torch.ones(c.d_model)

    def cache_specs(self) -> list[LayerCacheSpec]:
        c = self.cfg
        main = (
            TensorSpec((c.num_blocks, c.block_size, c.kv_lora_rank), torch.float32),
            TensorSpec((c.num_blocks, c.block_size, c.rope_dim), torch.float32),
        )
        return [LayerCacheSpec(main) for _ in range(c.num_layers)]

    def prefill(
        self,
        token_ids: Sequence[Sequence[int]],
        block_tables: Sequence[Sequence[int]],
        caches_of: Callable[[int], tuple[torch.Tensor, ...]],
        cached: Sequence[int] | None = None,
        hooks=None,
        on_attention: Callable[[int], None] | None = None,
    ) -> list[torch.Tensor]:
        """Final hidden states ``[len - cached, d_model]`` of the computed tokens of each request."""
        c = self.cfg
        cached = [0] * len(token_ids) if cached is None else list(cached)
        xs, poss, slots = [], [], []
        for toks, table, k in zip(token_ids, block_tables, cached, strict=True):
            pos = torch.arange(len(toks))
            tab = torch.tensor(table, dtype=torch.int64)
            slots.append(tab[pos // c.block_size] * c.block_size + pos % c.block_size)
            poss.append(pos)
            xs.append(self.embed[torch.tensor(toks[k:], dtype=torch.int64)])
        scale = 1.0 / math.sqrt(c.nope_dim + c.rope_dim)
        for layer, p in enumerate(self.layers):
            caches = caches_of(layer)
            if hooks is not None:
                hooks.wait_layer(layer, caches)
            c_cache = caches[0].view(-1, c.kv_lora_rank)
            pe_cache = caches[1].view(-1, c.rope_dim)
            hs = []
            for x, pos, slot, k in zip(xs, poss, slots, cached, strict=True):
                h = _rms(x, p["ln1"])
                kva = h @ p["w_kva"]
                c_kv = _rms(kva[:, : c.kv_lora_rank], p["kv_ln"])
                k_pe = _rope(kva[:, c.kv_lora_rank :], pos[k:])
                c_cache[slot[k:]] = c_kv
                pe_cache[slot[k:]] = k_pe
                hs.append(h)
            if hooks is not None:
                hooks.save_layer(layer, caches)
            if on_attention is not None:
                on_attention(layer)
            new_xs = []
            for x, h, pos, slot, k in zip(xs, hs, poss, slots, cached, strict=True):
                q = (h @ p["w_q"]).view(-1, c.n_heads, c.nope_dim + c.rope_dim)
                q_nope, q_pe = q[..., : c.nope_dim], _rope(q[..., c.nope_dim :], pos[k:])
                q_lat = torch.einsum("thd,hdr->thr", q_nope, p["w_uk"])
                c_all, pe_all = c_cache[slot], pe_cache[slot]
                s = (
                    torch.einsum("thr,sr->ths", q_lat, c_all) + torch.einsum("thd,sd->ths", q_pe, pe_all)
                ) * scale
                mask = pos[None, :] > pos[k:, None]
                s = s.masked_fill(mask[:, None, :], float("-inf"))
                o_lat = torch.einsum("ths,sr->thr", s.softmax(-1), c_all)
                o = torch.einsum("thr,hrv->thv", o_lat, p["w_uv"]).reshape(len(x), -1) @ p["w_o"]
                x = x + o
                x = x + torch.nn.functional.gelu(_rms(x, p["ln2"]) @ p["w_up"]) @ p["w_down"]
                new_xs.append(x)
            xs = new_xs
        return [_rms(x, self.ln_f) for x in xs]

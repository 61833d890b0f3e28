"""The library's eager MLA attention for Hugging Face DeepSeek-style attention modules.

:func:`mla_attention_forward` replaces an attention module's ``forward`` (see ``install.offload``). It
runs the module's own projections (``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` or ``q_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, the indexer's ``wq_b`` / ``wk`` / ``k_norm`` /
``weights_proj``) and the rotary functions of the module's own modeling file, then the op sequence of the
contract: layer hooks (layerwise ``layer_wait`` + ``layer_prefetch``; KVPP ``kvpp_wait_layer`` + ``kvpp_prefetch_layer``
of the next layer) → ``mla_cache_write`` → ``layer_save`` → ``mla_cache_attention`` → W_UV → ``o_proj``.

Absorption: with ``W = kv_b_proj.weight.view(H, qk_nope + v, Dc)``, ``W_UK = W[:, :qk_nope]`` and
``W_UV = W[:, qk_nope:]``, the query is folded into the latent space (``q_nope[h] = q_pass[h] @ W_UK[h]``)
and the latent output is expanded once per query (``out_v[h] = out[h] @ W_UV[h]ᵀ``), so no step re-expands
the cache through ``kv_b_proj``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from torch_kvoffload.core.spec import local_shard
from torch_kvoffload.ops import mla_runtime

__all__ = ["indexer_inputs", "mla_attention_forward", "rope_functions"]


def rope_functions(module: torch.nn.Module):
    """``(main, half)``: the rotary functions of the module's own modeling file, for the latent key /
    query (interleaved when ``config.rope_interleave``) and for the indexer (half split).

    Raises ``ValueError`` naming the attention class when its modeling file does not define them (the
    eager attention reproduces the DeepSeek-V3 attention code; other layouts need ``compile``).
    """
    mod = sys.modules[type(module).__module__]
    interleave = getattr(module.config, "rope_interleave", True)
    names = (
        "apply_rotary_pos_emb_interleave" if interleave else "apply_rotary_pos_emb",
        "apply_rotary_pos_emb",
    )
    missing = [n for n in names if not callable(getattr(mod, n, None))]
    if missing:
        raise ValueError(
            f"torch_kvoffload.offload cannot run {type(module).__name__} eagerly: {mod.__name__} has no "
            f"{' / '.join(missing)} (the eager attention follows the DeepSeek-V3 attention code); "
            "torch_kvoffload.compile rewrites the model's own graph and may serve it"
        )
    return getattr(mod, names[0]), getattr(mod, names[1])


def indexer_inputs(
    indexer: torch.nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, rope_half,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(index_q [B,S,Hi,Di], index_k [B,S,Di], index_weights fp32 [B,S,Hi])`` of a DSA indexer, with
    ``n_heads^-0.5 · softmax_scale`` folded into the weights (``relu(a·s) = s·relu(a)`` for ``s > 0``)."""
    B, S, _ = hidden_states.shape
    n, d, rope = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    with torch.no_grad():
        q = indexer.wq_b(q_resid).view(B, S, n, d)
        q_rot, q_pass = torch.split(q, [rope, d - rope], dim=-1)
        k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [rope, d - rope], dim=-1)
        q_rot, k_rot = rope_half(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        w = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
        w = w * (n**-0.5 * indexer.softmax_scale)
    return q, k, w


def mla_attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: Any = None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Drop-in ``forward`` of a DeepseekV3 / V32-style attention module (``self``), served by the
    session stored on it as ``self._kvoffload_session``. ``hidden_states [B, S, hidden]``; returns
    ``(o_proj output [B, S, hidden], None)``. The mask is not read: the session knows every request's
    visible tokens.

    Under transformers' tensor parallelism ``q_b_proj`` / ``kv_b_proj`` hold this rank's heads (colwise) and
    ``o_proj`` is rowwise: the attention runs on the local heads ``Hl`` (``q_b_proj``'s local output width
    / (nope + rope)) and ``o_proj``'s own hook sums the ranks' partial outputs; the latent, the rotary key
    and the indexer are replicated, so every rank writes and reads the same KV rows."""
    session = self._kvoffload_session
    layer = self.layer_idx
    B, S, _ = hidden_states.shape
    nope, rope, v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
    Dc = self.kv_lora_rank
    rope_main, rope_half = rope_functions(self)

    q_resid = None
    if getattr(self, "q_lora_rank", None) is None:
        q = self.q_proj(hidden_states)
    else:
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q = self.q_b_proj(q_resid)
    H = session.spec.num_heads  # this rank's heads
    q = q.view(B, S, H, nope + rope).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
    kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [Dc, rope], dim=-1)
    kv_c = self.kv_a_layernorm(kv_pass)
    cos, sin = position_embeddings
    q_rot, k_rot = rope_main(q_rot, k_rot.view(B, 1, S, rope), cos, sin)
    k_pe = k_rot[:, 0]

    index_q = index_k = index_w = None
    indexer = getattr(self, "indexer", None)
    if indexer is not None:
        index_q, index_k, index_w = indexer_inputs(indexer, hidden_states, q_resid, cos, sin, rope_half)

    w = local_shard(self.kv_b_proj.weight).view(H, nope + v, Dc)
    # batched over heads; both weight halves are read in place (no copy of kv_b_proj per call)
    q_nope = torch.matmul(q_pass, w[:, :nope]).transpose(1, 2)
    q_pe = q_rot.transpose(1, 2)

    ops = torch.ops.kvoffload
    caches = session.layer_caches(layer)
    lw = session.layerwise_runtime
    if lw is not None:
        ops.layer_wait(lw, layer, caches)
        ops.layer_prefetch(lw, layer, caches)
    kv = session.kvpp_runtime
    if kv is not None:
        # the owner's broadcast of this layer lands before the first KV access; the next one overlaps it
        ops.kvpp_wait_layer(kv, layer, caches)
        if layer + 1 < session.spec.num_layers:
            ops.kvpp_prefetch_layer(kv, layer + 1, session.layer_caches(layer + 1))
    mla_runtime.mla_cache_write(session.name, layer, kv_c, k_pe, index_k, caches)
    if lw is not None:
        ops.layer_save(lw, layer, caches)
    out = q_nope.new_empty(B, S, H, Dc)
    mla_runtime.mla_cache_attention(
        session.name, layer, q_nope, q_pe, index_q, index_w, float(self.scaling), out, caches
    )
    out_v = (
        torch.matmul(out.transpose(1, 2), w[:, nope:].transpose(1, 2)).transpose(1, 2).reshape(B, S, H * v)
    )
    return self.o_proj(out_v), None

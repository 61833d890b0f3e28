"""The library's eager MLA attention for Hugging Face DeepSeek-style attention modules.

:func:`mla_attention_forward` replaces an attention module's ``forward`` (see ``install.offload``). It
runs the module's own projections (``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` or ``q_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, the indexer's ``wq_b`` / ``wk`` / ``k_norm`` /
``weights_proj``) and the rotary functions of the module's own modeling file, then the op sequence of the
contract: layer hooks (layerwise ``layer_wait`` + ``layer_prefetch``; KVPP ``kvpp_wait_layer`` + ``kvpp_prefetch_layer``
of the next layer) → ``mla_cache_write`` → ``layer_save`` → ``mla_cache_attention`` → W_UV → ``o_proj``.
Run eagerly, the two cache steps call the KV core's ``cache_write`` / ``cache_attention`` directly (what
the ops' kernels call, without the dispatcher and the ops' checks of arguments this function made itself);
traced by Dynamo, it emits the ops, which a graph keeps as nodes.

Absorption: with ``W = kv_b_proj.weight.view(H, qk_nope + v, Dc)``, ``W_UK = W[:, :qk_nope]`` and
``W_UV = W[:, qk_nope:]``, the query is folded into the latent space (``q_nope[h] = q_pass[h] @ W_UK[h]``)
and the latent output is expanded once per query (``out_v[h] = out[h] @ W_UV[h]ᵀ``), so no step re-expands
the cache through ``kv_b_proj``.

Families. The forward is DeepSeek-V3's; where a family's modeling file differs (rotary style, an indexer's
rotary, the returned top-k), :data:`ATTENTION_CODE` says so per family and the family's own rotary function
runs. A family not in that table, or a module whose structure its entry does not describe, is refused with
a ``ValueError`` before anything is allocated (``install.offload`` calls :func:`rope_functions` first).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from torch_kvoffload.integrations.hf.output_attentions import attention_weights
from torch_kvoffload.kv.spec import local_shard
from torch_kvoffload.ops import mla_runtime

__all__ = [
    "ATTENTION_CODE",
    "AttentionCode",
    "attention_code",
    "indexer_inputs",
    "mla_attention_forward",
    "rope_functions",
]

#: ``(q, k, position_embeddings, unsqueeze_dim) -> (q, k)``: one rotary style, run by the family's own function.
Rotary = Callable[[torch.Tensor, torch.Tensor, Any, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AttentionCode:
    """How one family's attention forward (its transformers 5.24 modeling file) differs from DeepSeek-V3's.

    ``rotary`` (latent query / key) and ``indexer_rotary`` (DSA indexer; ``None``: the family has no indexer)
    name a rotary style, each run by the family's own function: ``"interleave"`` (cos / sin over interleaved
    pairs, ``apply_rotary_pos_emb_interleave``), ``"half"`` (cos / sin, half split, ``apply_rotary_pos_emb``),
    ``"complex"`` (``position_embeddings`` is the complex ``freqs_cis``, ``apply_rotary_emb``), ``"config"``
    (``"interleave"`` when ``config.rope_interleave``, else ``"half"``). ``returns_topk``: the forward returns
    ``(output, weights, topk_indices)``, the decoder layer handing the top-k on to the next layer."""

    rotary: str
    indexer_rotary: str | None = None
    returns_topk: bool = False


#: Per family: the ``<family>`` of the attention class's module ``transformers.models.<family>.modeling_<family>``
#: (the code that runs, whatever the config's ``model_type``). Every family listed shares the rest of the
#: DeepSeek-V3 forward, read in each file: the query projection (``q_proj`` when ``q_lora_rank`` is ``None``,
#: else ``q_a_proj`` → ``q_a_layernorm`` → ``q_b_proj``), ``kv_a_proj_with_mqa`` → ``kv_a_layernorm``, the
#: softmax scale ``self.scaling`` (yarn ``mscale_all_dim`` folded in by the module), yarn's attention factor
#: inside the position embeddings, ``kv_b_proj``'s ``[nope | v]`` rows per head; and, with an indexer, its
#: scoring: ``wq_b`` on the q_lora residual, ``wk`` → LayerNorm ``k_norm``, rotary on the first
#: ``qk_rope_head_dim`` dims, ``relu(q·k) · head_dim^-0.5`` weighted by ``weights_proj · n_heads^-0.5``, no
#: Hadamard rotation, top ``min(index_topk, T)``. A family not listed is refused (``ValueError``).
ATTENTION_CODE: dict[str, AttentionCode] = {
    "deepseek_v3": AttentionCode("config"),
    "glm4_moe_lite": AttentionCode("config"),
    "youtu": AttentionCode("config"),
    # freqs_cis: complex product over interleaved pairs, in fp32; the pairs stay interleaved in place
    "deepseek_v2": AttentionCode("complex"),
    # cos / sin, half split, whatever the config says (MiniCPM3Config has no rope_interleave)
    "minicpm3": AttentionCode("half"),
    "deepseek_v32": AttentionCode("interleave", indexer_rotary="half"),
    # GLM-5: the indexer's rotary is interleaved too, and the forward returns the top-k for the next layer
    # (its "shared" layers reuse it: refused by inspect_model, the library selects every layer's own)
    "glm_moe_dsa": AttentionCode("interleave", indexer_rotary="interleave", returns_topk=True),
}

_ROTARY_FUNCTIONS = {
    "interleave": "apply_rotary_pos_emb_interleave",
    "half": "apply_rotary_pos_emb",
    "complex": "apply_rotary_emb",
}


def _refuse(module: torch.nn.Module, reason: str) -> NoReturn:
    raise ValueError(
        f"torch_kvoffload.offload cannot run {type(module).__name__} eagerly: {reason}; "
        "torch_kvoffload.compile rewrites the model's own graph and may serve it"
    )


def _family(module: torch.nn.Module) -> str | None:
    """``<family>`` of a module defined in ``transformers.models.<family>.modeling_<family>``, else ``None``."""
    parts = type(module).__module__.split(".")
    if len(parts) == 4 and parts[:2] == ["transformers", "models"] and parts[3] == f"modeling_{parts[2]}":
        return parts[2]
    return None


def attention_code(module: torch.nn.Module) -> AttentionCode:
    """The :data:`ATTENTION_CODE` entry of an MLA attention module, its ``"config"`` rotary resolved and
    checked against the module's structure. ``ValueError`` naming the class and the reason for a family
    not listed, or a module whose indexer the family's entry does not describe."""
    family = _family(module)
    code = ATTENTION_CODE.get(family) if family is not None else None
    if code is None:
        _refuse(
            module,
            f"its attention code ({type(module).__module__}) is not one the eager attention reproduces "
            f"(known families: {', '.join(sorted(ATTENTION_CODE))})",
        )
    if code.rotary == "config":
        if not hasattr(module.config, "rope_interleave"):
            _refuse(module, f"{family}'s rotary follows config.rope_interleave, which its config lacks")
        style = "interleave" if module.config.rope_interleave else "half"  # as the family's forward tests it
        code = AttentionCode(style, code.indexer_rotary, code.returns_topk)
    has_indexer = getattr(module, "indexer", None) is not None
    if has_indexer and code.indexer_rotary is None:
        _refuse(
            module, f"its layer {module.layer_idx} has an indexer, which {family}'s attention code has not"
        )
    if not has_indexer and code.indexer_rotary is not None:
        _refuse(
            module,
            f"its layer {module.layer_idx} runs no indexer of its own ({family} layers without one reuse the "
            "previous layer's top-k, which the library does not)",
        )
    return code


def _rotary(module: torch.nn.Module, style: str) -> Rotary:
    """The rotary ``style`` of ``module``'s own modeling file, called as :data:`Rotary`."""
    mod = sys.modules[type(module).__module__]
    name = _ROTARY_FUNCTIONS[style]
    fn = getattr(mod, name, None)
    if not callable(fn):
        _refuse(module, f"{mod.__name__} has no {name} (its {style} rotary)")
    if style == "complex":

        def complex_rotary(q, k, freqs_cis, unsqueeze_dim=1):
            if not (isinstance(freqs_cis, torch.Tensor) and freqs_cis.is_complex()) or unsqueeze_dim != 1:
                raise ValueError(
                    f"{type(module).__name__}: its complex rotary takes freqs_cis [B, S, rope / 2] broadcast "
                    f"over dim 1, got {type(freqs_cis).__name__} and unsqueeze_dim={unsqueeze_dim}"
                )
            return fn(q, k, freqs_cis)

        return complex_rotary

    def cos_sin_rotary(q, k, position_embeddings, unsqueeze_dim=1):
        if isinstance(position_embeddings, torch.Tensor):  # unpacking it would split the batch
            raise ValueError(
                f"{type(module).__name__}: its {style} rotary takes (cos, sin), got one tensor "
                f"{tuple(position_embeddings.shape)}"
            )
        cos, sin = position_embeddings
        return fn(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    return cos_sin_rotary


def rope_functions(module: torch.nn.Module) -> tuple[Rotary, Rotary | None]:
    """``(main, index)``: the rotary of the latent query / key and of the DSA indexer (``None`` without an
    indexer), each the module's own modeling-file function in its family's style (:func:`attention_code`).

    Raises ``ValueError`` naming the attention class and the reason when the eager attention does not
    reproduce the family's code (``torch_kvoffload.compile`` rewrites the captured graph instead).
    """
    return _rotaries(module, attention_code(module))


def _rotaries(module: torch.nn.Module, code: AttentionCode) -> tuple[Rotary, Rotary | None]:
    index = _rotary(module, code.indexer_rotary) if code.indexer_rotary is not None else None
    return _rotary(module, code.rotary), index


def _attention_of(module: torch.nn.Module) -> tuple[AttentionCode, Rotary, Rotary | None]:
    """``module``'s :func:`attention_code` and rotaries, resolved at its first forward and kept on it (they
    depend on the module's class and config only)."""
    found = module.__dict__.get("_kvoffload_attention")
    if found is None:
        code = attention_code(module)
        found = (code, *_rotaries(module, code))
        module.__dict__["_kvoffload_attention"] = found
    return found


def indexer_inputs(
    indexer: torch.nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor, position_embeddings: Any,
    rope_index: Rotary,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(index_q [B,S,Hi,Di], index_k [B,S,Di], index_weights fp32 [B,S,Hi])`` of a DSA indexer, with
    ``n_heads^-0.5 · softmax_scale`` folded into the weights (``relu(a·s) = s·relu(a)`` for ``s > 0``).
    ``rope_index`` is the family's indexer rotary (half split for DeepSeek-V3.2, interleaved for GLM-5)."""
    B, S, _ = hidden_states.shape
    n, d, rope = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    with torch.no_grad():
        q = indexer.wq_b(q_resid).view(B, S, n, d)
        q_rot, q_pass = torch.split(q, [rope, d - rope], dim=-1)
        k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [rope, d - rope], dim=-1)
        q_rot, k_rot = rope_index(q_rot, k_rot, position_embeddings, 2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        w = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
        w = w * (n**-0.5 * indexer.softmax_scale)
    return q, k, w


def mla_attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: Any,
    attention_mask: Any = None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, None]:
    """Drop-in ``forward`` of an MLA attention module (``self``) of a family in :data:`ATTENTION_CODE`,
    served by the session stored on it as ``self._kvoffload_session``. ``hidden_states [B, S, hidden]``,
    ``position_embeddings`` the model's ``(cos, sin)`` or complex ``freqs_cis`` (DeepSeek-V2); returns
    ``(o_proj output [B, S, hidden], weights)``, and a third ``None`` (no top-k for a next layer to share) for a
    family whose forward returns its top-k (GLM-5). ``weights`` is ``None`` unless the forward asked for
    the attention probabilities (``output_attentions``: ``[B, H, S, past + S]``, see
    :mod:`torch_kvoffload.integrations.hf.output_attentions`). The mask is not read: the session knows every request's
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
    code, rope_main, rope_index = _attention_of(self)

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
    q_rot, k_rot = rope_main(q_rot, k_rot.view(B, 1, S, rope), position_embeddings, 1)
    k_pe = k_rot[:, 0]

    index_q = index_k = index_w = None
    indexer = getattr(self, "indexer", None)
    if indexer is not None:
        index_q, index_k, index_w = indexer_inputs(
            indexer, hidden_states, q_resid, position_embeddings, rope_index
        )

    w = local_shard(self.kv_b_proj.weight).view(H, nope + v, Dc)
    # batched over heads; both weight halves are read in place (no copy of kv_b_proj per call)
    q_nope = torch.matmul(q_pass, w[:, :nope]).transpose(1, 2)
    q_pe = q_rot.transpose(1, 2)

    # the core runs the layer's KV pipeline in cache_write (layerwise loads and saves, KVPP broadcasts)
    core = session.core
    out = q_nope.new_empty(B, S, H, Dc)
    traced = torch.compiler.is_compiling()
    if traced:  # a graph keeps the ops as nodes (the caches declared mutated order them); their kernels
        caches = session.layer_caches(layer)  # call the same core methods
        mla_runtime.mla_cache_write(session.name, layer, kv_c, k_pe, index_k, caches)
        mla_runtime.mla_cache_attention(
            session.name, layer, q_nope, q_pe, index_q, index_w, float(self.scaling), out, caches
        )
    else:
        core.cache_write(layer, kv_c, k_pe, index_k)
        core.cache_attention(layer, q_nope, q_pe, index_q, index_w, float(self.scaling), out)
    out_v = (
        torch.matmul(out.transpose(1, 2), w[:, nope:].transpose(1, 2)).transpose(1, 2).reshape(B, S, H * v)
    )
    weights = attention_weights(session, layer, q.dtype)  # None unless the forward asked (output_attentions)
    if code.returns_topk:
        return self.o_proj(out_v), weights, None
    return self.o_proj(out_v), weights

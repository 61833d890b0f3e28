"""Tiny random-initialised Hugging Face MLA / SFA models shared by the HF tests, examples and benchmarks.

No weights are downloaded: every model is built from a small config with a fixed seed, so two calls with
the same arguments give the same weights. ``deepseek_v3`` is plain MLA; ``deepseek_v32`` adds the DSA
lightning indexer (``index_topk`` well below the test contexts, so the selection is really sparse).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "FAMILIES",
    "ONE_LAYER",
    "SMALL",
    "build_model",
    "indexer_boundary_ties",
    "indexer_inputs",
    "left_padded_batch",
    "tiny_config",
]

FAMILIES = ("deepseek_v3", "deepseek_v32")
# Two layers (one dense, one MoE) and narrow widths: a compile takes seconds; index_topk (8) stays well
# below the context, so the V3.2 selection is really sparse (index_n_heads stays 32).
SMALL = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16,
)  # fmt: skip
# SMALL with one (dense) layer: Dynamo traces every layer of every graph (about 2.5 s a layer and graph here),
# so the compiled tests whose subject is not the passage from layer to layer (options, threads, copies,
# several models in a process) trace one
ONE_LAYER = {**SMALL, "num_hidden_layers": 1}

_COMMON: dict[str, Any] = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=64,
    q_lora_rank=96,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=1024,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# Many indexer heads make exact score ties rare: a key scores exactly 0 when every head's relu is 0,
# and the random keys of a tiny model are correlated enough for that to happen with few heads.
_INDEXER: dict[str, Any] = dict(index_topk=8, index_head_dim=32, index_n_heads=32)


def tiny_config(family: str, **overrides: Any):
    """The config of a tiny ``family`` model (``overrides`` replace any field)."""
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config

        return DeepseekV3Config(**{**_COMMON, **overrides})
    if family == "deepseek_v32":
        from transformers import DeepseekV32Config

        return DeepseekV32Config(**{**_COMMON, **_INDEXER, **overrides})
    raise ValueError(f"tiny_config: unknown family {family!r}; expected one of {FAMILIES}")


def build_model(
    family: str,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    **overrides: Any,
) -> torch.nn.Module:
    """A seeded random ``family`` causal LM in eval mode, ``dtype`` weights, on CPU."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    return model.to(dtype).eval()


def left_padded_batch(
    lengths: list[int], vocab_size: int = 1000, *, seed: int = 0, pad_token_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of ``lengths`` tokens, left padded: ``input_ids int64 [B, max]`` and
    ``attention_mask int64 [B, max]`` (0 on the padding)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros(len(lengths), width, dtype=torch.int64)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(3, vocab_size, (n,), generator=g)
        mask[b, width - n :] = 1
    return ids, mask


def indexer_inputs(indexer, hidden_states, q_resid, position_embeddings):
    """A DSA indexer module's roped queries ``[B, S, H, D]``, keys ``[B, S, D]`` and fp32 head weights
    ``[B, S, H]`` (with the ``n_heads ** -0.5`` factor), as its forward computes them."""
    import transformers.models.deepseek_v32.modeling_deepseek_v32 as v32

    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    rope, d = indexer.qk_rope_head_dim, indexer.head_dim
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, d)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    q_rot, k_rot = v32.apply_rotary_pos_emb(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rope:]], dim=-1)
    k = torch.cat([k_rot, k[..., rope:]], dim=-1).squeeze(2)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    return q, k, weights * indexer.n_heads**-0.5


def indexer_boundary_ties(model: torch.nn.Module, sequences: list[torch.Tensor]) -> int:
    """Query rows (over layers and ``sequences``, each an unpadded ``int64 [T]``) where the unmodified
    DSA indexer's ``index_topk``-th and next best scores are exactly equal.

    At such a row the top-k set depends on how ``topk`` breaks ties, which no other implementation can
    be expected to reproduce; token-equality tests check this is 0 for their data. Scores are recomputed
    here from the indexer's own weights, as its forward computes them.
    """
    import transformers.models.deepseek_v32.modeling_deepseek_v32 as v32

    ties = 0
    original = v32.DeepseekV32Indexer.forward

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=None):
        nonlocal ties
        s = hidden_states.shape[1]
        q, k, w = indexer_inputs(self, hidden_states, q_resid, position_embeddings)
        scores = torch.relu(q.float() @ k.float().transpose(-1, -2).unsqueeze(1) * self.softmax_scale)
        total = (w.unsqueeze(-2) @ scores).squeeze(-2)[0]
        total = total.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        k_top = self.index_topk
        if s > k_top:
            v = total.sort(dim=-1, descending=True).values[k_top:]
            ties += int((v[:, k_top - 1] == v[:, k_top]).sum())
        return original(
            self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=cache
        )

    v32.DeepseekV32Indexer.forward = forward
    try:
        with torch.no_grad():
            for seq in sequences:
                model(input_ids=seq[None])
    finally:
        v32.DeepseekV32Indexer.forward = original
    return ties

"""Eager offload (``torch_kvoffload.offload``) of the families whose attention code differs from DeepSeek-V3's:
DeepseekV2 (complex ``freqs_cis`` rotary; V2-Lite without q_lora), MiniCPM3 (half-split rotary) and GlmMoeDsa
(GLM-5: interleaved rotary in the indexer too, a forward returning the top-k).

Greedy tokens equal the unmodified model's and so do the per-step logits, to 1e-4 (fp32): tiny random
models attend almost uniformly, so a wrong latent rotary can leave the tokens unchanged but moves the
logits by 6e-4 or more (``test_the_checks_see_deepseek_v3_math_on_these_families``). Two generate calls
per model, of other batch sizes and prompt lengths, left padded.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from support.hf_models import left_padded_batch

import torch_kvoffload
from torch_kvoffload.integrations.hf import attention

# two layers (one dense MLP, one MoE), narrow widths
SMALL = dict(
    vocab_size=1000, num_hidden_layers=2, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=32,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=1024, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
# index_topk well below the contexts (really sparse); enough indexer heads to avoid top-k boundary ties
INDEXER = dict(index_topk=8, index_head_dim=32, index_n_heads=16)
# (prompt lengths, seed, max_new_tokens) of the two generate calls on one offloaded model
CALLS = [([20, 13], 0, 12), ([7, 30, 11], 1, 8)]
BS = 8
ATOL = 1e-4

CASES = {
    "v2-layerwise": ("DeepseekV2Config", {}, {"layerwise": {}}),
    "v2-lite-layerwise": ("DeepseekV2Config", {"q_lora_rank": None}, {"layerwise": {}}),
    "minicpm3-layerwise": ("MiniCPM3Config", {}, {"layerwise": {}}),
    "glm5-layerwise": ("GlmMoeDsaConfig", INDEXER, {"layerwise": {}}),
    "glm5-sparse": ("GlmMoeDsaConfig", INDEXER, {"sparse": {}}),
    "glm5-resident": ("GlmMoeDsaConfig", INDEXER, {"sparse": {"offload": False}}),
}


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _model(config_name: str, **overrides) -> torch.nn.Module:
    cfg = getattr(transformers, config_name)(**{**SMALL, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _generate(model, lengths, seed, new):
    """``(tokens [B, P + new], logits fp32 [new, B, vocab])`` of a greedy generate."""
    ids, mask = left_padded_batch(lengths, seed=seed)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits)


def _glm_boundary_ties(model) -> int:
    """Query rows where the unmodified GLM-5 indexer's ``index_topk``-th and next best scores are equal
    (the top-k would then depend on tie-breaking), over :data:`CALLS`' unpadded prompts; the scores are
    recomputed from the indexer's weights as its forward computes them (interleaved rotary)."""
    glm = sys.modules[type(model).__module__]
    ties = 0

    def count(indexer, args, kwargs):
        nonlocal ties
        hidden, q_resid, (cos, sin) = args[:3]
        s, n, d, rope = hidden.shape[1], indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
        q = indexer.wq_b(q_resid).view(1, s, n, d)
        k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
        q_rot, k_rot = glm.apply_rotary_pos_emb_interleave(
            q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2
        )
        q, k = torch.cat([q_rot, q[..., rope:]], -1), torch.cat([k_rot, k[..., rope:]], -1).squeeze(2)
        scores = torch.relu(q.float() @ k.float().transpose(-1, -2).unsqueeze(1) * indexer.softmax_scale)
        w = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * n**-0.5
        total = (
            (w.unsqueeze(-2) @ scores).squeeze(-2)[0].masked_fill(torch.ones(s, s).triu(1).bool(), -torch.inf)
        )
        top = indexer.index_topk
        if s > top:
            v = total.sort(dim=-1, descending=True).values[top:]
            ties += int((v[:, top - 1] == v[:, top]).sum())

    hooks = [
        layer.self_attn.indexer.register_forward_pre_hook(count, with_kwargs=True)
        for layer in model.model.layers
    ]
    try:
        for lengths, seed, _ in CALLS:
            ids, mask = left_padded_batch(lengths, seed=seed)
            for row, keep in zip(ids, mask.bool(), strict=True):
                model(input_ids=row[keep][None])
    finally:
        for h in hooks:
            h.remove()
    return ties


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logits_equal_unmodified_model(case):
    config_name, overrides, config = CASES[case]
    ref = _model(config_name, **overrides)
    if "index_topk" in overrides:
        assert _glm_boundary_ties(ref) == 0
    model = torch_kvoffload.offload(_model(config_name, **overrides), {**config, "block_size": BS})
    for lengths, seed, new in CALLS:
        want_tokens, want_logits = _generate(ref, lengths, seed, new)
        got_tokens, got_logits = _generate(model, lengths, seed, new)
        assert torch.equal(got_tokens, want_tokens)
        torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=ATOL)
    s = torch_kvoffload.stats(model)
    if "layerwise" in config:
        assert s["layer_saves"] > 0  # the KV really went through the host store
    if config.get("sparse") == {}:
        assert s["misses"] > 0 and s["hits"] > 0  # the selection is sparse and reads the host pool
    torch_kvoffload.integrations.hf.session_of(model).close()


@pytest.mark.parametrize(
    ("config_name", "overrides", "family", "wrong", "borrowed"),
    [
        # DeepSeek-V3's interleaved rotary where MiniCPM3 splits halves
        ("MiniCPM3Config", {}, "minicpm3", attention.AttentionCode("interleave"), "apply_rotary_pos_emb_interleave"),
        # DeepSeek-V3.2's half-split indexer rotary where GLM-5 interleaves
        ("GlmMoeDsaConfig", INDEXER, "glm_moe_dsa", attention.AttentionCode("interleave", "half", True),
         "apply_rotary_pos_emb"),
    ],
)  # fmt: skip
def test_the_checks_see_deepseek_v3_math_on_these_families(
    monkeypatch, config_name, overrides, family, wrong, borrowed
):
    """The family's entry replaced by the DeepSeek-V3 / V3.2 one (the missing function borrowed from
    DeepSeek-V3.2's file): tokens or logits then differ beyond the tolerance of the test above."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32

    ref = _model(config_name, **overrides)
    monkeypatch.setitem(attention.ATTENTION_CODE, family, wrong)
    own = sys.modules[type(ref).__module__]
    monkeypatch.setattr(own, borrowed, getattr(modeling_deepseek_v32, borrowed), raising=False)
    model = torch_kvoffload.offload(_model(config_name, **overrides), {"layerwise": {}, "block_size": BS})
    lengths, seed, new = CALLS[0]
    want_tokens, want_logits = _generate(ref, lengths, seed, new)
    got_tokens, got_logits = _generate(model, lengths, seed, new)
    assert not torch.equal(got_tokens, want_tokens) or (got_logits - want_logits).abs().max() > 5 * ATOL


class _UnknownAttention(transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention):
    """A DeepSeek-V3 attention defined outside transformers' DeepSeek-V3 file (as remote code would be)."""


def test_eager_offload_refuses_an_unknown_attention_code_before_allocating():
    model = _model("DeepseekV3Config")
    for layer in model.model.layers:
        layer.self_attn.__class__ = _UnknownAttention
    with pytest.raises(
        ValueError, match=r"cannot run _UnknownAttention eagerly: its attention code .*compile"
    ):
        torch_kvoffload.offload(model, {"layerwise": {}})
    assert not hasattr(model, "_kvoffload_session")


def test_glm5_cross_layer_topk_sharing_is_refused_before_allocating():
    """GLM-5 layers of ``indexer_types`` "shared" reuse the previous layer's top-k; the library's attention
    selects each layer's own (``offload`` and ``compile`` both refuse)."""
    model = _model("GlmMoeDsaConfig", **INDEXER, indexer_types=["full", "shared"])
    for wrap in (torch_kvoffload.offload, torch_kvoffload.compile):
        with pytest.raises(
            ValueError, match=r"GlmMoeDsaForCausalLM: layers \[1\] .*cross-layer top-k sharing"
        ):
            wrap(model, {"layerwise": {}})
        assert not hasattr(model, "_kvoffload_session")

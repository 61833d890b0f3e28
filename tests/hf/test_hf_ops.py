"""``kvoffload::mla_cache_write`` / ``mla_cache_attention``, the session behind them, the cache, the config."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import build_model

from torch_kvoffload import OffloadConfig
from torch_kvoffload.integrations.hf import OffloadSession, inspect_model
from torch_kvoffload.ops import mla_runtime
from torch_kvoffload.sparse.config import resolve_sparse_config


def _session(family="deepseek_v3", **cfg):
    """A session over a spec of a model the test does not keep: the spec holds its weights fingerprint."""
    model = build_model(family, num_hidden_layers=2)
    spec = inspect_model(model).with_weights(model)
    return spec, OffloadSession(spec, OffloadConfig(**cfg))


def test_layerwise_session_needs_the_weights_fingerprint():
    model = build_model("deepseek_v3", num_hidden_layers=2)
    spec = inspect_model(model)
    assert spec.weights_fingerprint == ""  # inspecting reads no weight
    with pytest.raises(ValueError, match=r"no weights_fingerprint.*with_weights\(model\)"):
        OffloadSession(spec, OffloadConfig(layerwise={}, block_size=4))
    # nothing was registered: a session over the fingerprinted spec works
    s = OffloadSession(spec.with_weights(model), OffloadConfig(layerwise={}, block_size=4))
    s.begin_forward(torch.randint(3, 1000, (1, 5)), None, past=0)
    s.abort_forward()
    s.close()


def _dense_reference(q_nope, q_pe, kv_c, k_pe, positions, scale):
    """Per query ``t`` at logical position ``positions[t]``: softmax over keys ``0..positions[t]``."""
    out = torch.zeros_like(q_nope)
    for t, p in enumerate(positions):
        s = (q_nope[t] @ kv_c[: p + 1].T + q_pe[t] @ k_pe[: p + 1].T) * scale  # [H, p+1]
        out[t] = torch.softmax(s, dim=-1) @ kv_c[: p + 1]
    return out


@pytest.mark.parametrize("cfg", [{"layerwise": {}}, {"layerwise": {"num_shared_buffers": 1}}])
def test_dense_attention_over_layer_buffers_matches_reference(cfg):
    """Two forwards (prefill with left padding, then a 3-token chunk) through both ops; the attention
    equals a dense causal softmax over the rows written so far."""
    spec, s = _session(**cfg, block_size=4)
    g = torch.Generator().manual_seed(0)
    Dc, Dr, H = spec.kv_lora_rank, spec.rope_dim, spec.num_heads
    lens = [7, 5]
    mask = torch.tensor([[1] * 7, [0, 0] + [1] * 5])
    history = [[torch.empty(0, Dc), torch.empty(0, Dr)] for _ in lens]
    past = 0
    for step, S in enumerate([7, 3]):
        ids = torch.randint(3, 1000, (2, S), generator=g)
        m = mask if step == 0 else torch.cat([mask, torch.ones(2, S, dtype=torch.int64)], dim=1)
        s.begin_forward(ids, m, past=past)
        real = m[:, past:].bool()
        for layer in range(spec.num_layers):
            caches = s.layer_caches(layer)
            kv_c, k_pe = torch.randn(2, S, Dc, generator=g), torch.randn(2, S, Dr, generator=g)
            torch.ops.kvoffload.layer_wait(s.layerwise_runtime, layer, caches)
            mla_runtime.mla_cache_write(s.name, layer, kv_c, k_pe, None, caches)
            torch.ops.kvoffload.layer_save(s.layerwise_runtime, layer, caches)
            qn, qp = torch.randn(2, S, H, Dc, generator=g), torch.randn(2, S, H, Dr, generator=g)
            out = torch.full((2, S, H, Dc), float("nan"))
            mla_runtime.mla_cache_attention(s.name, layer, qn, qp, None, None, spec.scale, out, caches)
            if layer == 0:
                for b in range(2):
                    hc = torch.cat([history[b][0], kv_c[b][real[b]]])
                    hp = torch.cat([history[b][1], k_pe[b][real[b]]])
                    history[b] = [hc, hp]
                    n_old = hc.shape[0] - int(real[b].sum())
                    pos = list(range(n_old, hc.shape[0]))
                    want = _dense_reference(qn[b][real[b]], qp[b][real[b]], hc, hp, pos, spec.scale)
                    torch.testing.assert_close(out[b][real[b]], want, rtol=1e-5, atol=1e-5)
                    assert torch.all(out[b][~real[b]] == 0)
        s.end_forward()
        past += S
    assert s.stats()["layer_loads"] > 0  # the second forward loaded the first one's full blocks
    s.close()


def test_opcheck_and_compile():
    spec, s = _session("deepseek_v32", sparse={}, block_size=4)
    g = torch.Generator().manual_seed(1)
    B, S = 1, 6
    s.begin_forward(torch.randint(3, 1000, (B, S), generator=g), None, past=0)
    Dc, Dr, H, Hi, Di = (
        spec.kv_lora_rank,
        spec.rope_dim,
        spec.num_heads,
        spec.index_n_heads,
        spec.index_head_dim,
    )
    caches = s.layer_caches(0)
    kv_c, k_pe = torch.randn(B, S, Dc, generator=g), torch.randn(B, S, Dr, generator=g)
    idx_k = torch.randn(B, S, Di, generator=g)
    torch.library.opcheck(torch.ops.kvoffload.mla_cache_write.default, (s.name, 0, kv_c, k_pe, idx_k, caches))
    qn, qp = torch.randn(B, S, H, Dc, generator=g), torch.randn(B, S, H, Dr, generator=g)
    iq, iw = torch.randn(B, S, Hi, Di, generator=g), torch.rand(B, S, Hi, generator=g)
    out = torch.empty(B, S, H, Dc)
    args = (s.name, 0, qn, qp, iq, iw, spec.scale, out, caches)
    torch.library.opcheck(torch.ops.kvoffload.mla_cache_attention.default, args)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def layer(kv_c, k_pe, idx_k, qn, qp, iq, iw):
        mla_runtime.mla_cache_write(s.name, 1, kv_c, k_pe, idx_k, s.layer_caches(1))
        o = torch.empty_like(qn)
        mla_runtime.mla_cache_attention(s.name, 1, qn, qp, iq, iw, spec.scale, o, s.layer_caches(1))
        return o * 2

    got = layer(kv_c, k_pe, idx_k, qn, qp, iq, iw)
    # eager run of the same layer: the same (prefill attends over this forward's rows)
    mla_runtime.mla_cache_write(s.name, 1, kv_c, k_pe, idx_k, s.layer_caches(1))
    want = torch.empty_like(qn)
    mla_runtime.mla_cache_attention(s.name, 1, qn, qp, iq, iw, spec.scale, want, s.layer_caches(1))
    torch.testing.assert_close(got, want * 2)
    s.end_forward()
    s.close()


def test_ops_validate_before_calling_the_runtime():
    spec, s = _session(layerwise={}, block_size=4)
    s.begin_forward(torch.randint(3, 1000, (1, 4)), None, past=0)
    caches = s.layer_caches(0)
    Dc, Dr = spec.kv_lora_rank, spec.rope_dim
    with pytest.raises(ValueError, match=r"mla_cache_write.*share B,S"):
        mla_runtime.mla_cache_write(s.name, 0, torch.randn(1, 4, Dc), torch.randn(1, 3, Dr), None, caches)
    with pytest.raises(ValueError, match=r"mla_cache_write.*'kv_c' / 'k_pe' must be"):
        mla_runtime.mla_cache_write(s.name, 0, torch.randn(1, 4, Dc + 1), torch.randn(1, 4, Dr), None, caches)
    with pytest.raises(KeyError, match="no MLA cache runtime named 'nope'"):
        mla_runtime.mla_cache_write("nope", 0, torch.randn(1, 4, Dc), torch.randn(1, 4, Dr), None, caches)
    q = torch.randn(1, 4, spec.num_heads, Dc)
    with pytest.raises(ValueError, match="'out' must be"):
        mla_runtime.mla_cache_attention(
            s.name,
            0,
            q,
            torch.randn(1, 4, spec.num_heads, Dr),
            None,
            None,
            1.0,
            torch.empty(1, 4, 1, Dc),
            caches,
        )
    with pytest.raises(ValueError, match="layer must be an int"):
        s.layer_caches(5)
    s.end_forward()
    s.close()


def test_cache_placeholders_hold_nothing_and_report_the_length():
    spec, s = _session(layerwise={}, block_size=4)
    cache = s.new_cache()
    k, v = torch.randn(2, 1, 3, spec.kv_lora_rank), torch.randn(2, 1, 3, spec.rope_dim)

    # only a graph Dynamo traces reads the placeholders (tests/hf/test_hf_safety.py: eagerly they raise)
    @torch.compile(backend="eager", fullgraph=True)
    def update(k, v):
        keys, values = cache.update(k, v, 0)
        return keys, values, cache.layers[0].keys.shape[2]

    keys, values, stored = update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v) and stored == 0
    cache.seen_tokens = 5
    assert cache.get_seq_length() == 5 and cache.get_mask_sizes(2, 1) == (7, 0)
    keys, _, _ = update(k, v)
    assert keys.shape[2] == 3  # nothing was stored
    s.close()


def test_offload_config_forms_and_errors():
    cfg = OffloadConfig.model_validate({"layerwise": {"num_shared_buffers": 3}, "sparse": {"capacity": 64}})
    assert cfg.layerwise.num_shared_buffers == 3 and cfg.sparse.given() == {"capacity": 64}
    assert cfg.sparse.offload is True
    text = '{"layerwise": {"num_shared_buffers": 3}, "sparse": {"capacity": 64}}'
    assert OffloadConfig.model_validate_json(text) == cfg
    assert OffloadConfig.model_validate_json(cfg.model_dump_json(exclude_unset=True)) == cfg
    assert cfg.resolved_block_size == 128
    spec = inspect_model(build_model("deepseek_v32", num_hidden_layers=2))
    full = resolve_sparse_config(cfg.sparse, spec, block_size=cfg.resolved_block_size, host_pool_blocks=10)
    assert (full.top_k, full.capacity, full.host_pool_blocks, full.kv_dtype) == (
        spec.index_topk,
        64,
        10,
        "fp32",
    )
    with pytest.raises(ValueError, match="unknown fields \\['topk'\\]"):
        OffloadConfig(sparse={"topk": 4})
    with pytest.raises(ValueError, match="capacity 4 is smaller than top_k 8"):
        OffloadConfig(sparse={"top_k": 8, "capacity": 4})
    with pytest.raises(ValueError, match=r"block_size 16 and sparse\.block_size 32 differ"):
        OffloadConfig(sparse={"block_size": 32}, block_size=16)
    with pytest.raises(ValueError, match="nothing is enabled"):
        OffloadConfig()
    with pytest.raises(ValueError, match="main KV dtype 'int8'"):
        OffloadConfig(sparse={"kv_dtype": "int8"})


def test_model_spec_describes_the_attention():
    spec = inspect_model(build_model("deepseek_v32", num_hidden_layers=2))
    assert (spec.num_layers, spec.kv_lora_rank, spec.rope_dim, spec.num_heads) == (2, 64, 16, 4)
    assert spec.has_indexer and (spec.index_topk, spec.index_head_dim, spec.index_n_heads) == (8, 32, 32)
    assert math.isclose(spec.scale, (32 + 16) ** -0.5)
    assert [m.layer_idx for m in spec.attention_modules] == [0, 1]
    v3 = inspect_model(build_model("deepseek_v3", num_hidden_layers=2))
    assert not v3.has_indexer and v3.fingerprint != spec.fingerprint


def test_a_taken_registry_name_leaves_nothing_registered():
    model = build_model("deepseek_v3", num_hidden_layers=2)
    spec = inspect_model(model).with_weights(model)
    first = OffloadSession(spec, OffloadConfig(layerwise={}, block_size=4), name="taken")
    before = mla_runtime.runtimes.names()
    with pytest.raises(ValueError, match="taken"):
        OffloadSession(spec, OffloadConfig(layerwise={}, block_size=4), name="taken")
    assert mla_runtime.runtimes.names() == before and mla_runtime.runtimes.get("taken") is first.core
    first.close()
    assert "taken" not in mla_runtime.runtimes.names()

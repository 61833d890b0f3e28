"""End to end on tiny random Hugging Face models: ``offload(model, config)`` then ``model.generate``.

The reference is the unmodified model (same seed, same dtype) generating from the same left-padded batch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import build_model, indexer_boundary_ties, left_padded_batch

import torch_kvoffload
from torch_kvoffload import OffloadConfig
from torch_kvoffload.integrations.hf import session_of

NEW = 32
LENGTHS = [20, 13]
BS = 8
L = 4  # layers of the tiny models


def _generate(model, ids, mask, new=NEW):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)


@pytest.fixture(autouse=True)
def _no_grad():
    """Forwards run without autograd (with autograd on, an offloaded forward refuses a backward: test_hf_safety.py)."""
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def batch():
    return left_padded_batch(LENGTHS, seed=0)


@pytest.fixture(scope="module")
def reference(batch):
    ids, mask = batch
    out = {fam: _generate(build_model(fam), ids, mask) for fam in ("deepseek_v3", "deepseek_v32")}
    # token equality needs a top-k the reference does not pick by tie-breaking
    rows = [out["deepseek_v32"][b][mask[b].bool().tolist() + [True] * NEW] for b in range(len(LENGTHS))]
    assert indexer_boundary_ties(build_model("deepseek_v32"), rows) == 0
    return out


CASES = {
    "v3-layerwise": ("deepseek_v3", {"layerwise": {}}),
    "v32-layerwise": ("deepseek_v32", {"layerwise": {}}),
    "v32-sparse": ("deepseek_v32", {"sparse": {}}),
    "v32-both": ("deepseek_v32", {"layerwise": {}, "sparse": {}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_unmodified_model(case, batch, reference, monkeypatch):
    family, cfg = CASES[case]
    ids, mask = batch
    model = torch_kvoffload.offload(build_model(family), OffloadConfig(**cfg, block_size=BS))
    hooks = []  # (layer, whether the forward runs the layerwise pipeline) of every layerwise hook call
    lw = session_of(model).core.backends.layerwise
    if lw is not None:
        wait = lw.wait_layer
        monkeypatch.setattr(
            lw, "wait_layer", lambda layer, caches=None: (hooks.append(lw._pass), wait(layer, caches))
        )
    got = _generate(model, ids, mask)
    assert torch.equal(got, reference[family])
    s = torch_kvoffload.stats(model)
    assert s["device_kv_bytes"] > 0 and s["forwards"] == NEW
    if "sparse" in cfg:
        assert s["decode_forwards"] == NEW - 1 and s["misses"] > 0 and s["hits"] > 0
    if "layerwise" in cfg:
        assert s["layer_saves"] > 0
        # the hooks run in the forwards with the layerwise pipeline only: with sparse, the prompt's alone
        assert len(hooks) == L * (1 if "sparse" in cfg else NEW) and all(p is not None for p in hooks)
    session_of(model).close()


def test_eager_attention_implementation(batch):
    """The reference is HF's eager attention this time (the default elsewhere is sdpa)."""
    ids, mask = batch
    want = _generate(build_model("deepseek_v32", attn_implementation="eager"), ids, mask, new=16)
    model = torch_kvoffload.offload(
        build_model("deepseek_v32", attn_implementation="eager"),
        {"layerwise": {}, "sparse": {}, "block_size": BS},
    )
    assert torch.equal(_generate(model, ids, mask, new=16), want)


def test_default_config_and_single_forward_logits(batch):
    """config=None: layerwise + sparse on V32; one padded forward's logits match at the real positions."""
    ids, mask = batch
    ref = build_model("deepseek_v32")
    model = torch_kvoffload.offload(build_model("deepseek_v32"))
    session = session_of(model)
    assert session.layerwise_on and session.sparse_on and session.block_size == 128
    want = ref(input_ids=ids, attention_mask=mask).logits
    got = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)


def test_bf16_tracks_unmodified_model_as_closely_as_hf_kernels_track_each_other(batch):
    """In bf16 no two attention kernels give identical greedy tokens for long (HF's own eager and sdpa
    diverge too): the offloaded model's first-forward logits must be as close to the sdpa model's as the
    eager model's are (within 2x), and the first generated tokens equal."""
    ids, mask = batch
    real = mask.bool()
    sdpa = build_model("deepseek_v32", dtype=torch.bfloat16)
    eager = build_model("deepseek_v32", dtype=torch.bfloat16, attn_implementation="eager")
    model = torch_kvoffload.offload(
        build_model("deepseek_v32", dtype=torch.bfloat16), {"layerwise": {}, "sparse": {}, "block_size": BS}
    )
    want = sdpa(input_ids=ids, attention_mask=mask).logits[real].float()
    hf_gap = (eager(input_ids=ids, attention_mask=mask).logits[real].float() - want).abs().max()
    ours = model(input_ids=ids, attention_mask=mask).logits[real].float()
    assert (ours - want).abs().max() <= 2 * hf_gap + 1e-2
    got = _generate(model, ids, mask, new=4)
    assert torch.equal(got, _generate(sdpa, ids, mask, new=4))


def test_int8_indexer_runs_and_mostly_agrees(batch, reference):
    """The Hadamard + int8 indexer selects almost the same top-k as HF's floating indexer; the tokens
    are not guaranteed equal (a different selection changes the attention)."""
    ids, mask = batch
    model = torch_kvoffload.offload(
        build_model("deepseek_v32"), {"sparse": {"indexer_dtype": "int8"}, "block_size": BS}
    )
    got = _generate(model, ids, mask)
    want = reference["deepseek_v32"]
    assert got.shape == want.shape
    # the prompt is kept and the first generated token (one prefill over a short prompt) agrees
    assert torch.equal(got[:, : ids.shape[1] + 1], want[:, : ids.shape[1] + 1])
    s = torch_kvoffload.stats(model)
    assert s["hits"] + s["misses"] == (NEW - 1) * L * len(LENGTHS) * 8  # top-k 8, contexts > 8


def test_int8_topk_agreement():
    """Top-k overlap of the int8 indexer path with the floating one on the same keys: high, not total."""
    from torch_kvoffload.ops import hadamard_quant_int8, lightning_indexer, quant_lightning_indexer

    g = torch.Generator().manual_seed(0)
    T, H, D, S, K = 16, 8, 128, 256, 32
    q, k = torch.randn(T, H, D, generator=g), torch.randn(S, D, generator=g)
    w = torch.rand(T, H, generator=g)
    table = torch.arange(S // 16, dtype=torch.int32)[None]
    cu, lens = torch.tensor([0, T], dtype=torch.int32), torch.tensor([S], dtype=torch.int32)
    ref = lightning_indexer(q, w, k.view(S // 16, 16, D), table, cu, lens, K)
    q8, qs = hadamard_quant_int8(q)
    k8, ks = hadamard_quant_int8(k)
    got = quant_lightning_indexer(
        q8, qs, w, k8.view(S // 16, 16, D), ks.view(S // 16, 16), table, cu, lens, K
    )
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ref, got, strict=True)) / (T * K)
    assert overlap > 0.85


def _expected_layerwise_bytes(lengths, new, bs, record_bytes):
    """Loads: every forward after the first loads each request's full blocks of all but its newest token
    (the store keeps every full block); saves: each full block once."""
    loaded, lens = 0, list(lengths)
    for _ in range(new - 1):
        lens = [n + 1 for n in lens]
        loaded += sum((n - 1) // bs for n in lens)
    saved = sum(n // bs for n in lens)
    return loaded * L * record_bytes, saved * L * record_bytes


def test_stats_match_an_independent_count(batch):
    ids, mask = batch
    Dc, Dr, Di, f32 = 64, 16, 32, 4
    # layerwise on V3: physical buffers 1 independent + 2 shared; tails [B, bs] per layer
    model = torch_kvoffload.offload(build_model("deepseek_v3"), {"layerwise": {}, "block_size": BS})
    _generate(model, ids, mask)
    s = torch_kvoffload.stats(model)
    blocks = len(LENGTHS) * -(-(ids.shape[1] + NEW) // BS)
    assert s["device_kv_bytes"] == 3 * blocks * BS * (Dc + Dr) * f32 + L * len(LENGTHS) * BS * (Dc + Dr) * f32
    seen = ids.shape[1] + NEW - 1
    assert s["dense_kv_bytes"] == L * len(LENGTHS) * seen * (Dc + Dr) * f32
    h2d, d2h = _expected_layerwise_bytes(LENGTHS, NEW, BS, BS * Dc * f32 + BS * Dr * f32)
    assert (s["bytes_h2d"], s["bytes_d2h"]) == (h2d, d2h)
    # sparse on V32: every row goes to the host pool once; misses move one row each
    model = torch_kvoffload.offload(build_model("deepseek_v32"), {"sparse": {}, "block_size": BS})
    _generate(model, ids, mask)
    s = torch_kvoffload.stats(model)
    rows = sum(LENGTHS) + len(LENGTHS) * (NEW - 1)
    assert s["bytes_d2h"] == L * rows * (Dc + Dr) * f32
    assert s["bytes_h2d"] == s["misses"] * (Dc + Dr) * f32
    hot = L * len(LENGTHS) * 16 * (Dc + Dr) * f32  # capacity 2 x top-k 8
    # the indexer cache holds exactly each request's tokens
    assert s["device_kv_bytes"] == hot + L * len(LENGTHS) * seen * Di * f32
    assert s["dense_kv_bytes"] == L * len(LENGTHS) * seen * (Dc + Dr + Di) * f32
    assert s["device_kv_bytes"] < s["dense_kv_bytes"]


def test_prefix_reuse_loads_from_the_store():
    first, _ = left_padded_batch([24], seed=3)
    second = torch.cat([first[:, :16], left_padded_batch([9], seed=4)[0]], dim=1)  # shares 2 blocks
    ref = build_model("deepseek_v3")
    model = torch_kvoffload.offload(build_model("deepseek_v3"), {"layerwise": {}, "block_size": BS})
    assert torch.equal(_generate(model, first, None, new=8), _generate(ref, first, None, new=8))
    before = torch_kvoffload.stats(model)
    logits = model(input_ids=second).logits
    after = torch_kvoffload.stats(model)
    assert after["layer_loads"] - before["layer_loads"] == L
    assert after["bytes_h2d"] - before["bytes_h2d"] == 2 * L * BS * (64 + 16) * 4
    torch.testing.assert_close(logits, ref(input_ids=second).logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(_generate(model, second, None, new=8), _generate(ref, second, None, new=8))


def test_unsupported_models_are_rejected_before_allocation():
    from transformers import LlamaConfig, LlamaForCausalLM

    from torch_kvoffload.ops import layer_hooks, mla_runtime

    registered = (mla_runtime.runtimes.names(), layer_hooks.runtimes.names())
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
        )
    )
    forward = llama.forward
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*no MLA attention"):
        torch_kvoffload.offload(llama)
    assert llama.forward == forward and not hasattr(llama, "_kvoffload_session")
    v3 = build_model("deepseek_v3", num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM.*lightning indexer"):
        torch_kvoffload.offload(v3, {"sparse": {}})
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM.*KVPP"):
        torch_kvoffload.offload(v3, {"kvpp": {"enable_kvpp": True, "tp_size": 2}})
    v3.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM.*hybrid"):
        torch_kvoffload.offload(v3)
    assert (mla_runtime.runtimes.names(), layer_hooks.runtimes.names()) == registered
    assert not hasattr(v3, "_kvoffload_session")


def test_bad_forward_inputs_are_rejected():
    model = torch_kvoffload.offload(build_model("deepseek_v3", num_hidden_layers=2), {"layerwise": {}})
    ids = torch.randint(3, 100, (2, 6))
    with pytest.raises(ValueError, match=r"must hold 0 \(padding\) and 1"):
        model(input_ids=ids, attention_mask=torch.full((2, 6), 2))
    with pytest.raises(ValueError, match="input_ids"):
        model(inputs_embeds=torch.randn(2, 6))
    from transformers import DynamicCache

    with pytest.raises(ValueError, match="the cache must be the library's"):
        model(input_ids=ids, cache=DynamicCache())
    # a failed forward does not leave the session stuck: a fresh sequence works
    out = model(input_ids=ids)
    assert out.logits.shape == (2, 6, 1000)


@pytest.mark.parametrize("cfg", [{"sparse": {}}, {"layerwise": {}, "sparse": {}}, {"layerwise": {}}])
def test_chunked_prefill_matches_one_shot(cfg):
    """A prompt fed in two forwards gives the logits of one forward of the whole prompt (the second chunk
    reads the first chunk's KV from the host pool / the store + tail)."""
    prompt, _ = left_padded_batch([21], seed=5)
    ref = build_model("deepseek_v32")(input_ids=prompt).logits
    model = torch_kvoffload.offload(build_model("deepseek_v32"), {**cfg, "block_size": BS})
    session = session_of(model)
    session.reserve(1, 32)
    cache = session.new_cache()
    model(input_ids=prompt[:, :10], cache=cache)
    got = model(input_ids=prompt[:, 10:], cache=cache).logits
    torch.testing.assert_close(got, ref[:, 10:], rtol=1e-4, atol=1e-5)


def test_both_releases_layer_buffers_for_decode(batch, reference):
    """Layerwise + sparse: after prefill the device holds only the hot buffers and the indexer cache."""
    ids, mask = batch
    model = torch_kvoffload.offload(
        build_model("deepseek_v32"), {"layerwise": {}, "sparse": {}, "block_size": BS}
    )
    assert torch.equal(_generate(model, ids, mask), reference["deepseek_v32"])
    s = torch_kvoffload.stats(model)
    hot = L * len(LENGTHS) * 16 * (64 + 16) * 4
    assert s["device_kv_bytes"] == hot + L * len(LENGTHS) * (ids.shape[1] + NEW - 1) * 32 * 4
    # a multi-token forward after decode steps continues through the host pool
    cache = session_of(model).owner
    assert model(
        input_ids=torch.randint(3, 1000, (2, 3)),
        attention_mask=torch.cat(
            [mask, torch.ones(2, cache.seen_tokens - ids.shape[1] + 3, dtype=mask.dtype)], 1
        ),
        cache=cache,
    ).logits.shape == (2, 3, 1000)

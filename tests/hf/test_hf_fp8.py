"""DeepSeek's FP8 KV formats on Hugging Face DeepseekV32.

``sparse.indexer_dtype="fp8_e4m3"``: the indexer cache keeps FP8 rows (132 bytes a token for a 128-wide
head) and the top-k is selected from FP8 queries and keys, as DeepSeek's inference code selects it.
``sparse={"kv_dtype": "fp8_e4m3"}``: the latent KV is kept as FlashMLA's FP8 rows, in the host pool and hot
buffers of sparse offload or (``offload=False``) on the device, and attention reads them dequantized. References: the unmodified model with its indexer scoring so, and
with its latent KV passed through the FP8 row (``support.fp8_reference``, written independently of the
library); their logits differ visibly from the unmodified model's, so agreement shows the FP8 paths run."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

pytest.importorskip("transformers")
from support.fp8_reference import fp8_indexer, fp8_latent_kv
from support.hf_models import ONE_LAYER, SMALL, build_model, left_padded_batch

import torch_kvoffload
from torch_kvoffload.integrations.hf import session_of
from torch_kvoffload.ops.fp8 import index_row_bytes, kv_row_bytes

BS = 16
NEW = 8
DI = 128
# a 128-wide indexer head (FP8 rows quantise 128-wide groups); 16 heads keep exact score ties away
WIDTHS = {**SMALL, "index_head_dim": DI, "index_n_heads": 16, "index_topk": 16}
FP8 = {"indexer_dtype": "fp8_e4m3"}
DC = 128  # FP8 latent rows quantise 128-wide tiles
FP8_BOTH = {"offload": False, "kv_dtype": "fp8_e4m3", "indexer_dtype": "fp8_e4m3"}
# both formats in the host pool and hot buffers of sparse offload
FP8_OFFLOADED = {"kv_dtype": "fp8_e4m3", "indexer_dtype": "fp8_e4m3"}
LATENT = {"resident": FP8_BOTH, "offloaded": FP8_OFFLOADED}
MODES = {
    "sparse": {"sparse": FP8, "block_size": BS},
    "resident": {"sparse": {**FP8, "offload": False}, "block_size": BS},
    "layerwise-sparse": {"layerwise": {}, "sparse": FP8, "block_size": BS},
}


def _generate(model, ids, mask, new=NEW):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, return_dict_in_generate=True,
            output_logits=True,
        )  # fmt: skip


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits, strict=True))


@pytest.fixture(scope="module")
def reference():
    """``(model, ids, mask, FP8-indexer output)``; the unmodified model's own output differs from it."""
    model = build_model("deepseek_v32", **WIDTHS)
    ids, mask = left_padded_batch([70, 50], seed=3)
    with fp8_indexer():
        want = _generate(model, ids, mask)
    assert _max_diff(want, _generate(model, ids, mask)) > 1e-2
    return model, ids, mask, want


@pytest.mark.parametrize("mode", list(MODES))
def test_fp8_indexer_selects_as_deepseek_and_its_rows_are_reused_from_the_store(reference, mode):
    ref, ids, mask, want = reference
    model = torch_kvoffload.offload(copy.deepcopy(ref), MODES[mode])
    got = _generate(model, ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    assert _max_diff(got, want) < 1e-4
    # again: the prompts' full blocks come from the store (FP8 indexer rows as kept, byte for byte)
    before = torch_kvoffload.stats(model)
    again = _generate(model, ids, mask)
    after = torch_kvoffload.stats(model)
    assert after["prefix_store_tokens"] - before["prefix_store_tokens"] > 0
    assert after["persist_failures"] == 0
    assert torch.equal(again.sequences, want.sequences)
    assert _max_diff(again, want) < 1e-4


def test_the_indexer_cache_holds_132_bytes_a_token(reference):
    ref, ids, mask, _ = reference
    sizes = {}
    for fmt in ("bf16", "fp8_e4m3"):
        model = torch_kvoffload.offload(
            copy.deepcopy(ref), {"sparse": {"indexer_dtype": fmt}, "block_size": BS}
        )
        _generate(model, ids, mask, new=1)
        cache = session_of(model).core.backends.sparse.index
        tensors = [t for layer in cache.layers for t in layer]
        sizes[fmt] = sum(t.numel() * t.element_size() for t in tensors)
        per_token = sum(t[0, 0].numel() * t.element_size() for t in cache.layers[0])
        assert per_token == (index_row_bytes(DI) if fmt == "fp8_e4m3" else DI * 4)  # fp32 model
    assert sizes["fp8_e4m3"] * DI * 4 == sizes["bf16"] * index_row_bytes(DI)


def test_fp8_and_floating_records_never_mix_in_one_store(reference, monkeypatch):
    """Two models of the same weights on one store: one keeping FP8 indexer rows, one the model's keys.
    Each finds only the blocks of a model keeping its own format."""
    from torch_kvoffload.layerwise import prefix_store
    from torch_kvoffload.store.local import LocalKVStore

    ref, ids, mask, want = reference
    store = LocalKVStore(64 << 20)
    store.close = lambda: None
    monkeypatch.setattr(prefix_store, "build_store", lambda config: store)
    fp8_a = torch_kvoffload.offload(copy.deepcopy(ref), MODES["sparse"])
    fp8_b = torch_kvoffload.offload(copy.deepcopy(ref), MODES["sparse"])
    floating = torch_kvoffload.offload(copy.deepcopy(ref), {"sparse": {}, "block_size": BS})
    assert torch.equal(_generate(fp8_a, ids, mask).sequences, want.sequences)
    before = torch_kvoffload.stats(floating)["prefix_store_tokens"]
    _generate(floating, ids, mask)
    assert torch_kvoffload.stats(floating)["prefix_store_tokens"] == before
    got = _generate(fp8_b, ids, mask)
    assert torch_kvoffload.stats(fp8_b)["prefix_store_tokens"] > 0
    assert torch.equal(got.sequences, want.sequences) and _max_diff(got, want) < 1e-4


def test_fp8_latent_records_and_the_models_values_never_mix_in_one_store(latent_reference, monkeypatch):
    """On one store: a model keeping FP8 latent rows (offloaded) stores them; a model of the same weights
    keeping the model's latent values finds none of them, one keeping FP8 rows (resident) reuses them."""
    from torch_kvoffload.layerwise import prefix_store
    from torch_kvoffload.store.local import LocalKVStore

    ref, ids, mask, want = latent_reference
    store = LocalKVStore(64 << 20)
    store.close = lambda: None
    monkeypatch.setattr(prefix_store, "build_store", lambda config: store)
    offloaded = torch_kvoffload.offload(copy.deepcopy(ref), {"sparse": LATENT["offloaded"], "block_size": BS})
    floating = torch_kvoffload.offload(copy.deepcopy(ref), {"sparse": FP8, "block_size": BS})
    resident = torch_kvoffload.offload(copy.deepcopy(ref), {"sparse": LATENT["resident"], "block_size": BS})
    assert torch.equal(_generate(offloaded, ids, mask).sequences, want.sequences)
    _generate(floating, ids, mask)
    assert torch_kvoffload.stats(floating)["prefix_store_tokens"] == 0
    got = _generate(resident, ids, mask)
    assert torch_kvoffload.stats(resident)["prefix_store_tokens"] > 0
    assert torch.equal(got.sequences, want.sequences) and _max_diff(got, want) < 1e-4


def test_the_cache_refuses_to_give_fp8_rows_as_indexer_keys(reference):
    ref, ids, mask, _ = reference
    model = torch_kvoffload.offload(copy.deepcopy(ref), MODES["sparse"])
    out = _generate(model, ids, mask, new=2)
    with pytest.raises(RuntimeError, match="fp8_e4m3"):
        _ = out.past_key_values.layers[0].indexer_keys
    assert out.past_key_values.layers[0].keys.shape[2] == ids.shape[1] + 1  # the latent KV reads fine


def test_fp8_indexer_configurations_refused_by_name():
    narrow = build_model("deepseek_v32", **{**SMALL, "index_head_dim": 32})
    with pytest.raises(ValueError, match="index_head_dim=32"):
        torch_kvoffload.offload(narrow, {"sparse": FP8})
    with pytest.raises(ValueError, match="policy 'score'"):
        torch_kvoffload.OffloadConfig(sparse={**FP8, "policy": "score"})


@pytest.mark.parametrize("fmt", ["layerwise-offloaded", "resident"])
def test_a_compiled_model_reads_fp8_rows_call_after_call(fmt):
    """Both formats compiled: through layerwise prefill's buffers and sparse offload's decode steps (host
    pool and hot buffers of FP8 rows), and on the resident KV."""
    widths = {k: WIDTHS[k] for k in ("index_head_dim", "index_n_heads", "index_topk")}
    ref = build_model("deepseek_v32", **{**ONE_LAYER, **widths, "kv_lora_rank": DC})
    if fmt == "resident":
        config = {"sparse": FP8_BOTH, "block_size": BS}
    else:
        config = {"layerwise": {}, "sparse": FP8_OFFLOADED, "block_size": BS}
    model = torch_kvoffload.compile(copy.deepcopy(ref), config)
    differs = []
    for lengths in ([40, 30], [52, 20]):
        ids, mask = left_padded_batch(lengths, seed=len(lengths) + lengths[0])
        with fp8_indexer(), fp8_latent_kv(ref):
            want = _generate(ref, ids, mask, new=3)
        got = _generate(model, ids, mask, new=3)
        assert torch.equal(got.sequences, want.sequences)
        assert _max_diff(got, want) < 1e-4
        differs.append(_max_diff(want, _generate(ref, ids, mask, new=3)) > 1e-2)
    assert any(differs)


@pytest.mark.parametrize("mode", ["offloaded-indexer", "offloaded", "resident"])
def test_continuous_batching_sizes_requests_by_the_fp8_rows_and_selects_with_them(mode, latent_reference):
    """CB over the FP8 indexer cache (sparse offload) and over both FP8 formats (sparse offload's hot buffers,
    the resident KV): the reference's tokens, and each request's device bytes smaller by exactly the rows'
    difference."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    ref = latent_reference[0]
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=999_999, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=8, max_batch_tokens=32, max_requests_per_batch=4)
    serving = {"max_requests": 3, "max_request_tokens": 96}
    prompts = [
        torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (40, 25, 33)
    ]
    resident, latent = mode == "resident", mode != "offloaded-indexer"
    with fp8_indexer(), fp8_latent_kv(ref) if latent else contextlib.nullcontext():
        want = [ref.generate(torch.tensor([p]), generation_config=gen)[0, len(p) :].tolist() for p in prompts]
    per = {}
    for fp8 in (False, True):
        sparse = ({"offload": False} if resident else {}) | ((LATENT.get(mode, FP8)) if fp8 else {})
        model = torch_kvoffload.offload(
            copy.deepcopy(ref), {"sparse": sparse, "block_size": 8, "serving": serving}
        )
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        assert all(out[rid].error is None for rid in out)
        got = [list(out[rid].generated_tokens) for rid in sorted(out, key=lambda r: int(r.rsplit("_", 1)[1]))]
        if fp8:
            assert got == want
        per[fp8] = session_of(model).serving.device_bytes_per_request
    # every layer, max_request_tokens rows: 132 bytes instead of 128 fp32 indexer values, and 148 bytes
    # instead of 128 + 8 fp32 latent and RoPE values: every row resident, or the hot buffers' rows (capacity
    # 2 x index_topk) offloaded
    tokens, row = serving["max_request_tokens"], DC + SMALL["qk_rope_head_dim"]
    saved = tokens * (DI * 4 - index_row_bytes(DI))
    if latent:
        rows = tokens if resident else 2 * WIDTHS["index_topk"]
        saved += rows * (row * 4 - kv_row_bytes(DC, SMALL["qk_rope_head_dim"]))
    assert per[False] - per[True] == ref.config.num_hidden_layers * saved


@pytest.fixture(scope="module")
def latent_reference():
    """``(model, ids, mask, output with FP8 latent rows and FP8 indexer)`` of a V3.2 with kv_lora_rank 128."""
    model = build_model("deepseek_v32", **{**WIDTHS, "kv_lora_rank": DC})
    ids, mask = left_padded_batch([70, 50], seed=4)
    with fp8_indexer(), fp8_latent_kv(model):
        want = _generate(model, ids, mask)
    with fp8_indexer():
        assert _max_diff(want, _generate(model, ids, mask)) > 1e-2  # the latent rows' rounding shows
    return model, ids, mask, want


@pytest.mark.parametrize("mode", ["resident", "offloaded"])
def test_the_latent_kv_kept_as_fp8_rows_is_read_dequantized_call_after_call(latent_reference, mode):
    ref, ids, mask, want = latent_reference
    model = torch_kvoffload.offload(copy.deepcopy(ref), {"sparse": LATENT[mode], "block_size": BS})
    for call in range(2):
        before = torch_kvoffload.stats(model)["prefix_store_tokens"]
        got = _generate(model, ids, mask)
        assert torch.equal(got.sequences, want.sequences)
        assert _max_diff(got, want) < 1e-4
        # the second call takes the prompts' full blocks from the store: the FP8 rows as kept
        assert (torch_kvoffload.stats(model)["prefix_store_tokens"] > before) == (call == 1)
    with pytest.raises(RuntimeError, match="FP8 rows"):
        _ = got.past_key_values.layers[0].keys
    # a token of the main KV: 128 fp8 values, one fp32 scale, 8 bf16 RoPE values (fp32 model: 136 x 4 bytes)
    row = kv_row_bytes(DC, SMALL["qk_rope_head_dim"])
    assert row == 148
    backend = session_of(model).core.backends.sparse
    if mode == "resident":
        (rows,) = backend.main.layers[0]
        assert rows.dtype == torch.uint8 and rows.shape[-1] == row
    else:  # the host pool and the hot buffers hold the rows; a miss moves one row's bytes
        rt = backend.runtime
        for t in (rt.pool.kv_c(0), rt.hot_kv_c[0]):
            assert t.dtype == torch.uint8 and t.shape[-1] == row
        assert rt.pool.k_pe(0).shape[-1] == rt.hot_k_pe[0].shape[-1] == 0
        pool, layers = rt.pool, ref.config.num_hidden_layers
        kept = sum(pool.kv_c(layer).numel() for layer in range(layers))
        assert kept == layers * pool.num_blocks * pool.block_size * row  # bytes: uint8
        assert pool.nbytes < kept + 4096  # and nothing else (the k_pe part after a page-aligned kv_c part)
        s = torch_kvoffload.stats(model)
        # decode steps move their misses' rows, the second call's prompt reads its stored prefix's rows
        prefill = backend.counters.snapshot()["prefill_host_bytes_h2d"]
        assert s["misses"] > 0 and s["bytes_h2d"] - prefill == s["misses"] * row
        assert prefill > 0 and prefill % row == 0
    # beams fork the requests' FP8 rows (another shape too)
    short, short_mask = ids[1:, 20:], mask[1:, 20:]
    with fp8_indexer(), fp8_latent_kv(ref), torch.no_grad():
        want_beams = ref.generate(
            short, attention_mask=short_mask, max_new_tokens=3, num_beams=2, do_sample=False
        )
    with torch.no_grad():
        got_beams = model.generate(
            short, attention_mask=short_mask, max_new_tokens=3, num_beams=2, do_sample=False
        )
    assert torch.equal(got_beams, want_beams)


@pytest.mark.parametrize("mode", ["resident", "offloaded"])
def test_layerwise_prefill_keeps_the_fp8_latent_rows_in_its_buffers_and_store(latent_reference, mode):
    """Layerwise prefill over FP8 latent rows and FP8 indexer rows: its layer buffers, tails and store records
    hold the rows the resident KV / host pool and the indexer cache hold (quantized once), the prompt's
    attention reads them dequantized, the second call loads the prompts' full blocks from the store as kept,
    and the blocks decoding completed are stored too."""
    ref, ids, mask, want = latent_reference
    model = torch_kvoffload.offload(
        copy.deepcopy(ref), {"layerwise": {}, "sparse": LATENT[mode], "block_size": BS}
    )
    lw = session_of(model).core.backends.layerwise
    assert lw.parts == ("kv_c", "index_k")  # the RoPE values inside the latent rows
    layers, row = ref.config.num_hidden_layers, kv_row_bytes(DC, SMALL["qk_rope_head_dim"])
    for call in range(2):
        before = lw.stats()
        got = _generate(model, ids, mask)
        after = lw.stats()
        assert torch.equal(got.sequences, want.sequences)
        assert _max_diff(got, want) < 1e-4
        saved, hits = after["bytes_d2h"] - before["bytes_d2h"], after["store_hits"] - before["store_hits"]
        # a block record: per layer 16 FP8 latent rows and 16 FP8 indexer rows
        assert saved % (layers * BS * (row + index_row_bytes(DI))) == 0
        assert torch_kvoffload.stats(model)["persist_failures"] == 0
        assert (saved > 0, hits > 0) == ((True, False) if call == 0 else (False, True))
    # a longer generation completes a block while decoding (width 70 + 12): stored when the sequence ends,
    # both formats as the caches keep them
    _generate(model, ids, mask, new=12)
    session_of(model).end_sequence()
    s = torch_kvoffload.stats(model)
    assert s["persisted_blocks"] > 0 and s["persist_failures"] == 0
    lw.rebuild(session_of(model).core.layout)
    comps = lw.runtime.layer_caches(0)
    assert [(c.dtype, c.shape[-1]) for c in comps] == [(torch.uint8, row), (torch.uint8, index_row_bytes(DI))]


def test_fp8_latent_rows_are_refused_where_they_cannot_be_kept():
    narrow = build_model("deepseek_v32", **WIDTHS)  # kv_lora_rank 32
    for sparse in (FP8_BOTH, FP8_OFFLOADED):
        with pytest.raises(ValueError, match="kv_lora_rank=32"):
            torch_kvoffload.offload(copy.deepcopy(narrow), {"sparse": sparse})
    assert torch_kvoffload.OffloadConfig(sparse=FP8_BOTH).prefix_store_config is not None  # stored as kept
    assert torch_kvoffload.OffloadConfig(sparse={"indexer_dtype": "int8"}).prefix_store_config is None
    assert torch_kvoffload.OffloadConfig(sparse=FP8).prefix_store_config is not None


@pytest.mark.parametrize("mode", ["resident", "offloaded"])
def test_attention_probabilities_read_the_fp8_rows_they_selected(mode):
    """``output_attentions`` over the FP8 rows (resident, or the hot buffers' rows a decode step read): the
    unmodified eager model's probabilities with its latent KV and indexer passed through the FP8 formats."""
    ref = build_model("deepseek_v32", attn_implementation="eager", **{**WIDTHS, "kv_lora_rank": DC})
    ids, mask = left_padded_batch([30, 22], seed=5)

    def run(model):
        with torch.no_grad():
            return model.generate(
                ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                output_attentions=True,
            )  # fmt: skip

    with fp8_latent_kv(ref), fp8_indexer():
        want = run(ref)
    got = run(torch_kvoffload.offload(copy.deepcopy(ref), {"sparse": LATENT[mode], "block_size": BS}))
    assert torch.equal(got.sequences, want.sequences)
    for step_got, step_want in zip(got.attentions, want.attentions, strict=True):
        for a, b in zip(step_got, step_want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

"""``sparse={"offload": "auto"}`` on Hugging Face DeepseekV32: requests resident while their latent KV fits
in the device budget, spilled to the host pool when it does not, promoted back when space frees.

References: the unmodified model's ``generate`` and the same model with the whole KV resident
(``offload=False``, itself checked against the unmodified model elsewhere); the tokens never depend on
where a row lives. Budgets are placed between the offloaded footprint (hot buffers, indexer cache) and the
pool every request fully resident would take, read from ``stats()`` of a run with room for everything."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

pytest.importorskip("transformers")
from support.hf_models import SMALL, build_model, left_padded_batch
from transformers import GenerationConfig

import torch_kvoffload
from torch_kvoffload.integrations.hf import session_of
from torch_kvoffload.sparse.hybrid_backend import HybridSparseBackend
from torch_kvoffload.sparse.hybrid_moves import PromotionLanding

BS = 16
NEW = 30
# a top-k of 4: hot buffers (8 rows) far smaller than a request's rows, as at production lengths
WIDTHS = {**SMALL, "index_n_heads": 8, "index_topk": 4}
# generate() kwargs of each sequence shape: plain batch, beams (forks, ended beams), sampled forks
SHAPES = {
    "batch": {},
    "beams": {"num_beams": 2},
    "forks": {"num_return_sequences": 2, "do_sample": True, "top_k": 1},
}


@pytest.fixture(scope="module")
def ref():
    model = build_model("deepseek_v32", **WIDTHS)
    ids, mask = left_padded_batch([70, 50, 33], seed=3)
    return model, ids, mask


def _generate(model, ids, mask, new: int = NEW, **kw):
    kw.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, **kw)


def _auto(extra: dict, budget: int) -> dict:
    sparse = {**extra.get("sparse", {}), "offload": "auto"}
    return {**extra, "sparse": sparse, "block_size": BS, "serving": {"device_kv_budget": budget}}


def _budgets(model, ids, mask, extra: dict, fractions, **kw) -> list[int]:
    """Budgets holding the offloaded footprint plus ``fractions`` of the pool of every request resident."""
    roomy = torch_kvoffload.offload(copy.deepcopy(model), _auto(extra, 1 << 40))
    _generate(roomy, ids, mask, **kw)
    st = torch_kvoffload.stats(roomy)
    assert st["spills"] == st["started_offloaded"] == 0 and st["offloaded_requests"] == 0
    return [int(st["offloaded_kv_bytes"] + f * st["resident_kv_bytes_wanted"]) for f in fractions]


def _budget_where(model, ids, mask, counter: str, **kw) -> int:
    """The largest budget of a few tried at which a run counts ``counter`` (e.g. a spill mid-generation)."""
    fractions = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
    for budget in _budgets(model, ids, mask, {}, fractions, **kw):
        probe = torch_kvoffload.offload(copy.deepcopy(model), _auto({}, budget))
        _generate(probe, ids, mask, **kw)
        if torch_kvoffload.stats(probe)[counter]:
            return budget
    raise AssertionError(f"no budget tried counts {counter}")


@pytest.mark.parametrize(
    ("shape", "extra"),
    [("batch", {}), ("beams", {}), ("forks", {}), ("batch", {"layerwise": {}})],
    ids=["batch", "beams", "forks", "layerwise-batch"],
)
def test_tokens_equal_the_resident_run_through_spills_and_promotions(ref, shape, extra) -> None:
    model, ids, mask = ref
    kw = SHAPES[shape]
    resident = torch_kvoffload.offload(
        copy.deepcopy(model), {**extra, "sparse": {"offload": False}, "block_size": BS}
    )
    want = _generate(resident, ids, mask, **kw)
    if shape == "batch" and not extra:
        assert torch.equal(want, _generate(model, ids, mask, **kw)), (
            "the resident run is the unmodified model's"
        )
    moved = {"spills": 0, "started_offloaded": 0, "promotions": 0}
    for budget in _budgets(model, ids, mask, extra, (0.2, 0.0), **kw):
        auto = torch_kvoffload.offload(copy.deepcopy(model), _auto(extra, budget))
        assert torch.equal(_generate(auto, ids, mask, **kw), want)
        assert torch.equal(_generate(auto, ids, mask, **kw), want), "a second call (prefix reuse) too"
        st = torch_kvoffload.stats(auto)
        assert st["prefix_store_tokens"] > 0, "the second call took its prompts' blocks from the store"
        assert st["device_kv_bytes"] <= budget
        assert st["spill_failures"] == st["promote_failures"] == 0
        assert st["resident_requests"] + st["offloaded_requests"] == st["reserved_requests"] > 0
        for k in moved:
            moved[k] += st[k]
        if st["spills"]:
            assert st["spill_bytes_d2h"] > 0
    assert moved["spills"] + moved["started_offloaded"] > 0, moved
    if shape == "beams":  # ended beams free blocks: offloaded beams are promoted
        assert moved["promotions"] > 0, moved
    else:
        assert moved["spills"] > 0, f"no request was spilled mid-generation: {moved}"


def test_fp8_rows_in_both_tiers() -> None:
    widths = {**SMALL, "kv_lora_rank": 128, "index_head_dim": 128, "index_n_heads": 16, "index_topk": 4}
    model = build_model("deepseek_v32", **widths)
    ids, mask = left_padded_batch([70, 50, 33], seed=5)
    fp8 = {"sparse": {"kv_dtype": "fp8_e4m3", "indexer_dtype": "fp8_e4m3"}}
    resident = torch_kvoffload.offload(
        copy.deepcopy(model), {"sparse": {**fp8["sparse"], "offload": False}, "block_size": BS}
    )
    want = _generate(resident, ids, mask)
    (budget,) = _budgets(model, ids, mask, fp8, (0.1,))
    auto = torch_kvoffload.offload(copy.deepcopy(model), _auto(fp8, budget))
    assert torch.equal(_generate(auto, ids, mask), want)
    st = torch_kvoffload.stats(auto)
    assert st["spills"] + st["started_offloaded"] > 0 and st["resident_requests"] > 0
    sp = session_of(auto).core.backends.sparse
    assert isinstance(sp, HybridSparseBackend) and sp.blocks.layers[0][0].dtype == torch.uint8
    # beams: FP8 rows spilled, and promoted back layer by layer as beams end
    want = _generate(resident, ids, mask, num_beams=2)
    (budget,) = _budgets(model, ids, mask, fp8, (0.3,), num_beams=2)
    beams = torch_kvoffload.offload(copy.deepcopy(model), _auto(fp8, budget))
    assert torch.equal(_generate(beams, ids, mask, num_beams=2), want)
    st = torch_kvoffload.stats(beams)
    assert st["spills"] > 0 and st["promotions"] > 0 and st["promote_failures"] == 0, st


def test_a_failed_spill_or_promotion_fails_the_call_and_the_next_call_runs(ref, monkeypatch) -> None:
    model, ids, mask = ref
    resident = torch_kvoffload.offload(copy.deepcopy(model), {"sparse": {"offload": False}, "block_size": BS})
    want = _generate(resident, ids, mask)
    budget = _budget_where(model, ids, mask, "spills")
    auto = torch_kvoffload.offload(copy.deepcopy(model), _auto({}, budget))
    real = HybridSparseBackend._to_host
    calls = {"n": 0}

    def failing(self, rid, upto):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("injected: the host pool copy failed")
        return real(self, rid, upto)

    monkeypatch.setattr(HybridSparseBackend, "_to_host", failing)
    with pytest.raises(OSError, match="injected"):
        _generate(auto, ids, mask)
    assert torch_kvoffload.stats(auto)["spill_failures"] == 1
    assert torch.equal(_generate(auto, ids, mask), want)
    assert torch_kvoffload.stats(auto)["spills"] > 0
    # a promotion that fails: beams promote offloaded beams when ended ones free blocks
    want_beams = _generate(resident, ids, mask, num_beams=2)
    budget = _budget_where(model, ids, mask, "promotions", num_beams=2)
    beams = torch_kvoffload.offload(copy.deepcopy(model), _auto({}, budget))
    real_copy = PromotionLanding.copy_layer
    copies: list[tuple[int, str]] = []

    def failing_copy(self, layer):
        copies.append((layer, threading.current_thread().name))
        if len(copies) == 1:
            raise OSError("injected: the promotion's host read failed")
        return real_copy(self, layer)

    monkeypatch.setattr(PromotionLanding, "copy_layer", failing_copy)
    with pytest.raises(Exception, match="injected: the promotion"):
        _generate(beams, ids, mask, num_beams=2)
    assert torch_kvoffload.stats(beams)["promote_failures"] == 1
    assert torch.equal(_generate(beams, ids, mask, num_beams=2), want_beams)
    assert torch_kvoffload.stats(beams)["promotions"] > 0
    # the copies ran on the transfer stream's thread, layer after layer, while the forwards computed
    assert {name for _, name in copies} == {"kvoffload-sparse-h2d"}, copies
    layers = beams.config.num_hidden_layers
    assert [layer for layer, _ in copies] == list(range(layers)) * (len(copies) // layers), copies


def test_a_budget_too_small_is_a_clear_error(ref) -> None:
    model, ids, mask = ref
    with pytest.raises(ValueError, match=r"device_kv_budget=1000 bytes cannot hold one offloaded request"):
        torch_kvoffload.offload(copy.deepcopy(model), _auto({}, 1000))
    (budget,) = _budgets(model, ids[:1], mask[:1], {}, (0.0,))
    auto = torch_kvoffload.offload(copy.deepcopy(model), _auto({}, budget))
    with pytest.raises(ValueError, match="cannot hold 3 offloaded request"):
        _generate(auto, ids, mask)
    # the refusal left the model usable: one request fits, offloaded
    resident = torch_kvoffload.offload(copy.deepcopy(model), {"sparse": {"offload": False}, "block_size": BS})
    assert torch.equal(_generate(auto, ids[:1], mask[:1]), _generate(resident, ids[:1], mask[:1]))


def test_continuous_batching_admits_by_the_offloaded_footprint_and_promotes_when_requests_end() -> None:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = build_model("deepseek_v32", **WIDTHS)
    with torch.no_grad():
        model.model.embed_tokens.weight[0].normal_()  # a zero embedding ties every indexer score
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (30, 52, 17, 45, 22, 50)]
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=999_999, pad_token_id=0)
    want = [model.generate(torch.tensor([p]), generation_config=gen)[0, len(p) :].tolist() for p in prompts]
    cb = ContinuousBatchingConfig(page_size=8, max_batch_tokens=16, max_requests_per_batch=4)
    probe = torch_kvoffload.offload(
        copy.deepcopy(model), {"sparse": {"offload": "auto"}, "block_size": 8,
                               "serving": {"max_requests": 3, "max_request_tokens": 64}},
    )  # fmt: skip
    probe.init_continuous_batching(generation_config=gen, continuous_batching_config=cb).stop()
    s = session_of(probe).serving
    # three requests' offloaded footprints: what the indexer rows and hot buffers the requests do not use
    # yet leave holds some of them resident
    budget = s.fixed_device_bytes + 3 * s.device_bytes_per_request
    serving = {"max_requests": 3, "max_request_tokens": 64, "device_kv_budget": budget}
    torch_kvoffload.offload(model, {"sparse": {"offload": "auto"}, "block_size": 8, "serving": serving})
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    order = sorted(out, key=lambda rid: int(rid.rsplit("_", 1)[1]))
    assert [list(out[rid].generated_tokens) for rid in order] == want
    st = torch_kvoffload.stats(model)
    assert st["serving_slots"] == 3, "slots counted by the offloaded footprint"
    assert st["device_kv_bytes"] <= budget
    moved = {k: st[k] for k in ("spills", "started_offloaded", "promotions", "resident_pool_blocks")}
    assert moved["spills"] + moved["started_offloaded"] > 0 and moved["promotions"] > 0, moved
    assert st["resident_requests"] == st["offloaded_requests"] == 0, "every request released"


def test_configuration() -> None:
    from torch_kvoffload import OffloadConfig

    cfg = OffloadConfig(sparse={"offload": "auto", "capacity": 64, "host_pool_blocks": 8})
    assert cfg.sparse.offload == "auto" and cfg.sparse.capacity == 64
    with pytest.raises(ValueError, match=r"sparse\.offload"):
        OffloadConfig(sparse={"offload": "sometimes"})
    # a prefill node runs no decode step; a decode node receives into the host pool (tests/hf/test_pd_hf.py)
    with pytest.raises(ValueError, match=r"pd.role='prefill' with sparse.offload='auto'.*no decode"):
        OffloadConfig(layerwise={}, sparse={"offload": "auto"}, pd={"role": "prefill"})
    assert OffloadConfig(sparse={"offload": "auto"}, pd={"role": "decode"}).pd.role == "decode"
    with pytest.raises(ValueError, match=r"offload='auto'.*kv_dtype='bf16'"):
        torch_kvoffload.offload(
            build_model("deepseek_v32", **WIDTHS), {"sparse": {"offload": "auto", "kv_dtype": "bf16"}}
        )


def test_output_attentions_through_resident_and_offloaded_rows(ref) -> None:
    """Decode steps whose batch holds resident and offloaded requests return the probabilities the resident
    run returns (itself the eager model's, tests/hf/test_hf_attentions.py)."""
    model, ids, mask = ref

    def run(m):
        return _generate(m, ids, mask, 6, return_dict_in_generate=True, output_attentions=True)

    resident = torch_kvoffload.offload(copy.deepcopy(model), {"sparse": {"offload": False}, "block_size": BS})
    want = run(resident)
    (budget,) = _budgets(model, ids, mask, {}, (0.0,))
    auto = torch_kvoffload.offload(copy.deepcopy(model), _auto({}, budget))
    got = run(auto)
    st = torch_kvoffload.stats(auto)
    assert st["resident_requests"] > 0 and st["offloaded_requests"] > 0, "decode steps of both kinds"
    assert torch.equal(got.sequences, want.sequences)
    for step_got, step_want in zip(got.attentions, want.attentions, strict=True):
        for g, w in zip(step_got, step_want, strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)

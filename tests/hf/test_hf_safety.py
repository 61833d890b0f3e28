"""The Hugging Face path is never silently wrong: what ``offload`` / ``compile`` do with many compiled
models in one process, Dynamo's fallback to eager, ``use_cache=False``, ``copy.deepcopy``, autograd and a
second thread. The reference is the unmodified model, deep-copied before it is offloaded."""

from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import ONE_LAYER, SMALL, build_model, left_padded_batch

import torch_kvoffload
from torch_kvoffload.integrations.hf import session_of

LENGTHS = [9, 13]
NEW = 6
FALLBACK = "the model's attention ran without the library's"


def _gen(model, ids, mask, new=NEW, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kwargs)


def _pair(family, mode, *, seed=0, config=None):
    """``(offloaded model, unmodified deep copy taken before)``; a compiled model has one layer."""
    model = build_model(family, seed=seed, **(ONE_LAYER if mode == "compile" else SMALL))
    ref = copy.deepcopy(model)
    apply = torch_kvoffload.compile if mode == "compile" else torch_kvoffload.offload
    return apply(model, config), ref


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_models_of_one_class_in_one_process_give_the_unmodified_tokens():
    """The models of one class share their forward's code object: without a recompile budget per model,
    Dynamo's limit on that code object sends a later model to eager. With a limit of 2 and two graphs per
    model (prefill, decode), the second model would be the first past it (it raises then: the same models
    compiled with ``isolate_recompiles=False``)."""
    for i in range(2):
        ids, mask = left_padded_batch(LENGTHS, seed=i)
        model = build_model("deepseek_v32", seed=i, **ONE_LAYER)
        ref = copy.deepcopy(model)
        model = torch_kvoffload.compile(model, recompile_limit=2)
        want = _gen(ref, ids, mask, new=4)
        got = _gen(model, ids, mask, new=4)
        assert torch.equal(got, want), f"model {i}: {(got != want).sum().item()} tokens differ"
        assert len(model._kvoffload_compile_reports) == 2, f"model {i} ran without its two graphs"


def test_compiled_models_of_other_widths_in_one_process_give_the_unmodified_tokens():
    """Every MLA family calls transformers' one attention function with its own scale: once a model of other
    head widths was compiled, Dynamo would see the scale as a symbolic float and the passes could not fold
    it (the graph was refused). A compiled forward keeps floats constant, and the caller's Dynamo settings
    are back after each call."""
    config = torch._dynamo.config
    before = (config.specialize_float, config.fake_tensor_cache_enabled)
    ids, mask = left_padded_batch(LENGTHS, seed=4)
    # V3 then V3.2 (whose attention reuses V3's code), of other widths and so other scales
    for family, widths in (("deepseek_v3", {}), ("deepseek_v32", {"qk_nope_head_dim": 24, "v_head_dim": 24})):
        model = build_model(family, **{**ONE_LAYER, **widths})
        ref = copy.deepcopy(model)
        model = torch_kvoffload.compile(model)
        assert torch.equal(_gen(model, ids, mask, new=3), _gen(ref, ids, mask, new=3)), family
        assert (config.specialize_float, config.fake_tensor_cache_enabled) == before


def test_a_fallback_to_eager_raises_instead_of_generating():
    """Past its recompile limit Dynamo runs the model eagerly: the model's own attention then reads the
    library's cache, which holds no KV, and raises. (``set_stance("force_eager")`` runs the library's eager
    attention instead: tests/hf/test_hf_force_eager.py.)"""
    ids, mask = left_padded_batch(LENGTHS)
    ref = build_model("deepseek_v32", **ONE_LAYER)
    # a budget of one graph: the decode step (a second graph) falls back to eager
    model = torch_kvoffload.compile(build_model("deepseek_v32", **ONE_LAYER), recompile_limit=1)
    with pytest.raises(RuntimeError, match=FALLBACK):
        _gen(model, ids, mask)
    # the prefill graph (the one within budget) still serves a new sequence
    assert torch.equal(_gen(model, ids, mask, new=1), _gen(ref, ids, mask, new=1))


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_the_models_own_attention_over_the_librarys_cache_raises(family):
    model, _ = _pair(family, "offload")
    session = session_of(model)
    cache = session.new_cache()
    attn = model.model.layers[0].self_attn
    hidden = torch.randn(2, 5, SMALL["hidden_size"])
    pos = torch.arange(5).expand(2, 5)
    rope = model.model.rotary_emb(hidden, pos)
    with torch.no_grad(), pytest.raises(RuntimeError, match=FALLBACK):
        attn._kvoffload_original_forward(hidden, rope, None, cache=cache, position_ids=pos)
    k = torch.randn(2, 1, 5, SMALL["kv_lora_rank"])
    v = torch.randn(2, 1, 5, SMALL["qk_rope_head_dim"])
    for write in (
        lambda: cache.update(k, v, 0),
        lambda: cache.update_indexer(torch.randn(2, 5, 32), 0),
    ):
        with pytest.raises(RuntimeError, match=FALLBACK):
            write()
    # reads answer as a fresh DynamicLayer does (their values: tests/hf/test_hf_cache_layers.py)
    assert cache.layers[1].keys is None and cache.layers[0].values is None
    assert cache.layers[0].indexer_keys is None
    assert cache.get_seq_length() == 0  # what generate asks is right: nothing seen yet


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_use_cache_false_gives_the_unmodified_results(family):
    _check_use_cache_false(*_pair(family, "offload"))


def _check_use_cache_false(model, ref):
    ids, mask = left_padded_batch(LENGTHS, seed=3)
    want = _gen(ref, ids, mask, use_cache=False)
    assert torch.equal(_gen(model, ids, mask, use_cache=False), want)

    with torch.no_grad():
        expected = ref(ids, attention_mask=mask, use_cache=False)
        out = model(ids, attention_mask=mask, use_cache=False)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
    assert out.past_key_values is None and expected.past_key_values is None
    # a cached generate afterwards, with another prompt
    ids2, mask2 = left_padded_batch([11, 6], seed=4)
    assert torch.equal(_gen(model, ids2, mask2), _gen(ref, ids2, mask2))


def test_deepcopy_gives_an_independent_model():
    _check_deepcopy(*_pair("deepseek_v32", "offload"), "offload")


def _check_deepcopy(model, ref, mode):
    ids, mask = left_padded_batch(LENGTHS, seed=5)
    want = _gen(ref, ids, mask)
    assert torch.equal(_gen(model, ids, mask), want)  # the original holds a sequence when copied

    twin = copy.deepcopy(model)
    s, t = session_of(model), session_of(twin)
    assert t is not s and t.name != s.name
    assert twin.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.data_ptr() != (
        model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.data_ptr()
    )
    assert list(t.spec.attention_modules) == [x.self_attn for x in twin.model.layers]
    if mode == "offload":
        assert all(x.self_attn._kvoffload_session is t for x in twin.model.layers)

    ids2, mask2 = left_padded_batch([7, 12], seed=6)
    want2 = _gen(ref, ids2, mask2)
    # either order, interleaved
    assert torch.equal(_gen(twin, ids, mask), want)
    assert torch.equal(_gen(model, ids2, mask2), want2)
    assert torch.equal(_gen(twin, ids2, mask2), want2)
    assert torch.equal(_gen(model, ids, mask), want)
    # the copy outlives the original
    del model, s
    gc.collect()
    assert torch.equal(_gen(twin, ids, mask), want)


def test_deepcopy_refuses_a_forward_it_cannot_rebind():
    """A forward replaced by a plain function before offloading would keep calling the original model."""
    model = build_model("deepseek_v3", **SMALL)
    hf_forward = model.forward
    model.forward = lambda *args, **kwargs: hf_forward(*args, **kwargs)
    torch_kvoffload.offload(model)
    with pytest.raises(NotImplementedError, match="plain function"):
        copy.deepcopy(model)


def test_forward_with_autograd_answers_and_its_backward_raises():
    _check_autograd(*_pair("deepseek_v32", "offload"), "offload")


def _check_autograd(model, ref, mode):
    """With autograd on, a forward gives the unmodified model's values, requiring grad as the unmodified
    model's do; a backward through them raises (the library's attention computes no gradients)."""
    ids, mask = left_padded_batch(LENGTHS, seed=7)
    # the compiled model wraps its graphs the same way: one call spelling there (each compiles a graph)
    extra = {"output_hidden_states": True, "labels": ids} if mode == "offload" else {}
    expected = ref(ids, attention_mask=mask, **extra)
    out = model(ids, attention_mask=mask, **extra)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
    assert out.logits.requires_grad
    refused = [out.logits.sum()]
    if extra:
        torch.testing.assert_close(out.loss, expected.loss, rtol=1e-4, atol=1e-5)
        assert out.loss.requires_grad and out.hidden_states[-1].requires_grad
        refused += [out.loss, out.hidden_states[-1].sum()]
        # return_dict=False: the tuple's tensors are refused the same way
        refused.append(model(ids, attention_mask=mask, return_dict=False)[0].sum())
    for value in refused:
        with pytest.raises(
            RuntimeError, match=r"backward through an offloaded model: .*computes no gradients"
        ):
            value.backward()
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not got.requires_grad
    with torch.inference_mode():
        got = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(_gen(model, ids, mask), _gen(ref, ids, mask))
    if mode == "offload":  # decode steps under inference mode: the state reused across layers watches
        with torch.inference_mode():  # tensors that keep no version counter
            assert torch.equal(_gen(model, ids, mask), _gen(ref, ids, mask))


def test_entry_point_backend_forward_with_autograd_raises():
    ids, mask = left_padded_batch([5, 7], seed=8)
    model = build_model("deepseek_v3", **SMALL)
    compiled = torch.compile(model, backend="kvoffload", options={"config": {"layerwise": {}}})
    with pytest.raises(RuntimeError, match="autograd"):
        compiled(ids, attention_mask=mask)
    with torch.no_grad():
        want = build_model("deepseek_v3", **SMALL)(ids, attention_mask=mask).logits
        torch.testing.assert_close(compiled(ids, attention_mask=mask).logits, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config", [None, {"sparse": {"offload": "auto"}}], ids=["default", "hybrid"])
def test_a_second_thread_gets_a_clear_error(config):
    _check_second_thread(*_pair("deepseek_v32", "offload", config=config))


def _check_second_thread(model, ref):
    """Thread A holds the model inside its first forward; the main thread's generate and forward raise,
    A's generate completes with the unmodified tokens, and each thread alone works afterwards."""
    ids, mask = left_padded_batch(LENGTHS, seed=9)
    want = _gen(ref, ids, mask)
    session = session_of(model)
    entered, release = threading.Event(), threading.Event()
    begin_forward = session.begin_forward

    def held_begin_forward(*args, **kwargs):
        if not entered.is_set():
            entered.set()
            release.wait()
        return begin_forward(*args, **kwargs)

    session.begin_forward = held_begin_forward
    results: dict[str, object] = {}

    def run(key):
        try:
            with torch.no_grad():
                results[key] = _gen(model, ids, mask)
        except Exception as exc:
            results[key] = exc

    a = threading.Thread(target=run, args=("a",))
    a.start()
    try:
        while not entered.wait(0.05):
            assert a.is_alive(), results.get("a")
        with pytest.raises(RuntimeError, match="second thread"):
            _gen(model, ids, mask)
        with torch.no_grad(), pytest.raises(RuntimeError, match="second thread"):
            model(ids, attention_mask=mask)
    finally:
        release.set()
        a.join()
    del session.begin_forward
    assert isinstance(results["a"], torch.Tensor) and torch.equal(results["a"], want), results["a"]

    assert torch.equal(_gen(model, ids, mask), want)
    b = threading.Thread(target=run, args=("b",))
    b.start()
    b.join()
    assert isinstance(results["b"], torch.Tensor) and torch.equal(results["b"], want), results["b"]


def test_one_compiled_model_through_use_cache_false_autograd_a_second_thread_and_deepcopy():
    """The checks above, in one sequence on one compiled DeepseekV32 (V3.2 only: its graphs trace what V3's
    do, and the indexer besides): each call after another reaches graphs the earlier ones compiled, or
    compiles its own; the deep copy comes last and is checked against the original's graphs."""
    model, ref = _pair("deepseek_v32", "compile")
    _check_use_cache_false(model, ref)
    _check_autograd(model, ref, "compile")
    _check_second_thread(model, ref)
    _check_deepcopy(model, ref, "compile")

"""Sequences of ``generate`` calls on one offloaded Hugging Face model: other batch sizes, longer and
shorter prompts, other ``max_new_tokens``, failed calls in between; and the device KV each call holds.

The reference is the unmodified model: a deep copy taken before offloading, generating from the same
left-padded batches.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import SMALL, build_model, indexer_boundary_ties, left_padded_batch

import torch_kvoffload
from torch_kvoffload.integrations.hf import session_of

# (batch, longest prompt, max_new_tokens) of each call, in order; the rows of a batch are 0..2 tokens
# shorter than the longest (left padded)
CALLS = [(2, 5, 8), (1, 12, 4), (3, 20, 16), (2, 3, 8)]
BS = 8
MODES = {
    "layerwise": {"layerwise": {}, "block_size": BS},
    "sparse": {"sparse": {}, "block_size": BS},
    "both": {"layerwise": {}, "sparse": {}, "block_size": BS},
    "default": None,  # layerwise + sparse on V3.2, block 128
}


def _batch(b: int, p: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded_batch([max(1, p - (r % 3)) for r in range(b)], seed=seed)


def _generate(model, ids, mask, new):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)


def _no_ties(family, model, ids, mask, out):
    """Token equality with the unmodified V3.2 needs no exact indexer score tie at the top-k boundary."""
    if family != "deepseek_v32":
        return
    new = out.shape[1] - ids.shape[1]
    rows = [out[b][mask[b].bool().tolist() + [True] * new] for b in range(ids.shape[0])]
    assert indexer_boundary_ties(model, rows) == 0


def _reference_run(family, overrides, calls, compiled_model=None):
    """Per call ``(ids, mask, new, unmodified tokens)`` from a deep copy taken before offloading."""
    model = build_model(family, **overrides)
    ref = copy.deepcopy(model)
    out = []
    for i, (b, p, new) in enumerate(calls):
        ids, mask = _batch(b, p, seed=i)
        want = _generate(ref, ids, mask, new)
        _no_ties(family, ref, ids, mask, want)
        out.append((ids, mask, new, want))
    return model, out


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _check_sequence(model, calls):
    session = session_of(model)
    sized = []
    for i, (ids, mask, new, want) in enumerate(calls):
        got = _generate(model, ids, mask, new)
        assert torch.equal(got, want), (
            f"call {i} {tuple(ids.shape)}+{new}: {(got != want).sum().item()} tokens differ"
        )
        s = torch_kvoffload.stats(model)
        sized.append((s.get("reserved_tokens"), s.get("reserved_requests")))
    # each call's caches were sized for its requests: prompt width + new tokens - 1 each
    sparse = session.sparse_on
    assert sized == [(ids.shape[1] + new - 1, ids.shape[0] if sparse else 0) for ids, _, new, _ in calls]
    return session


@pytest.mark.parametrize(
    ("family", "mode"),
    [("deepseek_v3", "layerwise"), ("deepseek_v32", "layerwise"), ("deepseek_v32", "sparse"),
     ("deepseek_v32", "both")],
)  # fmt: skip
def test_generate_sequence_eager(family, mode):
    model, calls = _reference_run(family, {}, CALLS)
    model = torch_kvoffload.offload(model, MODES[mode])
    _check_sequence(model, calls)
    session_of(model).close()


# ----------------------------------------------------------------------------------- failed calls
class _Boom(RuntimeError):
    pass


def _raise_once(obj, name, after: int = 0):
    """Make ``obj.name`` raise ``_Boom`` on its call number ``after`` (0-based), once."""
    original = getattr(obj, name)
    calls = {"n": 0}

    def patched(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == after + 1:
            raise _Boom(f"injected failure in {name}")
        return original(*args, **kwargs)

    setattr(obj, name, patched)
    return original


def _assert_released(model):
    """Nothing of the failed call (or of the sequence before it) is still reserved."""
    s = torch_kvoffload.stats(model)
    assert (s["reserved_requests"], s["resident_rows"]) == (0, 0)
    return s["failed_forwards"]


# the default config (None: layerwise + sparse, block 128) runs the paths of "both" with fewer full blocks
@pytest.mark.parametrize("mode", ["layerwise", "sparse", "both"])
def test_failed_calls_leave_the_model_usable(mode):
    calls = [(2, 9, 6), (3, 14, 6), (1, 6, 5)]
    model, ref = _reference_run("deepseek_v32", {}, calls)
    model = torch_kvoffload.offload(model, MODES[mode])
    session = session_of(model)
    (ids0, mask0, new0, want0), (ids1, mask1, new1, want1), (ids2, mask2, new2, want2) = ref
    assert torch.equal(_generate(model, ids0, mask0, new0), want0)

    # an attention mask of another batch size (transformers rejects it), then one that is not 0 / 1 (the
    # library rejects it): the previous sequence is released, nothing new is reserved
    with pytest.raises(RuntimeError, match="must match the size"):
        _generate(model, ids1, torch.ones(ids1.shape[0] + 1, ids1.shape[1], dtype=torch.int64), new1)
    _assert_released(model)
    with pytest.raises(ValueError, match="attention_mask"):
        _generate(model, ids1, mask1 * 2, new1)
    failures = _assert_released(model)
    assert torch.equal(_generate(model, ids1, mask1, new1), want1)

    # an exception in the middle of the prefill forward (layer 2's MLP)
    mlp = model.model.layers[2].mlp
    original = _raise_once(mlp, "forward")
    with pytest.raises(_Boom):
        _generate(model, ids2, mask2, new2)
    mlp.forward = original
    assert _assert_released(model) == failures + 1
    assert torch.equal(_generate(model, ids2, mask2, new2), want2)

    # an exception in the attention of the third forward (a decode step)
    _raise_once(session.core, "cache_attention", after=2 * session.spec.num_layers + 1)
    with pytest.raises(_Boom):
        _generate(model, ids0, mask0, new0)
    del session.core.cache_attention
    assert _assert_released(model) == failures + 2
    # a batch of another size right after the failure, then the first one again
    assert torch.equal(_generate(model, ids1, mask1, new1), want1)
    assert torch.equal(_generate(model, ids0, mask0, new0), want0)

    # a generate that fails between forwards (a stopping criterion raises after the first step)
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            raise _Boom()

    with torch.no_grad(), pytest.raises(_Boom):
        model.generate(
            input_ids=ids1, attention_mask=mask1, max_new_tokens=new1, do_sample=False,
            stopping_criteria=StoppingCriteriaList([_Stop()]),
        )  # fmt: skip
    assert _assert_released(model) == failures + 2  # no forward failed
    assert torch.equal(_generate(model, ids2, mask2, new2), want2)


def test_failed_compiled_call_leaves_the_model_usable():
    calls = [(2, 9, 6), (1, 13, 5)]
    model, ref = _reference_run("deepseek_v32", SMALL, calls)
    model = torch_kvoffload.compile(model, MODES["both"])
    session = session_of(model)
    (ids0, mask0, new0, want0), (ids1, mask1, new1, want1) = ref
    assert torch.equal(_generate(model, ids0, mask0, new0), want0)
    _raise_once(session.core, "cache_write", after=1)  # layer 1 of the prefill
    with pytest.raises(_Boom):
        _generate(model, ids1, mask1, new1)
    del session.core.cache_write
    assert _assert_released(model) == 1
    assert torch.equal(_generate(model, ids1, mask1, new1), want1)
    assert torch.equal(_generate(model, ids0, mask0, new0), want0)


def test_outgrowing_a_reservation_is_rejected_and_the_session_stays_usable():
    """Sparse offload keeps the host pool of a sequence's first forward: a later forward that needs more
    is a ValueError naming the sizes, and changes nothing (a shorter continuation and a new generate
    both still work)."""
    family = "deepseek_v32"
    model = build_model(family)
    ref = copy.deepcopy(model)
    model = torch_kvoffload.offload(model, MODES["sparse"])
    session = session_of(model)
    prompt, _ = left_padded_batch([20], seed=7)
    session.reserve(1, 12)  # a host pool of 2 blocks of 8
    cache = session.new_cache()
    with torch.no_grad():
        model(input_ids=prompt[:, :10], cache=cache)
        with pytest.raises(ValueError, match="needs 20 tokens per request but 12 were reserved"):
            model(input_ids=prompt[:, 10:], cache=cache)
        # 14 tokens fit the pool: the device caches grow in place
        resizes = torch_kvoffload.stats(model)["resizes"]
        got = model(input_ids=prompt[:, 10:14], cache=cache).logits
        want = ref(input_ids=prompt[:, :14]).logits[:, 10:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    s = torch_kvoffload.stats(model)
    assert s["resizes"] == resizes + 1 and s["reserved_tokens"] == 14
    ids, mask = _batch(2, 11, seed=3)
    assert torch.equal(_generate(model, ids, mask, 6), _generate(ref, ids, mask, 6))


# ----------------------------------------------------------------------------------- device KV
def _dense_bytes(config, batch: int, tokens: int) -> int:
    """The unmodified model's cache for ``tokens`` positions of ``batch`` rows: per layer the latent, the
    rotary key and (V3.2) the indexer key of every position, in the model's dtype (fp32 here)."""
    width = config.kv_lora_rank + config.qk_rope_head_dim + getattr(config, "index_head_dim", 0)
    return config.num_hidden_layers * batch * tokens * width * 4


def _cache_bytes(cache) -> int:
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in vars(layer).values()
        if isinstance(t, torch.Tensor)
    )


@pytest.mark.parametrize("mode", ["sparse", "both", "default"])
@pytest.mark.parametrize(("lengths", "new"), [([5, 3], 8), ([40, 29], 8), ([70], 6)])
def test_device_kv_never_exceeds_the_unmodified_cache(mode, lengths, new):
    """After each generate (decode holds the hot buffers and the indexer cache) the device KV is at most
    what the unmodified model's cache holds for the same tokens, short and long prompts alike."""
    model = build_model("deepseek_v32")
    ref = copy.deepcopy(model)
    config = model.config
    model = torch_kvoffload.offload(model, MODES[mode])
    ids, mask = left_padded_batch(lengths, seed=1)
    with torch.no_grad():
        want = ref.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
        )
    tokens = ids.shape[1] + new - 1
    dense = _dense_bytes(config, len(lengths), tokens)
    assert _cache_bytes(want.past_key_values) == dense  # the formula is what transformers holds
    assert torch.equal(_generate(model, ids, mask, new), want.sequences)
    s = torch_kvoffload.stats(model)
    assert s["dense_kv_bytes"] == dense
    assert 0 < s["device_kv_bytes"] <= dense
    # what is there: hot rows bounded by the configured capacity (2 x top_k) and by the tokens
    L, B, hot_rows = config.num_hidden_layers, len(lengths), min(2 * config.index_topk, tokens)
    hot = L * B * hot_rows * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    assert s["device_kv_bytes"] == hot + L * B * tokens * config.index_head_dim * 4


def test_configured_capacity_bounds_the_hot_buffers_of_a_long_prompt():
    model = build_model("deepseek_v32")
    config = model.config
    model = torch_kvoffload.offload(model, {"sparse": {"capacity": 12}, "block_size": BS})
    ids, mask = left_padded_batch([60, 45], seed=2)
    _generate(model, ids, mask, 5)
    sp = session_of(model).sparse_offload
    assert sp.capacity == 12 and sp.top_k == config.index_topk
    assert all(t.shape == (2, 12, config.kv_lora_rank) for t in sp.hot_kv_c)
    # a short request after it: rows beyond its tokens are never needed (and top-k covers them all)
    ids, mask = left_padded_batch([4, 2], seed=3)
    _generate(model, ids, mask, 3)
    sp = session_of(model).sparse_offload
    assert (sp.capacity, sp.top_k) == (6, 6)
    assert torch_kvoffload.stats(model)["device_kv_bytes"] <= _dense_bytes(config, 2, 6)


def test_layerwise_buffers_follow_each_request():
    """Layer buffers and tails are sized by each call's requests: a shorter call after a longer one
    holds less, and the figure is the one the sizes give."""
    model = build_model("deepseek_v3")
    config = model.config
    model = torch_kvoffload.offload(model, {"layerwise": {}, "block_size": BS})
    row = (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    L = config.num_hidden_layers
    for lengths, new in (([30, 20], 10), ([5, 2], 2), ([3], 1)):
        ids, mask = left_padded_batch(lengths, seed=4)
        _generate(model, ids, mask, new)
        tokens, B = ids.shape[1] + new - 1, len(lengths)
        buffers = 3 * B * -(-tokens // BS) * BS * row  # 1 + num_shared_buffers (2) physical buffers
        tails = L * B * min(BS, tokens) * row
        assert torch_kvoffload.stats(model)["device_kv_bytes"] == buffers + tails, (lengths, new)


@pytest.mark.parametrize("config", [{"sparse": {}}, None], ids=["sparse", "default"])
def test_a_sequence_growing_past_the_top_k_selects_the_configured_top_k(config):
    """Forwards without a plan size the caches for the first forward's width (here below ``index_topk``,
    so the hot buffers are clipped to it); each later step grows them, and the selection must come back to
    the configured top-k as the context passes it: logits equal the unmodified model's at every step."""
    model = build_model("deepseek_v32")
    ref = copy.deepcopy(model)
    torch_kvoffload.offload(model, config)  # blocks of 128: the host pool's reservation covers the growth
    ids, mask = left_padded_batch([6, 4], seed=3)
    top_k = model.config.index_topk
    assert ids.shape[1] < top_k
    from transformers import DynamicCache

    ref_cache, cache = DynamicCache(config=ref.config), session_of(model).new_cache()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask, cache=ref_cache).logits
        got = model(ids, attention_mask=mask, cache=cache).logits
        torch.testing.assert_close(got[mask.bool()], want[mask.bool()])
        g = torch.Generator().manual_seed(5)
        for step in range(top_k - ids.shape[1] + 4):
            nxt = torch.randint(3, 1000, (2, 1), generator=g)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            want = ref(nxt, attention_mask=mask, cache=ref_cache).logits
            got = model(nxt, attention_mask=mask, cache=cache).logits
            torch.testing.assert_close(got, want, msg=lambda m, s=step: f"step {s}: {m}")
    assert torch_kvoffload.stats(model)["resizes"] > 1

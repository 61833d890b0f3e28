"""The cache ``generate`` returns for an offloaded model reads like the unmodified model's: ``layers[i].keys``
(normalised latent ``[B, 1, T, kv_lora_rank]``), ``.values`` (roped rotary key ``[B, 1, T, rope]``) and, for
DeepSeek-V3.2, ``.indexer_keys`` (``[B, T, index_head_dim]``), materialised from wherever the session keeps
the KV, in every mode, after beam search and after several generates; read-only copies.

The reference is the unmodified model (deep-copied before it is offloaded) generating from the same inputs
and returning its ``DynamicCache``. Layer 0 sees the same inputs in both and must be bit-identical; later
layers follow the absorbed attention's output, equal to fp32 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import ONE_LAYER, SMALL, build_model, left_padded_batch
from transformers import LogitsProcessor, LogitsProcessorList

import torch_kvoffload
from torch_kvoffload.core.pd_role import PDRole
from torch_kvoffload.integrations.hf import session_of

LENGTHS = [9, 13]
NEW = 5
BS = 4  # several full blocks per request: the layerwise store and tails are both read

CASES = {
    "v3-layerwise": ("deepseek_v3", {"layerwise": {}}),
    "v32-layerwise": ("deepseek_v32", {"layerwise": {}}),
    "v32-sparse": ("deepseek_v32", {"sparse": {}}),
    "v32-resident": ("deepseek_v32", {"sparse": {"offload": False}}),
    "v32-both": ("deepseek_v32", {"layerwise": {}, "sparse": {}}),
}


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _pair(family: str, config: dict, mode: str = "offload"):
    """``(offloaded model, unmodified deep copy taken before)``; a compiled model has one layer."""
    model = build_model(family, **(ONE_LAYER if mode == "compile" else SMALL))
    ref = copy.deepcopy(model)
    apply = torch_kvoffload.compile if mode == "compile" else torch_kvoffload.offload
    return apply(model, {**config, "block_size": BS}), ref


def _gen(model, ids, mask, new=NEW, **kwargs):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=new, do_sample=False, return_dict_in_generate=True, **kwargs
    )


def _names(has_indexer: bool) -> tuple[str, ...]:
    return ("keys", "values", "indexer_keys") if has_indexer else ("keys", "values")


def assert_same_cache(got, want, padding: torch.Tensor | None = None) -> None:
    """``got`` (the library's cache) reads as ``want`` (a ``DynamicCache``): shapes, dtype, device, values;
    ``padding bool [B, T]``: positions that must read zero in ``got``."""
    assert len(got) == len(want) and got.get_seq_length() == want.get_seq_length()
    names = _names(got.session.spec.has_indexer)
    for i, (g, w) in enumerate(zip(got.layers, want.layers, strict=True)):
        for name in names:
            a, b = getattr(g, name), getattr(w, name)
            assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), (i, name)
            if i == 0:  # the same inputs in both models: bit-identical
                assert torch.equal(a, b), f"layer 0 {name}: max diff {(a - b).abs().max().item()}"
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"layer {i} {name}")
            if padding is not None:
                pad = padding if name == "indexer_keys" else padding[:, None]
                assert not a[pad.expand(a.shape[:-1])].any(), f"layer {i} {name}: padding is not zero"
        if "indexer_keys" not in names:
            assert g.indexer_keys is None


def _full_mask(mask: torch.Tensor, new: int) -> torch.Tensor:
    """The mask of what the returned cache holds: the prompt, then ``new - 1`` generated tokens."""
    return torch.cat([mask, torch.ones(mask.shape[0], new - 1, dtype=mask.dtype)], dim=1)


@pytest.mark.parametrize("case", list(CASES))
def test_layers_read_as_the_unmodified_cache(case):
    family, config = CASES[case]
    model, ref = _pair(family, config)
    ids, mask = left_padded_batch(LENGTHS)
    want, got = _gen(ref, ids, mask), _gen(model, ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    cache = got.past_key_values
    padding = _full_mask(mask, NEW) == 0
    assert padding.any()  # left padding: those positions keep no KV in the library
    assert_same_cache(cache, want.past_key_values, padding)
    # the unmodified model's padding holds zeros too here (pad token 0 embeds to zeros)
    assert not want.past_key_values.layers[0].keys[padding[:, None].expand(2, 1, -1)].any()

    # iteration as DynamicCache's: (keys, values, None) per layer
    for (k, v, extra), w in zip(cache, want.past_key_values.layers, strict=True):
        assert extra is None and k.shape == w.keys.shape and v.shape == w.values.shape

    # read-only copies: changing one changes nothing; assigning raises
    layer = cache.layers[1]
    before = layer.keys
    layer.keys.fill_(7.0)
    before.zero_()
    torch.testing.assert_close(layer.keys, want.past_key_values.layers[1].keys, rtol=1e-5, atol=1e-5)
    assert layer.keys is not layer.keys
    for name in _names(family == "deepseek_v32"):
        with pytest.raises(AttributeError, match="read-only"):
            setattr(layer, name, torch.zeros(1))
    assert_same_cache(cache, want.past_key_values, padding)


class _Meddle(LogitsProcessor):
    """Between two forwards of a running generate, reads the library's cache and scribbles over the copies."""

    def __init__(self, session, names):
        self.session, self.names, self.steps = session, names, 0

    def __call__(self, input_ids, scores):
        self.steps += 1
        cache = self.session.owner
        for layer in cache.layers:
            for name in self.names:
                t = getattr(layer, name)
                assert t.shape[-2] == input_ids.shape[1]  # T: every position so far
                t.normal_()
        return scores


@pytest.mark.parametrize("case", ["v3-layerwise", "v32-sparse", "v32-resident", "v32-both"])
def test_changing_a_returned_tensor_does_not_change_the_next_steps(case):
    family, config = CASES[case]
    model, ref = _pair(family, config)
    ids, mask = left_padded_batch(LENGTHS, seed=1)
    want = _gen(ref, ids, mask, new=8)
    meddle = _Meddle(session_of(model), _names(family == "deepseek_v32"))
    got = _gen(model, ids, mask, new=8, logits_processor=LogitsProcessorList([meddle]))
    assert meddle.steps == 8
    assert torch.equal(got.sequences, want.sequences)
    assert_same_cache(got.past_key_values, want.past_key_values)


@pytest.mark.parametrize("case", ["v3-layerwise", "v32-layerwise", "v32-sparse", "v32-resident", "v32-both"])
def test_beam_search_then_another_generate_of_other_shapes(case):
    family, config = CASES[case]
    model, ref = _pair(family, config)
    ids, mask = left_padded_batch(LENGTHS, seed=2)
    beams = dict(num_beams=3, num_return_sequences=2)
    want, got = _gen(ref, ids, mask, **beams), _gen(model, ids, mask, **beams)
    assert torch.equal(got.sequences, want.sequences)
    first = got.past_key_values
    assert first.layers[0].keys.shape[0] == 6  # the running beams, as transformers leaves them
    assert_same_cache(first, want.past_key_values)

    # another generate: another batch, other prompt lengths, more tokens
    ids2, mask2 = left_padded_batch([5, 11, 7], seed=3)
    want2, got2 = _gen(ref, ids2, mask2, new=7), _gen(model, ids2, mask2, new=7)
    assert torch.equal(got2.sequences, want2.sequences)
    assert_same_cache(got2.past_key_values, want2.past_key_values, _full_mask(mask2, 7) == 0)
    # the first cache's sequence was released when the second started: refused, not stale data
    with pytest.raises(RuntimeError, match="no longer holds this cache's sequence"):
        _ = first.layers[0].keys


def test_caches_without_kv_to_read():
    model, _ = _pair("deepseek_v32", {"sparse": {}})
    session = session_of(model)
    assert all(layer.keys is None and layer.indexer_keys is None for layer in session.new_cache().layers)

    ids, mask = left_padded_batch(LENGTHS, seed=4)
    cache = _gen(model, ids, mask).past_key_values
    assert cache.layers[1].values.shape == (2, 1, 13 + NEW - 1, SMALL["qk_rope_head_dim"])
    session.end_sequence()
    with pytest.raises(RuntimeError, match=r"layers\[1\]\.values: the session no longer holds"):
        _ = cache.layers[1].values

    cache = _gen(model, ids, mask).past_key_values
    session.close()
    with pytest.raises(RuntimeError, match="session is closed"):
        _ = cache.layers[0].keys


def test_a_read_while_a_forward_runs_raises():
    model, _ = _pair("deepseek_v3", {"layerwise": {}})
    session = session_of(model)
    ids, mask = left_padded_batch(LENGTHS, seed=5)
    cache = _gen(model, ids, mask).past_key_values
    step = torch.ones(2, 1, dtype=torch.int64)
    full = torch.cat([_full_mask(mask, NEW), torch.ones(2, 1, dtype=torch.int64)], dim=1)

    def hook(module, args, output):
        _ = session.owner.layers[0].keys

    handle = model.model.layers[1].register_forward_hook(hook)
    try:
        with pytest.raises(RuntimeError, match="while a forward runs"):
            model(step, attention_mask=full, cache=cache)
    finally:
        handle.remove()


def test_what_cannot_be_read_back_raises():
    # an int8 indexer cache does not give the indexer keys back; the main KV still reads
    model, ref = _pair("deepseek_v32", {"sparse": {"indexer_dtype": "int8"}})
    ids, mask = left_padded_batch(LENGTHS, seed=6)
    cache = _gen(model, ids, mask).past_key_values
    want = _gen(ref, ids, mask).past_key_values
    prompt = mask.shape[1]  # the int8 selection may pick other tokens later on
    assert torch.equal(cache.layers[0].keys[:, :, :prompt], want.layers[0].keys[:, :, :prompt])
    with pytest.raises(RuntimeError, match=r"indexer_keys: .*int8"):
        _ = cache.layers[0].indexer_keys

    # a P/D node (its role is a backend of the KV core)
    backends = session_of(model).core.backends
    backends.role = PDRole()
    try:
        with pytest.raises(NotImplementedError, match="P/D node"):
            _ = cache.layers[0].values
    finally:
        backends.role = None
    # KVPP: each rank keeps only the layers it owns
    backends.kvpp = object()
    try:
        with pytest.raises(NotImplementedError, match="KVPP"):
            _ = cache.layers[1].keys
    finally:
        backends.kvpp = None


@pytest.fixture(scope="module")
def compiled():
    """One compiled V3.2 model (layerwise + sparse) and its unmodified copy, for the whole module."""
    torch._dynamo.reset()
    model, ref = _pair("deepseek_v32", {"layerwise": {}, "sparse": {}}, mode="compile")
    yield model, ref
    torch._dynamo.reset()


def test_compiled_models_cache_reads_as_the_unmodified_one(compiled):
    model, ref = compiled
    ids, mask = left_padded_batch(LENGTHS, seed=7)
    want, got = _gen(ref, ids, mask, new=6), _gen(model, ids, mask, new=6)
    assert torch.equal(got.sequences, want.sequences)
    assert_same_cache(got.past_key_values, want.past_key_values, _full_mask(mask, 6) == 0)
    graphs = len(model._kvoffload_compile_reports)
    # reading it did not touch what the graphs are traced with: another generate compiles nothing new
    ids2, mask2 = left_padded_batch([6, 10], seed=8)
    assert torch.equal(_gen(model, ids2, mask2).sequences, _gen(ref, ids2, mask2).sequences)
    assert len(model._kvoffload_compile_reports) == graphs

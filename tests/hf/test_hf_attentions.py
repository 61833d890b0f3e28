"""``output_attentions=True`` on offloaded and compiled models: the attention probabilities equal the unmodified
model's with ``attn_implementation="eager"`` (a deep copy taken before offloading; ``sdpa`` returns none), per
layer ``[batch, heads, q_len, kv_len]``: dense softmax for DeepSeek-V3, zero outside the indexer's top-k for
V3.2, in every mode (layerwise, sparse offload, resident sparse, layerwise + sparse), for forwards and for
``generate`` (prefill and decode steps), with left padding, and calls with and without them in any order.

Forwards are given the position ids ``generate`` uses (counting real tokens only): a plain forward on a
left-padded batch counts positions with the padding, and the layerwise store, keyed by tokens, would then
hand a later ``generate`` rows roped at other positions (a prefix-reuse limit outside this feature).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import ONE_LAYER, SMALL, build_model, indexer_boundary_ties, left_padded_batch

import torch_kvoffload
from torch_kvoffload.backend import compile_reports
from torch_kvoffload.integrations.hf import session_of

CASES = {
    "v3-layerwise": ("deepseek_v3", {"layerwise": {}, "block_size": 4}),
    "v32-sparse": ("deepseek_v32", {"sparse": {"capacity": 9}, "block_size": 4}),  # hot-buffer misses
    "v32-resident": ("deepseek_v32", {"sparse": {"offload": False}}),
    "v32-layerwise": ("deepseek_v32", {"layerwise": {}, "block_size": 4}),
    "v32-both": ("deepseek_v32", {"layerwise": {}, "sparse": {"capacity": 9}, "block_size": 4}),
}


@pytest.fixture(scope="module")
def weights():
    """Per family, the tiny model the offloaded copies start from (only read)."""
    return {f: build_model(f, **SMALL) for f in ("deepseek_v3", "deepseek_v32")}


@pytest.fixture(scope="module")
def refs(weights):
    """Per family, the unmodified model with eager attention (the one that returns attentions)."""
    out = {}
    for family, model in weights.items():
        out[family] = copy.deepcopy(model)
        out[family].set_attn_implementation("eager")
    return out


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """The position ids ``generate`` gives a left-padded batch (real tokens counted from 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _assert_layers(got, want) -> None:
    assert got is not None and len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape)
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def _forward(model, ids, mask, **kw):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), **kw)


def _generate(model, ids, mask, n: int, **kw):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=n,
        do_sample=False,
        return_dict_in_generate=True,
        **kw,
    )


def _check_generate(ref, model, ids, mask, n: int, *, ties: bool = False) -> torch.Tensor:
    """``generate`` with ``output_attentions``: the eager model's tokens and attentions at every step;
    returns the sequences. ``ties``: check the V3.2 indexer's top-k never depends on how ties break."""
    want = _generate(ref, ids, mask, n, output_attentions=True)
    got = _generate(model, ids, mask, n, output_attentions=True)
    assert torch.equal(got.sequences, want.sequences)
    if ties and ref.config.model_type == "deepseek_v32":
        rows = [
            s[torch.cat([m.bool(), torch.ones(n, dtype=torch.bool)])]
            for s, m in zip(got.sequences, mask, strict=True)
        ]
        assert indexer_boundary_ties(ref, rows) == 0
    assert len(got.attentions) == len(want.attentions) == n
    for step_got, step_want in zip(got.attentions, want.attentions, strict=True):
        _assert_layers(step_got, step_want)
    return got.sequences


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_generate_return_the_eager_models_attentions(case, weights, refs):
    family, config = CASES[case]
    ref = refs[family]
    model = torch_kvoffload.offload(copy.deepcopy(weights[family]), config)
    ids, mask = left_padded_batch([11, 5, 8], seed=3)
    want, got = (
        _forward(ref, ids, mask, output_attentions=True),
        _forward(model, ids, mask, output_attentions=True),
    )
    _assert_layers(got.attentions, want.attentions)
    real = mask.bool()  # left padding that sees no token: eager averages over masked keys, sdpa gives 0
    torch.testing.assert_close(got.logits[real], want.logits[real], rtol=1e-4, atol=1e-5)
    sequences = _check_generate(ref, model, ids, mask, 5, ties=True)
    # without them afterwards: the same tokens, nothing returned
    plain = _generate(model, ids, mask, 5)
    assert plain.attentions is None and torch.equal(plain.sequences, sequences)
    assert _forward(model, ids, mask).attentions is None
    # then again, with other shapes: fewer rows, other lengths, another number of new tokens
    ids2, mask2 = left_padded_batch([4, 9], seed=5)
    _check_generate(ref, model, ids2, mask2, 3)
    got = _forward(model, ids2, mask2, output_attentions=True)
    _assert_layers(got.attentions, _forward(ref, ids2, mask2, output_attentions=True).attentions)


def test_config_flag_no_cache_and_refusals(refs, monkeypatch):
    family = "deepseek_v32"
    ref = refs[family]
    # transformers refuses config.output_attentions on an sdpa model: this one is offloaded from the eager copy
    model = torch_kvoffload.offload(copy.deepcopy(ref), {"sparse": {"offload": False}})
    ids, mask = left_padded_batch([7, 3], seed=8)
    want = _forward(ref, ids, mask, output_attentions=True, use_cache=False).attentions
    _assert_layers(_forward(model, ids, mask, output_attentions=True, use_cache=False).attentions, want)
    model.config.output_attentions = True  # the config's flag, unless the call says otherwise
    try:
        _assert_layers(_forward(model, ids, mask).attentions, want)
        assert _forward(model, ids, mask, output_attentions=False).attentions is None
    finally:
        model.config.output_attentions = False
    with pytest.raises(ValueError, match=r"output_attentions=True, cache_implementation='static'"):
        _generate(model, ids, mask, 2, output_attentions=True, cache_implementation="static")
    monkeypatch.setattr(session_of(model), "pd", object())  # what a P/D node's session holds
    with pytest.raises(ValueError, match="output_attentions=True is not supported on a P/D node"):
        _forward(model, ids, mask, output_attentions=True)
    monkeypatch.undo()
    assert torch.equal(_generate(model, ids, mask, 3).sequences, _generate(ref, ids, mask, 3).sequences)


@pytest.mark.parametrize(
    ("family", "config"),
    [("deepseek_v3", None), ("deepseek_v32", {"sparse": {"capacity": 9}, "block_size": 4})],
    ids=["v3-default", "v32-sparse"],
)
def test_compiled_model_returns_them_eagerly_and_keeps_its_graphs(family, config):
    torch._dynamo.reset()
    model = build_model(family, **ONE_LAYER)  # a compiled model traces one layer
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    model = torch_kvoffload.compile(model, config)
    ids, mask = left_padded_batch([9, 4], seed=6)
    first = _generate(model, ids, mask, 4)
    graphs = len(compile_reports(model))
    _check_generate(ref, model, ids, mask, 4)
    ids2, mask2 = left_padded_batch([3, 6, 5], seed=7)
    got = _forward(model, ids2, mask2, output_attentions=True)
    _assert_layers(got.attentions, _forward(ref, ids2, mask2, output_attentions=True).attentions)
    assert len(compile_reports(model)) == graphs  # those calls compiled nothing
    served = torch_kvoffload.stats(model)["prefix_store_tokens"]
    again = _generate(model, ids, mask, 4)
    assert torch.equal(again.sequences, first.sequences) and again.attentions is None
    # nor did this one, but for the prompt columns after a prefix taken over from the store (block 4: V3.2)
    reused = torch_kvoffload.stats(model)["prefix_store_tokens"] > served
    assert len(compile_reports(model)) == graphs + reused
    torch._dynamo.reset()

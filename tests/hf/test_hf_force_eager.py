"""A model compiled by ``torch_kvoffload.compile`` under ``torch.compiler.set_stance("force_eager")`` (Dynamo
builds and runs no graph) runs the library's eager attention over the same session and cache: the
unmodified model's tokens, a sequence that continues across a stance change, and the compiled graphs again
once the stance ends. The reference is the unmodified model, deep-copied before it is compiled.

One compiled model for the whole module (compiling is slow on the test machine)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import SMALL, build_model, left_padded_batch
from transformers import LogitsProcessor, LogitsProcessorList

import torch_kvoffload
from torch_kvoffload.integrations.hf import attention as hf_attention
from torch_kvoffload.integrations.hf import compile as hf_compile

LENGTHS = [9, 13]
NEW = 6
CONFIG = {"layerwise": {}, "sparse": {}, "block_size": 4}


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def compiled():
    """``(compiled V3.2 model, unmodified copy)``, with the model's prefill and decode graphs compiled."""
    torch._dynamo.reset()
    model = build_model("deepseek_v32", **SMALL)
    ref = copy.deepcopy(model)
    torch_kvoffload.compile(model, CONFIG)
    ids, mask = left_padded_batch(LENGTHS)
    with torch.no_grad():
        assert torch.equal(_gen(model, ids, mask), _gen(ref, ids, mask))
    yield model, ref
    torch._dynamo.reset()


@pytest.fixture
def eager_calls(monkeypatch):
    """How many forwards ran the library's eager attention (``compile._eager_forward``)."""
    calls = []
    real = hf_compile._eager_forward

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_compile, "_eager_forward", spy)
    return calls


def _gen(model, ids, mask, new=NEW, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kwargs)


def test_force_eager_runs_the_eager_attention_then_the_graphs_again(compiled, eager_calls):
    model, ref = compiled
    graphs = len(model._kvoffload_compile_reports)
    ids, mask = left_padded_batch([7, 12], seed=1)
    want = _gen(ref, ids, mask, return_dict_in_generate=True)
    with torch.compiler.set_stance("force_eager"):
        got = _gen(model, ids, mask, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    assert len(eager_calls) == NEW  # every forward, prefill and decode
    cache, ref_cache = got.past_key_values, want.past_key_values
    assert torch.equal(cache.layers[0].keys, ref_cache.layers[0].keys)
    assert torch.equal(cache.layers[0].indexer_keys, ref_cache.layers[0].indexer_keys)
    # nothing of the eager call is left on the attention modules
    assert all("forward" not in vars(m) for m in model._kvoffload_session.spec.attention_modules)

    # the stance over: the compiled graphs serve again, none compiled anew
    ids2, mask2 = left_padded_batch([10, 5, 8], seed=2)
    assert torch.equal(_gen(model, ids2, mask2), _gen(ref, ids2, mask2))
    assert len(eager_calls) == NEW and len(model._kvoffload_compile_reports) == graphs

    # beam search under force_eager (rows forked between forwards, on the same session)
    with torch.compiler.set_stance("force_eager"):
        got = _gen(model, ids, mask, num_beams=2)
    assert torch.equal(got, _gen(ref, ids, mask, num_beams=2))


class _Flip(LogitsProcessor):
    """Sets the stance between two forwards of a running generate: force_eager from step ``start`` to
    ``stop``."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop, self.steps = start, stop, 0

    def __call__(self, input_ids, scores):
        self.steps += 1
        if self.steps == self.start:
            torch.compiler.set_stance("force_eager")
        if self.steps == self.stop:
            torch.compiler.set_stance("default")
        return scores


def test_a_sequence_continues_across_the_stance_change(compiled, eager_calls):
    model, ref = compiled
    graphs = len(model._kvoffload_compile_reports)
    ids, mask = left_padded_batch(LENGTHS, seed=3)
    flip = _Flip(start=2, stop=5)
    try:
        got = _gen(model, ids, mask, new=8, logits_processor=LogitsProcessorList([flip]))
    finally:
        torch.compiler.set_stance("default")
    assert torch.equal(got, _gen(ref, ids, mask, new=8))
    assert len(eager_calls) == 3  # the forwards after steps 2, 3 and 4
    assert len(model._kvoffload_compile_reports) == graphs


def test_force_eager_on_a_model_the_eager_attention_cannot_serve(compiled, monkeypatch):
    model, ref = compiled

    def refuse(module):
        raise ValueError(f"torch_kvoffload.offload cannot run {type(module).__name__} eagerly: test")

    monkeypatch.setattr(hf_attention, "rope_functions", refuse)
    ids, mask = left_padded_batch(LENGTHS, seed=4)
    with (
        torch.compiler.set_stance("force_eager"),
        pytest.raises(ValueError, match=r"force_eager.*eagerly: test"),
    ):
        _gen(model, ids, mask)
    monkeypatch.undo()
    assert torch.equal(_gen(model, ids, mask), _gen(ref, ids, mask))  # the graphs still serve


def test_dynamo_disabled_when_compiling_runs_the_eager_attention(monkeypatch, eager_calls):
    """``TORCHDYNAMO_DISABLE=1``: ``torch.compile`` returns the forward itself; every call runs eagerly."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    model = build_model("deepseek_v3", **SMALL)
    ref = copy.deepcopy(model)
    torch_kvoffload.compile(model, {"layerwise": {}})
    ids, mask = left_padded_batch(LENGTHS, seed=5)
    assert torch.equal(_gen(model, ids, mask), _gen(ref, ids, mask))
    assert len(eager_calls) == NEW and not model._kvoffload_compile_reports

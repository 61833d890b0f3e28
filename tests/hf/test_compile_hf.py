"""``torch_kvoffload.compile`` end to end on the tiny Hugging Face models: greedy tokens equal the
unmodified model's, a bounded number of graphs, ``explain``, the backend entry point and bad input."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import ONE_LAYER, SMALL, build_model, indexer_boundary_ties, left_padded_batch

import torch_kvoffload
from torch_kvoffload.backend import kvoffload_backend

NEW_TOKENS = 32
LENGTHS = [9, 13]

# block size 8: the calls' prompts and generations cross block boundaries
CONFIGS = {
    "layerwise": {"layerwise": {}, "block_size": 8},
    "sparse": {"sparse": {}, "block_size": 8},
    "both": {"layerwise": {}, "sparse": {}, "block_size": 8},
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _generate(model, ids, mask, new=NEW_TOKENS):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)


# (prompt lengths of the rows, max_new_tokens) of the calls after the first: batches of 1 and more rows,
# with and without padding (Hugging Face passes no attention mask for a batch without), one-token prompts
# and one-token decodes; MANY_SHAPES for the case that also bounds the graph count (the input variants
# behind the graphs are the same in every mode: V3.2 with both runtimes has the most to trace), SHAPES
# otherwise
SHAPES = [([5, 4], 8), ([12], 4), ([20, 19, 18], 16), ([3, 2], 8)]
# for the V3.2 cases with one runtime: other batch sizes and lengths of the input variants the first
# call compiled (padded batches of 2 and more), which the graphs of "both" and of V3 already bound
PADDED_SHAPES = [([5, 4], 8), ([20, 19, 18], 16)]
MANY_SHAPES = [
    ([5, 4], 8), ([12], 4), ([20, 19, 18], 16), ([3, 3], 8), ([7, 6, 5, 7], 5), ([1], 6), ([9, 9, 9], 3),
    ([11, 10], 7), ([4, 3, 2, 4, 3], 9), ([25], 4), ([1, 1], 3), ([6, 2], 1), ([2], 3), ([14, 1, 8], 6),
]  # fmt: skip
# a prefill and a decode graph for each of: batch 1 / more, prompt (or cached) length 1 / more, with /
# without attention mask, is at most 16; MANY_SHAPES after a prompt run twice (its second run skips the cached
# prefix: prompt columns after a cached past) need 11 (13 with shape-specialised first graphs)
MAX_GRAPHS = 11


# two layers where the layerwise pipeline passes from layer to layer (V3.2, the graphs holding the indexer
# too); one layer elsewhere (Dynamo traces every layer of every graph): the graph count of MANY_SHAPES depends
# on the runtimes' input variants, not on the layers
@pytest.mark.parametrize(
    ("family", "mode", "shapes", "widths"),
    [("deepseek_v3", "layerwise", SHAPES, ONE_LAYER), ("deepseek_v32", "layerwise", PADDED_SHAPES, SMALL),
     ("deepseek_v32", "sparse", PADDED_SHAPES, ONE_LAYER), ("deepseek_v32", "both", MANY_SHAPES, ONE_LAYER)],
    ids=["v3-layerwise", "v32-layerwise", "v32-sparse", "v32-both"],
)  # fmt: skip
def test_compiled_generate_matches_the_model_call_after_call(family, mode, shapes, widths):
    """One compiled model, called again and again with other shapes: every call gives the unmodified
    model's tokens, each sizes the library's caches for its own requests, the graph count stays bounded
    (Dynamo's default recompile limit, 8, used to run out after four calls of new shapes) and calls of
    shapes seen before compile nothing."""
    ids, mask = left_padded_batch(LENGTHS)
    model = build_model(family, **widths)
    ref = copy.deepcopy(model)
    want = _generate(ref, ids, mask)

    # fullgraph=True (passed through to torch.compile) for one case: the rewritten graph has no break
    kwargs = {"fullgraph": True} if mode == "both" else {}
    model = torch_kvoffload.compile(model, CONFIGS[mode], **kwargs)
    got = _generate(model, ids, mask)
    assert torch.equal(got, want), f"{(got != want).sum().item()} tokens differ"

    # prefill + decode graphs only: the cached length is dynamic, so 32 steps do not recompile
    graphs = model._kvoffload_compile_reports
    assert 1 <= len(graphs) <= 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3

    text = torch_kvoffload.explain(model)
    for layer in range(widths["num_hidden_layers"]):
        assert f"layer {layer}:" in text
    assert "mla_cache_attention" in text
    assert ("indexer top-k" in text) == (family == "deepseek_v32")
    # the graphs hold no layerwise hook ops: the KV core runs each layer's loads and saves in cache_write
    assert "layer_wait" not in text and "layer_save" not in text

    stats = torch_kvoffload.stats(model)
    assert stats["forwards"] == NEW_TOKENS
    if mode != "layerwise":
        assert stats["misses"] > 0 and stats["bytes_h2d"] > 0  # decode read the host pool
    if mode != "sparse":
        assert stats["layer_saves"] > 0  # the KV went through the host store

    # a second generate of the same prompts: the cached blocks are skipped (prefix reuse; from the prefix
    # store without layerwise offload), whose prompt columns after a cached past take one graph of their
    # own; the decode graph is reused
    n_graphs, served = len(graphs), torch_kvoffload.stats(model)["prefix_store_tokens"]
    again = _generate(model, ids, mask, new=4)
    assert torch.equal(again, want[:, : ids.shape[1] + 4])
    reused = torch_kvoffload.stats(model)["prefix_store_tokens"] - served
    assert reused > 0
    assert len(model._kvoffload_compile_reports) == n_graphs + (reused > 0)

    counts = []
    for i, (lengths, new) in enumerate(shapes):
        ids, mask = left_padded_batch(lengths, seed=100 + i)
        want = _generate(ref, ids, mask, new)
        if family == "deepseek_v32":
            rows = [want[b][mask[b].bool().tolist() + [True] * new] for b in range(len(lengths))]
            assert indexer_boundary_ties(ref, rows) == 0
        got = _generate(model, ids, mask, new)
        assert torch.equal(got, want), f"call {i} {lengths}: {(got != want).sum().item()} tokens differ"
        # each call's caches were sized for its requests: prompt width + new tokens - 1 each
        s = torch_kvoffload.stats(model)
        sparse = mode != "layerwise"
        assert (s.get("reserved_tokens"), s.get("reserved_requests")) == (
            ids.shape[1] + new - 1,
            len(lengths) if sparse else 0,
        )
        counts.append(len(model._kvoffload_compile_reports))
    assert counts[-1] <= MAX_GRAPHS, counts
    # the same shapes again compile nothing
    for i, (lengths, new) in enumerate(shapes[:6]):
        ids, mask = left_padded_batch(lengths, seed=200 + i)
        _generate(model, ids, mask, new)
    assert len(model._kvoffload_compile_reports) == counts[-1]


def test_explain_runs_a_forward_when_nothing_is_compiled():
    model = build_model("deepseek_v3", **SMALL)
    ref = copy.deepcopy(model)
    model = torch_kvoffload.compile(model, CONFIGS["layerwise"])
    ids, mask = left_padded_batch([5, 5])
    text = torch_kvoffload.explain(model, ids, attention_mask=mask)
    assert text.startswith("DeepseekV3ForCausalLM: 1 graph(s)")
    assert "replaced" in text and "layer_save" not in text  # the core saves in cache_write
    # the same call spelled by keyword or all positionally reuses the graph (Dynamo alone would build one per
    # spelling: it guards on the number of positional arguments)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        for got in (
            model(input_ids=ids, attention_mask=mask),
            model(ids, mask),
            model(ids, attention_mask=mask),
        ):
            torch.testing.assert_close(got.logits, want, rtol=1e-4, atol=1e-5)
    assert len(model._kvoffload_compile_reports) == 1
    with torch.no_grad(), pytest.raises(TypeError, match="multiple values"):  # the forward's own error
        model(ids, input_ids=ids)
    with pytest.raises(ValueError, match=r"was not compiled with torch_kvoffload\.compile"):
        torch_kvoffload.explain(build_model("deepseek_v3", **SMALL))


def test_backend_is_registered_by_entry_point():
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "kvoffload" in list_backends(exclude_tags=())
    assert lookup_backend("kvoffload") is kvoffload_backend


def test_entry_point_backend_with_a_config():
    """``torch.compile(model, backend="kvoffload", options={"config": ...})``: no package call needed; the
    backend builds the session and brackets each compiled call (each a fresh sequence here)."""
    ids, mask = left_padded_batch([5, 7], seed=1)
    with torch.no_grad():
        want = build_model("deepseek_v32", **SMALL)(ids, attention_mask=mask).logits
        model = build_model("deepseek_v32", **SMALL)
        compiled = torch.compile(model, backend="kvoffload", options={"config": CONFIGS["both"]})
        for _ in range(2):
            got = compiled(ids, attention_mask=mask).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch_kvoffload.stats(model)["forwards"] == 2


def test_compile_rejects_bad_input_and_leaves_the_model_alone():
    model = build_model("deepseek_v3", **SMALL)
    forward = model.forward
    with pytest.raises(ValueError, match="'backend' is set by the library"):
        torch_kvoffload.compile(model, None, backend="inductor")
    with pytest.raises(ValueError, match="sparse decode offload needs a lightning indexer"):
        torch_kvoffload.compile(model, CONFIGS["sparse"])
    assert model.forward == forward and getattr(model, "_kvoffload_session", None) is None

    class NotMLA(torch.nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(ValueError, match="NotMLA"):
        torch_kvoffload.compile(NotMLA())


def test_backend_needs_a_session():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown options"):
        kvoffload_backend(gm, [], options={"sesion": None})
    with pytest.raises(ValueError, match="no offload session"):
        kvoffload_backend(gm, [], options={})

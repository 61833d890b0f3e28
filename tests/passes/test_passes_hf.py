"""The offload passes on graphs Dynamo captured from the real tiny Hugging Face MLA / DSA models.

Graphs are recorded with a pass-through backend while the unmodified model generates with its own
``DynamicCache`` (prefill graph, decode graphs). The analysis is checked against the model's config and
modules; the rewritten graph is run against a dense absorbed-attention test runtime (written out here)
and must give the logits the unmodified graph gives.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import SMALL, build_model

from torch_kvoffload.ops import layer_hooks, mla_runtime
from torch_kvoffload.passes import (
    AbsorbMLAPass,
    KVPPHooksPass,
    LayerwiseHooksPass,
    OffloadPassManager,
    PassContext,
    _match,
    analyze_graph,
)

pytestmark = pytest.mark.slow  # captures whole Hugging Face models with Dynamo

# Narrow widths keep the captures fast; the graph structure is the full model's.
LAYERS = SMALL["num_hidden_layers"]
_names = itertools.count()


def _capture(
    family: str, attn: str, *, new_tokens: int = 3, lengths=(6, 6), seed: int = 0, **generate_kwargs
):
    """``(model, [[gm, inputs]...])``: the graphs of a greedy generate, prefill first, with the inputs of
    their first call."""
    model = build_model(family, attn_implementation=attn, seed=seed, **SMALL)
    graphs = []

    def record(gm, example_inputs):
        entry = [gm, None]
        graphs.append(entry)

        def run(*args):
            if entry[1] is None:  # the first call's real inputs (sizes as ints, not symbols)
                entry[1] = list(args)
            return gm.forward(*args)

        return run

    torch._dynamo.reset()
    original = model.forward
    model.forward = torch.compile(original, backend=record)
    ids = torch.randint(3, 1000, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **generate_kwargs)
    model.forward = original
    return model, graphs


@pytest.fixture(scope="module", params=[("deepseek_v3", "sdpa"), ("deepseek_v3", "eager"),
                                        ("deepseek_v32", "sdpa"), ("deepseek_v32", "eager")])  # fmt: skip
def captured(request):
    family, attn = request.param
    model, graphs = _capture(family, attn)
    assert len(graphs) >= 2, "expected a prefill and at least one decode graph"
    return family, attn, model, graphs


def _ctx(num_caches: int = 2, layerwise: str | None = None, kvpp: str | None = None) -> PassContext:
    return PassContext(
        runtime="passes-test", num_caches=lambda layer: num_caches, layerwise_runtime=layerwise,
        kvpp_scheduler=kvpp, num_layers=LAYERS,
    )  # fmt: skip


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    from torch_kvoffload.backend import _own_copy

    return _own_copy(gm)


def test_analysis_finds_every_layer(captured):
    family, attn, model, graphs = captured
    cfg = model.config
    for index, (gm, _) in enumerate(graphs):
        a = analyze_graph(gm)
        assert a.problems == {}, a.problems
        assert [s.layer for s in a.layers] == list(range(LAYERS))
        for s in a.layers:
            attn_module = model.model.layers[s.layer].self_attn
            assert s.scope == f"model.layers.{s.layer}.self_attn"
            assert s.attention_kind == attn
            assert (s.heads, s.qk_nope_dim, s.rope_dim, s.v_dim, s.latent_dim) == (
                cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                cfg.kv_lora_rank,
            )  # fmt: skip
            assert s.scale == pytest.approx(attn_module.scaling)
            # cache inputs: graph placeholders in decode graphs, the empty seed made in the prefill graph
            for w in s.writes:
                assert w.kind == "cat"
                if index == 0:
                    assert w.cache_input.op != "placeholder"
                else:
                    assert w.cache_input.op == "placeholder"
            assert _match.shape(s.latent.node)[-1] == cfg.kv_lora_rank
            assert _match.shape(s.rope.node)[-1] == cfg.qk_rope_head_dim
            assert "kv_b_proj" in _match.module_path(s.kv_b_proj)
            if family == "deepseek_v32":
                ix = s.indexer
                assert ix is not None
                assert _match.is_op(ix.topk, "topk")
                assert _match.shape(ix.write.node)[-1] == cfg.index_head_dim
                assert tuple(_match.shape(ix.query))[2:] == (cfg.index_n_heads, cfg.index_head_dim)
                assert tuple(_match.shape(ix.weights))[-1] == cfg.index_n_heads
                assert ix.scale == pytest.approx(cfg.index_head_dim**-0.5)
            else:
                assert s.indexer is None


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_analysis_finds_static_cache_writes(family):
    """A static cache is written in place (``index_copy_`` into the preallocated input) and read whole."""
    model, graphs = _capture(family, "sdpa", new_tokens=2, cache_implementation="static")
    for gm, _ in graphs:
        a = analyze_graph(gm)
        assert a.problems == {}
        assert [s.layer for s in a.layers] == list(range(LAYERS))
        for s in a.layers:
            for w in s.writes:
                assert w.kind == "index_copy"
                # a graph input, or (first forward) the buffer allocated in the graph from nothing
                assert w.cache_input.op == "placeholder" or not w.cache_input.all_input_nodes
                assert w.new is w.node.args[3]
            assert (s.indexer is not None) == (family == "deepseek_v32")
            assert s.latent_dim == model.config.kv_lora_rank
        gm2 = _copy(gm)
        OffloadPassManager()(gm2, _ctx(layerwise="lw"))
        code = gm2.code
        OffloadPassManager()(gm2, _ctx(layerwise="lw"))
        assert gm2.code == code
        assert len(_calls(gm2, "mla_cache_attention")) == LAYERS


def _calls(gm, name: str, layer: int | None = None):
    op = getattr(torch.ops.kvoffload, name).default
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op
            and (layer is None or n.args[1] == layer)]  # fmt: skip


@pytest.mark.parametrize("which", ["absorb", "layerwise", "kvpp", "all"])
def test_passes_are_idempotent_and_lint(captured, which):
    _, _, _, graphs = captured
    passes = {
        "absorb": [AbsorbMLAPass()],
        "layerwise": [LayerwiseHooksPass()],
        "kvpp": [KVPPHooksPass()],
        "all": None,
    }[which]
    ctx = _ctx(layerwise="lw", kvpp="pp")
    for gm0, _ in graphs[:2]:
        gm = _copy(gm0)
        manager = OffloadPassManager(passes)
        first = manager(gm, ctx)
        gm.graph.lint()
        code = gm.code
        second = manager(gm, ctx)
        gm.graph.lint()
        assert gm.code == code
        assert second.records == first.records
        assert first.records, "the pass did nothing"


def test_no_full_cache_reexpansion_after_passes(captured):
    family, _, _, graphs = captured
    ctx = _ctx(num_caches=3, layerwise="lw")
    for gm0, _ in graphs:
        gm = _copy(gm0)
        OffloadPassManager()(gm, ctx)
        assert analyze_graph(gm).layers == []
        kv_b_weights = {n for n in gm.graph.nodes if n.op == "placeholder" and "kv_b_proj" in n.name}
        assert len(kv_b_weights) == LAYERS
        for n in gm.graph.nodes:
            assert not (_match.is_op(n, "linear") and n.args[1] in kv_b_weights), (
                f"{n.name} re-expands a cache"
            )
            assert not _match.is_op(n, "sdpa")
            if any(_match.in_scope(n, f"model.layers.{i}.self_attn") for i in range(LAYERS)):
                assert not _match.is_op(n, "topk"), f"{n.name}: the indexer top-k is still computed"
        for layer in range(LAYERS):
            (w,) = _calls(gm, "mla_cache_write", layer)
            (a,) = _calls(gm, "mla_cache_attention", layer)
            (wait,) = _calls(gm, "layer_wait", layer)
            (pre,) = _calls(gm, "layer_prefetch", layer)
            (save,) = _calls(gm, "layer_save", layer)
            pos = {n: i for i, n in enumerate(gm.graph.nodes)}
            assert pos[wait] < pos[pre] < pos[w] < pos[save] < pos[a]
            assert (a.args[4] is None) == (family == "deepseek_v3")
            # every op of the layer takes the same cache inputs, in order
            caches = w.args[5]
            assert [c.name for c in caches] == [f"kvoffload_l{layer}_c{i}" for i in range(3)]
            assert a.args[8] == caches and wait.args[2] == caches
        # the new graph inputs come last, in the order recorded for the runner
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        extra = [
            (int(p.name.split("_")[1][1:]), int(p.name.split("_c")[-1])) for p in placeholders[-3 * LAYERS :]
        ]
        assert gm.meta["kvoffload_cache_inputs"] == extra


def test_kvpp_pass_waits_then_prefetches_next_layer(captured):
    _, _, _, graphs = captured
    gm = _copy(graphs[-1][0])
    OffloadPassManager()(gm, _ctx(kvpp="pp"))
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for layer in range(LAYERS):
        (wait,) = _calls(gm, "kvpp_wait_layer", layer)
        (w,) = _calls(gm, "mla_cache_write", layer)
        assert pos[wait] < pos[w]
        pre = _calls(gm, "kvpp_prefetch_layer", layer + 1)
        if layer + 1 < LAYERS:
            assert len(pre) == 1 and pos[wait] < pos[pre[0]] < pos[w]
        else:
            assert pre == []
    assert _calls(gm, "layer_wait") == []


def test_a_runtime_that_runs_the_hooks_gets_them_only_around_layers_it_does_not_write(captured):
    """``runtime_runs_hooks`` (the library's KV core runs each layer's layerwise and KVPP steps in
    ``mla_cache_write``): no hook op around an absorbed layer; a graph absorb did not rewrite (the model's
    own cache appends) still gets them around each layer's appends."""
    _, _, _, graphs = captured
    ctx = PassContext(
        runtime="passes-test", num_caches=lambda layer: 2, layerwise_runtime="lw", kvpp_scheduler="pp",
        num_layers=LAYERS, runtime_runs_hooks=True,
    )  # fmt: skip
    gm = _copy(graphs[-1][0])
    report = OffloadPassManager()(gm, ctx)
    assert len(_calls(gm, "mla_cache_write")) == LAYERS
    for hook in ("layer_wait", "layer_prefetch", "layer_save", "kvpp_wait_layer", "kvpp_prefetch_layer"):
        assert _calls(gm, hook) == [], hook
    assert not [r for r in report.records if r.action == "inserted"]
    unabsorbed = _copy(graphs[-1][0])
    OffloadPassManager([LayerwiseHooksPass(), KVPPHooksPass()])(unabsorbed, ctx)
    for layer in range(LAYERS):
        assert (
            len(_calls(unabsorbed, "layer_wait", layer))
            == len(_calls(unabsorbed, "kvpp_wait_layer", layer))
            == 1
        )


def test_context_rejects_bad_values():
    with pytest.raises(ValueError, match="runtime"):
        PassContext(runtime="", num_caches=lambda layer: 1)
    with pytest.raises(ValueError, match="layerwise_runtime"):
        PassContext(runtime="x", num_caches=lambda layer: 1, layerwise_runtime="")
    ctx = PassContext(runtime="x", num_caches=lambda layer: 0, num_layers=2)
    with pytest.raises(ValueError, match="caches of layer 0"):
        ctx.caches_of(0)
    with pytest.raises(ValueError, match="attention layer 5"):
        ctx.caches_of(5)


# --------------------------------------------------------------------------- numerics of the rewrite
class DenseReference:
    """A test runtime: keeps every row per layer and runs absorbed attention densely (no padding).

    ``score[t, s] = scale · (q_nope[t] · kv_c[s] + q_pe[t] · k_pe[s])`` over the causal keys; with an
    indexer, only the ``top_k`` keys of ``Σ_h w[t,h] · relu(index_q[t,h] · index_k[s])`` are kept.
    """

    def __init__(self, top_k: int | None, caches: list[torch.Tensor]) -> None:
        self.top_k = top_k
        self.caches = caches  # what the graph is given as every layer's cache inputs
        self.rows: dict[int, list[torch.Tensor | None]] = {}
        self.calls: list[tuple[str, int]] = []
        self.hook_calls: list[tuple[str, int]] = []

    def cache_write(self, layer, kv_c, k_pe, index_k):
        self.calls.append(("write", layer))
        old = self.rows.get(layer)
        new = [kv_c, k_pe, index_k]
        if old is not None:
            new = [None if o is None else torch.cat([o, n], dim=1) for o, n in zip(old, new, strict=True)]
        self.rows[layer] = new

    def layer_caches(self, layer):
        return self.caches

    def cache_attention(self, layer, q_nope, q_pe, index_q, index_weights, scale, out):
        self.calls.append(("attention", layer))
        kv_c, k_pe, index_k = self.rows[layer]
        S, T = q_nope.shape[1], kv_c.shape[1]
        s = torch.einsum("bshc,btc->bhst", q_nope, kv_c) + torch.einsum("bshr,btr->bhst", q_pe, k_pe)
        s = s * scale
        qpos = torch.arange(T - S, T)[:, None]
        allowed = torch.arange(T)[None, :] <= qpos  # [S, T]
        allowed = allowed.expand(q_nope.shape[0], S, T)
        if index_q is not None:
            iscore = torch.einsum(
                "bsh,bsht->bst", index_weights, torch.relu(torch.einsum("bshd,btd->bsht", index_q, index_k))
            )
            iscore = iscore.masked_fill(~allowed, -math.inf)
            k = min(self.top_k, T)
            top = iscore.topk(k, dim=-1).indices
            chosen = torch.zeros_like(allowed).scatter(-1, top, True)
            allowed = allowed & chosen
        s = s.masked_fill(~allowed[:, None], -math.inf)
        p = torch.softmax(s.float(), dim=-1).to(kv_c.dtype)
        out.copy_(torch.einsum("bhst,btc->bshc", p, kv_c))

    # layerwise hooks: only their order is recorded
    def wait_layer(self, layer, caches=None):
        self.hook_calls.append(("wait", layer))

    def prefetch_layer(self, layer, caches=None):
        self.hook_calls.append(("prefetch", layer))

    def save_layer(self, layer, caches=None):
        self.hook_calls.append(("save", layer))


def test_rewritten_graphs_match_the_model(captured):
    """Prefill and decode graphs (static and symbolic length), rewritten, give the unmodified graph's
    logits when the runtime ops are served by a dense reference."""
    _, _, model, graphs = captured
    name = f"passes-ref-{next(_names)}"
    caches = [torch.zeros(1) for _ in range(2)]
    ref = DenseReference(getattr(model.config, "index_topk", None), caches)
    mla_runtime.runtimes.register(name, ref)
    layer_hooks.runtimes.register(name + "/lw", ref)
    ctx = PassContext(
        runtime=name, num_caches=lambda layer: 2, layerwise_runtime=name + "/lw", num_layers=LAYERS
    )
    try:
        for gm0, inputs in graphs:  # in the order generate ran them
            want = gm0(*inputs)
            gm = _copy(gm0)
            OffloadPassManager()(gm, ctx)
            extra = [caches[i] for _, i in gm.meta["kvoffload_cache_inputs"]]
            ref.calls.clear()
            ref.hook_calls.clear()
            got = gm(*inputs, *extra)
            logits_want, logits_got = want[-1], got[-1]
            assert logits_got.shape == logits_want.shape
            torch.testing.assert_close(logits_got, logits_want, rtol=1e-4, atol=1e-4)
            assert ref.calls == [(k, layer) for layer in range(LAYERS) for k in ("write", "attention")]
            assert ref.hook_calls == [
                (k, layer) for layer in range(LAYERS) for k in ("wait", "prefetch", "save")
            ]
    finally:
        mla_runtime.runtimes.unregister(name)
        layer_hooks.runtimes.unregister(name + "/lw")


def test_unmatched_attention_is_reported_not_rewritten(captured):
    """A graph whose attention the analysis cannot map is left as it is, with the reason recorded."""
    _, attn, _, graphs = captured
    gm = _copy(graphs[-1][0])
    # break the pattern: the rope-key append of layer 1 no longer looks like a cache append
    cat = analyze_graph(gm).layer(1).rope.node
    cat.args = ([cat.args[0][1], cat.args[0][1]], *cat.args[1:])
    gm.recompile()
    records = OffloadPassManager()(gm, _ctx()).records
    skipped = [r for r in records if r.action == "skipped"]
    assert len(skipped) == 1 and "model.layers.1.self_attn" in skipped[0].detail
    assert {r.layer for r in records if r.action == "replaced"} == {0}
    if attn == "sdpa":
        assert sum(1 for n in gm.graph.nodes if _match.is_op(n, "sdpa")) == 1
    else:
        assert sum(1 for n in gm.graph.nodes if _match.is_op(n, "softmax")) == 1

"""Absorbed MLA: replace each layer's cache append + latent re-expansion + dense attention.

Per layer found by :func:`~torch_kvoffload.passes.analysis.analyze_graph`, the pass inserts, right
before the layer's attention call (``B`` batch, ``S`` new tokens, ``H`` heads)::

    kv_c, k_pe   = new latent rows [B,S,Dc], new rope-key rows [B,S,Dr]   (the appended tensors)
    index_k      = new indexer-key rows [B,S,Di] or None
    kvoffload::mla_cache_write(runtime, layer, kv_c, k_pe, index_k, caches)
    W            = kv_b_proj.weight.view(H, nope + v, Dc);  W_UK = W[:, :nope];  W_UV = W[:, nope:]
    q_nope_abs   = einsum("bhsn,hnc->bshc", q_nope, W_UK)                  [B,S,H,Dc]
    q_pe         = q_rope.transpose(1, 2)                                  [B,S,H,Dr]
    index_weights = weights · c    (the indexer's ``relu(c · q·k)`` scale folded in; c > 0)
    out          = empty [B,S,H,Dc]
    kvoffload::mla_cache_attention(runtime, layer, q_nope_abs, q_pe, index_q, index_weights, scale,
                                   out, caches)
    attn         = einsum("bshc,hvc->bhsv", out, W_UV)                     [B,H,S,v]

and makes every user of the old attention output read ``attn`` (so the model's own reshape and
``o_proj`` follow unchanged). The old attention, the re-expansion through ``kv_b_proj``, the indexer's
dense scoring / top-k / mask, and the full-cache ``cat`` (unless the graph returns it) become dead
and are removed.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from torch_kvoffload.passes import _graph as g
from torch_kvoffload.passes import _match as m
from torch_kvoffload.passes._ops import op
from torch_kvoffload.passes.analysis import LayerSites, analyze_graph
from torch_kvoffload.passes.context import PassContext

__all__ = ["AbsorbMLAPass"]


def _rows(graph: fx.Graph, new: fx.Node) -> fx.Node:
    """New cache rows as ``[B, S, D]`` (a ``[B, 1, S, D]`` append loses its head axis)."""
    if len(m.shape(new)) == 4:
        return graph.call_method("squeeze", (new, 1))
    return new


def _query_parts(graph: fx.Graph, sites: LayerSites) -> tuple[fx.Node, fx.Node]:
    """``q_nope [B,H,S,nope]`` and the roped ``q_pe [B,H,S,rope]`` the attention query is made of."""
    q = sites.query
    if m.is_op(q, "cat"):
        parts = m.arg(q, 0, "tensors")
        dim = m.arg(q, 1, "dim", 0)
        if (
            isinstance(parts, (list, tuple))
            and len(parts) == 2
            and dim in (-1, 3)
            and m.shape(parts[0]) is not None
            and m.static_int(m.shape(parts[0])[-1]) == sites.qk_nope_dim
        ):
            return parts[0], parts[1]
    nope = sites.qk_nope_dim
    q_nope = graph.call_function(operator.getitem, (q, (Ellipsis, slice(None, nope))))
    q_pe = graph.call_function(operator.getitem, (q, (Ellipsis, slice(nope, None))))
    return q_nope, q_pe


class AbsorbMLAPass:
    """Rewrite each MLA layer onto ``mla_cache_write`` + ``mla_cache_attention`` (absorbed, latent space)."""

    name = "absorb_mla"

    def uuid(self) -> str:
        return "kvoffload.absorb_mla.v1"

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> list[g.PassRecord]:
        analysis = analyze_graph(gm)
        done: list[g.PassRecord] = []
        for scope, reason in analysis.problems.items():
            done.append(g.record(gm, g.PassRecord(self.name, -1, "skipped", f"{scope}: {reason}")))
        write_op, attn_op = op("mla_cache_write"), op("mla_cache_attention")
        for sites in analysis.layers:
            if g.op_nodes(gm.graph, attn_op, sites.layer):
                continue  # already absorbed (a graph keeps one attention per layer)
            done.extend(self._rewrite(gm, ctx, sites, write_op, attn_op))
        if done:
            g.finish(gm)
        return done

    def _rewrite(
        self, gm: fx.GraphModule, ctx: PassContext, s: LayerSites, write_op: object, attn_op: object
    ) -> list[g.PassRecord]:
        graph = gm.graph
        layer = s.layer
        caches = g.layer_cache_nodes(gm, layer, ctx.caches_of(layer))
        old = s.attention
        meta = {k: old.meta[k] for k in ("nn_module_stack", "stack_trace") if k in old.meta}
        before = set(graph.nodes)
        h, nope, v, c = s.heads, s.qk_nope_dim, s.v_dim, s.latent_dim
        with graph.inserting_before(old):
            kv_c = _rows(graph, s.latent.new)
            k_pe = _rows(graph, s.rope.new)
            index_k = _rows(graph, s.indexer.write.new) if s.indexer is not None else None
            graph.call_function(write_op, (ctx.runtime, layer, kv_c, k_pe, index_k, caches))
            w = graph.call_method("view", (s.kv_b_weight, h, nope + v, c))
            w_uk = graph.call_function(operator.getitem, (w, (slice(None), slice(None, nope))))
            w_uv = graph.call_function(operator.getitem, (w, (slice(None), slice(nope, None))))
            q_nope, q_rope = _query_parts(graph, s)
            q_abs = graph.call_function(torch.einsum, ("bhsn,hnc->bshc", q_nope, w_uk))
            q_abs = graph.call_method("contiguous", (q_abs,))
            q_pe = graph.call_method("transpose", (q_rope, 1, 2))
            q_pe = graph.call_method("contiguous", (q_pe,))
            index_q = index_w = None
            if s.indexer is not None:
                index_q = graph.call_method("contiguous", (s.indexer.query,))
                index_w = graph.call_function(operator.mul, (s.indexer.weights, s.indexer.scale))
                index_w = graph.call_method("contiguous", (index_w,))
            out = graph.call_function(torch.empty_like, (q_abs,))
            graph.call_function(
                attn_op, (ctx.runtime, layer, q_abs, q_pe, index_q, index_w, s.scale, out, caches)
            )
            attn = graph.call_function(torch.einsum, ("bshc,hvc->bhsv", out, w_uv))
        for node in graph.nodes:
            if node not in before:
                node.meta.update(meta)
        old.replace_all_uses_with(attn)
        scope = s.scope

        def removable(n: fx.Node) -> bool:  # only this layer's attention subgraph
            return not scope or m.in_scope(n, scope)

        removed = g.remove_dead(graph, removable)
        graph_outputs = {a for a in graph.output_node().all_input_nodes} if graph.output_node() else set()
        kept = [w.node.name for w in s.writes if w.node in graph.nodes and w.node in graph_outputs]
        recs = [
            g.PassRecord(
                self.name,
                layer,
                "found",
                f"{scope}: cache writes {', '.join(w.node.name for w in s.writes)}; kv_b_proj "
                f"{s.kv_b_proj.name}; {s.attention_kind} attention {old.name}"
                + (f"; indexer top-k {s.indexer.topk.name}" if s.indexer is not None else ""),
            ),
            g.PassRecord(
                self.name,
                layer,
                "replaced",
                f"{s.attention_kind} attention over the re-expanded cache -> mla_cache_write + "
                f"mla_cache_attention ({'indexer top-k' if s.indexer is not None else 'dense'}, "
                f"{h} heads, latent {c}, rope {s.rope_dim}, scale {s.scale:.6g}); {removed} nodes removed"
                + (f"; cache outputs kept for the caller: {', '.join(kept)}" if kept else ""),
            ),
        ]
        for r in recs:
            g.record(gm, r)
        return recs

"""Find, per attention layer of a captured graph, what the offload passes rewrite.

Everything is found from the graph alone: op patterns, tensor shapes and ``node.meta["nn_module_stack"]``.
No model family is named. For a Hugging Face MLA / DSA graph (transformers 5.x, captured by Dynamo) a
layer looks like this (``B`` batch, ``S`` new tokens, ``T`` cached + new tokens, ``H`` heads)::

    keys   = cat([cache_keys   [B,1,T0,Dc], kv_c [B,1,S,Dc]], dim=-2)    # latent cache write
    values = cat([cache_values [B,1,T0,Dr], k_pe [B,1,S,Dr]], dim=-2)    # rope-key cache write
    kv     = linear(keys, kv_b_proj.weight)  [B,1,T,H*(nope+v)]          # re-expansion of the cache
    (index_k = cat([cache_index [B,T0,Di], k_idx [B,S,Di]], dim=1)       # indexer cache write (DSA)
     scores = matmul(weights [B,S,1,Hi], relu(matmul(q_idx [B,S,Hi,Di], index_kᵀ) · c))
     topk(masked scores) -> scatter -> boolean mask)                     # indexer top-k
    out    = sdpa(query [B,H,S,nope+rope], key, value, mask, scale)  [B,H,S,v]
             (or matmul -> mul(scale) -> add(mask) -> softmax -> matmul: eager attention)

A cache *input* is a placeholder (or a tensor made in the graph from nothing, the seed of an empty
cache); a cache *write* is a ``cat`` of a cache input with new rows along the token dimension, or an
``index_copy_`` into it (static caches). The latent cache is the write that feeds a ``linear`` (the
latent up-projection, ``kv_b_proj``); the attention is the one that linear reaches; the rope-key cache is
the other write the attention's key reads; the indexer cache is the write the top-k reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch.fx as fx

from torch_kvoffload.passes import _match as m

__all__ = ["CacheWrite", "GraphAnalysis", "IndexerSites", "LayerSites", "analyze_graph"]


@dataclass
class CacheWrite:
    """One append of new rows to a cache input.

    ``kind`` is ``"cat"`` (``node = cat([cache, new], dim)``) or ``"index_copy"``
    (``node = cache.index_copy_(dim, positions, new)``). ``new`` holds the rows of this forward.
    """

    node: fx.Node
    cache_input: fx.Node
    new: fx.Node
    dim: int
    kind: str


@dataclass
class IndexerSites:
    """The lightning indexer's top-k of one layer and the values its score is made of.

    ``score[t, s] = Σ_h weights[t, h] · relu(scale · query[t, h, :] · key[s, :])``; ``query``
    ``[B,S,Hi,Di]``, ``weights`` ``[B,S,Hi]``, ``scale`` a positive Python float.
    """

    topk: fx.Node
    query: fx.Node
    weights: fx.Node
    scale: float
    write: CacheWrite


@dataclass
class LayerSites:
    """What the analysis found for one attention layer (``scope``: its module path)."""

    layer: int
    scope: str
    latent: CacheWrite
    rope: CacheWrite
    kv_b_proj: fx.Node
    kv_b_weight: fx.Node
    attention: fx.Node
    attention_kind: str  # "sdpa" | "eager"
    query: fx.Node
    scale: float
    heads: int
    qk_nope_dim: int
    rope_dim: int
    v_dim: int
    latent_dim: int
    indexer: IndexerSites | None = None

    @property
    def writes(self) -> list[CacheWrite]:
        out = [self.latent, self.rope]
        if self.indexer is not None:
            out.append(self.indexer.write)
        return out


@dataclass
class GraphAnalysis:
    """Per-layer sites, sorted by layer, and what could not be matched (``problems``: scope -> reason)."""

    layers: list[LayerSites] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)

    def layer(self, index: int) -> LayerSites | None:
        return next((s for s in self.layers if s.layer == index), None)


def _token_dim(node: fx.Node, dim: object) -> int | None:
    out = m.shape(node)
    if out is None or not isinstance(dim, int):
        return None
    return dim % len(out)


def _cache_writes(graph: fx.Graph) -> list[CacheWrite]:
    writes: list[CacheWrite] = []
    for node in graph.nodes:
        if m.is_op(node, "cat"):
            tensors = m.arg(node, 0, "tensors")
            if not isinstance(tensors, (list, tuple)) or len(tensors) != 2:
                continue
            cache, new = tensors
            dim = _token_dim(node, m.arg(node, 1, "dim", 0))
            out = m.shape(node)
            # The token dimension of a cache is never the last (feature) one.
            if dim is None or out is None or dim == len(out) - 1 or not m.is_graph_input(cache):
                continue
            if m.shape(new) is None or len(m.shape(new)) != len(out):
                continue
            writes.append(CacheWrite(node, cache, new, dim, "cat"))
        elif m.is_op(node, "index_copy"):
            cache = node.args[0]
            new = m.arg(node, 3, "source")
            dim = _token_dim(cache, m.arg(node, 1, "dim"))
            if m.is_graph_input(cache) and isinstance(new, fx.Node) and dim is not None:
                writes.append(CacheWrite(node, cache, new, dim, "index_copy"))
    return writes


def _written_value(write: CacheWrite) -> fx.Node:
    """The node later ops read the whole cache from (the cat, or the cache updated in place)."""
    return write.node if write.kind == "cat" else write.cache_input


def _layer_index(scope: str, order: int) -> int:
    numbers = re.findall(r"(?:^|\.)(\d+)(?=\.|$)", scope)
    return int(numbers[-1]) if numbers else order


def _find_attention(scope: str, start: fx.Node, graph: fx.Graph) -> tuple[fx.Node, str] | None:
    """The first sdpa (or eager softmax chain) of ``scope`` after ``start`` that depends on it."""
    seen_start = False
    for node in graph.nodes:
        if node is start:
            seen_start = True
            continue
        if not seen_start or not m.in_scope(node, scope):
            continue
        if m.is_op(node, "sdpa") and start in m.ancestors(node):
            return node, "sdpa"
        if m.is_op(node, "softmax") and start in m.ancestors(node):
            out = _eager_output(node)
            if out is not None:
                return out, "eager"
    return None


def _eager_output(softmax: fx.Node) -> fx.Node | None:
    """The ``matmul(p, v)`` reading the probabilities through casts / dropout."""
    frontier = [softmax]
    for _ in range(4):
        nxt = []
        for n in frontier:
            for user in n.users:
                if m.is_op(user, "matmul") and m.strip_casts(user.args[0]) in (n, softmax):
                    return user
                if m.is_op(user, "dropout") or (user.op == "call_method" and user.target in m.CASTS):
                    nxt.append(user)
        frontier = nxt
    return None


def _eager_scores(out: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
    """``(query, key_t, scale)`` of ``softmax(matmul(q, kᵀ) * scale + mask)`` feeding ``out``."""
    p = out.args[0]
    softmax = m.find_upstream(
        p,
        lambda n: m.is_op(n, "softmax"),
        through=lambda n: m.is_op(n, "dropout") or m.strip_casts(n) is not n,
    )
    if softmax is None:
        return None
    node = softmax.args[0]
    scale = 1.0
    for _ in range(4):
        if not isinstance(node, fx.Node):
            return None
        if m.is_op(node, "matmul"):
            return node.args[0], node.args[1], scale
        if m.is_op(node, "add"):
            node = node.args[0]
        elif m.is_op(node, "mul") and m.python_number(node.args[1]) is not None:
            scale *= float(node.args[1])
            node = node.args[0]
        else:
            node = m.strip_casts(node) if m.strip_casts(node) is not node else None
    return None


def _indexer(topk: fx.Node, writes: list[CacheWrite]) -> tuple[fx.Node, fx.Node, float, CacheWrite] | str:
    """Parse ``topk(mask(squeeze(matmul(unsqueeze(w), relu(matmul(q, kᵀ) * c)))))``."""
    node = m.arg(topk, 0, "input")

    def through_mask(n: fx.Node) -> bool:
        return (n.op == "call_method" and n.target in ("masked_fill", "squeeze", "__add__", "add")) or (
            m.is_op(n, "add") or m.strip_casts(n) is not n
        )

    weighted = m.find_upstream(node, lambda n: m.is_op(n, "matmul"), through=through_mask)
    if weighted is None:
        return "no weighted head sum before the top-k"
    w_side, s_side = weighted.args[0], weighted.args[1]
    relu = m.find_upstream(s_side, lambda n: m.is_op(n, "relu"), through=lambda n: m.strip_casts(n) is not n)
    if relu is None:
        return "no relu in the indexer score"
    inner = relu.args[0]
    scale = 1.0
    while isinstance(inner, fx.Node) and m.is_op(inner, "mul") and m.python_number(inner.args[1]) is not None:
        scale *= float(inner.args[1])
        inner = inner.args[0]
    if not (isinstance(inner, fx.Node) and m.is_op(inner, "matmul")):
        return "the indexer score is not relu(matmul(q, kᵀ))"
    if scale <= 0:
        return f"the indexer score scale {scale} is not positive"
    query = m.strip_casts(inner.args[0])
    weights = w_side
    while isinstance(weights, fx.Node) and (
        (weights.op == "call_method" and weights.target == "unsqueeze")
        or m.strip_casts(weights) is not weights
    ):
        weights = weights.args[0]
    q_shape, w_shape = m.shape(query), m.shape(weights)
    if q_shape is None or w_shape is None or len(q_shape) != 4 or len(w_shape) != 3:
        return f"indexer query / weights have unexpected shapes {q_shape} / {w_shape}"
    key_side = m.ancestors(inner)
    write = next((w for w in writes if _written_value(w) in key_side or w.node in key_side), None)
    if write is None:
        return "the indexer score reads no cache write"
    return query, weights, scale, write


def analyze_graph(gm: fx.GraphModule) -> GraphAnalysis:
    """Find every MLA attention layer of ``gm`` (see the module docstring for what is matched)."""
    graph = gm.graph
    result = GraphAnalysis()
    writes = _cache_writes(graph)
    if not writes:
        return result
    by_value = {_written_value(w): w for w in writes}
    order = 0
    for node in graph.nodes:
        if not m.is_op(node, "linear"):
            continue
        latent = by_value.get(m.strip_casts(m.arg(node, 0, "input")))
        if latent is None:
            continue
        scope = m.parent_path(m.module_path(node))
        sites = _layer_sites(gm, node, latent, scope, order, writes)
        if isinstance(sites, str):
            result.problems[scope or f"#{order}"] = sites
        else:
            result.layers.append(sites)
        order += 1
    result.layers.sort(key=lambda s: s.layer)
    if len({s.layer for s in result.layers}) != len(result.layers):  # module paths without distinct numbers
        for i, s in enumerate(result.layers):
            s.layer = i
    return result


def _layer_sites(
    gm: fx.GraphModule, kv_b: fx.Node, latent: CacheWrite, scope: str, order: int, writes: list[CacheWrite]
) -> LayerSites | str:
    found = _find_attention(scope, kv_b, gm.graph)
    if found is None:
        return "no attention reads the up-projected latent cache"
    attention, kind = found
    if kind == "sdpa":
        query, value = attention.args[0], attention.args[2]
        scale = m.arg(attention, 6, "scale")
    else:
        parsed = _eager_scores(attention)
        if parsed is None:
            return "eager attention without matmul(q, kᵀ)·scale before its softmax"
        query, _key, scale = parsed
        value = attention.args[1]
    q_shape, v_shape, c_shape = m.shape(query), m.shape(value), m.shape(latent.new)
    if q_shape is None or v_shape is None or c_shape is None or len(q_shape) != 4:
        return "attention query / value shapes are unknown"
    others = [w for w in writes if w is not latent and (m.in_scope(w.node, scope) or not scope)]
    # The key is assembled in place (new_empty + copy_), so data flow does not reach it; the rope-key
    # cache is the layer's other cache laid out like the latent one ([B, 1, T, D]).
    same_layout = [w for w in others if len(m.shape(w.node)) == len(c_shape) and w.dim == latent.dim]
    if len(same_layout) != 1:
        return f"expected one rope-key cache write next to the latent one, found {len(same_layout)}"
    rope = same_layout[0]
    heads, qk_dim = m.static_int(q_shape[1]), m.static_int(q_shape[-1])
    rope_dim, v_dim, c_dim = (
        m.static_int(m.shape(rope.new)[-1]),
        m.static_int(v_shape[-1]),
        m.static_int(c_shape[-1]),
    )
    weight = m.arg(kv_b, 1, "weight")
    w_shape = m.shape(weight)
    if None in (heads, qk_dim, rope_dim, v_dim, c_dim) or w_shape is None:
        return "head count / widths are not static"
    nope = qk_dim - rope_dim
    if tuple(w_shape) != (heads * (nope + v_dim), c_dim) or m.arg(kv_b, 2, "bias") is not None:
        return (
            f"kv_b_proj weight {tuple(w_shape)} does not match {heads} heads x ({nope} + {v_dim}) x {c_dim}"
        )
    if m.shape(latent.new)[1 if len(c_shape) == 4 else 0] != 1 and len(c_shape) == 4:
        return "the latent cache has more than one head"
    if scale is None:
        scale = qk_dim**-0.5
    if m.python_number(scale) is None:
        return (
            f"attention scale {scale!r} is not a constant (a float Dynamo made symbolic, e.g. after a model of "
            "other head widths was compiled: torch._dynamo.config.specialize_float=True keeps it constant, as "
            "torch_kvoffload.compile does)"
        )
    sites = LayerSites(
        layer=_layer_index(scope, order),
        scope=scope,
        latent=latent,
        rope=rope,
        kv_b_proj=kv_b,
        kv_b_weight=weight,
        attention=attention,
        attention_kind=kind,
        query=query,
        scale=float(scale),
        heads=heads,
        qk_nope_dim=nope,
        rope_dim=rope_dim,
        v_dim=v_dim,
        latent_dim=c_dim,
    )
    attn_deps = m.ancestors(attention)
    topks = [n for n in attn_deps if m.is_op(n, "topk") and (m.in_scope(n, scope) or not scope)]
    if topks:
        topk = m.first_in_order(topks, gm.graph)
        parsed = _indexer(topk, [w for w in others if w is not rope])
        if isinstance(parsed, str):
            return f"indexer top-k found but not understood: {parsed}"
        query_i, weights, iscale, iwrite = parsed
        sites.indexer = IndexerSites(topk, query_i, weights, iscale, iwrite)
    return sites

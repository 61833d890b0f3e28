"""Graph-editing helpers shared by the passes: the layer-cache inputs, records, dead-code removal.

Layer caches as graph inputs
    The runtime ops take a layer's cache tensors (``session.layer_caches(layer)``) as mutated arguments.
    The passes make them graph inputs: one placeholder per tensor, named ``kvoffload_l<layer>_c<i>``,
    appended after the graph's own inputs, and listed in order in
    ``gm.meta["kvoffload_cache_inputs"]`` as ``(layer, i)`` pairs. Whoever runs the graph (the
    ``kvoffload`` backend) passes those tensors after the inputs Dynamo passes.

Records
    Each pass appends :class:`PassRecord` entries to ``gm.meta["kvoffload_records"]``; ``explain`` prints
    them per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from torch_kvoffload.passes import _match as m
from torch_kvoffload.passes._ops import op

CACHE_INPUTS_KEY = "kvoffload_cache_inputs"
RECORDS_KEY = "kvoffload_records"

_VIEW_METHODS = ("view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "narrow")


@dataclass(frozen=True)
class PassRecord:
    """One thing a pass found or did to one layer (``layer`` ``-1``: the whole graph)."""

    pass_name: str
    layer: int
    action: str  # "found" | "inserted" | "replaced" | "removed" | "skipped"
    detail: str


def records(gm: fx.GraphModule) -> list[PassRecord]:
    return gm.meta.setdefault(RECORDS_KEY, [])


def record(gm: fx.GraphModule, rec: PassRecord) -> PassRecord:
    """Append ``rec`` unless the same record is there already (passes run twice record once)."""
    existing = records(gm)
    if rec not in existing:
        existing.append(rec)
    return rec


def cache_inputs(gm: fx.GraphModule) -> list[tuple[int, int]]:
    return gm.meta.setdefault(CACHE_INPUTS_KEY, [])


def layer_cache_nodes(gm: fx.GraphModule, layer: int, count: int) -> list[fx.Node]:
    """The placeholders of ``layer``'s ``count`` cache tensors, created (after the last input) if missing."""
    graph = gm.graph
    existing = {n.target: n for n in graph.nodes if n.op == "placeholder"}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    out = []
    listed = cache_inputs(gm)
    for i in range(count):
        name = f"kvoffload_l{layer}_c{i}"
        node = existing.get(name)
        if node is None:
            anchor = placeholders[-1] if placeholders else None
            if anchor is None:
                with graph.inserting_before(next(iter(graph.nodes), None)):
                    node = graph.placeholder(name)
            else:
                with graph.inserting_after(anchor):
                    node = graph.placeholder(name)
            placeholders.append(node)
            listed.append((layer, i))
        out.append(node)
    return out


def op_nodes(graph: fx.Graph, op: object, layer: int | None = None) -> list[fx.Node]:
    """Call nodes of ``op`` (an OpOverload), optionally only those whose ``layer`` argument is ``layer``."""
    return [
        n
        for n in graph.nodes
        if n.op == "call_function" and n.target is op and (layer is None or n.args[1] == layer)
    ]


def _view_root(node: object) -> object:
    while isinstance(node, fx.Node) and (
        m.is_op(node, "getitem") or (node.op == "call_method" and node.target in _VIEW_METHODS)
    ):
        node = node.args[0]
    return node


def _is_inplace(node: fx.Node) -> bool:
    """A Tensor method ``x.op_(...)``, or an ATen overload whose schema mutates an argument."""
    if node.op == "call_method":
        return isinstance(node.target, str) and node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    return False


def _dead_inplace(node: fx.Node) -> bool:
    """An in-place write into a tensor nothing reads (only views of it and other such writes)."""
    if not _is_inplace(node) or node.users or not node.args:
        return False
    root = _view_root(node.args[0])
    if not isinstance(root, fx.Node) or root.op == "placeholder":
        return False
    frontier, seen = [root], set()
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if _is_inplace(user) and not user.users and _view_root(user.args[0]) is root:
                continue
            if m.is_op(user, "getitem") or (user.op == "call_method" and user.target in _VIEW_METHODS):
                frontier.append(user)
                continue
            return False
    return True


def remove_dead(graph: fx.Graph, removable: Callable[[fx.Node], bool]) -> int:
    """Erase unused nodes for which ``removable`` holds (pure ones and dead in-place writes); count them.

    Unlike ``Graph.eliminate_dead_code`` it also drops in-place writes into a dead temporary (the key
    assembled with ``new_empty`` + ``copy_``) and never touches nodes outside ``removable``.
    """
    removed = 0
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.op in ("placeholder", "output") or node.users or not removable(node):
                continue
            if node.is_impure() and not _dead_inplace(node):
                continue
            if _is_inplace(node) and not _dead_inplace(node):
                continue
            graph.erase_node(node)
            removed += 1
            changed = True
    return removed


def finish(gm: fx.GraphModule) -> None:
    """Lint and regenerate ``gm``'s code after an edit."""
    gm.graph.lint()
    gm.recompile()


def layer_kv_accesses(gm: fx.GraphModule) -> dict[int, tuple[fx.Node, fx.Node]]:
    """Per layer, ``(first KV access, last cache write)`` in graph order.

    After the absorb pass these are the layer's ``mla_cache_write`` nodes; in a graph it did not
    rewrite, the layer's cache appends found by the analysis.
    """
    from torch_kvoffload.passes.analysis import analyze_graph

    out: dict[int, tuple[fx.Node, fx.Node]] = {}
    writes = op_nodes(gm.graph, op("mla_cache_write"))
    for node in writes:
        layer = node.args[1]
        first, _ = out.get(layer, (node, node))
        out[layer] = (first, node)
    for sites in analyze_graph(gm).layers:
        if sites.layer in out:
            continue
        nodes = [w.node for w in sites.writes]
        out[sites.layer] = (m.first_in_order(nodes, gm.graph), m.last_in_order(nodes, gm.graph))
    return dict(sorted(out.items()))


def insert_layer_hooks(
    gm: fx.GraphModule,
    pass_name: str,
    marker: object,
    insert: Callable[[int, fx.Node, fx.Node, int | None], tuple[list[fx.Node], str]],
    *,
    runtime_runs_hooks: bool = False,
) -> list[PassRecord]:
    """Insert hook nodes around each layer's KV accesses, once per layer.

    For every layer of :func:`layer_kv_accesses` that has no ``marker`` op node yet,
    ``insert(layer, first, last, next_layer)`` adds the layer's nodes (``next_layer``: the next layer with
    KV accesses, ``None`` for the last) and returns them with the record's detail. The new nodes get
    ``first``'s meta, each layer one ``"inserted"`` record; the graph is finished when anything changed.
    ``runtime_runs_hooks``: a layer whose KV is written by ``mla_cache_write`` gets nothing (its runtime
    runs the layer's hooks itself).
    """
    accesses = layer_kv_accesses(gm)
    layers = list(accesses)
    write = op("mla_cache_write")
    done = []
    for i, layer in enumerate(layers):
        if op_nodes(gm.graph, marker, layer):
            continue
        if runtime_runs_hooks and accesses[layer][0].target is write:
            continue
        first, last = accesses[layer]
        new, detail = insert(layer, first, last, layers[i + 1] if i + 1 < len(layers) else None)
        copy_meta(new, first)
        done.append(record(gm, PassRecord(pass_name, layer, "inserted", detail)))
    if done:
        finish(gm)
    return done


def copy_meta(new_nodes: list[fx.Node], like: fx.Node) -> None:
    """Give inserted nodes the module stack of the node they sit next to (explain groups by it)."""
    for key in ("nn_module_stack", "stack_trace"):
        if key in like.meta:
            for n in new_nodes:
                n.meta.setdefault(key, like.meta[key])

"""Small graph-matching helpers shared by the passes: op identity, module scopes, shapes, ancestry.

They accept both levels a graph may come in: Dynamo's Torch-level graph (``torch.cat``,
``F.linear``, ``call_method "transpose"``) and ATen graphs (``aten.cat.default``, ...). Nothing here
knows a model family: matching is by op, by shape and by the ``nn_module_stack`` the tracer recorded.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F

aten = torch.ops.aten

# One name per op family -> every target that spells it (Torch function, Tensor method name, ATen).
_FUNCTIONS: dict[str, tuple[object, ...]] = {
    "cat": (torch.cat, torch.concat, torch.concatenate, aten.cat.default),
    "linear": (F.linear, torch._C._nn.linear, aten.linear.default),
    "matmul": (torch.matmul, operator.matmul, aten.matmul.default, torch.bmm, aten.bmm.default),
    "sdpa": (
        F.scaled_dot_product_attention,
        torch._C._nn.scaled_dot_product_attention,
        aten.scaled_dot_product_attention.default,
    ),
    "softmax": (F.softmax, torch.softmax, aten._softmax.default, aten.softmax.int),
    "topk": (torch.topk, aten.topk.default),
    "relu": (F.relu, torch.relu, aten.relu.default),
    "mul": (operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar),
    "add": (operator.add, torch.add, aten.add.Tensor),
    "index_copy": (aten.index_copy_.default, aten.index_copy.default, torch.index_copy),
    "scatter": (torch.scatter, aten.scatter.value, aten.scatter.src),
    "dropout": (F.dropout, torch.dropout, aten.dropout.default),
    "getitem": (operator.getitem,),
}
_METHODS: dict[str, tuple[str, ...]] = {
    "cat": (),
    "linear": (),
    "matmul": ("matmul", "__matmul__", "bmm"),
    "sdpa": (),
    "softmax": ("softmax",),
    "topk": ("topk",),
    "relu": ("relu",),
    "mul": ("mul", "__mul__"),
    "add": ("add", "__add__"),
    "index_copy": ("index_copy_", "index_copy"),
    "scatter": ("scatter", "scatter_"),
    "dropout": (),
    "getitem": (),
}
# Value-preserving ops a pattern may look through (casts, views that keep the data as it is).
CASTS = ("float", "to", "type", "contiguous", "half", "bfloat16", "double")
_CAST_FUNCTIONS = (aten._to_copy.default, aten.clone.default, aten.contiguous.default)


def is_op(node: fx.Node, family: str) -> bool:
    """Whether ``node`` calls an op of ``family`` (a key of the tables above)."""
    if node.op == "call_function":
        return node.target in _FUNCTIONS[family]
    if node.op == "call_method":
        return node.target in _METHODS[family]
    return False


def arg(node: fx.Node, index: int, name: str, default: object = None) -> object:
    """Argument ``index`` / keyword ``name`` of a call node (methods count ``self`` as argument 0)."""
    if name in node.kwargs:
        return node.kwargs[name]
    if len(node.args) > index:
        return node.args[index]
    return default


def tensor_value(node: object) -> torch.Tensor | None:
    """The example / fake tensor the tracer recorded for ``node`` (``None`` for non-tensors)."""
    if not isinstance(node, fx.Node):
        return None
    for key in ("example_value", "val"):
        value = node.meta.get(key)
        if isinstance(value, torch.Tensor):
            return value
    return None


def shape(node: object) -> tuple[object, ...] | None:
    value = tensor_value(node)
    return None if value is None else tuple(value.shape)


def static_int(value: object) -> int | None:
    """``value`` as a Python int when it is a concrete size, ``None`` for a symbolic one."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt) and is_concrete_int(value):
        return int(value)
    return None


def module_path(node: fx.Node) -> str:
    """The innermost module path recorded for ``node`` (``"model.layers.0.self_attn.kv_b_proj"``)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return normalise_path(path)


def normalise_path(path: str) -> str:
    """Dynamo writes ``L['self'].model.layers.0``; keep the attribute path only."""
    for prefix in ("L['self'].", "L['self']", "self."):
        if path.startswith(prefix):
            path = path[len(prefix) :]
    return path.replace("._modules['", ".").replace("']", "")


def in_scope(node: fx.Node, scope: str) -> bool:
    path = module_path(node)
    return path == scope or path.startswith(scope + ".")


def parent_path(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def strip_casts(node: object) -> object:
    """Follow dtype casts / ``contiguous`` back to the value they convert."""
    while isinstance(node, fx.Node) and (
        (node.op == "call_method" and node.target in CASTS)
        or (node.op == "call_function" and node.target in _CAST_FUNCTIONS)
    ):
        node = node.args[0]
    return node


def is_graph_input(node: object) -> bool:
    """A placeholder, or a tensor created inside the graph from no tensor or empty (a cache seed)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op in ("placeholder", "get_attr"):
        return True
    value = tensor_value(node)
    if value is None:
        return False
    # the seed of a cache made empty inside the graph (``torch.tensor([])``, ``x.new_zeros(B, 1, 0, D)``)
    return not node.all_input_nodes or (value.numel() == 0 and node.op in ("call_function", "call_method"))


def ancestors(node: fx.Node) -> set[fx.Node]:
    """Every node ``node`` depends on."""
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def find_upstream(
    node: fx.Node, predicate: Callable[[fx.Node], bool], *, through: Callable[[fx.Node], bool]
) -> fx.Node | None:
    """The first node matching ``predicate`` walking the first tensor input back through ``through``."""
    current: object = node
    for _ in range(64):
        if not isinstance(current, fx.Node):
            return None
        if predicate(current):
            return current
        if not through(current) or not current.all_input_nodes:
            return None
        current = current.args[0] if isinstance(current.args[0], fx.Node) else current.all_input_nodes[0]
    return None


def first_in_order(nodes: Iterable[fx.Node], graph: fx.Graph) -> fx.Node | None:
    wanted = set(nodes)
    if not wanted:
        return None
    for n in graph.nodes:
        if n in wanted:
            return n
    return None


def last_in_order(nodes: Iterable[fx.Node], graph: fx.Graph) -> fx.Node | None:
    wanted = set(nodes)
    last = None
    for n in graph.nodes:
        if n in wanted:
            last = n
    return last


def python_number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None

"""MLA cache runtime ops: ``kvoffload::mla_cache_write`` and ``kvoffload::mla_cache_attention``.

They hand one layer's new latent KV and queries to the runtime registered under ``runtime`` in
:data:`runtimes` (a model's KV core: ``torch_kvoffload.core.kv.KVCore``), which
keeps KV where its configuration says (layerwise physical buffer, sparse host pool, indexer cache) and
runs absorbed MLA attention over every visible cached token. The eager adapter and the graph passes call,
per layer: projections → layer / KVPP hooks → ``mla_cache_write`` → ``layer_save`` →
``mla_cache_attention`` → W_UV → ``o_proj``.

``caches`` is the runtime's ``layer_caches(layer)``, declared mutated so that graphs keep these ops in
order with the hook ops of the same layer; when they are copies of the runtime's tensors (a
functionalized graph's clones) the kernel copies the runtime's contents into them afterwards. The kernel
is the Python runtime itself (registered as the reference kernel for every device); the fake kernel
checks shapes and returns nothing.
"""

from __future__ import annotations

from typing import Protocol

import torch

from torch_kvoffload.ops import _checks
from torch_kvoffload.ops._hook_registry import HookRegistry, sync_copies
from torch_kvoffload.ops._registry import define_op

__all__ = ["MLACacheRuntime", "mla_cache_attention", "mla_cache_write", "runtimes"]


class MLACacheRuntime(Protocol):
    """What the ops call (a KV core)."""

    def cache_write(
        self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor, index_k: torch.Tensor | None
    ) -> None: ...

    def layer_caches(self, layer: int) -> list[torch.Tensor]: ...

    def cache_attention(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        index_q: torch.Tensor | None,
        index_weights: torch.Tensor | None,
        scale: float,
        out: torch.Tensor,
    ) -> None: ...


runtimes: HookRegistry[MLACacheRuntime] = HookRegistry(
    "MLA cache runtime", methods=("cache_write", "cache_attention", "layer_caches")
)


def _check_write(kv_c, k_pe, index_k) -> None:
    op = "mla_cache_write"
    if kv_c.dim() != 3 or k_pe.dim() != 3 or kv_c.shape[:2] != k_pe.shape[:2]:
        _checks.fail(
            op,
            f"'kv_c' [B,S,Dc] and 'k_pe' [B,S,Dr] must share B,S; got {list(kv_c.shape)}, {list(k_pe.shape)}",
        )
    if index_k is not None and (index_k.dim() != 3 or index_k.shape[:2] != kv_c.shape[:2]):
        _checks.fail(op, f"'index_k' must be [B,S,Di] with B,S of 'kv_c', got {list(index_k.shape)}")
    if k_pe.dtype != kv_c.dtype:
        _checks.fail(op, f"'k_pe' must have dtype {kv_c.dtype} (as 'kv_c'), got {k_pe.dtype}", TypeError)


def _check_attention(q_nope, q_pe, index_q, index_weights, out) -> None:
    op = "mla_cache_attention"
    if q_nope.dim() != 4 or q_pe.dim() != 4 or q_nope.shape[:3] != q_pe.shape[:3]:
        _checks.fail(
            op,
            f"'q_nope' [B,S,H,Dc] and 'q_pe' [B,S,H,Dr] must share B,S,H; got {list(q_nope.shape)}, "
            f"{list(q_pe.shape)}",
        )
    if out.shape != q_nope.shape or out.dtype != q_nope.dtype:
        _checks.fail(
            op, f"'out' must be {q_nope.dtype} {list(q_nope.shape)}, got {out.dtype} {list(out.shape)}"
        )
    if (index_q is None) != (index_weights is None):
        _checks.fail(op, "'index_q' and 'index_weights' must both be given or both be None")
    if index_q is not None:
        if index_q.dim() != 4 or index_q.shape[:2] != q_nope.shape[:2]:
            _checks.fail(op, f"'index_q' must be [B,S,Hi,Di] with B,S of 'q_nope', got {list(index_q.shape)}")
        if tuple(index_weights.shape) != tuple(index_q.shape[:3]):
            _checks.fail(
                op,
                f"'index_weights' must be {list(index_q.shape[:3])} ([B,S,Hi]), got {list(index_weights.shape)}",
            )


def _sync(rt: MLACacheRuntime, layer: int, caches: list[torch.Tensor]) -> None:
    """Give ``caches`` what the runtime holds when they are copies (a functionalized graph's clones)."""
    own = rt.layer_caches(layer)
    if len(own) == len(caches) and all(a.shape == b.shape for a, b in zip(own, caches, strict=True)):
        sync_copies(caches, own)


def _write_fake(runtime, layer, kv_c, k_pe, index_k, caches) -> None:
    _check_write(kv_c, k_pe, index_k)


def _write_kernel(runtime, layer, kv_c, k_pe, index_k, caches) -> None:
    _check_write(kv_c, k_pe, index_k)
    rt = runtimes.get(runtime)
    rt.cache_write(layer, kv_c, k_pe, index_k)
    _sync(rt, layer, caches)


def _attention_fake(runtime, layer, q_nope, q_pe, index_q, index_weights, scale, out, caches) -> None:
    _check_attention(q_nope, q_pe, index_q, index_weights, out)


def _attention_kernel(runtime, layer, q_nope, q_pe, index_q, index_weights, scale, out, caches) -> None:
    _check_attention(q_nope, q_pe, index_q, index_weights, out)
    rt = runtimes.get(runtime)
    rt.cache_attention(layer, q_nope, q_pe, index_q, index_weights, scale, out)
    _sync(rt, layer, caches)


_write_op = define_op(
    "mla_cache_write",
    "(str runtime, int layer, Tensor kv_c, Tensor k_pe, Tensor? index_k, Tensor(a!)[] caches) -> ()",
    fake=_write_fake,
    reference=_write_kernel,
)
_attention_op = define_op(
    "mla_cache_attention",
    "(str runtime, int layer, Tensor q_nope, Tensor q_pe, Tensor? index_q, Tensor? index_weights, float scale, "
    "Tensor(a!) out, Tensor(b!)[] caches) -> ()",
    fake=_attention_fake,
    reference=_attention_kernel,
)


def mla_cache_write(
    runtime: str,
    layer: int,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    index_k: torch.Tensor | None,
    caches: list[torch.Tensor],
) -> None:
    """Hand this forward's new tokens of ``layer`` to the runtime, which stores them where it keeps KV.

    Parameters
    ----------
    runtime : str
        Name of a runtime registered in :data:`runtimes`.
    layer : int
        Layer index.
    kv_c : Tensor
        ``[B, S, Dc]``: normalised latent (``kv_a_layernorm`` output) of the forward's ``S`` positions.
    k_pe : Tensor
        ``[B, S, Dr]``, dtype of ``kv_c``: roped rotary key.
    index_k : Tensor or None
        ``[B, S, Di]``: roped, normed indexer key (models with a lightning indexer).
    caches : list of Tensor
        The runtime's ``layer_caches(layer)``; declared mutated.
    """
    _write_op(runtime, layer, kv_c, k_pe, index_k, caches)


def mla_cache_attention(
    runtime: str,
    layer: int,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    index_q: torch.Tensor | None,
    index_weights: torch.Tensor | None,
    scale: float,
    out: torch.Tensor,
    caches: list[torch.Tensor],
) -> None:
    """Absorbed MLA attention of this forward's queries over every visible cached token of ``layer``.

    Parameters
    ----------
    q_nope : Tensor
        ``[B, S, H, Dc]``: per head ``q_nope_head @ W_UK[h]`` (W_UK from ``kv_b_proj``).
    q_pe : Tensor
        ``[B, S, H, Dr]``, dtype of ``q_nope``: roped rotary query.
    index_q : Tensor or None
        ``[B, S, Hi, Di]``: roped indexer query; with it the attention reads the lightning indexer's top-k
        keys, without it every visible key (dense causal, padding respected).
    index_weights : Tensor or None
        ``[B, S, Hi]`` with every scalar factor folded in:
        ``score[t, s] = Σ_h index_weights[t, h] · relu(index_q[t, h] · index_k[s])``.
    scale : float
        Softmax scale of the model.
    out : Tensor
        ``[B, S, H, Dc]``, dtype of ``q_nope``: receives the latent output (padding positions: 0).
    caches : list of Tensor
        The runtime's ``layer_caches(layer)``; declared mutated.
    """
    _attention_op(runtime, layer, q_nope, q_pe, index_q, index_weights, scale, out, caches)

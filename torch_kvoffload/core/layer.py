"""One layer of a running forward: its new rows into the backends, its queries' attention out of them.

:func:`write_rows` and :func:`attend_queries` take the layer's inputs in the forward's layout
(:attr:`ForwardPlan.shape`: ``[B, S, ...]`` batched, ``[1, N, ...]`` packed), already checked by the core
(:func:`~torch_kvoffload.kv.forward.check_write`, :func:`~torch_kvoffload.kv.forward.check_queries`).
Each part of the forward (:attr:`ForwardPlan.parts`: a mixed forward's decode tokens and its other rows;
else the forward itself) takes its rows at its ``sel`` and runs through the backends taking part in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from torch_kvoffload.core import attention
from torch_kvoffload.kv.backend import KVBackend, NewRows, Queries
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.kv.spec import ModelSpec

__all__ = ["attend_queries", "engaged", "parts_of", "write_rows"]

#: the backends taking part in a plan (the core's, memoized per plan)
Taking = Callable[[ForwardPlan], Sequence[KVBackend]]


def parts_of(fwd: ForwardPlan) -> list[ForwardPlan]:
    """The parts of ``fwd``: its :attr:`~ForwardPlan.parts`, or ``[fwd]``."""
    return fwd.parts or [fwd]


def _rows(t: torch.Tensor, part: ForwardPlan, *shape: int) -> torch.Tensor:
    """``t``'s rows of ``part`` (``t`` flattened over the forward's two leading dims to ``[n, *shape]``)."""
    flat = t.reshape(part.shape[0] * part.shape[1], *shape)
    return flat if part.packed else flat[part.sel]


def write_rows(
    layer: int,
    fwd: ForwardPlan,
    spec: ModelSpec,
    taking: Taking,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    index_k: torch.Tensor | None,
) -> None:
    """Keep ``layer``'s new rows (``kv_c [.., Dc]``, ``k_pe [.., Dr]``, ``index_k [.., Di]`` or ``None``) in
    the backends taking part in each part of ``fwd``, in the model's dtype: each one's ``before_write``
    first, then the writes, then each one's ``after_write`` (a layerwise load waited for before the rows
    land in its buffer, their save started after)."""
    before, after = _write_hooks(fwd, taking)
    for part, b in before:
        b.before_write(layer, part)
    for part in parts_of(fwd):
        rows = NewRows(
            _rows(kv_c, part, spec.kv_lora_rank).to(spec.dtype),
            _rows(k_pe, part, spec.rope_dim).to(spec.dtype),
            _rows(index_k, part, spec.index_head_dim) if index_k is not None and spec.has_indexer else None,
        )
        for b in taking(part):
            b.write(layer, part, rows)
    for part, b in after:
        b.after_write(layer, part)


def _write_hooks(fwd: ForwardPlan, taking: Taking) -> tuple[list, list]:
    """``(part, backend)`` of the backends taking part in ``fwd`` that have a ``before_write`` / an
    ``after_write`` of their own, once per forward (most have neither)."""
    hooks = fwd.memo.get("write_hooks")
    if hooks is None:
        pairs = engaged(fwd, taking)
        hooks = fwd.memo["write_hooks"] = tuple(
            [(part, b) for part, b in pairs if getattr(type(b), name) is not getattr(KVBackend, name)]
            for name in ("before_write", "after_write")
        )
    return hooks


def engaged(fwd: ForwardPlan, taking: Taking) -> list[tuple[ForwardPlan, KVBackend]]:
    """``(part, backend)`` of every backend taking part in each part of ``fwd``, in call order."""
    return [(part, b) for part in parts_of(fwd) for b in taking(part)]


def attend_queries(
    layer: int,
    fwd: ForwardPlan,
    spec: ModelSpec,
    taking: Taking,
    indexer: KVBackend | None,
    q: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    scale: float,
    out: torch.Tensor,
    probs: dict[int, torch.Tensor] | None,
) -> None:
    """``layer``'s absorbed attention of every query of ``fwd`` into ``out [.., H, Dc]`` (``q = (q_nope,
    q_pe, index_q, index_weights)`` in the forward's layout), part by part; a padding query attends over its
    request's real tokens before it, one that sees none gets zero. ``probs``: when given, the
    probabilities each query applied go there under ``layer`` (fp32 ``[*shape, H, max(new_len)]``)."""
    q_nope, q_pe, index_q, index_weights = q
    (B, S), H = fwd.shape, spec.num_heads

    def queries(part: ForwardPlan, at: torch.Tensor | None) -> Queries:  # at None: the part's own rows
        def rows(t: torch.Tensor, *shape: int) -> torch.Tensor:
            return _rows(t, part, *shape) if at is None else t.reshape(B * S, *shape)[at]

        iq = iw = None
        if index_q is not None and index_weights is not None:
            iq, iw = rows(index_q, *index_q.shape[2:]), rows(index_weights, -1).float()
        return Queries(rows(q_nope, H, -1), rows(q_pe, H, -1), iq, iw, scale)

    width = max(fwd.new_len, default=0) if probs is not None else None
    flat = out.view(B * S, H, -1)
    p_flat = q_nope.new_zeros((B * S, H, width), dtype=torch.float32) if width is not None else None
    if not fwd.packed:
        out.zero_()  # padding positions that see no real token, rows of no part
    for part in parts_of(fwd):
        q_pad = queries(part, part.pad_sel) if part.n_pad else None
        res, res_pad, p, p_pad = attention.attend_layer(
            layer, part, taking(part), indexer, queries(part, None), q_pad, width
        )
        if part.packed:  # every position is this part's real query, in order
            flat.copy_(res)
        else:
            flat.index_copy_(0, part.sel, res.to(out.dtype))
        if res_pad is not None:
            flat.index_copy_(0, part.pad_sel, res_pad.to(out.dtype))
        if p_flat is not None and p is not None:
            p_flat.index_copy_(0, part.sel, p)
            if p_pad is not None:
                p_flat.index_copy_(0, part.pad_sel, p_pad)
    if probs is not None and p_flat is not None:
        probs[layer] = p_flat.view(B, S, H, -1)

"""``ForwardPlan``: the index tensors of one forward over a batch of requests.

Two layouts of a forward's inputs (every layer's rows and queries):

* **packed** (:func:`plan_packed`): the requests' new tokens one after the other, request-major, in one row
  ``[1, N]`` (``cu_seqlens_q`` gives each request's run): the layout vLLM and transformers' continuous
  batching use. No padding: every position is a real token. A packed forward of decode tokens and prompt
  chunks together is planned in two parts (:func:`plan_mixed`), each served by its own path.
* **batched** (:func:`plan_forward`): one batch row per request, ``[B, S]``, with padding.

A batched forward feeds ``S`` positions of ``B`` requests (one per batch row). Row ``b``'s real new tokens are the
positions where ``new_mask[b]`` is true (padding may be anywhere: left, right, between real tokens, in any
forward of a request, and a row may have no real token at all); they take the request's logical positions
``old_len[b] .. new_len[b] - 1``. Every paged cache is addressed through the request's device slot (see
:mod:`torch_kvoffload.kv.requests`).

Padding positions keep no KV, but a Hugging Face model still computes their attention: the query at a
padding position ``s`` of row ``b`` sees the request's real tokens before it, ``old_len[b]`` plus the real
new tokens at positions ``< s`` (its *visible length* ``v``). The plan lists the padding queries with
``v > 0`` (``pad_sel``, ``pad_row``, ``pad_len``); a padding query with ``v == 0`` (left padding before a
request's first token) is fully masked and its attention output is zero.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_kvoffload.kv.layout import KVLayout
from torch_kvoffload.kv.requests import Request
from torch_kvoffload.kv.spec import ModelSpec

__all__ = [
    "ForwardPlan", "check_bias", "check_queries", "check_write", "plan_forward", "plan_mixed", "plan_packed",
    "visible_padding",
]  # fmt: skip


@dataclass
class ForwardPlan:
    """Index tensors of one forward (device tensors unless noted)."""

    B: int  # requests
    S: int  # positions per batch row (a packed forward: N)
    requests: list[Request]  # per batch row; their tokens include this forward's
    decode: bool  # one new real token per request after earlier ones, no padding, with a sparse backend
    layerwise: bool  # runs the layerwise pipeline
    old_len: list[int]  # per request, tokens before this forward (host ints)
    new_len: list[int]
    sel: torch.Tensor  # int64 [N]: flat (b * S + s) of the real positions, request-major
    pos: torch.Tensor  # int64 [N]: their logical positions
    row: torch.Tensor  # int64 [N]: their batch row
    phys: torch.Tensor  # int64 [N]: their row in a cache paged in blocks (slot * M * bs + pos)
    block_table: torch.Tensor  # int32 [B, M]: each request's blocks
    index_table: torch.Tensor  # int32 [B, pages]: each request's pages of the per-request caches
    index_phys: torch.Tensor  # int64 [N]: the rows' rows in the per-request caches
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    seq_lens_k: torch.Tensor  # int32 [B]
    # padding queries that see at least one real token, request-major (see the module docstring)
    pad_sel: torch.Tensor  # int64 [P]: their flat b * S + s
    pad_row: torch.Tensor  # int64 [P]: their batch row
    pad_len: torch.Tensor  # int32 [P]: their visible length v (the request's rows 0 .. v - 1)
    n_pad: int  # P (host)
    # fp32 [N, L]: an additive bias of each query over its request's logical positions, in place of the
    # causal rule (KVCore.attention_bias); None: causal
    bias: torch.Tensor | None = None
    # every position is real (sel == arange(N)): rows and queries are the inputs' own rows, request-major
    packed: bool = False
    # the leading dims of every layer input: (B, S) batched, (1, N) for a packed forward (plan_packed)
    shape: tuple[int, int] = (0, 0)
    # a mixed forward's parts (plan_mixed): each a plan over some of its requests, whose sel index the
    # whole forward's inputs; empty: the plan is its own only part
    parts: list[ForwardPlan] = field(default_factory=list)
    # what the layers of this forward derive alike from the plan, computed by the first that needs it
    memo: dict[Any, Any] = field(default_factory=dict)
    # rows taken over from a store, written between forwards (core.prefix): no layer runs, nothing attends
    writes_only: bool = False

    @property
    def request_ids(self) -> list[int]:
        return [r.id for r in self.requests]

    @property
    def slots(self) -> list[int]:
        return [r.slot for r in self.requests]

    def query_rows(self) -> torch.Tensor:
        """int64 [N]: the batch row (request) of each real position (computed once per forward)."""
        rows = self.memo.get("query_rows")
        if rows is None:
            counts = self.cu_seqlens_q[1:].long() - self.cu_seqlens_q[:-1].long()
            rows = torch.repeat_interleave(torch.arange(self.B, device=counts.device), counts)
            self.memo["query_rows"] = rows
        return rows

    @property
    def first(self) -> bool:
        """Whether no request had tokens before this forward."""
        return not any(self.old_len)


def visible_padding(new_mask: torch.Tensor, old_len: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(flat int64 [P], visible length int64 [P])`` of the padding positions of ``new_mask bool [B, S]``
    (host) that see at least one real token of their request (``old_len[b]`` earlier ones), request-major."""
    seen = torch.tensor(list(old_len), dtype=torch.int64)[:, None] + torch.cumsum(new_mask, dim=1)
    flat = torch.nonzero((~new_mask & (seen > 0)).reshape(-1)).reshape(-1)
    return flat, seen.reshape(-1)[flat]


#: Up to this many real positions a plan's per-position indices are computed from Python ints (a decode
#: step of a batch): a few tensor ops on tiny tensors cost more than the arithmetic.
_FEW_ROWS = 64


@functools.lru_cache(maxsize=8)
def _no_padding(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int64 [0], int32 [0])`` on ``device``: a plan without padding queries (read only)."""
    with torch.inference_mode(False):
        return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(
            0, dtype=torch.int32, device=device
        )


def _rows_of(old_len: Sequence[int], n_new: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(request row, logical position)`` of each of a few new tokens, request-major, as Python ints:
    ``n_new[r]`` of request ``r`` after its ``old_len[r]`` earlier ones."""
    row = [r for r, n in enumerate(n_new) for _ in range(n)]
    pos = [o + i for o, n in zip(old_len, n_new, strict=True) for i in range(n)]
    return row, pos


def _assemble(
    requests: Sequence[Request],
    old_len: Sequence[int],
    n_new: Sequence[int],
    layout: KVLayout,
    sel: torch.Tensor | list[int],
    row: torch.Tensor | list[int],
    pos: torch.Tensor | list[int],
    *,
    shape: tuple[int, int],
    packed: bool,
    decode: bool,
    layerwise: bool,
    device: torch.device,
    pad_sel: torch.Tensor | None = None,
    pad_len: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> ForwardPlan:
    """The plan of a forward whose real positions are ``sel`` (flat over ``shape``) of batch row / request
    ``row`` at logical positions ``pos`` (host int64 ``[N]`` each, or lists of ints for a few positions;
    request-major, ``n_new[r]`` of request ``r``), with its padding queries ``pad_sel`` / ``pad_len``
    (``None``: none): the paged caches' tables and rows of every request, the indexer's cumulative lengths,
    everything moved to ``device`` (the per-position indices in one copy, the lengths in another)."""
    bs, M = layout.block_size, layout.blocks_per_request
    page, pages = layout.page
    slots = tuple(r.slot for r in requests)
    B = len(slots)
    new_len = [o + n for o, n in zip(old_len, n_new, strict=True)]
    device = torch.device(device)
    table, index_table = layout.tables(slots, device)
    if isinstance(sel, list):
        assert isinstance(row, list) and isinstance(pos, list)
        phys = [slots[r] * (M * bs) + p for r, p in zip(row, pos, strict=True)]
        index_phys = [slots[r] * (pages * page) + p for r, p in zip(row, pos, strict=True)]
        flat = torch.tensor([*sel, *pos, *row, *phys, *index_phys], dtype=torch.int64)
    else:
        assert isinstance(row, torch.Tensor) and isinstance(pos, torch.Tensor)
        slot_of = torch.tensor(slots, dtype=torch.int64)[row]
        flat = torch.cat([sel, pos, row, slot_of * (M * bs) + pos, slot_of * (pages * page) + pos])
    N = flat.numel() // 5
    sel_d, pos_d, row_d, phys_d, index_phys_d = flat.to(device).split_with_sizes([N] * 5)
    lengths = torch.tensor([0, *itertools.accumulate(n_new), *new_len], dtype=torch.int32).to(device)
    cu, seq_lens_k = lengths.split_with_sizes([B + 1, B])
    if pad_sel is None or pad_len is None:
        pad_sel_d, pad_len_d = _no_padding(device)
        pad_row_d = pad_sel_d
    else:
        pad_sel_d, pad_row_d = pad_sel.to(device), (pad_sel // shape[1]).to(device)
        pad_len_d = pad_len.to(torch.int32).to(device)
    return ForwardPlan(
        B=B, S=shape[1], requests=list(requests), decode=decode, layerwise=layerwise, old_len=list(old_len),
        new_len=new_len, sel=sel_d, pos=pos_d, row=row_d, phys=phys_d, block_table=table,
        index_table=index_table, index_phys=index_phys_d, cu_seqlens_q=cu, seq_lens_k=seq_lens_k,
        pad_sel=pad_sel_d, pad_row=pad_row_d, pad_len=pad_len_d, n_pad=int(pad_sel_d.numel()), bias=bias,
        packed=packed, shape=shape,
    )  # fmt: skip


def plan_forward(
    requests: Sequence[Request],
    old_len: Sequence[int],
    new_mask: torch.Tensor,
    layout: KVLayout,
    *,
    decode: bool,
    layerwise: bool,
    device: torch.device,
    padding_queries: bool = True,
    bias: torch.Tensor | None = None,
    all_real: bool | None = None,
) -> ForwardPlan:
    """The plan of a forward of ``requests`` (batch rows) whose real new positions are ``new_mask bool [B,
    S]`` (host, padding anywhere), ``old_len[b]`` tokens of request ``b`` before it. ``padding_queries=False``:
    the caller discards the padding positions' outputs, so none attends (all get zero). ``bias``: see
    :func:`check_bias`. ``all_real``: ``bool(new_mask.all())`` when the caller knows it."""
    B, S = new_mask.shape
    packed = bool(new_mask.all()) if all_real is None else all_real
    if packed and B * S <= _FEW_ROWS:  # a decode step of a batch: Python ints
        n_new = [S] * B
        row, pos = _rows_of(old_len, n_new)
        sel = list(range(B * S))
    elif packed:  # every position real (an unpadded batch): no search for them
        old = torch.tensor(list(old_len), dtype=torch.int64)
        sel = torch.arange(B * S)
        row = sel if S == 1 else sel // S
        pos = old if S == 1 else old[row] + sel % S
        n_new = [S] * B
    else:
        old = torch.tensor(list(old_len), dtype=torch.int64)
        sel = torch.nonzero(new_mask.reshape(-1)).reshape(-1)
        row = sel // S
        rank = torch.cumsum(new_mask.int(), dim=1) - 1  # index among the row's new tokens
        pos = old[row] + rank.reshape(-1)[sel].to(torch.int64)
        n_new = new_mask.sum(dim=1).tolist()
    if bias is not None:  # checked by the caller before anything changed (check_bias)
        bias = bias.to(device=device, dtype=torch.float32).reshape(B * S, -1)
    pad_sel = pad_len = None
    if padding_queries and not packed:
        pad_sel, pad_len = visible_padding(new_mask, old_len)
    return _assemble(
        requests, old_len, n_new, layout, sel, row, pos, shape=(B, S), packed=packed, decode=decode,
        layerwise=layerwise, device=device, pad_sel=pad_sel, pad_len=pad_len, bias=bias,
    )  # fmt: skip


def plan_packed(
    requests: Sequence[Request],
    old_len: Sequence[int],
    n_new: Sequence[int],
    layout: KVLayout,
    *,
    decode: bool,
    layerwise: bool,
    device: torch.device,
    rows_at: Sequence[int] | None = None,
    width: int | None = None,
) -> ForwardPlan:
    """The plan of a packed forward: ``n_new[r]`` new tokens of ``requests[r]`` (``old_len[r]`` before it)
    one after the other in one row ``[1, N]`` (``N = sum(n_new)``), request-major; a request may have none.
    Its positions are all real: no padding queries, no bias. ``rows_at`` (a part of a mixed forward): the
    rows' places in a packed row of ``width`` tokens that holds other requests' rows too."""
    N = sum(n_new)
    if N <= _FEW_ROWS:  # a decode step of a batch, a few chunk tokens: Python ints
        row_l, pos_l = _rows_of(old_len, n_new)
        return _assemble(
            requests, old_len, n_new, layout, list(range(N)) if rows_at is None else list(rows_at), row_l,
            pos_l, shape=(1, N if width is None else width), packed=rows_at is None, decode=decode,
            layerwise=layerwise, device=device,
        )  # fmt: skip
    counts = torch.tensor(list(n_new), dtype=torch.int64)
    starts = torch.cumsum(counts, 0) - counts  # each request's first row
    index = torch.arange(N)
    row = torch.repeat_interleave(torch.arange(len(requests)), counts, output_size=N)
    pos = torch.tensor(list(old_len), dtype=torch.int64)[row] + index - starts[row]
    sel = index if rows_at is None else torch.tensor(list(rows_at), dtype=torch.int64)
    return _assemble(
        requests, old_len, n_new, layout, sel, row, pos, shape=(1, N if width is None else width),
        packed=rows_at is None, decode=decode, layerwise=layerwise, device=device,
    )  # fmt: skip


def plan_mixed(
    requests: Sequence[Request],
    old_len: Sequence[int],
    n_new: Sequence[int],
    layout: KVLayout,
    *,
    layerwise: bool,
    device: torch.device,
) -> ForwardPlan | None:
    """A packed forward (see :func:`plan_packed`) holding both decode tokens (one new token after earlier
    ones) and other rows, as one plan of two parts: the decode tokens (``decode=True``: the sparse decode
    step) and the rest (prompts and chunks: ``layerwise`` when asked). ``None`` when the forward holds only
    one kind. One model forward then serves a continuous-batching step's decode tokens and prompt chunks."""
    decode = [i for i, (o, n) in enumerate(zip(old_len, n_new, strict=True)) if o > 0 and n == 1]
    if not decode or len(decode) == len(requests):
        return None
    taken = set(decode)
    rest = [i for i in range(len(requests)) if i not in taken]
    starts = list(itertools.accumulate(n_new, initial=0))

    def part(idx: list[int], is_decode: bool, lw: bool) -> ForwardPlan:
        rows_at = [t for i in idx for t in range(starts[i], starts[i + 1])]
        return plan_packed(
            [requests[i] for i in idx], [old_len[i] for i in idx], [n_new[i] for i in idx], layout,
            decode=is_decode, layerwise=lw, device=device, rows_at=rows_at, width=starts[-1],
        )  # fmt: skip

    whole = plan_packed(requests, old_len, n_new, layout, decode=False, layerwise=layerwise, device=device)
    whole.parts = [part(decode, True, False), part(rest, False, layerwise)]
    return whole


def check_bias(bias: torch.Tensor, new_mask: torch.Tensor, new_len: list[int]) -> None:
    """``ValueError`` unless ``bias`` fits a forward of ``new_mask bool [B, S]`` whose requests reach
    ``new_len`` tokens: an additive fp32 bias ``[B, S, L]`` of every new position (all real: no padding)
    over its request's logical positions ``0 .. L - 1`` (``L >= max(new_len)``), which the forward's
    attention and indexer scores add instead of the causal rule (:attr:`ForwardPlan.bias`)."""
    B, S = new_mask.shape
    where = "KVCore.begin_forward: attention_bias"
    if not bool(new_mask.all()):
        raise ValueError(f"{where} needs every new position real (no padding in new_mask)")
    if bias.dim() != 3 or tuple(bias.shape[:2]) != (B, S) or bias.shape[2] < max(new_len, default=0):
        raise ValueError(
            f"{where} must be [{B}, {S}, >= {max(new_len, default=0)}] (batch, new positions, the longest "
            f"request's positions), got {list(bias.shape)}"
        )
    if not bias.dtype.is_floating_point:
        raise ValueError(f"{where} must be floating (additive), got {bias.dtype}")


def check_write(
    f: ForwardPlan, spec: ModelSpec, kv_c: torch.Tensor, k_pe: torch.Tensor, index_k: torch.Tensor | None
) -> None:
    """``ValueError`` unless a layer's new rows fit forward ``f``: ``kv_c [B, S, Dc]``, ``k_pe [B, S, Dr]``
    and, for a model with an indexer, ``index_k [B, S, Di]`` (``(B, S)`` is ``f.shape``: ``(1, N)`` packed)."""
    B, S = f.shape
    if kv_c.shape != (B, S, spec.kv_lora_rank) or k_pe.shape != (B, S, spec.rope_dim):
        raise ValueError(
            f"kvoffload::mla_cache_write: 'kv_c' / 'k_pe' must be [{B}, {S}, {spec.kv_lora_rank}] / "
            f"[{B}, {S}, {spec.rope_dim}], got {list(kv_c.shape)} / {list(k_pe.shape)}"
        )
    if spec.has_indexer and (index_k is None or index_k.shape != (B, S, spec.index_head_dim)):
        raise ValueError(
            f"kvoffload::mla_cache_write: 'index_k' must be [{B}, {S}, {spec.index_head_dim}] for "
            f"{spec.model_class}, got {None if index_k is None else list(index_k.shape)}"
        )


def check_queries(
    f: ForwardPlan,
    spec: ModelSpec,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    index_q: torch.Tensor | None,
    index_weights: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """``ValueError`` unless a layer's queries fit forward ``f``: ``q_nope [B, S, H, Dc]``, ``q_pe [B, S, H,
    Dr]``, ``out`` shaped as ``q_nope``, and for a model with an indexer ``index_q [B, S, Hi, Di]`` with
    ``index_weights [B, S, Hi]`` (``(B, S)`` is ``f.shape``: ``(1, N)`` packed)."""
    (B, S), H = f.shape, spec.num_heads
    where = "kvoffload::mla_cache_attention"
    if q_nope.shape != (B, S, H, spec.kv_lora_rank) or q_pe.shape != (B, S, H, spec.rope_dim):
        raise ValueError(
            f"{where}: 'q_nope' / 'q_pe' must be [{B}, {S}, {H}, {spec.kv_lora_rank}] / "
            f"[{B}, {S}, {H}, {spec.rope_dim}], got {list(q_nope.shape)} / {list(q_pe.shape)}"
        )
    if out.shape != q_nope.shape:
        raise ValueError(f"{where}: 'out' must be {list(q_nope.shape)}, got {list(out.shape)}")
    if spec.has_indexer and (index_q is None or index_weights is None):
        raise ValueError(f"{where}: {spec.model_class} needs 'index_q' and 'index_weights'")
    if index_q is not None and (
        index_weights is None
        or index_q.shape[:2] != (B, S)
        or index_q.dim() != 4
        or tuple(index_weights.shape) != tuple(index_q.shape[:3])
    ):
        raise ValueError(
            f"{where}: 'index_q' [{B}, {S}, Hi, Di] and 'index_weights' [{B}, {S}, Hi] must come together, got "
            f"{list(index_q.shape)} and {None if index_weights is None else list(index_weights.shape)}"
        )

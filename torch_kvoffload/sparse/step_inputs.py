"""The inputs of one decode step and layer (:class:`IndexerInputs`, :class:`DecodeRows`) and their checks.

Shape, dtype and device checks always run. Checks of values (request ids, stable lengths, block-table
entries, sequence lengths) run on tensors that live on the CPU, where reading them costs nothing; on an
accelerator the per-layer step reads no device tensor back (the ops' kernels still reject out-of-range
indices).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from torch_kvoffload._utils import Unchanged
from torch_kvoffload.sparse._checks import check_layer, check_scale, check_tensor, host_ints
from torch_kvoffload.sparse.host_pool import HostKVPool

__all__ = [
    "CheckedRows",
    "DecodeRows",
    "IndexerInputs",
    "check_block_coverage",
    "check_rows",
    "check_step",
    "check_step_checked",
]


@dataclass
class IndexerInputs:
    """The lightning indexer's inputs for one layer and step (all on the compute device).

    ``q [T, H, D]`` and ``weights [T, H]``; ``k_cache [num_blocks, block_size, D]`` (floating path),
    ``k_int8_cache`` int8 ``[num_blocks, block_size, D]`` + ``k_scale_cache`` fp32 ``[num_blocks,
    block_size]`` (int8 path) or ``k_fp8_rows`` uint8 ``[num_blocks, block_size, D + 4 * D / 128]`` (FP8
    path); ``block_table int32 [B, max_blocks]`` of the indexer cache;
    ``cu_seqlens_q int32 [B + 1]``; ``seq_lens_k int32 [B]``.
    """

    q: torch.Tensor
    weights: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens_k: torch.Tensor
    k_cache: torch.Tensor | None = None
    k_int8_cache: torch.Tensor | None = None
    k_scale_cache: torch.Tensor | None = None
    k_fp8_rows: torch.Tensor | None = None


@dataclass
class DecodeRows:
    """The decode rows of one step: ``T`` query tokens, in any order.

    ``request_ids int64 [T]`` (or a list of ints): the request each row belongs to; a request's rows
    keep their residency rows (hot buffers) by their order among that request's rows. ``stable_len
    int64 [T]``: the verified prefix of that request (hot rows at or beyond it are reloaded).
    ``host_block_table int32 [T, max_blocks]``: the row's request's blocks in the host pool, e.g.
    ``pool.block_table(ids)``. Scheduler metadata: CPU tensors (the runtime moves what the device needs).
    """

    request_ids: torch.Tensor | Sequence[int]
    stable_len: torch.Tensor
    host_block_table: torch.Tensor


@dataclass
class CheckedRows:
    """:class:`DecodeRows` checked once for the steps of one forward (every layer), from
    :meth:`~torch_kvoffload.sparse.SparseDecodeOffload.check_rows`.

    ``request_ids`` (``T`` ints), ``stable_len int64 [T]`` and ``host_block_table int32 [T, W]`` passed
    the checks of :func:`check_rows` against the indexer's ``cu_seqlens_q`` / ``seq_lens_k``. They stay
    valid while those tensors are the same objects, unmodified (``watched``: their and the rows' tensors,
    see :class:`~torch_kvoffload._utils.Unchanged`), and the runtime's requests did not change (``epoch``).
    """

    request_ids: list[int]
    stable_len: torch.Tensor
    host_block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens_k: torch.Tensor
    epoch: int
    watched: tuple[Unchanged, ...]  # the four tensors above, as checked
    # the per-layer inputs' layout (shapes, dtypes, devices) last checked with these rows: a later layer's
    # inputs of the same layout pass the per-layer checks without running them again
    layer_inputs: tuple | None = field(default=None, compare=False)

    def unchanged(self) -> bool:
        """Whether the four tensors are unmodified since they were checked."""
        tensors = (self.stable_len, self.host_block_table, self.cu_seqlens_q, self.seq_lens_k)
        return all(w.holds(t) for w, t in zip(self.watched, tensors, strict=True))


def check_step(
    where: str,
    layer: object,
    q_nope: object,
    q_pe: object,
    scale: object,
    indexer: object,
    rows: object,
    *,
    pool: HostKVPool,
    max_rows: int,
    dims: tuple[int, int],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    indexer_dtype: str,
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Check every argument of one layer's step (``attend``); return ``(request ids as ints, stable_len
    int64 [T], host block table int32 [T, W])``.

    ``q_nope [T, H, Dc]`` / ``q_pe [T, H, Dr]`` (``dims``) of one of ``dtypes`` on ``device`` with ``1 <= T <=
    max_rows``; ``rows`` a :class:`DecodeRows` and ``indexer`` :class:`IndexerInputs` of the same ``T``
    rows, with the caches of ``indexer_dtype`` (``SparseDecodeConfig.indexer_dtype``); then
    :func:`check_block_coverage`.
    """
    T = _check_queries(where, layer, q_nope, q_pe, scale, pool=pool, max_rows=max_rows, dims=dims, dtypes=dtypes,
                       device=device)  # fmt: skip
    if not isinstance(rows, DecodeRows):
        raise TypeError(f"{where}: 'rows' must be a DecodeRows, got {type(rows).__name__}")
    if not isinstance(indexer, IndexerInputs):
        raise TypeError(f"{where}: 'indexer' must be IndexerInputs, got {type(indexer).__name__}")
    ids, stable, host_bt = _check_rows(where, rows, T, device)
    cu, lens = _check_indexer(where, indexer, T, device, indexer_dtype)
    check_block_coverage(where, pool, ids, host_bt, cu, lens)
    return ids, stable, host_bt


def check_rows(
    where: str,
    rows: object,
    cu_seqlens_q: object,
    seq_lens_k: object,
    *,
    pool: HostKVPool,
    max_rows: int,
    device: torch.device,
    epoch: int,
) -> CheckedRows:
    """The checks :func:`check_step` runs on ``rows`` (a :class:`DecodeRows` of ``1..max_rows`` rows),
    on the indexer's ``cu_seqlens_q int32 [B + 1]`` / ``seq_lens_k int32 [B]`` and on the block
    coverage, once for every layer of a forward; returns the :class:`CheckedRows`."""
    if not isinstance(rows, DecodeRows):
        raise TypeError(f"{where}: 'rows' must be a DecodeRows, got {type(rows).__name__}")
    ids = rows.request_ids
    T = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 1 else None
    if T is None:
        T = len(ids) if isinstance(ids, Sequence) and not isinstance(ids, str | bytes) else 0
    if not 1 <= T <= max_rows:
        raise ValueError(f"{where}: {T} decode rows, expected 1..max_rows={max_rows}")
    ids, stable, host_bt = _check_rows(where, rows, T, device)
    dev = (device,)
    cu = check_tensor(where, "indexer.cu_seqlens_q", cu_seqlens_q, dim=1, dtypes=(torch.int32,), devices=dev)
    lens = check_tensor(where, "indexer.seq_lens_k", seq_lens_k, shape=(cu.shape[0] - 1,),
                        dtypes=(torch.int32,), devices=dev)  # fmt: skip
    check_block_coverage(where, pool, ids, host_bt, cu, lens)
    watched = tuple(Unchanged(t) for t in (stable, host_bt, cu, lens))
    return CheckedRows(ids, stable, host_bt, cu, lens, epoch, watched)


def check_step_checked(
    where: str,
    layer: object,
    q_nope: object,
    q_pe: object,
    scale: object,
    indexer: object,
    rows: CheckedRows,
    *,
    pool: HostKVPool,
    max_rows: int,
    dims: tuple[int, int],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    indexer_dtype: str,
    epoch: int,
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """:func:`check_step` for rows checked by :func:`check_rows`: the per-layer checks, and that ``rows``
    still describe these steps (same ``T``, the indexer's ``cu_seqlens_q`` / ``seq_lens_k`` the tensors
    they were checked with, unmodified, no request reserved or released since: ``epoch``).

    The per-layer checks run in full once per layout of the queries and the indexer's tensors: a later
    layer whose inputs have the shapes, dtypes and devices of ones that passed with these rows skips them
    (the next layers of a forward)."""
    layout = _layer_inputs(q_nope, q_pe, indexer)
    if layout is not None:  # what the checks compare the inputs with: the runtime's, as well
        layout = (id(pool), max_rows, dims, dtypes, device, indexer_dtype, layout)
    if (
        layout is None
        or layout != rows.layer_inputs
        or not (type(layer) is int and 0 <= layer < pool.num_layers)
    ):
        T = _check_queries(where, layer, q_nope, q_pe, scale, pool=pool, max_rows=max_rows, dims=dims, dtypes=dtypes,
                           device=device)  # fmt: skip
        if not isinstance(indexer, IndexerInputs):
            raise TypeError(f"{where}: 'indexer' must be IndexerInputs, got {type(indexer).__name__}")
        if len(rows.request_ids) != T:
            raise ValueError(f"{where}: the checked rows hold {len(rows.request_ids)} rows, q_nope {T}")
        _check_indexer(where, indexer, T, device, indexer_dtype)
        rows.layer_inputs = layout
    else:
        check_scale(where, scale)
    assert isinstance(indexer, IndexerInputs)
    cu, lens = indexer.cu_seqlens_q, indexer.seq_lens_k
    if cu is not rows.cu_seqlens_q or lens is not rows.seq_lens_k:
        raise ValueError(
            f"{where}: the checked rows were checked with other indexer.cu_seqlens_q / seq_lens_k tensors; "
            "check_rows() them with this step's"
        )
    if rows.epoch != epoch or not rows.unchanged():
        raise ValueError(
            f"{where}: the checked rows are stale (a request was reserved or released, or their tensors "
            "were modified since check_rows()); check them again"
        )
    return rows.request_ids, rows.stable_len, rows.host_block_table


def _layer_inputs(q_nope: object, q_pe: object, indexer: object) -> tuple | None:
    """The layout (shape, dtype, device of each tensor) of one layer's queries and indexer inputs; None
    when one of them is not a plain tensor (the full checks then say what is wrong)."""
    if type(indexer) is not IndexerInputs:
        return None
    layout: list[object] = []
    for t in (q_nope, q_pe, indexer.q, indexer.weights, indexer.block_table, indexer.cu_seqlens_q,
              indexer.seq_lens_k, indexer.k_cache, indexer.k_int8_cache, indexer.k_scale_cache,
              indexer.k_fp8_rows):  # fmt: skip
        if t is None:
            layout.append(None)
        elif type(t) is torch.Tensor:
            layout.append((t.shape, t.dtype, t.device))
        else:
            return None
    return tuple(layout)


def _check_queries(
    where: str, layer: object, q_nope: object, q_pe: object, scale: object, *, pool: HostKVPool,
    max_rows: int, dims: tuple[int, int], dtypes: tuple[torch.dtype, ...], device: torch.device,
) -> int:  # fmt: skip
    """``layer``, ``q_nope [T, H, Dc]``, ``q_pe [T, H, Dr]`` (``dims``, one of ``dtypes``) and ``scale``;
    returns ``T``."""
    check_layer(where, layer, pool.num_layers)
    dev = (device,)
    Dc, Dr = dims
    q_nope = check_tensor(where, "q_nope", q_nope, shape=(None, None, Dc), dtypes=dtypes, devices=dev)
    T, H = q_nope.shape[:2]
    if not 1 <= T <= max_rows:
        raise ValueError(f"{where}: {T} decode rows, expected 1..max_rows={max_rows}")
    check_tensor(where, "q_pe", q_pe, shape=(T, H, Dr), dtypes=(q_nope.dtype,), devices=dev)
    check_scale(where, scale)
    return T


def _check_rows(
    where: str, rows: DecodeRows, T: int, device: torch.device
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """``rows``' request ids (``T`` ints), ``stable_len int64 [T]`` and ``host_block_table int32 [T, W]``."""
    ids = host_ints(where, "rows.request_ids", rows.request_ids, T)
    stable = check_tensor(where, "rows.stable_len", rows.stable_len, shape=(T,), dtypes=(torch.int64,),
                          devices=(torch.device("cpu"), device))  # fmt: skip
    if stable.device.type == "cpu" and bool((stable < 0).any()):
        raise ValueError(f"{where}: rows.stable_len entries must be >= 0, got {stable.tolist()}")
    host_bt = check_tensor(where, "rows.host_block_table", rows.host_block_table, dim=2, dtypes=(torch.int32,),
                           devices=(torch.device("cpu"), device))  # fmt: skip
    if host_bt.shape[0] != T:
        raise ValueError(f"{where}: rows.host_block_table must have {T} rows, got {list(host_bt.shape)}")
    return ids, stable, host_bt


def _check_indexer(
    where: str, indexer: IndexerInputs, T: int, device: torch.device, indexer_dtype: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``indexer``'s tensors for ``T`` query rows; returns ``(cu_seqlens_q, seq_lens_k)``."""
    dev = (device,)
    check_tensor(where, "indexer.q", indexer.q, dim=3, devices=dev)
    if indexer.q.shape[0] != T:
        raise ValueError(f"{where}: indexer.q must have {T} rows (T of q_nope), got {list(indexer.q.shape)}")
    check_tensor(where, "indexer.weights", indexer.weights, shape=(T, indexer.q.shape[1]), devices=dev)
    cu = check_tensor(where, "indexer.cu_seqlens_q", indexer.cu_seqlens_q, dim=1, dtypes=(torch.int32,),
                      devices=dev)  # fmt: skip
    lens = check_tensor(where, "indexer.seq_lens_k", indexer.seq_lens_k, shape=(cu.shape[0] - 1,),
                        dtypes=(torch.int32,), devices=dev)  # fmt: skip
    check_tensor(where, "indexer.block_table", indexer.block_table, shape=(cu.shape[0] - 1, None),
                 dtypes=(torch.int32,), devices=dev)  # fmt: skip
    if indexer_dtype == "fp8_e4m3":
        if indexer.k_fp8_rows is None:
            raise ValueError(f"{where}: the FP8 indexer path needs indexer.k_fp8_rows")
        check_tensor(
            where, "indexer.k_fp8_rows", indexer.k_fp8_rows, dim=3, dtypes=(torch.uint8,), devices=dev
        )
    elif indexer_dtype == "int8":
        if indexer.k_int8_cache is None or indexer.k_scale_cache is None:
            raise ValueError(f"{where}: the int8 indexer path needs indexer.k_int8_cache and k_scale_cache")
        check_tensor(where, "indexer.k_int8_cache", indexer.k_int8_cache, dim=3, dtypes=(torch.int8,),
                     devices=dev)  # fmt: skip
        check_tensor(where, "indexer.k_scale_cache", indexer.k_scale_cache, dim=2, dtypes=(torch.float32,),
                     devices=dev)  # fmt: skip
    else:
        if indexer.k_cache is None:
            raise ValueError(f"{where}: the floating indexer path needs indexer.k_cache")
        check_tensor(where, "indexer.k_cache", indexer.k_cache, dim=3, devices=dev)
    return cu, lens


def check_block_coverage(
    where: str,
    pool: HostKVPool,
    request_ids: list[int],
    host_block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
) -> None:
    """Every position a row's indexer may select (``< seq_lens_k`` of its batch entry) has a host row.

    ``host_block_table int32 [T, W]`` row ``t`` must cover ``seq_lens_k[b]`` positions (``b`` the batch
    entry of query ``t`` through ``cu_seqlens_q``) with blocks of the pool; where this pool object
    allocated the request's blocks (the writer, or a rank replaying the allocations), the entries must
    be those blocks. Skipped for tensors off the CPU (reading them would synchronise).
    """
    if any(t.device.type != "cpu" for t in (host_block_table, cu_seqlens_q, seq_lens_k)):
        return
    T, width = host_block_table.shape
    cu, lens = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    if len(cu) != len(lens) + 1 or cu[0] != 0 or cu[-1] != T or any(a > b for a, b in itertools.pairwise(cu)):
        raise ValueError(
            f"{where}: indexer.cu_seqlens_q must rise from 0 to T = {T} with one more entry than "
            f"seq_lens_k ({len(lens)}), got {cu}"
        )
    bs = pool.block_size
    table = host_block_table.tolist()
    for b, seq in enumerate(lens):
        if seq < 0:
            raise ValueError(f"{where}: indexer.seq_lens_k entry {b} is {seq}, expected >= 0")
        need = math.ceil(seq / bs)
        for t in range(cu[b], cu[b + 1]):
            rid = request_ids[t]
            if need > width:
                raise ValueError(
                    f"{where}: rows.host_block_table has {width} blocks per row, row {t} (request {rid}) "
                    f"attends to {seq} positions = {need} blocks of {bs}"
                )
            entries = table[t][:need]
            bad = [e for e in entries if not 0 <= e < pool.num_blocks]
            if bad:
                raise IndexError(
                    f"{where}: rows.host_block_table row {t} (request {rid}) holds block {bad[0]} among its "
                    f"first {need} entries, expected a value in [0, {pool.num_blocks})"
                )
            if pool.knows(rid):
                if pool.reserved_tokens(rid) < seq:
                    raise ValueError(
                        f"{where}: request {rid} (row {t}) attends to {seq} positions but only "
                        f"{pool.reserved_tokens(rid)} are reserved in the host pool"
                    )
                if entries != pool.blocks_of(rid)[:need]:
                    raise ValueError(
                        f"{where}: rows.host_block_table row {t} is {entries}, but request {rid}'s blocks "
                        f"in the host pool are {pool.blocks_of(rid)[:need]}"
                    )

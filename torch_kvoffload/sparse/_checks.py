"""Argument checks of the sparse decode runtime, run before anything is written.

Shape, dtype and device checks always run. Checks of values (block-table entries, sequence lengths) run
on tensors that live on the CPU, where reading them costs nothing; on an accelerator the per-layer step
reads no device tensor back (the ops' kernels still reject out-of-range indices).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from numbers import Real
from typing import TYPE_CHECKING

import torch

from torch_kvoffload._utils import check_int

if TYPE_CHECKING:
    from torch_kvoffload.sparse.host_pool import HostKVPool

__all__ = ["check_block_coverage", "check_layer", "check_tensor", "host_ints"]


def check_layer(where: str, layer: object, num_layers: int) -> int:
    """``layer`` as an int in ``[0, num_layers)`` (``-1`` is an error, not the last layer)."""
    return check_int(where, "layer", layer, minimum=0, maximum=num_layers - 1)


def check_tensor(
    where: str,
    arg: str,
    t: object,
    *,
    shape: Sequence[int | None] | None = None,
    dim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    devices: Sequence[torch.device] | None = None,
) -> torch.Tensor:
    """``t`` as a tensor of the given shape (``None`` = any size), dims, dtypes and devices."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: '{arg}' must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(w is None or s == w for s, w in zip(t.shape, shape, strict=True))
        if not ok:
            want = ", ".join("*" if w is None else str(w) for w in shape)
            raise ValueError(f"{where}: '{arg}' must have shape [{want}], got {list(t.shape)}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{where}: '{arg}' must have {dim} dims, got shape {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{where}: '{arg}' must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if devices is not None and t.device not in devices:
        raise ValueError(f"{where}: '{arg}' must be on {' or '.join(map(str, devices))}, got {t.device}")
    return t


def check_scale(where: str, scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, Real) or not math.isfinite(float(scale)):
        raise ValueError(f"{where}: 'scale' must be a finite float, got {scale!r}")
    return float(scale)


def host_ints(where: str, arg: str, values: object, n: int) -> list[int]:
    """Request ids (a sequence of ints or an integer tensor ``[n]``) as ``n`` Python ints ``>= 0``.

    They are scheduler metadata: pass them as a CPU tensor or a list (a device tensor is read back,
    which synchronises with the device).
    """
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{where}: '{arg}' must be an int64 / int32 tensor [{n}], got {values.dtype} {list(values.shape)}"
            )
        out = values.tolist()
    elif isinstance(values, Sequence) and not isinstance(values, str | bytes):
        out = [check_int(where, f"{arg}[{i}]", v) for i, v in enumerate(values)]
    else:
        raise TypeError(
            f"{where}: '{arg}' must be a sequence of ints or a tensor, got {type(values).__name__}"
        )
    if len(out) != n:
        raise ValueError(f"{where}: '{arg}' must hold {n} entries (one per row), got {len(out)}")
    bad = [v for v in out if v < 0]
    if bad:
        raise ValueError(f"{where}: '{arg}' entries must be >= 0, got {bad[0]}")
    return out


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

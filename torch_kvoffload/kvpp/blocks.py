"""Which bytes of a bundle a forward needs: its block tables as a few contiguous block runs.

A forward reads only the physical blocks in its requests' block tables. :func:`block_runs` takes their
union, sorted, as half-open runs ``[start, stop)`` of consecutive block ids, and, past ``max_runs`` runs,
merges the runs separated by the smallest gaps (the gap blocks are moved too: one collective fewer per
component for a few blocks more). Because a bundle is component-major (each component holds every block),
a run is one contiguous byte range per component; :func:`run_byte_ranges` lists them, merging ranges that
touch (the whole pool is one range: the bundle span). :func:`forward_digest` fingerprints a forward's
tables, so the ranks of a group can check that they schedule the same forward.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from torch_kvoffload._utils import check_int
from torch_kvoffload.kvpp.layout import bundle_layout

__all__ = ["BlockTables", "block_runs", "forward_digest", "run_byte_ranges"]

#: A forward's block tables: an integer tensor of any shape (``-1`` entries are padding), or one
#: sequence of physical block ids per request.
BlockTables = torch.Tensor | Sequence[Sequence[int]]


def _unique_blocks(where: str, block_tables: BlockTables, num_blocks: int) -> list[int]:
    if isinstance(block_tables, torch.Tensor):
        if (
            block_tables.dtype.is_floating_point
            or block_tables.dtype.is_complex
            or block_tables.dtype == torch.bool
        ):
            raise TypeError(
                f"{where}: argument 'block_tables' must be an integer tensor, got dtype {block_tables.dtype}"
            )
        flat = block_tables.detach().reshape(-1).to("cpu", torch.int64)
        if flat.numel() and int(flat.min()) < -1:
            raise ValueError(
                f"{where}: argument 'block_tables' holds {int(flat.min())}; entries must be block ids in "
                f"[0, {num_blocks}) or -1 (padding)"
            )
        flat = flat[flat >= 0]
        if flat.numel() and int(flat.max()) >= num_blocks:
            raise ValueError(
                f"{where}: argument 'block_tables' holds block {int(flat.max())}, out of range [0, {num_blocks})"
            )
        return torch.unique(flat).tolist()
    if isinstance(block_tables, (str, bytes)) or not isinstance(block_tables, Sequence):
        raise TypeError(
            f"{where}: argument 'block_tables' must be an integer tensor or a sequence of block-id sequences, "
            f"got {type(block_tables).__name__}"
        )
    blocks: set[int] = set()
    for r, table in enumerate(block_tables):
        if isinstance(table, torch.Tensor):
            table = table.reshape(-1).tolist()
        if isinstance(table, (str, bytes)) or not isinstance(table, Sequence):
            raise TypeError(
                f"{where}: block_tables[{r}] must be a sequence of block ids, got {type(table).__name__}"
            )
        for block in table:
            b = check_int(where, f"block_tables[{r}] entry", block, minimum=-1, maximum=num_blocks - 1)
            if b >= 0:
                blocks.add(b)
    return sorted(blocks)


def block_runs(
    block_tables: BlockTables, num_blocks: int, *, max_runs: int | None = None
) -> list[tuple[int, int]]:
    """The union of ``block_tables`` as sorted half-open runs ``[(start, stop), ...]`` of block ids.

    Parameters
    ----------
    block_tables : integer tensor (any shape, ``-1`` = padding) or per-request sequences of block ids,
        each in ``[0, num_blocks)``.
    num_blocks : blocks in the pool (ids are checked against it).
    max_runs : at most this many runs (``>= 1``): the runs separated by the smallest gaps are merged
        first (ties: the leftmost gap), so the result covers every requested block plus the fewest gap
        blocks a run budget allows. ``None``: no limit.

    Raises ``TypeError`` / ``ValueError`` naming the bad entry. Deterministic: every rank that passes the
    same tables gets the same runs.
    """
    where = "block_runs"
    num_blocks = check_int(where, "num_blocks", num_blocks, minimum=1)
    if max_runs is not None:
        max_runs = check_int(where, "max_runs", max_runs, minimum=1)
    blocks = _unique_blocks(where, block_tables, num_blocks)
    runs: list[list[int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1][1] = b + 1
        else:
            runs.append([b, b + 1])
    if max_runs is not None and len(runs) > max_runs:
        gaps = [(runs[i + 1][0] - runs[i][1], i) for i in range(len(runs) - 1)]
        keep = {i for _, i in sorted(gaps, key=lambda g: (-g[0], g[1]))[: max_runs - 1]}
        merged: list[list[int]] = [list(runs[0])]
        for i in range(len(runs) - 1):
            if i in keep:
                merged.append(list(runs[i + 1]))
            else:
                merged[-1][1] = runs[i + 1][1]
        runs = merged
    return [(start, stop) for start, stop in runs]


def run_byte_ranges(
    component_bytes_per_block: list[int], num_blocks: int, runs: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Byte ranges ``[(begin, end), ...]`` of a bundle that hold ``runs`` of every component.

    The bundle is component-major (:func:`~torch_kvoffload.kvpp.layout.bundle_layout`): component ``c``
    of block ``b`` lies at ``offset_c + b * bytes_per_block_c``, so run ``[s, t)`` of component ``c`` is
    ``[offset_c + s * bpb_c, offset_c + t * bpb_c)``. Ranges are listed component by component, runs in
    order; ranges that touch are merged (all blocks of all components give ``[(0, bundle_bytes)]``).
    """
    spans, _ = bundle_layout(component_bytes_per_block, num_blocks)
    previous = 0
    for start, stop in runs:
        if not previous <= start < stop <= num_blocks:
            raise ValueError(
                f"run_byte_ranges: run [{start}, {stop}) must be non-empty, inside [0, {num_blocks}) and "
                f"after the previous run (which ends at {previous})"
            )
        previous = stop
    out: list[tuple[int, int]] = []
    for (offset, _), per_block in zip(spans, component_bytes_per_block, strict=True):
        for start, stop in runs:
            begin, end = offset + start * per_block, offset + stop * per_block
            if out and out[-1][1] == begin:
                out[-1] = (out[-1][0], end)
            else:
                out.append((begin, end))
    return out


def forward_digest(has_history: bool, block_tables: BlockTables | None) -> int:
    """A 64-bit fingerprint (signed ``int``) of a forward's ``has_history`` flag and block tables.

    Covers the tables' shape and entries as given (``None``, a tensor of any integer dtype or device, or
    per-request sequences), so ranks that pass the same tables in the same form get the same value and
    ranks whose forwards would issue different collectives get different ones. The tables must already be
    valid (:func:`block_runs`).
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(b"history" if has_history else b"none")
    if block_tables is None:
        h.update(b"all")
    elif isinstance(block_tables, torch.Tensor):
        flat = block_tables.detach().to("cpu", torch.int64).contiguous()
        h.update(b"tensor" + repr(tuple(flat.shape)).encode())
        h.update(flat.numpy().tobytes())
    else:
        h.update(b"lists")
        for table in block_tables:
            ids = table.reshape(-1).tolist() if isinstance(table, torch.Tensor) else [int(b) for b in table]
            h.update(len(ids).to_bytes(8, "little"))
            h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)

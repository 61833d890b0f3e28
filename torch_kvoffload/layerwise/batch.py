"""Forward planning: check a prefill batch, find and lease its cached prefixes, list the blocks to move.

Block tables: requests of one batch may share physical blocks for reading (a shared prefix): a shared
block is loaded once per layer and saved at most once. At most one request may *write* a block (compute
tokens into it) in a forward; a block another request writes in the same forward is not loaded (its
writer computes it) and must be a full block of the same prefix for every request that uses it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from torch_kvoffload._utils import check_int
from torch_kvoffload.counters import Counters
from torch_kvoffload.layerwise.lookup import PrefixLookup
from torch_kvoffload.store.base import StoreLease

__all__ = ["ForwardPlanner", "Request", "Transfers"]


@dataclass
class Request:
    hashes: list[str]
    block_ids: list[int]
    num_cached_blocks: int  # blocks not computed: loaded, or computed by another request of the batch
    # the pinning lease whose keys are exactly blocks [0, leased_blocks) of every layer, layer-major:
    # the loads read through it (no second lookup); None when the loads must look their keys up
    lease: StoreLease | None = None
    leased_blocks: int = 0


@dataclass(frozen=True)
class Transfers:
    """The blocks every layer moves in one forward (the same for every layer).

    Loads: each physical block once, in request order; ``load_runs`` cuts the load list into runs of
    consecutive logical blocks of one request: ``(start, request, first block, length)`` — entries
    ``[start, start + length)`` read blocks ``first ..`` of that request (the first request reading each
    block). Saves: the full blocks the forward computes, each content (hash) once.
    """

    requests: list[Request] = field(default_factory=list)
    load_hashes: list[str] = field(default_factory=list)
    load_blocks: list[int] = field(default_factory=list)
    load_runs: list[tuple[int, int, int, int]] = field(default_factory=list)
    save_hashes: list[str] = field(default_factory=list)
    save_blocks: list[int] = field(default_factory=list)
    # loads read through the requests' pinning leases (every loaded entry's request has an exact one)
    via_leases: bool = False


class ForwardPlanner:
    """Turns ``begin_forward``'s arguments into the forward's :class:`Transfers`.

    ``lookup`` finds and leases the prefixes (its ``leases`` hold them until the forward ends);
    ``counters`` receives ``store_hits`` / ``store_misses`` / ``batch_shared_blocks`` / ``leased_blocks``.
    """

    def __init__(self, lookup: PrefixLookup, counters: Counters, *, num_blocks: int, num_layers: int) -> None:
        self.lookup = lookup
        self.counters = counters
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = lookup.block_size

    def plan(
        self,
        token_ids: Sequence[Sequence[int] | torch.Tensor],
        block_tables: Sequence[Sequence[int]] | torch.Tensor,
        num_cached_tokens: Sequence[int] | None,
        max_cached_tokens: Sequence[int] | None,
        idle: Sequence[bool] | None = None,
        positions: Sequence[Sequence[int] | torch.Tensor | None] | None = None,
    ) -> Transfers:
        """Check the batch, lease its prefixes and plan its transfers (``begin_forward``'s contract).

        Raises ``ValueError`` / ``TypeError`` / ``IndexError`` naming the argument; nothing is leased or
        counted then.
        """
        fn = "begin_forward"
        if isinstance(block_tables, torch.Tensor):
            if (
                block_tables.dim() != 2
                or block_tables.dtype.is_floating_point
                or block_tables.dtype == torch.bool
            ):
                raise ValueError(
                    f"{fn}: 'block_tables' must be an int tensor [R, max_blocks], got "
                    f"{block_tables.dtype} {list(block_tables.shape)}"
                )
            block_tables = block_tables.tolist()
        if len(block_tables) != len(token_ids):
            raise ValueError(
                f"{fn}: 'block_tables' has {len(block_tables)} rows, 'token_ids' {len(token_ids)} requests"
            )
        for arg, values in (
            ("num_cached_tokens", num_cached_tokens),
            ("max_cached_tokens", max_cached_tokens),
            ("idle", idle),
            ("positions", positions),
        ):
            if values is not None and len(values) != len(token_ids):
                raise ValueError(f"{fn}: '{arg}' has {len(values)} entries, expected {len(token_ids)}")
        if max_cached_tokens is not None:
            if num_cached_tokens is not None:
                raise ValueError(f"{fn}: pass 'num_cached_tokens' or 'max_cached_tokens', not both")
            for r, m in enumerate(max_cached_tokens):
                check_int(fn, f"max_cached_tokens[{r}]", m, minimum=0)
        # a request without tokens computes none
        idle_rows = [len(t) == 0 or (idle is not None and bool(idle[r])) for r, t in enumerate(token_ids)]
        tables, hashes = self._check_batch(token_ids, block_tables, num_cached_tokens, idle_rows, positions)
        try:
            requests = self._plan_requests(
                token_ids, tables, hashes, num_cached_tokens, max_cached_tokens, idle_rows
            )
        except BaseException:
            self.lookup.release_leases()
            raise
        return plan_transfers(requests)

    def _check_batch(
        self,
        token_ids: Sequence[Sequence[int] | torch.Tensor],
        block_tables: Sequence[Sequence[int]],
        num_cached_tokens: Sequence[int] | None,
        idle: list[bool],
        positions: Sequence[Sequence[int] | torch.Tensor | None] | None = None,
    ) -> tuple[list[list[int]], list[list[str]]]:
        """Validate every request's tokens, block table and fixed cached count; return the block ids each
        request uses and its block hashes (of its tokens at ``positions[r]``). Touches no state."""
        fn = "begin_forward"
        tables, hashes = [], []
        for r, (toks, table) in enumerate(zip(token_ids, block_tables, strict=True)):
            n = len(toks)
            need = -(-n // self.block_size)
            if len(table) < need:
                raise ValueError(
                    f"{fn}: request {r} has {n} tokens = {need} blocks, its block table only {len(table)}"
                )
            ids: list[int] = []
            position: dict[int, int] = {}
            for j in range(need):
                b = check_int(fn, f"block_tables[{r}][{j}]", table[j])
                if not 0 <= b < self.num_blocks:
                    raise IndexError(
                        f"{fn}: block_tables[{r}][{j}] is {b}, expected a block in [0, {self.num_blocks})"
                    )
                if b in position:
                    raise ValueError(
                        f"{fn}: request {r} uses block {b} twice (block_tables[{r}][{position[b]}] and [{j}])"
                    )
                position[b] = j
                ids.append(b)
            if num_cached_tokens is not None:
                c = num_cached_tokens[r]
                if isinstance(c, bool) or not isinstance(c, int) or c < 0 or c % self.block_size:
                    raise ValueError(
                        f"{fn}: num_cached_tokens[{r}] must be a non-negative multiple of "
                        f"{self.block_size}, got {c!r}"
                    )
                if idle[r] and c != n // self.block_size * self.block_size:
                    raise ValueError(
                        f"{fn}: num_cached_tokens[{r}] = {c}, but request {r} computes no token: expected "
                        f"its {n // self.block_size * self.block_size} tokens of full blocks"
                    )
                if not idle[r] and c // self.block_size > self.lookup.max_cacheable_blocks(n):
                    raise ValueError(f"{fn}: num_cached_tokens[{r}] = {c} leaves no token of {n} to compute")
            tables.append(ids)
            hashes.append(self.lookup.hashes(toks, None if positions is None else positions[r]))
        return tables, hashes

    def _plan_requests(
        self,
        token_ids: Sequence[Sequence[int] | torch.Tensor],
        tables: list[list[int]],
        hashes: list[list[str]],
        num_cached_tokens: Sequence[int] | None,
        max_cached_tokens: Sequence[int] | None,
        idle: list[bool],
    ) -> list[Request]:
        """Look the validated batch's prefixes up and lease them (``lookup.leases``; the caller releases
        them if this raises), check the blocks the requests share, then count hits and misses. An idle
        request (computing no token) reads all its full blocks: ``RuntimeError`` when the store lacks one."""
        lookup = self.lookup
        requests: list[Request] = []
        # full blocks earlier requests of the batch compute in this forward: block -> its hash
        computed: dict[int, str] = {}
        for r, (ids, h) in enumerate(zip(tables, hashes, strict=True)):
            if num_cached_tokens is None:
                limit = len(h) if idle[r] else min(len(h), lookup.max_cacheable_blocks(len(token_ids[r])))
                cap = (
                    limit
                    if max_cached_tokens is None
                    else min(limit, max_cached_tokens[r] // self.block_size)
                )
                found, lease = lookup.lease_prefix(h, cap, fixed=False)
                # then read, rather than compute again, the full blocks of the same prefix that an
                # earlier request computes into the same physical blocks in this forward
                cached = found
                while cached < limit and computed.get(ids[cached]) == h[cached]:
                    cached += 1
            else:
                found, lease = lookup.lease_prefix(h, num_cached_tokens[r] // self.block_size, fixed=True)
                cached = found
            if lease is not None:
                lookup.leases.append(lease)
            if idle[r] and cached < len(h):
                raise RuntimeError(
                    f"begin_forward: request {r} computes no token in this forward, but only {cached} of its "
                    f"{len(h)} full blocks are in the store (or computed by the batch); its KV is lost"
                )
            exact = lease is not None and lease.pinned and len(lease.keys) == found * self.num_layers
            requests.append(Request(h, ids, cached, lease if exact else None, found))
            for j in range(cached, len(h)):
                computed.setdefault(ids[j], h[j])
        check_shared_blocks(requests)
        written = {b for q in requests for b in q.block_ids[q.num_cached_blocks :]}
        for q in requests:
            shared = sum(b in written for b in q.block_ids[: q.num_cached_blocks])
            self.counters.add("store_hits", q.num_cached_blocks - shared)
            self.counters.add("batch_shared_blocks", shared)
            self.counters.add("store_misses", len(q.hashes) - q.num_cached_blocks)
        for lease in lookup.leases:
            if lease.pinned:
                self.counters.add("leased_blocks", sum(lease.found))
        return requests


def check_shared_blocks(requests: list[Request]) -> None:
    """A physical block is written (tokens computed into it) by at most one request of the batch, and
    every request using it holds the same content there: the same full block of the same prefix
    (equal chained hashes; a partially filled block cannot be shared)."""
    fn = "begin_forward"
    writer: dict[int, int] = {}
    content: dict[int, tuple[int, str | None]] = {}
    for r, q in enumerate(requests):
        for j, b in enumerate(q.block_ids):
            h = q.hashes[j] if j < len(q.hashes) else None
            if j >= q.num_cached_blocks:
                if b in writer:
                    raise ValueError(
                        f"{fn}: requests {writer[b]} and {r} both write block {b} in this forward "
                        f"(only one request may compute tokens into a block; others may read it)"
                    )
                writer[b] = r
            first = content.setdefault(b, (r, h))
            if first[0] != r and (h is None or first[1] != h):
                raise ValueError(
                    f"{fn}: requests {first[0]} and {r} share block {b} but hold different tokens "
                    f"there (a shared block must be the same full block of the same prefix)"
                )


def plan_transfers(requests: list[Request]) -> Transfers:
    """The blocks every layer loads and saves in this forward (checked by :func:`check_shared_blocks`).

    Loads: each request's cached blocks in request order, a block shared by several requests once,
    none that a request of the batch writes (its writer computes it in this forward). Saves: the full
    blocks the requests compute, one per content (requests of one batch may share a prefix in
    distinct blocks).
    """
    written = {b for q in requests for b in q.block_ids[q.num_cached_blocks :]}
    loaded: set[int] = set()
    out = Transfers(requests)
    for r, q in enumerate(requests):
        for j in range(q.num_cached_blocks):
            b = q.block_ids[j]
            if b in written or b in loaded:
                continue
            loaded.add(b)
            runs = out.load_runs
            if runs and runs[-1][1] == r and runs[-1][2] + runs[-1][3] == j:
                start, _, first, length = runs[-1]
                runs[-1] = (start, r, first, length + 1)
            else:
                runs.append((len(out.load_blocks), r, j, 1))
            out.load_hashes.append(q.hashes[j])
            out.load_blocks.append(b)
    seen: set[str] = set()
    for q in requests:
        n = q.num_cached_blocks
        for h, b in zip(q.hashes[n:], q.block_ids[n : len(q.hashes)], strict=True):
            if h not in seen:
                seen.add(h)
                out.save_hashes.append(h)
                out.save_blocks.append(b)
    # loads read through the leases when every loaded entry's request leased exactly its prefix
    via = bool(out.load_runs) and all(requests[r].lease is not None for _, r, _, _ in out.load_runs)
    return dataclasses.replace(out, via_leases=via)

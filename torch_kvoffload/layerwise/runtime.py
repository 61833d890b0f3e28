"""The layerwise prefill offload runtime: load / wait / save / prefetch per layer, overlapped with compute.

A model (or an FX graph through the ``kvoffload::layer_*`` hook ops, whose names these methods carry
without the ``layer_`` prefix) calls, per forward::

    rt.begin_forward(token_ids, block_tables)   # looks the prefixes up in the store, starts prefetch
    for layer in range(N):
        rt.wait_layer(layer)    # waits for the buffer's previous user + this layer's load
        ...write the new tokens' KV into rt.layer_caches(layer), run attention...
        rt.save_layer(layer)    # starts the save of the new blocks
    rt.end_forward()      # waits for every transfer, raises the first failure

Block tables: requests of one batch may share physical blocks for reading (a shared prefix): a shared
block is loaded once per layer and saved at most once. At most one request may *write* a block (compute
tokens into it) in a forward; a block another request writes in the same forward is not loaded (its
writer computes it) and must be a full block of the same prefix for every request that uses it.

Reuse invariant: layer ``L`` never loads into / writes its physical buffer before the previous user of
that buffer finished computing, its save completed and every registered external consumer (P/D remote
read) reported completion. Completion is tracked per physical slot. A failed save or load poisons the
slot: every waiter of the slot raises a :class:`~torch_kvoffload.transfer.TransferError` and the slot is
not handed out again until :meth:`LayerwiseOffloadRuntime.reset`.

Store records: one key per (layer, full block) from ``torch_kvoffload.store.keys``, namespaced by
:attr:`LayerwiseOffloadRuntime.fingerprint` (the cache layout's digest and the user ``model_id``, so two
models on one store never read each other's KV). The value is the block's bundle — every cache component
of the layer (main, then indexer) for that block, each at a 16-byte aligned offset inside one ``uint8``
record. With host (CPU) buffers a layer's blocks move between the store and the buffers in one store call
per layer (:meth:`KVStore.batch_get_leased_blocks` through the lookup's pinning leases, else
``batch_get_blocks``; ``batch_put_blocks``); the embedded store does that with one ``copy_blocks`` kernel
per component, no staging copy. With device buffers the records go through pinned host staging tensors,
each reused only after the device copy that last used it completed (an event), and a host read of a
device-to-host copy waits for that copy's event first.

Evicted prefixes: ``begin_forward`` leases the blocks it found (:meth:`KVStore.lease`); a store that can
pin (the embedded one) then keeps them until ``end_forward``. A store that cannot pin may drop a block
before its layer loads it: the load raises :class:`PrefixEvictedError` (which layer, how many prefix
tokens per request are still usable), the runtime stays usable, and :meth:`LayerwiseOffloadRuntime.run_forward`
reruns the forward with the prefix cut there so the model recomputes instead of failing.

Hook ops find a runtime by name in ``torch_kvoffload.ops.layer_hooks.runtimes``
(``runtimes.register(name, rt)``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from torch_kvoffload._utils import check_int, round_up
from torch_kvoffload.counters import Counters
from torch_kvoffload.device import accelerator_type, default_device, empty_host
from torch_kvoffload.layerwise.allocation import LayerBuffers
from torch_kvoffload.layerwise.planner import LayerBufferPlan
from torch_kvoffload.ops._hook_registry import sync_copies
from torch_kvoffload.ops.copy import copy_blocks
from torch_kvoffload.store.base import KVStore, RecordLayout, StoreLease, leased_keys
from torch_kvoffload.store.keys import block_hashes, cache_layout_fingerprint, layer_key_prefix
from torch_kvoffload.transfer import (
    TransferError,
    TransferEvent,
    TransferStream,
    record_compute_event,
    submit_split,
)

logger = logging.getLogger(__name__)

__all__ = [
    "COUNTER_NAMES",
    "CompletionProvider",
    "LayerwiseOffloadRuntime",
    "PrefixEvictedError",
    "SlotPoisonedError",
    "StoreMissError",
]

_ALIGN = 16
# CPU tuning, measured on one machine (docs/performance-notes.md): a critical-path transfer is cut into
# this many parts, and an idle transfer thread waits this long before a transfer that overlaps compute.
_CRITICAL_PARTS = 2
_WAKE_DELAY = 50e-6
# pinned staging tensors per direction with device buffers: the host fills one while the device copies
# from another
_STAGING_RING = 2

#: ``fn(slot, layer) -> TransferEvent``: completes when an external reader is done with the slot's data.
CompletionProvider = Callable[[int, int], TransferEvent]

COUNTER_NAMES = (
    "bytes_loaded",  # host pool -> device buffers
    "bytes_saved",  # device buffers -> host pool
    "loads",  # per-layer load batches
    "saves",  # per-layer save batches
    "blocks_loaded",
    "blocks_saved",
    "store_hits",  # cached request blocks loaded from the store (found for every layer, or given)
    "store_misses",  # full request blocks computed by the request (not found, or past the cap)
    "batch_shared_blocks",  # full blocks a request read from another request's compute in one forward
    "load_failures",
    "save_failures",
    "waits",  # blocking waits in wait()
    "wait_seconds",
    "load_seconds",  # transfer-thread time spent loading (store reads + host->device copies)
    "save_seconds",  # transfer-thread time spent saving (device->host copies + store writes)
    "leased_blocks",  # store records pinned by begin_forward's leases (pinning stores only)
    "prefix_evictions",  # loads that found blocks of the looked-up prefix gone
    "forward_retries",  # forwards rerun by run_forward with a shorter prefix
    "store_errors",  # lookups whose store call raised (nothing found: the forward computes the prefix)
)

T = TypeVar("T")


class StoreMissError(TransferError):
    """A block found at lookup was gone when its layer was loaded (evicted in between)."""


class PrefixEvictedError(StoreMissError):
    """Blocks of the cached prefix were gone from the store when layer ``layer`` loaded them.

    Happens only with stores that cannot pin what ``begin_forward`` found (``StoreLease.pinned`` false:
    remote pools evict on their own). The forward cannot continue — the layer's cached tokens are
    missing — but nothing is poisoned: close it with ``end_forward()`` (which raises this error again)
    and run it again with ``begin_forward(..., max_cached_tokens=err.usable_tokens)``, or let
    :meth:`LayerwiseOffloadRuntime.run_forward` do both.

    Attributes:
        layer: the layer whose load found blocks missing.
        usable_tokens: per request, the cached tokens still usable: its prefix up to the first missing
            block of ``layer`` (never more than the request's cached tokens of this forward).
        missing_blocks: blocks of ``layer`` that were missing.
    """

    def __init__(self, message: str, *, layer: int, usable_tokens: list[int], missing_blocks: int) -> None:
        super().__init__(message)
        self.layer = layer
        self.usable_tokens = list(usable_tokens)
        self.missing_blocks = missing_blocks


class SlotPoisonedError(TransferError):
    """A physical buffer's last save or load failed; it is not handed out until ``reset()``."""


@dataclass
class _Slot:
    occupant: int | None = None  # layer currently owning the buffer
    release: list[TransferEvent] = field(default_factory=list)  # gate for the next user
    compute_done: bool = True
    handed_to: int | None = None  # a later layer whose load into this buffer was issued
    poison: BaseException | None = None
    poison_layer: int | None = None


@dataclass
class _Request:
    hashes: list[str]
    block_ids: list[int]
    num_cached_blocks: int  # blocks not computed: loaded, or computed by another request of the batch
    # the pinning lease whose keys are exactly blocks [0, leased_blocks) of every layer, layer-major:
    # the loads read through it (no second lookup); None when the loads must look their keys up
    lease: StoreLease | None = None
    leased_blocks: int = 0


@dataclass(frozen=True)
class _Transfers:
    """The blocks every layer moves in one forward (the same for every layer).

    Loads: each physical block once, in request order; ``load_runs`` cuts the load list into runs of
    consecutive logical blocks of one request: ``(start, request, first block, length)`` — entries
    ``[start, start + length)`` read blocks ``first ..`` of that request (the first request reading each
    block). Saves: the full blocks the forward computes, each content (hash) once.
    """

    requests: list[_Request] = field(default_factory=list)
    load_hashes: list[str] = field(default_factory=list)
    load_blocks: list[int] = field(default_factory=list)
    load_runs: list[tuple[int, int, int, int]] = field(default_factory=list)
    save_hashes: list[str] = field(default_factory=list)
    save_blocks: list[int] = field(default_factory=list)
    # loads read through the requests' pinning leases (every loaded entry's request has an exact one)
    via_leases: bool = False


@dataclass
class _Staging:
    """A reusable pinned host staging buffer; ``event`` marks the device copy that last used it."""

    buffer: torch.Tensor | None = None
    event: torch.Event | None = None


@dataclass
class _Layout:
    components: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    record_bytes: int
    records: RecordLayout | None  # the components as store records; None for device buffers


def _failure(exc: TransferError, context: str) -> TransferError:
    """A waiter's error: the class of the transfer's own failure when it is a TransferError (e.g.
    PrefixEvictedError, with its attributes), else SlotPoisonedError; the message names the context and
    the cause."""
    cause = exc.__cause__
    if isinstance(cause, PrefixEvictedError):
        err: TransferError = PrefixEvictedError(
            f"{context}: {cause}",
            layer=cause.layer,
            usable_tokens=cause.usable_tokens,
            missing_blocks=cause.missing_blocks,
        )
        err.__cause__ = cause
        return err
    cls = type(cause) if isinstance(cause, TransferError) else SlotPoisonedError
    err = cls(f"{context}: {cause if cause is not None else exc}")
    err.__cause__ = cause if cause is not None else exc
    return err


class LayerwiseOffloadRuntime:
    """Runs layerwise load / save of a :class:`LayerBufferPlan` against a :class:`KVStore`.

    Parameters
    ----------
    plan, buffers : the plan (made from cache specs) and its allocation.
    store : the host KV pool.
    prefetch_depth : loads are issued up to this many layers ahead of the running layer (``>= 1``).
    model_id : names the model (weights, revision); with the cache layout it makes :attr:`fingerprint`,
        the model id of every store key, so runtimes of different models or layouts sharing one store
        never read each other's blocks, even with an empty ``model_id``.
    salt : namespaces the block hashes (``block_hashes(..., salt=)``: e.g. a LoRA or cache-salt id).
    transfer_streams : 2 = loads and saves on separate :class:`TransferStream` s (both copy directions
        at once: the default on accelerators); 1 = one stream in submission order (the default on CPU,
        where each stream is a worker thread competing with compute for cores).

    Every layer must use the same ``[num_blocks, block_size]`` paging (one block table per request for all
    layers). Transfers run on :class:`TransferStream` s (see ``transfer_streams``); waits happen in
    :meth:`wait` and :meth:`end_forward` only. On CPU, a transfer the compute thread waits for at once
    (the first layer's load, the last layer's save, a save the next layer's buffer waits for, a load
    issued for the running layer) is cut in two (``submit_split``): the transfer thread and the waiting
    thread, whose core would idle, run the halves at once.
    """

    def __init__(
        self,
        plan: LayerBufferPlan,
        buffers: LayerBuffers,
        store: KVStore,
        *,
        prefetch_depth: int = 2,
        model_id: str = "",
        salt: str = "",
        transfer_streams: int | None = None,
    ) -> None:
        where = "LayerwiseOffloadRuntime"
        if not isinstance(plan, LayerBufferPlan) or plan.specs is None:
            raise ValueError(
                f"{where}: 'plan' must be a LayerBufferPlan made from cache specs, not a layer count"
            )
        if not isinstance(buffers, LayerBuffers) or buffers.plan is not plan:
            raise ValueError(f"{where}: 'buffers' must be the LayerBuffers allocated for 'plan'")
        prefetch_depth = check_int(where, "prefetch_depth", prefetch_depth, minimum=1)
        if not isinstance(store, KVStore):
            raise TypeError(f"{where}: 'store' must be a KVStore, got {type(store).__name__}")
        if not isinstance(salt, str):
            raise TypeError(f"{where}: 'salt' must be a str, got {type(salt).__name__}")
        lead = plan.specs[0].main[0].shape[:2]
        for layer, spec in enumerate(plan.specs):
            if spec.main[0].shape[:2] != lead:
                raise ValueError(
                    f"{where}: layer {layer} pages its cache as [num_blocks, block_size] = "
                    f"{list(spec.main[0].shape[:2])}, layer 0 as {list(lead)}; all layers share one block table"
                )
        cpu_streams = default_device().type == "cpu"
        if transfer_streams is None:
            transfer_streams = 1 if cpu_streams else 2
        if transfer_streams not in (1, 2) or isinstance(transfer_streams, bool):
            raise ValueError(
                f"{where}: 'transfer_streams' must be 1 or 2 (or None), got {transfer_streams!r}"
            )
        #: the model id of this runtime's store keys: ``cache_layout_fingerprint(plan.specs, model_id)``
        self.fingerprint = cache_layout_fingerprint(plan.specs, model_id)
        self.plan = plan
        self.buffers = buffers
        self.store = store
        self.prefetch_depth = prefetch_depth
        self.model_id = model_id
        self.salt = salt
        self.num_blocks, self.block_size = lead
        self.counters = Counters(COUNTER_NAMES)
        self._layouts = [self._layout(layer) for layer in range(plan.num_layers)]
        # "kv/{fingerprint}/{layer}/": the store key of a block is this + its hash (layer_block_keys)
        self._key_prefixes = [
            layer_key_prefix(layer, model_id=self.fingerprint) for layer in range(plan.num_layers)
        ]
        self.transfer_streams = transfer_streams
        # parts of a critical-path transfer (CPU worker threads only; tests may change it)
        self._critical_parts = _CRITICAL_PARTS if cpu_streams else 1
        self._load_stream = TransferStream("layerwise-load" if transfer_streams == 2 else "layerwise")
        self._save_stream = TransferStream("layerwise-save") if transfer_streams == 2 else self._load_stream
        self._lock = threading.Lock()
        self._slots = [_Slot() for _ in plan.slots]
        self._providers: list[CompletionProvider] = []
        self._in_forward = False
        self._transfers = _Transfers()
        self._current = -1
        self._loads: dict[int, TransferEvent] = {}
        self._pending: list[TransferEvent] = []
        self._entered: set[int] = set()
        # host buffers: the staging path (non-contiguous host buffers) reuses one staging tensor per
        # direction with no events; device buffers: a ring of pinned tensors gated by copy events
        self._host_buffers = all(t.device.type == "cpu" for t in buffers.layer_caches(0))
        # compute runs on this thread, so it is done when the runtime is called (record_compute_event
        # would return an event that is already complete)
        self._sync_compute = accelerator_type() == "cpu"
        # Seconds an idle transfer thread waits before starting a save / prefetch that overlaps the
        # next compute (TransferStream.submit's wake_delay): the submitting thread starts an op right
        # then, and torch ops take the GIL briefly inside, which the woken thread's Python would hold.
        self._wake_delay = _WAKE_DELAY if self._sync_compute else 0.0
        self._next_reuses = [
            layer + 1 < plan.num_layers and plan.previous_user[layer + 1] == layer
            for layer in range(plan.num_layers)
        ]
        ring = 1 if self._host_buffers else _STAGING_RING
        self._staging_ring: dict[str, list[_Staging]] = {
            k: [_Staging() for _ in range(ring)] for k in ("load", "save")
        }
        self._staging_next = {"load": 0, "save": 0}
        self._leases: list[StoreLease] = []
        self._closed = False

    # ------------------------------------------------------------------------------------ layout
    def _layout(self, layer: int) -> _Layout:
        comps = self.buffers.layer_caches(layer)
        offsets, off = [], 0
        for c in comps:
            offsets.append(off)
            off = round_up(off + c[0].nbytes, _ALIGN)
        direct = all(c.device.type == "cpu" and c.is_contiguous() for c in comps)
        return _Layout(comps, tuple(offsets), off, RecordLayout(comps, offsets, off) if direct else None)

    def _staging_views(self, layer: int, staging: torch.Tensor) -> list[torch.Tensor]:
        lay = self._layouts[layer]
        n = staging.shape[0]
        views = []
        for comp, off in zip(lay.components, lay.offsets, strict=True):
            nb = comp[0].nbytes
            views.append(staging[:, off : off + nb].view(comp.dtype).view(n, *comp.shape[1:]))
        return views

    def record_bytes(self, layer: int) -> int:
        """Bytes of one store record (one block of every cache component of ``layer``)."""
        return self._layouts[layer].record_bytes

    def layer_caches(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The cache tensors of ``layer``: main components, then indexer components if it has any."""
        return self.buffers.layer_caches(self._check_layer("layer_caches", layer))

    # ----------------------------------------------------------------------------- registration
    def register_completion_provider(self, fn: CompletionProvider) -> None:
        """Add an external consumer: ``fn(slot, layer)`` is called when ``layer``'s KV is written (before
        the store save starts) and returns the event of its read; the slot's next user waits for it."""
        if not callable(fn):
            raise TypeError(f"register_completion_provider: expected a callable, got {type(fn).__name__}")
        self._providers.append(fn)

    # -------------------------------------------------------------------------------- lookups
    def _check_layer(self, fn: str, layer: object) -> int:
        if type(layer) is int and 0 <= layer < self.plan.num_layers:  # the per-layer calls' fast path
            return layer
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.plan.num_layers:
            raise ValueError(
                f"LayerwiseOffloadRuntime.{fn}: 'layer' must be an int in [0, {self.plan.num_layers}), got {layer!r}"
            )
        return layer

    def _max_cacheable_blocks(self, num_tokens: int) -> int:
        # At least one token is always computed, so a fully cached prompt still yields its last logits.
        return (num_tokens - 1) // self.block_size

    def lookup(self, token_ids: Sequence[int] | torch.Tensor) -> int:
        """Tokens of ``token_ids`` whose KV every layer has in the store (a multiple of ``block_size``,
        leaving at least one token to compute)."""
        hashes = block_hashes(token_ids, self.block_size, salt=self.salt)
        return self._cached_blocks(hashes, len(token_ids)) * self.block_size

    def _cached_blocks(self, hashes: list[str], num_tokens: int) -> int:
        cap = min(len(hashes), self._max_cacheable_blocks(num_tokens))
        if cap == 0:
            return 0
        return self._prefix_of(self.store.batch_exists(self._prefix_keys(hashes, cap)), cap)

    def _prefix_keys(self, hashes: list[str], n: int) -> list[str]:
        """Keys of blocks ``[0, n)`` of every layer, layer-major."""
        head = hashes[:n]
        return [prefix + h for prefix in self._key_prefixes for h in head]

    def _layer_keys(self, hashes: list[str], layer: int) -> list[str]:
        """``layer_block_keys(hashes, layer, model_id=)`` for hashes made by ``block_hashes`` (valid by
        construction, so not checked again on every transfer)."""
        prefix = self._key_prefixes[layer]
        return [prefix + h for h in hashes]

    def _prefix_of(self, found: list[bool], cap: int) -> int:
        """Longest prefix (in blocks, ``<= cap``) present for every layer in a layer-major ``found``."""
        cached = cap
        for layer in range(self.plan.num_layers):
            row = found[layer * cap : (layer + 1) * cap]
            cached = min(cached, row.index(False) if False in row else cap)
        return cached

    def _lease_prefix(self, hashes: list[str], cap: int, *, fixed: bool) -> tuple[int, StoreLease | None]:
        """Lease blocks ``[0, cap)`` of every layer; return the prefix found (``cap`` when ``fixed``) and
        the lease covering exactly that prefix (pinning stores), or ``None`` when nothing is cached."""
        if cap == 0 or (fixed and not self.store.pins_leases):
            return cap, None  # nothing to load, or a lease that would only repeat a presence query
        try:
            lease = self._lease(hashes, cap)
        except Exception as exc:
            if fixed:  # the caller says these blocks are cached: it must hear that they cannot be read
                raise
            self._store_failed("lookup", exc)  # nothing found: the forward computes the prefix
            return 0, None
        cached = cap if fixed else self._prefix_of(lease.found, cap)
        if cached < cap and lease.pinned:
            # keep only what the forward loads; blocks past the prefix must stay evictable
            try:
                narrowed = self._lease(hashes, cached) if cached else None
            finally:
                lease.release()
            lease = narrowed
        elif cached == 0:
            lease.release()
            lease = None
        return cached, lease

    def _lease(self, hashes: list[str], n: int) -> StoreLease:
        """Lease blocks ``[0, n)`` of every layer; a pinning store checks their record sizes too."""
        keys = self._prefix_keys(hashes, n)
        if not self.store.pins_leases:
            return self.store.lease(keys)
        sizes = [self._layouts[layer].record_bytes for layer in range(self.plan.num_layers) for _ in range(n)]
        return self.store.lease(keys, nbytes=sizes)

    def _release_leases(self) -> None:
        leases, self._leases = self._leases, []
        for lease in leases:
            lease.release()

    # -------------------------------------------------------------------------------- forward
    def begin_forward(
        self,
        token_ids: Sequence[Sequence[int] | torch.Tensor],
        block_tables: Sequence[Sequence[int]] | torch.Tensor,
        num_cached_tokens: Sequence[int] | None = None,
        *,
        max_cached_tokens: Sequence[int] | None = None,
    ) -> list[int]:
        """Start a prefill forward of a batch; return the cached tokens of each request.

        ``token_ids[r]``: all tokens of request ``r`` (prefix included; a host int tensor ``[T]`` or a
        sequence of ints). ``block_tables``: ``[R, max_blocks]`` device block ids (an int tensor, read on
        the host — pass a CPU tensor —, or a list of lists; ``-1`` padding allowed past the blocks a
        request needs). Requests may share physical blocks for reading (a shared prefix); a block may be
        written (tokens computed into it) by one request only, and every request using a block must hold
        the same content there (the same full block of the same prefix). A block that one request
        computes and others read is not loaded: the model writes it before attention reads it.

        ``num_cached_tokens``: per request, tokens not to compute (multiples of ``block_size``): loaded
        from the store, or computed into a shared block by another request of the batch. Default: the
        longest prefix every layer has in the store (:meth:`lookup`), extended over the full blocks of the
        same prefix that an earlier request of the batch computes into the same physical blocks.
        ``max_cached_tokens``: per request, an upper bound on the prefix looked up in the store (``>= 0``;
        rounded down to whole blocks) — e.g. ``PrefixEvictedError.usable_tokens``. The model computes
        tokens ``[cached, len)`` of each request and attends to all ``[0, len)``. The blocks to load are
        leased in the store until :meth:`end_forward` (pinned where the store can pin). Loads of the first
        layers start here.

        Raises ``ValueError`` / ``TypeError`` / ``IndexError`` naming the argument (and, for a block
        conflict, both requests and the block); nothing is changed then (no lease, no counter).
        """
        fn = "begin_forward"
        if self._closed:
            raise RuntimeError(f"LayerwiseOffloadRuntime.{fn}: the runtime is closed")
        if self._in_forward:
            raise RuntimeError(f"LayerwiseOffloadRuntime.{fn}: a forward is running; call end_forward()")
        for s, slot in enumerate(self._slots):
            if slot.poison is not None:
                raise SlotPoisonedError(self._poison_message(s, fn))
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
        ):
            if values is not None and len(values) != len(token_ids):
                raise ValueError(f"{fn}: '{arg}' has {len(values)} entries, expected {len(token_ids)}")
        if max_cached_tokens is not None:
            if num_cached_tokens is not None:
                raise ValueError(f"{fn}: pass 'num_cached_tokens' or 'max_cached_tokens', not both")
            for r, m in enumerate(max_cached_tokens):
                check_int(fn, f"max_cached_tokens[{r}]", m, minimum=0)
        tables, hashes = self._check_batch(token_ids, block_tables, num_cached_tokens)
        try:
            requests = self._plan_requests(token_ids, tables, hashes, num_cached_tokens, max_cached_tokens)
        except BaseException:
            self._release_leases()
            raise
        self._transfers = self._plan_transfers(requests)
        self._in_forward = True
        self._current = -1
        self._loads = {}
        self._pending = []
        self._entered = set()
        self._issue_window(0)
        return [q.num_cached_blocks * self.block_size for q in requests]

    def _check_batch(
        self,
        token_ids: Sequence[Sequence[int] | torch.Tensor],
        block_tables: Sequence[Sequence[int]],
        num_cached_tokens: Sequence[int] | None,
    ) -> tuple[list[list[int]], list[list[str]]]:
        """Validate every request's tokens, block table and fixed cached count; return the block ids each
        request uses and its block hashes. Touches no state."""
        fn = "begin_forward"
        tables, hashes = [], []
        for r, (toks, table) in enumerate(zip(token_ids, block_tables, strict=True)):
            n = len(toks)
            if n == 0:
                raise ValueError(f"{fn}: request {r} has no tokens")
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
                if c // self.block_size > self._max_cacheable_blocks(n):
                    raise ValueError(f"{fn}: num_cached_tokens[{r}] = {c} leaves no token of {n} to compute")
            tables.append(ids)
            hashes.append(block_hashes(toks, self.block_size, salt=self.salt))
        return tables, hashes

    def _plan_requests(
        self,
        token_ids: Sequence[Sequence[int] | torch.Tensor],
        tables: list[list[int]],
        hashes: list[list[str]],
        num_cached_tokens: Sequence[int] | None,
        max_cached_tokens: Sequence[int] | None,
    ) -> list[_Request]:
        """Look the validated batch's prefixes up and lease them (``self._leases``; the caller releases
        them if this raises), check the blocks the requests share, then count hits and misses."""
        requests: list[_Request] = []
        # full blocks earlier requests of the batch compute in this forward: block -> its hash
        computed: dict[int, str] = {}
        for r, (ids, h) in enumerate(zip(tables, hashes, strict=True)):
            if num_cached_tokens is None:
                limit = min(len(h), self._max_cacheable_blocks(len(token_ids[r])))
                cap = (
                    limit
                    if max_cached_tokens is None
                    else min(limit, max_cached_tokens[r] // self.block_size)
                )
                found, lease = self._lease_prefix(h, cap, fixed=False)
                # then read, rather than compute again, the full blocks of the same prefix that an
                # earlier request computes into the same physical blocks in this forward
                cached = found
                while cached < limit and computed.get(ids[cached]) == h[cached]:
                    cached += 1
            else:
                found, lease = self._lease_prefix(h, num_cached_tokens[r] // self.block_size, fixed=True)
                cached = found
            if lease is not None:
                self._leases.append(lease)
            exact = lease is not None and lease.pinned and len(lease.keys) == found * self.plan.num_layers
            requests.append(_Request(h, ids, cached, lease if exact else None, found))
            for j in range(cached, len(h)):
                computed.setdefault(ids[j], h[j])
        self._check_shared_blocks(requests)
        written = {b for q in requests for b in q.block_ids[q.num_cached_blocks :]}
        for q in requests:
            shared = sum(b in written for b in q.block_ids[: q.num_cached_blocks])
            self.counters.add("store_hits", q.num_cached_blocks - shared)
            self.counters.add("batch_shared_blocks", shared)
            self.counters.add("store_misses", len(q.hashes) - q.num_cached_blocks)
        for lease in self._leases:
            if lease.pinned:
                self.counters.add("leased_blocks", sum(lease.found))
        return requests

    @staticmethod
    def _check_shared_blocks(requests: list[_Request]) -> None:
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

    def prefetch_layer(self, layer: int, caches: Sequence[torch.Tensor] | None = None) -> None:
        """Issue the loads of ``layer .. layer + prefetch_depth`` whose buffers may be overwritten now.

        ``caches`` (optional): ``layer``'s cache tensors, checked against :meth:`layer_caches`.
        """
        self._check_layer("prefetch", layer)
        self._need_forward("prefetch")
        self._check_caches("prefetch", layer, caches)
        self._issue_window(layer)

    def wait_layer(self, layer: int, caches: Sequence[torch.Tensor] | None = None) -> None:
        """Block until ``layer`` may use its buffer and its cached prefix is loaded.

        ``caches`` (optional): the tensors the caller will read, checked against :meth:`layer_caches`;
        a tensor that is a copy of the buffer (a functionalized graph's clone) receives the loaded data.

        Raises :class:`TransferError` (or a subclass) if the slot's previous save, an external consumer
        or this layer's load failed; the slot is then poisoned. Calling it again for the layer that is
        running is a no-op wait; going back to an earlier layer raises ``RuntimeError``.
        """
        self._check_layer("wait", layer)
        self._need_forward("wait")
        if caches is not None:
            self._check_caches("wait", layer, caches)
        slot_id = self.plan.slot_of[layer]
        slot = self._slots[slot_id]
        if layer == self._current and slot.occupant == layer:
            self._wait_events(slot_id, layer, [self._loads[layer]] if layer in self._loads else [])
            self._sync_caches(layer, caches, into_buffers=False)
            return
        if layer <= self._current:
            raise RuntimeError(
                f"LayerwiseOffloadRuntime.wait: layer {layer} after layer {self._current}; "
                "layers run in increasing order"
            )
        self._finish_compute_before(layer)
        self._current = layer
        self._issue_window(layer)
        if slot.poison is not None:
            raise SlotPoisonedError(self._poison_message(slot_id, f"wait({layer})"))
        events = slot.release
        load = self._loads.get(layer)
        if load is not None:
            events = [*events, load]
        self._wait_events(slot_id, layer, events)
        slot.occupant, slot.release, slot.compute_done, slot.handed_to = layer, [], False, None
        self._entered.add(layer)
        if caches is not None:
            self._sync_caches(layer, caches, into_buffers=False)

    def save_layer(self, layer: int, caches: Sequence[torch.Tensor] | None = None) -> None:
        """Start the save of ``layer``'s newly computed full blocks (asynchronous).

        External completion providers are called first; the slot's next user waits for all of them and
        for the save. ``caches`` (optional): the tensors the caller wrote, checked against
        :meth:`layer_caches`; a tensor that is a copy of the buffer is copied into it before the save.
        """
        self._check_layer("save", layer)
        self._need_forward("save")
        if caches is not None:
            self._check_caches("save", layer, caches)
        slot_id = self.plan.slot_of[layer]
        slot = self._slots[slot_id]
        if slot.occupant != layer or layer != self._current:
            raise RuntimeError(
                f"LayerwiseOffloadRuntime.save: layer {layer} is not the running layer "
                f"(running: {self._current}); call wait({layer}) first"
            )
        if slot.handed_to is not None:
            raise RuntimeError(
                f"LayerwiseOffloadRuntime.save: buffer {slot_id} of layer {layer} was already "
                f"handed to layer {slot.handed_to}"
            )
        if slot.poison is not None:
            raise SlotPoisonedError(self._poison_message(slot_id, f"save({layer})"))
        if caches is not None:
            self._sync_caches(layer, caches, into_buffers=True)
        events = [fn(slot_id, layer) for fn in self._providers]
        plan = self._transfers
        if plan.save_hashes:
            # the next layer computes meanwhile, unless it reuses this buffer (its load waits for this
            # save) or there is none (end_forward waits for it): then the save is on the critical path
            critical = layer == self.plan.num_layers - 1 or self._next_reuses[layer]
            args = (layer, plan.save_hashes, plan.save_blocks)
            if critical and self._splits(layer):
                n = len(plan.save_hashes)
                ev = submit_split(
                    [self._save_stream],
                    n,
                    functools.partial(self._save_part, *args),
                    after=self._compute_done(),
                    done=functools.partial(self._save_done, layer, slot_id, n),
                    parts=self._critical_parts,
                )
            else:
                # keys are made on the transfer thread: per-layer Python stays off the compute thread
                ev = self._save_stream.submit(
                    self._do_save,
                    slot_id,
                    *args,
                    after=self._compute_done(),
                    wake_delay=0.0 if critical else self._wake_delay,
                )
            events.append(ev)
            self._pending.append(ev)
        slot.release.extend(events)

    def end_forward(self) -> None:
        """Wait for every load and save of the forward; raise the first failure (slots stay poisoned).

        External consumers are not waited for here: they gate the next use of their slot.
        """
        self._need_forward("end_forward")
        first: BaseException | None = None
        try:
            for ev in [*self._loads.values(), *self._pending]:
                try:
                    # a host wait for the host side (errors), a stream wait for device copies
                    ev.wait_on_compute()
                except TransferError as exc:
                    first = first or _failure(exc, "layerwise end_forward: a transfer of this forward failed")
            self._finish_compute_before(self.plan.num_layers)
        finally:
            self._in_forward = False
            self._loads, self._pending = {}, []
            self._transfers = _Transfers()
            self._current = -1
            self._release_leases()
        if first is not None:
            raise first

    def run_forward(
        self,
        token_ids: Sequence[Sequence[int] | torch.Tensor],
        block_tables: Sequence[Sequence[int]] | torch.Tensor,
        body: Callable[[list[int]], T],
        *,
        num_cached_tokens: Sequence[int] | None = None,
        max_cached_tokens: Sequence[int] | None = None,
    ) -> T:
        """``begin_forward``, ``body(cached)``, ``end_forward`` — recomputing instead of failing when the
        store dropped part of the prefix.

        ``body(cached)`` runs every layer of the model (:meth:`wait` / :meth:`save` or the
        hook ops) for the cached token counts it is given, and returns the model's outputs. If a load finds
        its blocks gone (:class:`PrefixEvictedError`, from ``body`` or ``end_forward``), the forward is
        closed and run again from the first layer, looking each request's prefix up again with at most
        the tokens still usable (``max_cached_tokens``; also after a first try with ``num_cached_tokens``).
        Requests sharing a block that must now be recomputed get it computed by the first of them and
        read by the others. Every retry lowers the cap of the request whose blocks were missing, so this
        ends — at worst with the whole prompt recomputed. Any other error closes the forward and
        propagates.
        """
        if isinstance(block_tables, torch.Tensor):
            block_tables = block_tables.tolist()
        fixed, caps = num_cached_tokens, max_cached_tokens
        while True:
            cached = self.begin_forward(
                token_ids, block_tables, fixed, **({} if fixed is not None else {"max_cached_tokens": caps})
            )
            try:
                out = body(cached)
            except PrefixEvictedError as exc:
                evicted = exc
                self.end_aborted_forward()
            except BaseException:
                self.end_aborted_forward()
                raise
            else:
                try:
                    self.end_forward()
                    return out
                except PrefixEvictedError as exc:
                    evicted = exc
            caps = self.retry_caps(cached, caps, evicted)
            fixed = None

    def retry_caps(
        self, cached: Sequence[int], caps: Sequence[int] | None, evicted: PrefixEvictedError
    ) -> list[int]:
        """The ``max_cached_tokens`` of the next try of a forward that raised ``evicted`` after
        ``begin_forward`` returned ``cached`` (under the caps ``caps`` of that try, or ``None``): each
        request's prefix cut at its first missing block, so every retry shortens it. Counted in
        ``forward_retries`` and logged; the caller closes the failed forward and begins the next try."""
        cut = [min(c, u) for c, u in zip(cached, evicted.usable_tokens, strict=True)]
        assert sum(cut) < sum(cached), "a prefix eviction must shorten the prefix"
        logger.warning(
            "layerwise: layer %d found %d prefix block(s) missing or unreadable; recomputing with cached "
            "tokens %s instead of %s",
            evicted.layer,
            evicted.missing_blocks,
            cut,
            list(cached),
        )
        self.counters.add("forward_retries")
        return cut if caps is None else [min(c, p) for c, p in zip(cut, caps, strict=True)]

    def end_aborted_forward(self) -> None:
        """Close a forward that already raised; its transfer failures were (or will be) reported."""
        try:
            self.end_forward()
        except TransferError as exc:
            logger.debug("layerwise: end_forward of an aborted forward: %s", exc)

    def reset(self) -> None:
        """Clear poisoned slots (their contents are garbage until a layer rewrites them)."""
        if self._in_forward:
            raise RuntimeError("LayerwiseOffloadRuntime.reset: a forward is running; call end_forward()")
        self._release_leases()
        with self._lock:
            for slot in self._slots:
                slot.poison, slot.poison_layer = None, None
                slot.release = [ev for ev in slot.release if ev.error is None]

    def poisoned_slots(self) -> list[int]:
        with self._lock:
            return [s for s, slot in enumerate(self._slots) if slot.poison is not None]

    def close(self) -> None:
        """Finish queued transfers and stop the transfer threads."""
        if self._closed:
            return
        self._closed = True
        self._load_stream.close()
        if self._save_stream is not self._load_stream:
            self._save_stream.close()
        self._release_leases()

    # ---------------------------------------------------------------------------------- internals
    def _check_caches(self, fn: str, layer: int, caches: Sequence[torch.Tensor] | None) -> None:
        if caches is None:
            return
        own = self.buffers.layer_caches(layer)
        if len(caches) != len(own):
            raise ValueError(
                f"LayerwiseOffloadRuntime.{fn}: 'caches' of layer {layer} must hold {len(own)} tensors "
                f"(main components, then indexer), got {len(caches)}"
            )
        for i, (t, b) in enumerate(zip(caches, own, strict=True)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"LayerwiseOffloadRuntime.{fn}: 'caches[{i}]' must be a tensor, got {type(t).__name__}"
                )
            if t.dtype != b.dtype:
                raise TypeError(
                    f"LayerwiseOffloadRuntime.{fn}: 'caches[{i}]' of layer {layer} must have dtype {b.dtype}, got {t.dtype}"
                )
            if t.shape != b.shape or t.device != b.device:
                raise ValueError(
                    f"LayerwiseOffloadRuntime.{fn}: 'caches[{i}]' of layer {layer} must be {list(b.shape)} on "
                    f"{b.device}, got {list(t.shape)} on {t.device}"
                )

    def _sync_caches(self, layer: int, caches: Sequence[torch.Tensor] | None, *, into_buffers: bool) -> None:
        if caches is None:
            return
        own = self.buffers.layer_caches(layer)
        if into_buffers:
            sync_copies(own, caches)
        else:
            sync_copies(caches, own)

    def _need_forward(self, fn: str) -> None:
        if not self._in_forward:
            raise RuntimeError(f"LayerwiseOffloadRuntime.{fn}: no forward is running; call begin_forward()")

    def _finish_compute_before(self, layer: int) -> None:
        """Layers below ``layer`` finished computing: their buffers' next users may overwrite them once
        the transfers done; on an accelerator that is ordered by a compute event."""
        ev = None
        for slot in self._slots:
            if slot.occupant is not None and slot.occupant < layer and not slot.compute_done:
                if not self._sync_compute:
                    ev = ev or record_compute_event()
                    slot.release.append(ev)
                slot.compute_done = True

    def _compute_done(self) -> list[TransferEvent]:
        """Events marking the compute submitted so far; none on CPU, where compute is synchronous."""
        return [] if self._sync_compute else [record_compute_event()]

    def _issue_window(self, start: int) -> None:
        """Issue loads for the running layer and up to ``prefetch_depth`` layers after it.

        A later layer's load is issued only once its buffer's previous user finished computing; the load
        itself runs after the slot's release events (that user's save, external readers).
        """
        plan = self._transfers
        if not plan.load_hashes:
            return
        first = max(start, self._current, 0)
        for layer in range(first, min(self.plan.num_layers, max(self._current, 0) + self.prefetch_depth + 1)):
            if layer in self._loads:
                continue
            slot_id = self.plan.slot_of[layer]
            slot = self._slots[slot_id]
            if slot.poison is not None:
                continue
            if layer != self._current:
                prev = self.plan.previous_user[layer]
                # the previous user must have run in *this* forward (an aborted forward may have left
                # it as the occupant) and finished computing
                ready = slot.compute_done and (
                    prev is None or (slot.occupant == prev and prev in self._entered)
                )
                if not ready:
                    continue
            if layer == max(self._current, 0) and self._splits(layer):
                # the compute thread waits for this load at once (the first layer's, or the running
                # layer's): it runs the parts the transfer thread has not started
                self._loads[layer] = submit_split(
                    [self._load_stream],
                    len(plan.load_hashes),
                    functools.partial(self._load_part, layer, slot_id, plan),
                    after=slot.release,
                    done=functools.partial(self._load_done, layer, slot_id, plan),
                    parts=self._critical_parts,
                )
            else:
                self._loads[layer] = self._load_stream.submit(
                    self._do_load,
                    layer,
                    slot_id,
                    plan,
                    after=slot.release,
                    # a later layer's load overlaps compute; the running layer's is waited for at once
                    wake_delay=self._wake_delay if layer != self._current and self._current >= 0 else 0.0,
                )
            if layer != self._current:
                slot.handed_to = layer

    @staticmethod
    def _plan_transfers(requests: list[_Request]) -> _Transfers:
        """The blocks every layer loads and saves in this forward (checked by ``_check_shared_blocks``).

        Loads: each request's cached blocks in request order, a block shared by several requests once,
        none that a request of the batch writes (its writer computes it in this forward). Saves: the full
        blocks the requests compute, one per content (requests of one batch may share a prefix in
        distinct blocks).
        """
        written = {b for q in requests for b in q.block_ids[q.num_cached_blocks :]}
        loaded: set[int] = set()
        out = _Transfers(requests)
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

    def _wait_events(self, slot_id: int, layer: int, events: list[TransferEvent]) -> None:
        if all(ev.succeeded() for ev in events):  # the usual case on CPU: nothing to wait for
            return
        pending = [ev for ev in events if not ev.query()]
        start = time.perf_counter()
        try:
            for ev in events:
                ev.wait_on_compute()
        except TransferError as exc:
            if not isinstance(exc.__cause__, PrefixEvictedError):
                self._poison(slot_id, layer, exc)  # an evicted prefix leaves nothing half-written to reuse
            raise _failure(exc, f"layerwise: layer {layer} cannot use physical buffer {slot_id}") from exc
        finally:
            if pending:
                self.counters.add("waits")
                self.counters.add("wait_seconds", time.perf_counter() - start)

    def _poison(self, slot_id: int, layer: int, exc: BaseException) -> None:
        with self._lock:
            slot = self._slots[slot_id]
            if slot.poison is None:
                slot.poison, slot.poison_layer = exc, layer
        logger.error("layerwise: physical buffer %d poisoned by layer %d: %s", slot_id, layer, exc)

    def _poison_message(self, slot_id: int, where: str) -> str:
        slot = self._slots[slot_id]
        return (
            f"layerwise {where}: physical buffer {slot_id} is poisoned by a failed transfer of layer "
            f"{slot.poison_layer} ({slot.poison}); call reset() after handling the failure"
        )

    # ---------------------------------------------------------------------- transfer-thread work
    def _staging(self, kind: str, n: int, record_bytes: int) -> tuple[_Staging, torch.Tensor]:
        """The next staging buffer of direction ``kind`` and a ``uint8 [n, record_bytes]`` view of it.

        Each direction runs on one transfer thread, one transfer at a time, and reuses its buffers: a
        fresh multi-MiB (pinned) allocation per layer would page-fault or register memory every time.
        With host buffers there is one per direction (copies are synchronous; the store keeps copies of
        what it is given). With device buffers a ring of pinned buffers: one is reused only after the
        device copy that last used it completed (its event; a host wait on this transfer thread).
        """
        ring = self._staging_ring[kind]
        entry = ring[self._staging_next[kind]]
        self._staging_next[kind] = (self._staging_next[kind] + 1) % len(ring)
        if entry.event is not None:
            entry.event.synchronize()
            entry.event = None
        need = n * record_bytes
        if entry.buffer is None or entry.buffer.numel() < need:
            entry.buffer = empty_host((need,), torch.uint8)
        return entry, entry.buffer[:need].view(n, record_bytes)

    def _copies_issued(self, entry: _Staging, device: torch.device) -> None:
        """Mark the copies this thread just issued to or from ``entry`` (device buffers: an event on the
        current stream — the transfer stream on the transfer thread; host buffers: done already)."""
        if device.type != "cpu":
            event = torch.Event(device)
            event.record(torch.accelerator.current_stream(device))
            entry.event = event

    def _store_failed(self, what: str, exc: Exception) -> None:
        """A store call raised: counted and logged; the caller treats it as a miss."""
        self.counters.add("store_errors")
        logger.warning(
            "layerwise: the store failed during a %s (%s: %s); treated as a miss",
            what,
            type(exc).__name__,
            exc,
        )

    def _evicted(self, layer: int, plan: _Transfers, found: list[bool]) -> PrefixEvictedError:
        """The error of a load that found its blocks (the load list of ``layer``) partly missing."""
        found_of = dict(zip(plan.load_blocks, found, strict=True))
        usable = []
        for q in plan.requests:
            n = q.num_cached_blocks
            # a block not in the load list is computed in this forward by the request that writes it
            missing = next((j for j in range(n) if not found_of.get(q.block_ids[j], True)), n)
            usable.append(missing * self.block_size)
        missing = found.count(False)
        return PrefixEvictedError(
            f"layerwise: {missing} of {len(found)} cached blocks of layer {layer} could not be loaded from the "
            f"store (evicted after the lookup, failed their checksum, or the store failed: see the store's "
            f"counters and the log); usable cached tokens per request: {usable}",
            layer=layer,
            usable_tokens=usable,
            missing_blocks=missing,
        )

    def _splits(self, layer: int) -> bool:
        """Whether a critical-path transfer of ``layer`` is split into parts: host buffers only (the
        staging path reuses one staging tensor per direction)."""
        return self._critical_parts > 1 and self._layouts[layer].records is not None

    @staticmethod
    def _lease_segments(
        plan: _Transfers, layer: int, begin: int, end: int
    ) -> list[tuple[StoreLease, int, int]]:
        """The lease ranges holding entries ``[begin, end)`` of ``layer``'s load list: each request's
        lease holds its leased prefix of every layer, layer-major (``plan.load_runs``)."""
        segments: list[tuple[StoreLease, int, int]] = []
        for start, r, first, length in plan.load_runs:
            lo, hi = max(begin, start), min(end, start + length)
            if lo < hi:
                q = plan.requests[r]
                k = layer * q.leased_blocks + first - start
                segments.append((q.lease, k + lo, k + hi))  # type: ignore[arg-type]
        return segments

    def _do_load(self, layer: int, slot_id: int, plan: _Transfers) -> None:
        """Load all of ``layer``'s prefix blocks on this thread."""
        n = len(plan.load_hashes)
        try:
            result = self._load_part(layer, slot_id, plan, 0, n)
        except BaseException as exc:
            self._load_done(layer, slot_id, plan, [], exc)
            raise  # not reached: _load_done raises
        self._load_done(layer, slot_id, plan, [result], None)

    def _load_part(
        self, layer: int, slot_id: int, plan: _Transfers, begin: int, end: int
    ) -> tuple[list[bool], float]:
        """Copy entries ``[begin, end)`` of ``layer``'s load list into its buffer; return which were
        found and the seconds it took. Misses are reported by :meth:`_load_done`."""
        start = time.perf_counter()
        lay = self._layouts[layer]
        if self._slots[slot_id].poison is not None:
            raise SlotPoisonedError(self._poison_message(slot_id, f"load of layer {layer}"))
        part_blocks = plan.load_blocks[begin:end]
        if plan.via_leases:
            segments = self._lease_segments(plan, layer, begin, end)
            if lay.records is not None:
                # host buffers: the store writes the records straight into the layer's blocks
                found = self.store.batch_get_leased_blocks(segments, lay.records, part_blocks)
                return found, time.perf_counter() - start
            keys = leased_keys("LayerwiseOffloadRuntime load", segments)
        else:
            keys = self._layer_keys(plan.load_hashes[begin:end], layer)
            if lay.records is not None:
                found = self.store.batch_get_blocks(keys, lay.records, part_blocks)
                return found, time.perf_counter() - start
        n = end - begin
        entry, staging = self._staging("load", n, lay.record_bytes)
        found = self.store.batch_get(keys, list(staging.unbind(0)))
        if False not in found:
            mapping = torch.stack([torch.arange(n), torch.tensor(part_blocks, dtype=torch.int64)], dim=1)
            for comp, view in zip(lay.components, self._staging_views(layer, staging), strict=True):
                copy_blocks(view, comp, mapping)
            self._copies_issued(entry, lay.components[0].device)
        return found, time.perf_counter() - start

    def _load_done(
        self,
        layer: int,
        slot_id: int,
        plan: _Transfers,
        results: list[tuple[list[bool], float]],
        error: BaseException | None,
    ) -> None:
        """Account for ``layer``'s whole load (its parts' ``results``); raise its failure: ``error``, or
        :class:`PrefixEvictedError` if blocks were missing."""
        if error is None:
            found = [hit for part, _ in results for hit in part]
            if False in found:
                error = self._evicted(layer, plan, found)
        if error is not None:
            self.counters.add("load_failures")
            if isinstance(error, PrefixEvictedError):
                # the layer's waiter raises; the buffer holds nothing anyone will read, so no poison
                self.counters.add("prefix_evictions")
                logger.info("%s", error)
            else:
                self._poison(slot_id, layer, error)
            raise error
        n = len(plan.load_hashes)
        self.counters.add("load_seconds", sum(seconds for _, seconds in results))
        self.counters.add("loads")
        self.counters.add("blocks_loaded", n)
        self.counters.add("bytes_loaded", n * self._layouts[layer].record_bytes)

    def _do_save(self, slot_id: int, layer: int, hashes: list[str], blocks: list[int]) -> None:
        """Save all of ``layer``'s new blocks on this thread."""
        n = len(hashes)
        try:
            seconds = self._save_part(layer, hashes, blocks, 0, n)
        except BaseException as exc:
            self._save_done(layer, slot_id, n, [], exc)
            raise  # not reached: _save_done raises
        self._save_done(layer, slot_id, n, [seconds], None)

    def _save_part(self, layer: int, hashes: list[str], blocks: list[int], begin: int, end: int) -> float:
        """Store entries ``[begin, end)`` of the save list from ``layer``'s buffer; return the seconds."""
        start = time.perf_counter()
        lay = self._layouts[layer]
        keys = self._layer_keys(hashes[begin:end], layer)
        if lay.records is not None:
            self.store.batch_put_blocks(keys, lay.records, blocks[begin:end])
        else:
            n = end - begin
            entry, staging = self._staging("save", n, lay.record_bytes)
            mapping = torch.stack(
                [torch.tensor(blocks[begin:end], dtype=torch.int64), torch.arange(n)], dim=1
            )
            for comp, view in zip(lay.components, self._staging_views(layer, staging), strict=True):
                copy_blocks(comp, view, mapping)
            self._copies_issued(entry, lay.components[0].device)
            if entry.event is not None:
                # the store reads the staging bytes on this host thread: the copies must have landed
                entry.event.synchronize()
                entry.event = None
            self.store.batch_put(keys, list(staging.unbind(0)))
        return time.perf_counter() - start

    def _save_done(
        self, layer: int, slot_id: int, n: int, results: list[float], error: BaseException | None
    ) -> None:
        """Account for ``layer``'s whole save (its parts' seconds); raise ``error`` (poisoning the slot)."""
        if error is not None:
            self.counters.add("save_failures")
            self._poison(slot_id, layer, error)
            raise error
        self.counters.add("save_seconds", sum(results))
        self.counters.add("saves")
        self.counters.add("blocks_saved", n)
        self.counters.add("bytes_saved", n * self._layouts[layer].record_bytes)

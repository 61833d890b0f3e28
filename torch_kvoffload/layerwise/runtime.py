"""The layerwise prefill offload runtime: load / wait / save / prefetch per layer, overlapped with compute.

A model (or an FX graph through the hook ops ``kvoffload::layer_wait`` / ``layer_prefetch`` /
``layer_save``, which call ``wait_layer`` / ``prefetch_layer`` / ``save_layer``) calls, per forward::

    rt.begin_forward(token_ids, block_tables)   # looks the prefixes up in the store, starts prefetch
    for layer in range(N):
        rt.wait_layer(layer)    # waits for the buffer's previous user + this layer's load
        ...write the new tokens' KV into rt.layer_caches(layer), run attention...
        rt.save_layer(layer)    # starts the save of the new blocks
    rt.end_forward()      # waits for every transfer, raises the first failure

This module holds the forward's sequence (which layer runs, which loads are issued when, what each
buffer's next user waits for); its rooms do one job each:

* :mod:`~torch_kvoffload.layerwise.batch` — checks a batch and plans its transfers (shared blocks:
  loaded once, saved at most once, written by one request);
* :mod:`~torch_kvoffload.layerwise.lookup` — store keys (namespaced by
  :attr:`~LayerwiseOffloadRuntime.fingerprint`), prefix lookups and the leases held until ``end_forward``;
* :mod:`~torch_kvoffload.layerwise.slots` — the per-buffer reuse gates and their poisoning;
* :mod:`~torch_kvoffload.layerwise.store_io` — the byte movement between the store and the buffers, on
  :class:`~torch_kvoffload.transfer.TransferStream` s;
* :mod:`~torch_kvoffload.layerwise.hook_args` — the hook methods' optional ``caches`` argument;
* :mod:`~torch_kvoffload.layerwise.retry` — :meth:`~LayerwiseOffloadRuntime.run_forward`, which reruns a
  forward whose prefix was evicted from a store that cannot pin (:class:`PrefixEvictedError`) with the
  prefix cut there, so the model recomputes instead of failing;
* :mod:`~torch_kvoffload.layerwise.errors` — the errors a waiter raises.

Hook ops find a runtime by name in ``torch_kvoffload.ops.layer_hooks.runtimes``
(``runtimes.register(name, rt)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from torch_kvoffload._utils import check_int
from torch_kvoffload.counters import Counters
from torch_kvoffload.device import accelerator_type, default_device
from torch_kvoffload.layerwise import hook_args, retry
from torch_kvoffload.layerwise.allocation import LayerBuffers
from torch_kvoffload.layerwise.batch import ForwardPlanner, Transfers
from torch_kvoffload.layerwise.counter_names import COUNTER_NAMES
from torch_kvoffload.layerwise.errors import (
    PrefixEvictedError,
    SlotPoisonedError,
    StoreMissError,
    waiter_error,
)
from torch_kvoffload.layerwise.lookup import PrefixLookup
from torch_kvoffload.layerwise.planner import LayerBufferPlan
from torch_kvoffload.layerwise.slots import SlotGates
from torch_kvoffload.layerwise.store_io import LayerStoreIO, layer_layout
from torch_kvoffload.store.base import KVStore
from torch_kvoffload.store.keys import cache_layout_fingerprint
from torch_kvoffload.transfer import TransferError, TransferEvent

logger = logging.getLogger(__name__)

__all__ = [
    "COUNTER_NAMES",
    "CompletionProvider",
    "LayerwiseOffloadRuntime",
    "PrefixEvictedError",
    "SlotPoisonedError",
    "StoreMissError",
]

# CPU tuning, measured on one machine (docs/performance-notes.md): a critical-path transfer is cut into
# this many parts, and an idle transfer thread waits this long before a transfer that overlaps compute.
_CRITICAL_PARTS = 2
_WAKE_DELAY = 50e-6

#: ``fn(slot, layer) -> TransferEvent``: completes when an external reader is done with the slot's data.
CompletionProvider = Callable[[int, int], TransferEvent]

T = TypeVar("T")


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
    :meth:`wait_layer` and :meth:`end_forward` only. On CPU, a transfer the compute thread waits for at
    once (the first layer's load, the last layer's save, a save the next layer's buffer waits for, a load
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
        self.transfer_streams = transfer_streams
        self._layouts = [layer_layout(buffers, layer) for layer in range(plan.num_layers)]
        # compute runs on this thread, so it is done when the runtime is called
        sync_compute = accelerator_type() == "cpu"
        self._gates = SlotGates(len(plan.slots), self.counters, sync_compute=sync_compute)
        sizes = [lay.record_bytes for lay in self._layouts]
        self._lookup = PrefixLookup(
            store, self.fingerprint, sizes, block_size=self.block_size, salt=salt, counters=self.counters
        )
        self._planner = ForwardPlanner(
            self._lookup, self.counters, num_blocks=self.num_blocks, num_layers=plan.num_layers
        )
        self._io = LayerStoreIO(
            store,
            self._layouts,
            self._lookup,
            self._gates,
            self.counters,
            transfer_streams=transfer_streams,
            host_buffers=all(t.device.type == "cpu" for t in buffers.layer_caches(0)),
        )
        # parts of a critical-path transfer (CPU worker threads only; tests may change it)
        self._critical_parts = _CRITICAL_PARTS if cpu_streams else 1
        # Seconds an idle transfer thread waits before starting a save / prefetch that overlaps the
        # next compute (TransferStream.submit's wake_delay): the submitting thread starts an op right
        # then, and torch ops take the GIL briefly inside, which the woken thread's Python would hold.
        self._wake_delay = _WAKE_DELAY if sync_compute else 0.0
        self._next_reuses = [
            layer + 1 < plan.num_layers and plan.previous_user[layer + 1] == layer
            for layer in range(plan.num_layers)
        ]
        self._providers: list[CompletionProvider] = []
        # the running forward: its transfers, running layer, issued loads, pending saves, entered layers
        self._in_forward = False
        self._transfers = Transfers()
        self._current = -1
        self._loads: dict[int, TransferEvent] = {}
        self._pending: list[TransferEvent] = []
        self._entered: set[int] = set()
        self._closed = False

    def record_bytes(self, layer: int) -> int:
        """Bytes of one store record (one block of every cache component of ``layer``)."""
        return self._layouts[layer].record_bytes

    def layer_caches(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The cache tensors of ``layer``: main components, then indexer components if it has any."""
        return self.buffers.layer_caches(hook_args.check_layer("layer_caches", layer, self.plan.num_layers))

    def register_completion_provider(self, fn: CompletionProvider) -> None:
        """Add an external consumer: ``fn(slot, layer)`` is called when ``layer``'s KV is written (before
        the store save starts) and returns the event of its read; the slot's next user waits for it."""
        if not callable(fn):
            raise TypeError(f"register_completion_provider: expected a callable, got {type(fn).__name__}")
        self._providers.append(fn)

    def lookup(
        self, token_ids: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor | None = None
    ) -> int:
        """Tokens of ``token_ids`` (their KV computed at ``positions``, see :meth:`begin_forward`) whose KV
        every layer has in the store (a multiple of ``block_size``, leaving at least one token to compute)."""
        return self._lookup.lookup(token_ids, positions)

    def read_block(
        self, token_ids: Sequence[int], block: int, positions: Sequence[int] | None = None
    ) -> list[list[torch.Tensor]] | None:
        """Full block ``block`` of ``token_ids`` (at ``positions``) as stored; between forwards
        (``LayerStoreIO.read_block``)."""
        return self._io.read_block(self._lookup.hashes(token_ids, positions)[block])

    def write_block(
        self, token_ids: Sequence[int], block: int, positions: Sequence[int] | None, rows
    ) -> None:
        """Store block ``block`` of ``token_ids`` (at ``positions``) from ``rows`` (host, per layer and part)."""
        self._io.write_block(self._lookup.hashes(token_ids, positions)[block], rows)

    def stored_blocks(self, token_ids: Sequence[int], positions: Sequence[int] | None = None) -> int:
        """Leading full blocks of ``token_ids`` (at ``positions``) every layer has in the store."""
        return self._lookup.stored_prefix(token_ids, positions)

    # -------------------------------------------------------------------------------- forward
    def begin_forward(
        self,
        token_ids: Sequence[Sequence[int] | torch.Tensor],
        block_tables: Sequence[Sequence[int]] | torch.Tensor,
        num_cached_tokens: Sequence[int] | None = None,
        *,
        max_cached_tokens: Sequence[int] | None = None,
        idle: Sequence[bool] | None = None,
        positions: Sequence[Sequence[int] | torch.Tensor | None] | None = None,
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
        tokens ``[cached, len)`` of each request and attends to all ``[0, len)``; an ``idle`` one (or one
        without tokens) none: all its full blocks are read (``RuntimeError`` if the store lacks one), its
        partial block is the caller's. Loads are leased until :meth:`end_forward`; the first layers' start.

        ``positions[r]``: the model positions (rotary positions) request ``r``'s KV is computed at, one per
        token (``None``, or ``positions`` ``None``: token ``t`` at position ``t``). Blocks are keyed by
        their tokens and these positions (:func:`~torch_kvoffload.store.keys.block_hashes`): KV computed at
        other positions is never loaded.

        Raises ``ValueError`` / ``TypeError`` / ``IndexError`` naming the argument (and, for a block
        conflict, both requests and the block); nothing is changed then (no lease, no counter).
        """
        fn = "begin_forward"
        if self._closed:
            raise RuntimeError(f"LayerwiseOffloadRuntime.{fn}: the runtime is closed")
        if self._in_forward:
            raise RuntimeError(f"LayerwiseOffloadRuntime.{fn}: a forward is running; call end_forward()")
        self._gates.check_clean(fn)
        self._transfers = self._planner.plan(
            token_ids, block_tables, num_cached_tokens, max_cached_tokens, idle, positions
        )
        self._in_forward, self._current = True, -1
        self._loads, self._pending, self._entered = {}, [], set()
        self._issue_window(0)
        return [q.num_cached_blocks * self.block_size for q in self._transfers.requests]

    def prefetch_layer(self, layer: int, caches: Sequence[torch.Tensor] | None = None) -> None:
        """Issue the loads of ``layer .. layer + prefetch_depth`` whose buffers may be overwritten now.

        ``caches`` (optional): ``layer``'s cache tensors, checked against :meth:`layer_caches`.
        """
        hook_args.check_layer("prefetch", layer, self.plan.num_layers)
        self._need_forward("prefetch")
        hook_args.check_caches("prefetch", layer, caches, self.buffers)
        self._issue_window(layer)

    def wait_layer(self, layer: int, caches: Sequence[torch.Tensor] | None = None) -> None:
        """Block until ``layer`` may use its buffer and its cached prefix is loaded.

        ``caches`` (optional): the tensors the caller will read, checked against :meth:`layer_caches`;
        a tensor that is a copy of the buffer (a functionalized graph's clone) receives the loaded data.

        Raises :class:`TransferError` (or a subclass) if the slot's previous save, an external consumer
        or this layer's load failed; the slot is then poisoned. Calling it again for the layer that is
        running is a no-op wait; going back to an earlier layer raises ``RuntimeError``.
        """
        hook_args.check_layer("wait", layer, self.plan.num_layers)
        self._need_forward("wait")
        if caches is not None:
            hook_args.check_caches("wait", layer, caches, self.buffers)
        slot_id = self.plan.slot_of[layer]
        slot = self._gates[slot_id]
        if layer == self._current and slot.occupant == layer:
            self._gates.wait(slot_id, layer, [self._loads[layer]] if layer in self._loads else [])
            hook_args.sync_caches(layer, caches, self.buffers, into_buffers=False)
            return
        if layer <= self._current:
            raise RuntimeError(
                f"LayerwiseOffloadRuntime.wait: layer {layer} after layer {self._current}; "
                "layers run in increasing order"
            )
        self._gates.finish_compute_before(layer)
        self._current = layer
        self._issue_window(layer)
        if slot.poison is not None:
            raise SlotPoisonedError(self._gates.poison_message(slot_id, f"wait({layer})"))
        events = slot.release
        load = self._loads.get(layer)
        if load is not None:
            events = [*events, load]
        self._gates.wait(slot_id, layer, events)
        slot.occupant, slot.release, slot.compute_done, slot.handed_to = layer, [], False, None
        self._entered.add(layer)
        if caches is not None:
            hook_args.sync_caches(layer, caches, self.buffers, into_buffers=False)

    def save_layer(self, layer: int, caches: Sequence[torch.Tensor] | None = None) -> None:
        """Start the save of ``layer``'s newly computed full blocks (asynchronous).

        External completion providers are called first; the slot's next user waits for all of them and
        for the save. ``caches`` (optional): the tensors the caller wrote, checked against
        :meth:`layer_caches`; a tensor that is a copy of the buffer is copied into it before the save.
        """
        hook_args.check_layer("save", layer, self.plan.num_layers)
        self._need_forward("save")
        if caches is not None:
            hook_args.check_caches("save", layer, caches, self.buffers)
        slot_id = self.plan.slot_of[layer]
        slot = self._gates[slot_id]
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
            raise SlotPoisonedError(self._gates.poison_message(slot_id, f"save({layer})"))
        if caches is not None:
            hook_args.sync_caches(layer, caches, self.buffers, into_buffers=True)
        events = [fn(slot_id, layer) for fn in self._providers]
        plan = self._transfers
        if plan.save_hashes:
            # the next layer computes meanwhile, unless it reuses this buffer (its load waits for this
            # save) or there is none (end_forward waits for it): then the save is on the critical path
            critical = layer == self.plan.num_layers - 1 or self._next_reuses[layer]
            ev = self._io.submit_save(
                layer,
                slot_id,
                plan,
                after=self._gates.compute_done(),
                parts=self._critical_parts if critical else 1,
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
                    first = first or waiter_error(
                        exc, "layerwise end_forward: a transfer of this forward failed"
                    )
            self._gates.finish_compute_before(self.plan.num_layers)
        finally:
            self._in_forward = False
            self._loads, self._pending = {}, []
            self._transfers = Transfers()
            self._current = -1
            self._lookup.release_leases()
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
        positions: Sequence[Sequence[int] | torch.Tensor | None] | None = None,
    ) -> T:
        """``begin_forward``, ``body(cached)`` (every layer of the model, returning its outputs),
        ``end_forward`` — rerun with a shorter prefix when the store dropped part of it; any other error
        closes the forward and propagates (:func:`torch_kvoffload.layerwise.retry.run_forward`)."""
        caps = {"num_cached_tokens": num_cached_tokens, "max_cached_tokens": max_cached_tokens}
        return retry.run_forward(self, token_ids, block_tables, body, positions=positions, **caps)

    def retry_caps(
        self, cached: Sequence[int], caps: Sequence[int] | None, evicted: PrefixEvictedError
    ) -> list[int]:
        """The ``max_cached_tokens`` of the next try of a forward that raised ``evicted`` (see
        :func:`torch_kvoffload.layerwise.retry.retry_caps`); the caller closes the failed forward."""
        return retry.retry_caps(self.counters, cached, caps, evicted)

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
        self._lookup.release_leases()
        self._gates.reset()

    def poisoned_slots(self) -> list[int]:
        return self._gates.poisoned()

    def close(self) -> None:
        """Finish queued transfers and stop the transfer threads."""
        if self._closed:
            return
        self._closed = True
        self._io.close()
        self._lookup.release_leases()

    # ---------------------------------------------------------------------------------- internals
    def _need_forward(self, fn: str) -> None:
        if not self._in_forward:
            raise RuntimeError(f"LayerwiseOffloadRuntime.{fn}: no forward is running; call begin_forward()")

    def _issue_window(self, start: int) -> None:
        """Issue loads for the running layer and up to ``prefetch_depth`` layers after it.

        A later layer's load is issued only once its buffer's previous user finished computing; the load
        itself runs after the slot's release events (that user's save, external readers).
        """
        plan = self._transfers
        if not plan.load_hashes:
            return
        running = max(self._current, 0)
        for layer in range(max(start, running), min(self.plan.num_layers, running + self.prefetch_depth + 1)):
            if layer in self._loads:
                continue
            slot_id = self.plan.slot_of[layer]
            slot = self._gates[slot_id]
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
            self._loads[layer] = self._io.submit_load(
                layer,
                slot_id,
                plan,
                after=slot.release,
                # the compute thread waits at once for the first layer's load and the running layer's:
                # it runs the parts the transfer thread has not started
                parts=self._critical_parts if layer == running else 1,
                # a later layer's load overlaps compute; the running layer's is waited for at once
                wake_delay=self._wake_delay if layer != self._current and self._current >= 0 else 0.0,
            )
            if layer != self._current:
                slot.handed_to = layer

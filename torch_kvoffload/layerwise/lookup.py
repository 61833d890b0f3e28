"""Store keys, prefix lookups and leases of the layerwise runtime.

Store records: one key per (layer, full block) from ``torch_kvoffload.store.keys``, namespaced by the
runtime's fingerprint (the cache layout's digest and the user ``model_id``, so two models on one store
never read each other's KV).

Evicted prefixes: ``begin_forward`` leases the blocks it found (:meth:`KVStore.lease`); a store that can
pin (the embedded one) then keeps them until ``end_forward``. A store that cannot pin may drop a block
before its layer loads it: the load raises :class:`~torch_kvoffload.layerwise.errors.PrefixEvictedError`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from torch_kvoffload.counters import Counters
from torch_kvoffload.store.base import KVStore, StoreLease
from torch_kvoffload.store.keys import block_hashes, layer_key_prefix

logger = logging.getLogger(__name__)

__all__ = ["PrefixLookup"]


class PrefixLookup:
    """Finds, keys and leases the cached prefixes of a runtime's requests in ``store``.

    Parameters
    ----------
    store : the host KV pool.
    fingerprint : the model id of every store key (``cache_layout_fingerprint(specs, model_id)``).
    record_bytes : per layer, the bytes of one store record (checked by a pinning store's lease).
    block_size : tokens per block.
    salt : namespaces the block hashes (``block_hashes(..., salt=)``).
    counters : receives ``store_errors`` (lookups whose store call raised).

    The leases of the running forward are held in :attr:`leases` until :meth:`release_leases`.
    """

    def __init__(
        self,
        store: KVStore,
        fingerprint: str,
        record_bytes: Sequence[int],
        *,
        block_size: int,
        salt: str,
        counters: Counters,
    ) -> None:
        self.store = store
        self.record_bytes = list(record_bytes)
        self.num_layers = len(self.record_bytes)
        self.block_size = block_size
        self.salt = salt
        self.counters = counters
        # "kv/{fingerprint}/{layer}/": the store key of a block is this + its hash (layer_block_keys)
        self.key_prefixes = [
            layer_key_prefix(layer, model_id=fingerprint) for layer in range(self.num_layers)
        ]
        self.leases: list[StoreLease] = []

    def hashes(
        self, token_ids: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor | None = None
    ) -> list[str]:
        """The chained hashes of the full blocks of ``token_ids`` whose KV was computed at ``positions``
        (``None``: token ``t`` at position ``t``; see :func:`~torch_kvoffload.store.keys.block_hashes`)."""
        return block_hashes(token_ids, self.block_size, salt=self.salt, positions=positions)

    def max_cacheable_blocks(self, num_tokens: int) -> int:
        # At least one token is always computed, so a fully cached prompt still yields its last logits.
        return max(num_tokens - 1, 0) // self.block_size

    def lookup(
        self, token_ids: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor | None = None
    ) -> int:
        """Tokens of ``token_ids`` (at ``positions``) whose KV every layer has in the store (a multiple of
        ``block_size``, leaving at least one token to compute)."""
        hashes = self.hashes(token_ids, positions)
        return (
            self._stored(hashes, min(len(hashes), self.max_cacheable_blocks(len(token_ids))))
            * self.block_size
        )

    def stored_prefix(
        self, token_ids: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor | None = None
    ) -> int:
        """Leading full blocks of ``token_ids`` (at ``positions``) every layer has in the store (no cap)."""
        hashes = self.hashes(token_ids, positions)
        return self._stored(hashes, len(hashes))

    def _stored(self, hashes: list[str], cap: int) -> int:
        """Leading blocks of ``hashes[:cap]`` every layer has in the store (one ``batch_exists``)."""
        if cap == 0:
            return 0
        return self.prefix_of(self.store.batch_exists(self.prefix_keys(hashes, cap)), cap)

    def prefix_keys(self, hashes: list[str], n: int) -> list[str]:
        """Keys of blocks ``[0, n)`` of every layer, layer-major."""
        head = hashes[:n]
        return [prefix + h for prefix in self.key_prefixes for h in head]

    def layer_keys(self, hashes: list[str], layer: int) -> list[str]:
        """``layer_block_keys(hashes, layer, model_id=)`` for hashes made by ``block_hashes`` (valid by
        construction, so not checked again on every transfer)."""
        prefix = self.key_prefixes[layer]
        return [prefix + h for h in hashes]

    def prefix_of(self, found: list[bool], cap: int) -> int:
        """Longest prefix (in blocks, ``<= cap``) present for every layer in a layer-major ``found``."""
        cached = cap
        for layer in range(self.num_layers):
            row = found[layer * cap : (layer + 1) * cap]
            cached = min(cached, row.index(False) if False in row else cap)
        return cached

    def lease_prefix(self, hashes: list[str], cap: int, *, fixed: bool) -> tuple[int, StoreLease | None]:
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
        cached = cap if fixed else self.prefix_of(lease.found, cap)
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
        keys = self.prefix_keys(hashes, n)
        if not self.store.pins_leases:
            return self.store.lease(keys)
        sizes = [self.record_bytes[layer] for layer in range(self.num_layers) for _ in range(n)]
        return self.store.lease(keys, nbytes=sizes)

    def release_leases(self) -> None:
        leases, self.leases = self.leases, []
        for lease in leases:
            lease.release()

    def _store_failed(self, what: str, exc: Exception) -> None:
        """A store call raised: counted and logged; the caller treats it as a miss."""
        self.counters.add("store_errors")
        logger.warning(
            "layerwise: the store failed during a %s (%s: %s); treated as a miss",
            what,
            type(exc).__name__,
            exc,
        )

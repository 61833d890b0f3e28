"""``OffloadCache``: the ``transformers.Cache`` an offloaded model generates with.

It holds no per-layer KV. Each layer keeps zero-length placeholders ``keys [B, 1, 0, Dc]``, ``values
[B, 1, 0, Dr]`` (and ``indexer_keys [B, 0, Di]`` for indexed layers); ``update`` / ``update_indexer``
return ``cat(placeholder, new)`` without storing it, so a Dynamo graph shows the usual cache-append pattern
on cache inputs while the KV itself lives where the session keeps it. ``get_seq_length`` reports the
tokens seen so far (padding included, as Hugging Face counts them), advanced by the session at the end of
every forward.

The batch rows and positions are the session's sequence's: ``reorder_cache`` (beam search),
``batch_select_indices``, ``batch_repeat_interleave`` and ``crop`` (assisted decoding, prompt lookup) act on
it as a whole (``OffloadSession.rebuild_rows`` / ``crop``: requests forked or truncated in every backend);
the per-layer methods refuse and point there.

Only a graph Dynamo is tracing may append to the placeholders (the passes then rewrite the attention onto
the session). Run eagerly, the model's own attention would attend over the new tokens alone, so ``update``
and ``update_indexer`` raise ``RuntimeError`` outside Dynamo's tracing: that is what happens when Dynamo
falls back to running the model eagerly (its recompile limit) or a model runs the library's cache without
the library's attention.

Reading ``layers[i].keys`` / ``values`` / ``indexer_keys`` outside Dynamo's tracing gives what the
unmodified model's ``DynamicCache`` holds there, materialised from the session's KV wherever it lives
(:func:`~torch_kvoffload.core.readback.read_rows`): ``keys`` the normalised latent ``[B, 1, T,
kv_lora_rank]``, ``values`` the roped rotary key ``[B, 1, T, qk_rope_head_dim]``, ``indexer_keys`` ``[B, T,
index_head_dim]`` (``None`` for a model without an indexer), in the model's dtype on its device; ``T`` counts
the padding as transformers does. A padding position holds zeros (the library keeps no KV for padding; the
unmodified model keeps what it computed for the pad token there, zero too when the pad token's embedding is,
as with ``padding_idx``). Each read is a new tensor holding a copy of that layer's whole history (for the
host tiers a host-to-device copy; a layerwise store is read a whole block of every layer at a time):
changing it changes nothing else, and assigning the attribute raises ``AttributeError``. A cache that has
seen no forward reads ``None``, as a fresh ``DynamicLayer``; one whose sequence the session no longer holds
(a later sequence started, ``end_sequence``, a failed forward, ``close``) raises ``RuntimeError``, as does
a read while a forward runs; a P/D node and KVPP raise ``NotImplementedError``, an int8 indexer cache (for
``indexer_keys``) or a host pool in another dtype than the model's ``RuntimeError``. Inside a Dynamo trace
(any ``torch.compile``) the attributes are the placeholders the library's graphs are traced with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from torch_kvoffload.core.readback import read_rows

if TYPE_CHECKING:
    from torch_kvoffload.core.kv import KVCore
    from torch_kvoffload.integrations.hf.sequence import HFSequence
    from torch_kvoffload.kv.spec import ModelSpec

__all__ = ["is_offload_cache", "new_offload_cache"]


class _Session(Protocol):
    """What the cache reads of its session (``integrations.hf.session.OffloadSession``)."""

    spec: ModelSpec
    core: KVCore
    owner: Any
    forward_running: bool
    _closed: bool
    _seq: HFSequence  # the running sequence's requests and real-token masks (``layers[i].keys``)

    def rebuild_rows(self, owner: Any, sources: list[int], where: str) -> None: ...

    def crop(self, owner: Any, remove: int) -> None: ...


_CLASSES: dict[str, type] = {}


def _check_traced(what: str) -> None:
    """Raise unless Dynamo is tracing: eagerly, the placeholders would stand in for the whole history."""
    if not torch.compiler.is_compiling():
        raise RuntimeError(
            f"OffloadCache.{what}: the model's attention ran without the library's (Dynamo fell back to eager "
            "after its recompile limit? a model given the library's cache but not offloaded?); the library's "
            "cache holds no KV, so that attention would see only the new tokens. Run the model through "
            "torch_kvoffload.offload or torch_kvoffload.compile (with fullgraph=True a fallback raises instead)"
        )


def _history(name: str, part: str) -> property:
    """A read-only layer attribute: inside a Dynamo trace the placeholder, otherwise the layer's history
    materialised from the session (see the module docstring)."""
    slot = f"_{name}"

    def get(self: Any) -> torch.Tensor | None:
        if torch.compiler.is_compiling():
            return getattr(self, slot)
        return self._owner._read_history(self._layer, name, part)

    def set_(self: Any, value: Any) -> None:
        raise AttributeError(
            f"OffloadCache.layers[{self._layer}].{name} is read-only: the KV lives in the offload session, and "
            "each read returns a copy of it (changing the copy changes nothing)"
        )

    return property(get, set_, doc=f"``{name}`` of this layer, as the unmodified model's cache holds it.")


def _classes() -> tuple[type, type]:
    """The cache and layer classes (built on first use: ``transformers`` is optional)."""
    if _CLASSES:
        return _CLASSES["cache"], _CLASSES["layer"]
    try:
        from transformers.cache_utils import Cache, CacheLayerMixin
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError(
            "torch_kvoffload's Hugging Face integration needs transformers: pip install 'torch_kvoffload[hf]'"
        ) from exc

    class OffloadCacheLayer(CacheLayerMixin):
        """One layer's placeholders; the cached length is the owning cache's."""

        is_sliding = False
        is_croppable = True  # the cache crops its session's sequence (OffloadCache.crop)
        keys = _history("keys", "kv_c")
        values = _history("values", "k_pe")
        indexer_keys = _history("indexer_keys", "index_k")

        def __init__(self, owner: Any, indexed: bool, layer: int) -> None:
            # not CacheLayerMixin.__init__: it assigns the read-only attributes
            self._owner = owner
            self._indexed = indexed
            self._layer = layer
            self._keys = self._values = self._indexer_keys = None
            self.is_initialized = False

        def set_placeholders(
            self, keys: torch.Tensor, values: torch.Tensor, indexer_keys: torch.Tensor | None
        ) -> None:
            """What a Dynamo trace reads as the layer's cache (``integrations.hf.compile`` shows the cached
            length this way); it holds no KV."""
            self._keys, self._values, self._indexer_keys = keys, values, indexer_keys
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            b = key_states.shape[0]
            self.device = key_states.device
            self._keys = key_states.new_zeros((b, 1, 0, key_states.shape[-1]))
            self._values = value_states.new_zeros((b, 1, 0, value_states.shape[-1]))
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            _check_traced("update")
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            keys = torch.cat([self._keys, key_states], dim=-2)
            return keys, torch.cat([self._values, value_states], dim=-2)

        def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
            _check_traced("update_indexer")
            if self._indexer_keys is None:
                k = indexer_key_states
                self._indexer_keys = k.new_zeros((k.shape[0], 0, k.shape[-1]))
            return torch.cat([self._indexer_keys, indexer_key_states], dim=1)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self._owner.get_seq_length() + query_length, 0

        def get_seq_length(self) -> int:
            return self._owner.seen_tokens

        def get_max_length(self) -> int:
            return -1

        def reset(self) -> None:
            self._keys = self._values = self._indexer_keys = None
            self.is_initialized = False

        def _whole_cache(self, what: str) -> None:
            raise NotImplementedError(
                f"OffloadCacheLayer.{what}: the library's cache changes its batch rows as a whole; call "
                f"OffloadCache.{what}"
            )

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            self._whole_cache("reorder_cache")

        def crop(self, tokens_to_remove: int) -> None:
            self._whole_cache("crop")

        def batch_repeat_interleave(self, repeats: int) -> None:
            self._whole_cache("batch_repeat_interleave")

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._whole_cache("batch_select_indices")

    class OffloadCache(Cache):
        """A cache that stores nothing itself: the session keeps the KV (see the module docstring)."""

        def __init__(self, session: _Session) -> None:
            self.session = session
            self.seen_tokens = 0
            indexed = session.spec.has_indexer
            super().__init__(
                layers=[OffloadCacheLayer(self, indexed, i) for i in range(session.spec.num_layers)]
            )

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.seen_tokens

        def __iter__(self):
            """``(keys, values, None)`` per layer, as ``DynamicCache`` iterates (each a copy: see the
            module docstring)."""
            for layer in self.layers:
                yield layer.keys, layer.values, None

        def _read_history(self, layer: int, name: str, part: str) -> torch.Tensor | None:
            """``layers[layer].<name>`` outside a Dynamo trace (see the module docstring)."""
            where = f"OffloadCache.layers[{layer}].{name}"
            session = self.session
            spec = session.spec
            if part == "index_k" and not spec.has_indexer:
                return None
            if session._closed:
                raise RuntimeError(f"{where}: the offload session is closed; its KV was released")
            seq = session._seq
            if session.owner is not self or not seq.requests:
                if self.seen_tokens == 0:
                    return None  # nothing cached yet, as in a fresh DynamicLayer
                raise RuntimeError(
                    f"{where}: the session no longer holds this cache's sequence (a later generate or forward "
                    "started another one, end_sequence() was called, or a forward of it failed), so its KV "
                    "was released; read the attributes before the next sequence starts"
                )
            if session.forward_running:
                raise RuntimeError(f"{where}: read while a forward runs; read the cache between forwards")
            masks = seq.masks  # bool [B, T]: which positions of each row hold a real token
            try:
                rows = read_rows(session.core, layer, seq.requests, part)
            except (RuntimeError, NotImplementedError) as exc:
                raise type(exc)(f"{where}: {exc}") from exc
            width = {"kv_c": spec.kv_lora_rank, "k_pe": spec.rope_dim, "index_k": spec.index_head_dim}[part]
            B, T = masks.shape
            out = torch.zeros(B, T, width, dtype=spec.dtype, device=spec.device)
            for b, r in enumerate(rows):
                at = masks[b].nonzero().squeeze(1).to(spec.device)
                if at.numel() != r.shape[0]:  # the sequence's bookkeeping disagrees with its KV: never guess
                    raise RuntimeError(
                        f"{where}: row {b} has {at.numel()} real positions but its request keeps {r.shape[0]} "
                        "rows"
                    )
                out[b, at] = r.to(spec.dtype)
            return out if part == "index_k" else out.unsqueeze(1)

        def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
            return self.seen_tokens + query_length, 0

        def reset(self) -> None:
            super().reset()
            self.seen_tokens = 0

        def _rows(self, sources: list[int], where: str) -> None:
            self.session.rebuild_rows(self, sources, where)

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            """Beam search: row ``i`` continues row ``beam_idx[i]`` (see ``HFSequence.rebuild_rows``)."""
            self._rows(
                _row_list("OffloadCache.reorder_cache", "beam_idx", beam_idx), "OffloadCache.reorder_cache"
            )

        def batch_repeat_interleave(self, repeats: int) -> None:
            """Each row repeated ``repeats`` times in place (row ``i`` becomes rows ``i*repeats ..``)."""
            where = "OffloadCache.batch_repeat_interleave"
            if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
                raise ValueError(f"{where}: repeats must be an int >= 1, got {repeats!r}")
            batch = len(self.session.request_ids) if self.session.owner is self else 0
            self._rows([b for b in range(batch) for _ in range(repeats)], where)

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            """Keep the rows ``indices`` (in that order)."""
            where = "OffloadCache.batch_select_indices"
            self._rows(_row_list(where, "indices", indices), where)

        def crop(self, tokens_to_remove: int) -> None:
            """Forget the last ``-tokens_to_remove`` positions (transformers passes a count <= 0)."""
            where = "OffloadCache.crop"
            if (
                isinstance(tokens_to_remove, bool)
                or not isinstance(tokens_to_remove, int)
                or tokens_to_remove > 0
            ):
                raise ValueError(
                    f"{where}: pass minus the number of positions to remove (an int <= 0), got {tokens_to_remove!r}"
                )
            if tokens_to_remove == 0:
                return
            self.session.crop(self, -tokens_to_remove)
            self.seen_tokens += tokens_to_remove

    _CLASSES["cache"], _CLASSES["layer"] = OffloadCache, OffloadCacheLayer
    return OffloadCache, OffloadCacheLayer


def _row_list(where: str, name: str, rows: Any) -> list[int]:
    """``rows`` (a 1-D integer tensor or sequence) as host ints (``ValueError`` otherwise)."""
    if isinstance(rows, torch.Tensor):
        if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype == torch.bool:
            raise ValueError(
                f"{where}: {name!r} must be a 1-D integer tensor, got {rows.dtype} {list(rows.shape)}"
            )
        return [int(x) for x in rows.tolist()]
    if isinstance(rows, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in rows):
        return list(rows)
    raise ValueError(f"{where}: {name!r} must be a 1-D integer tensor, got {type(rows).__name__}")


def new_offload_cache(session: _Session) -> Any:
    """A fresh :class:`OffloadCache` bound to ``session`` (a ``transformers.Cache``)."""
    cache_cls, _ = _classes()
    return cache_cls(session)


def is_offload_cache(obj: Any) -> bool:
    """Whether ``obj`` is an :class:`OffloadCache`."""
    cache_cls, _ = _classes()
    return isinstance(obj, cache_cls)

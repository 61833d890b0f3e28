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

Only a graph Dynamo is tracing may read the placeholders (the passes then rewrite the attention onto the
session). Run eagerly, the model's own attention would attend over the new tokens alone, so ``update``,
``update_indexer`` and reading ``keys`` / ``values`` / ``indexer_keys`` raise ``RuntimeError`` outside
Dynamo's tracing: that is what happens when Dynamo falls back to running the model eagerly (its recompile
limit) or a model runs the library's cache without the library's attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch_kvoffload.core.spec import ModelSpec

__all__ = ["is_offload_cache", "new_offload_cache"]


class _Session(Protocol):
    """What the cache reads of its session (``integrations.hf.session.OffloadSession``)."""

    spec: ModelSpec

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


def _placeholder(name: str) -> property:
    """A layer attribute that only a graph Dynamo traces may read (see the module docstring)."""
    slot = f"_{name}"

    def get(self: Any) -> torch.Tensor | None:
        _check_traced(f"layers[{self._layer}].{name}")
        return getattr(self, slot)

    def set_(self: Any, value: torch.Tensor | None) -> None:
        setattr(self, slot, value)

    return property(get, set_)


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
        keys = _placeholder("keys")
        values = _placeholder("values")
        indexer_keys = _placeholder("indexer_keys")

        def __init__(self, owner: Any, indexed: bool, layer: int) -> None:
            super().__init__()
            self._owner = owner
            self._indexed = indexed
            self._layer = layer
            self.indexer_keys = None

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            b = key_states.shape[0]
            self.device = key_states.device
            self.keys = key_states.new_zeros((b, 1, 0, key_states.shape[-1]))
            self.values = value_states.new_zeros((b, 1, 0, value_states.shape[-1]))
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            _check_traced("update")
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

        def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
            _check_traced("update_indexer")
            if self.indexer_keys is None:
                k = indexer_key_states
                self.indexer_keys = k.new_zeros((k.shape[0], 0, k.shape[-1]))
            return torch.cat([self.indexer_keys, indexer_key_states], dim=1)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self._owner.get_seq_length() + query_length, 0

        def get_seq_length(self) -> int:
            return self._owner.seen_tokens

        def get_max_length(self) -> int:
            return -1

        def reset(self) -> None:
            self.keys = self.values = self.indexer_keys = None
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

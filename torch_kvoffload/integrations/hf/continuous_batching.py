"""Continuous batching (``model.generate_batch``) for unmodified DeepSeek-V3 (MLA) / V3.2 (MLA + DSA) models.

transformers 5.24's paged cache assumes per-head K and V: every full-attention layer stores
``[tokens, 2, num_key_value_heads, head_dim]`` and the memory sizing counts those bytes. MLA caches one
latent row per token instead (``kv_lora_rank`` + ``qk_rope_head_dim``), V3.2 adds the lightning indexer key
(``index_head_dim``) read through ``cache.update_indexer``, and V3.2 names its layers ``indexed_attention``,
which the paged cache rejects. :class:`MLACacheAllocator` is written as a transformers allocator would be:
one ``[Dc | Dr | Di]`` row per token and layer, so the sectors, blocks and memory sizing all count MLA bytes.

transformers has no allocator registry, so :func:`enable_mla_continuous_batching` overrides, for one model,
its ``init_continuous_batching`` (an instance attribute) and, on the manager it returns,
``_create_batch_processor``. While those two calls run (under a lock), these module attributes point at
the MLA versions and are put back afterwards: ``cache.ATTN_TYPE_TO_ALLOCATOR``,
``cache.group_layers_by_attn_type``, ``cache.FullAttentionCacheAllocator``,
``initialization.ATTN_TYPE_TO_ALLOCATOR`` and ``initialization.group_layers_by_attn_type``
(:data:`OVERRIDDEN`). The cache built there gets an instance ``update_indexer``. Other models are untouched.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "OVERRIDDEN",
    "MLACacheAllocator",
    "disable_mla_continuous_batching",
    "enable_mla_continuous_batching",
]

#: The transformers private names (module, attribute) swapped while an enabled model builds its CB state.
OVERRIDDEN = (
    ("transformers.generation.continuous_batching.cache", "ATTN_TYPE_TO_ALLOCATOR"),
    ("transformers.generation.continuous_batching.cache", "group_layers_by_attn_type"),
    ("transformers.generation.continuous_batching.cache", "FullAttentionCacheAllocator"),
    ("transformers.generation.continuous_batching.initialization", "ATTN_TYPE_TO_ALLOCATOR"),
    ("transformers.generation.continuous_batching.initialization", "group_layers_by_attn_type"),
)
_LOCK = threading.RLock()
_FULL = "full_attention"


def _base_allocator() -> type:
    from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

    return FullAttentionCacheAllocator


class MLACacheAllocator(_base_allocator()):
    """Paged cache of a group of MLA layers: one ``[Dc | Dr | Di]`` row per token and layer, ``cache_dtype``.

    ``Dc`` = ``kv_lora_rank`` (latent KV), ``Dr`` = ``qk_rope_head_dim`` (rope key), ``Di`` =
    ``index_head_dim`` for a DSA indexer, else 0. Block bookkeeping and indices are the full-attention ones.
    """

    # Why: the kernel block table and prefix sharing expect per-head K / V pages.
    supports_block_sharing = False
    supports_block_table = False
    layer_type = _FULL
    rows_per_token = 1
    #: ``(Dc, Dr, Di)``; set on the per-config subclass made by :meth:`for_config`.
    widths: tuple[int, int, int] = (0, 0, 0)

    @classmethod
    def for_config(cls, config: Any) -> type[MLACacheAllocator]:
        """A subclass whose rows fit ``config`` (``kv_lora_rank``, ``qk_rope_head_dim``, ``index_head_dim``)."""
        di = int(getattr(config, "index_head_dim", 0) or 0) if hasattr(config, "index_topk") else 0
        widths = (int(config.kv_lora_rank), int(config.qk_rope_head_dim), di)
        return type(cls.__name__, (cls,), {"widths": widths})

    def __init__(
        self, index, config, num_key_value_heads, cache_dtype, page_size, layer_indices, allow_block_sharing
    ):
        self.cache_dtype = cache_dtype
        self.row_width = sum(self.widths)
        self._last_indices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._before_cache_tensor_init(
            index=index,
            layer_indices=layer_indices,
            tokens_per_page=page_size,
            bytes_per_page=self.get_bytes_per_page(num_key_value_heads, 0, cache_dtype, page_size),
            allow_block_sharing=allow_block_sharing,
        )

    @classmethod
    def get_bytes_per_page(
        cls, num_key_value_heads: int, head_dim: int, cache_dtype: torch.dtype, page_size: int
    ):
        """Bytes of one page: ``page_size`` rows of ``Dc + Dr + Di`` (heads and ``head_dim`` do not apply)."""
        if sum(cls.widths) == 0:
            raise ValueError(
                "MLACacheAllocator.get_bytes_per_page: use MLACacheAllocator.for_config(config) first"
            )
        return sum(cls.widths) * cache_dtype.itemsize * page_size

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        """Views the byte tensor as ``[tokens, Dc + Dr + Di]`` rows; layer ``i`` of a block owns page ``i``."""
        self.bytes_per_sector = bytes_per_sector
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
        total_bytes = non_trash_bytes + 2 * bytes_per_sector
        total_tokens = (total_bytes // self.bytes_per_page) * self.tokens_per_page
        rows = cache_tensor.view(self.cache_dtype)[: total_tokens * self.row_width].view(
            total_tokens, self.row_width
        )
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, rows, pool)
        self._row_views = {
            layer: rows[i * self.tokens_per_page :] for i, layer in enumerate(self.layer_indices)
        }

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        """Writes latent ``key_states [Q, 1, Dc]`` and rope key ``value_states [Q, 1, Dr]`` at ``write_index
        [Q]``; returns both for the ``read_index [T]`` rows (the inputs when nothing is read)."""
        dc, dr, _ = self.widths
        view = self._row_views[layer_idx]
        view[:, : dc + dr].index_copy_(0, write_index, torch.cat((key_states, value_states), -1).squeeze(1))
        # Why: update_indexer gets no kwargs; it runs after update in the same layer and reuses these indices.
        self._last_indices[layer_idx] = (read_index, write_index)
        if read_index.numel() == 0:
            return key_states, value_states
        rows = torch.index_select(view[:, : dc + dr], 0, read_index).unsqueeze(1)
        return rows[..., :dc], rows[..., dc:]

    def update_indexer(self, index_keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Writes indexer keys ``[Q, Di]`` at the indices of this layer's last :meth:`update`; returns ``[T, Di]``."""
        dc, dr, di = self.widths
        if di == 0 or layer_idx not in self._last_indices:
            raise RuntimeError(
                f"MLACacheAllocator.update_indexer: layer {layer_idx} has no indexer rows (Di={di}) or no prior update"
            )
        read_index, write_index = self._last_indices[layer_idx]
        view = self._row_views[layer_idx][:, dc + dr :]
        view.index_copy_(0, write_index, index_keys)
        return index_keys if read_index.numel() == 0 else torch.index_select(view, 0, read_index)


def _update_indexer(cache: Any, index_keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """``cache.update_indexer`` of the paged cache: ``index_keys [1, Q, Di]`` -> ``[1, T, Di]``."""
    return cache.layer_to_allocator[layer_idx].update_indexer(index_keys.squeeze(0), layer_idx).unsqueeze(0)


@contextlib.contextmanager
def _mla_names(config: Any) -> Iterator[None]:
    """Points :data:`OVERRIDDEN` at the MLA allocator for ``config`` and puts them back on exit."""
    import importlib

    allocator = MLACacheAllocator.for_config(config)
    table = {_FULL: allocator}

    def group(cfg: Any) -> dict[str, list[int]]:
        # Why: V3.2's "indexed_attention" layers are full attention plus the indexer rows of the same allocator.
        return {_FULL: list(range(cfg.num_hidden_layers))}

    values = {"ATTN_TYPE_TO_ALLOCATOR": table, "group_layers_by_attn_type": group}
    values["FullAttentionCacheAllocator"] = allocator
    with _LOCK:
        saved = []
        try:
            for module_name, name in OVERRIDDEN:
                module = importlib.import_module(module_name)
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, values[name])
            yield
        finally:
            for module, name, value in reversed(saved):
                setattr(module, name, value)


def _create_batch_processor(manager: Any, original: Any, config: Any) -> Any:
    with _mla_names(config):
        processor = original()
    cache = processor.cache
    cache.update_indexer = functools.partial(_update_indexer, cache)
    return processor


def enable_mla_continuous_batching(model: Any) -> None:
    """Makes ``model.generate_batch`` / ``init_continuous_batching`` work on a DeepSeek-V3 / V3.2 ``model``.

    Only this model changes (an instance attribute); :func:`disable_mla_continuous_batching` removes it.
    Raises ``ValueError`` for a model without MLA (``kv_lora_rank``) in its text config.
    """
    config = model.config.get_text_config()
    if getattr(config, "kv_lora_rank", None) is None:
        raise ValueError(
            f"enable_mla_continuous_batching: model {type(model).__name__} has no MLA (config.kv_lora_rank); "
            "expected a DeepSeek-V3 / V3.2 model"
        )
    original_init = type(model).init_continuous_batching.__get__(model)

    @functools.wraps(original_init)
    def init_continuous_batching(*args: Any, **kwargs: Any) -> Any:
        with _mla_names(config):
            manager = original_init(*args, **kwargs)
        if "_create_batch_processor" not in vars(manager):
            original = manager._create_batch_processor
            manager._create_batch_processor = functools.partial(
                _create_batch_processor, manager, original, config
            )
        return manager

    model.init_continuous_batching = init_continuous_batching


def disable_mla_continuous_batching(model: Any) -> None:
    """Undoes :func:`enable_mla_continuous_batching` on ``model`` (a no-op if it was not enabled)."""
    vars(model).pop("init_continuous_batching", None)

"""Continuous batching (``model.generate_batch``) for unmodified DeepSeek-V3 (MLA) / V3.2 (MLA + DSA) models.

transformers 5.24's paged cache assumes per-head K and V: every full-attention layer stores
``[tokens, 2, num_key_value_heads, head_dim]`` and the memory sizing counts those bytes (5.25 adds an MLA
allocator of its own, without the indexer rows). MLA caches one
latent row per token instead (``kv_lora_rank`` + ``qk_rope_head_dim``), V3.2 adds the lightning indexer key
(``index_head_dim``) read through ``cache.update_indexer``, and V3.2 names its layers ``indexed_attention``,
which the paged cache rejects. :class:`MLACacheAllocator` is written as a transformers allocator would be:
one ``[Dc | Dr | Di]`` row per token and layer, so the sectors, blocks and memory sizing all count MLA bytes.

transformers has no allocator registry, so :func:`enable_mla_continuous_batching` overrides, for one model,
its ``init_continuous_batching`` (an instance attribute) and, on the manager it returns,
``_create_batch_processor``. While those two calls run (under a lock), these module attributes point at
the MLA versions and are put back afterwards: ``cache.ATTN_TYPE_TO_ALLOCATOR``,
``cache.group_layers_by_attn_type``, ``cache.FullAttentionCacheAllocator``,
``initialization.ATTN_TYPE_TO_ALLOCATOR`` and ``initialization.group_layers_by_attn_type``, and from
transformers 5.25 on ``cache.MLACacheAllocator`` (transformers' own MLA allocator, which 5.25's paged cache
picks for every MLA full-attention layer instead of ``ATTN_TYPE_TO_ALLOCATOR``'s) (:data:`OVERRIDDEN`). The
cache built there gets an instance ``update_indexer``. Other models are untouched. Importing this module
checks that every transformers name it relies on exists (:data:`TRANSFORMERS_NAMES`; ``ImportError``
naming the missing ones, the installed release and the supported range otherwise).

An offloaded model (``torch_kvoffload.offload``, which enables this) keeps its KV in the library's caches
(:mod:`torch_kvoffload.integrations.hf.serving`): transformers' paged cache only keeps its block ledger
(one element per token and layer, :meth:`MLACacheAllocator.ledger`), and on the cache instance
``extend_read_and_write_indices`` (records each request's place in the step), ``can_store_request_tokens``
(admits a request only into a free library slot; refuses a new one that sits out the step),
``free_blocks`` / ``free_all_requests`` (finish the library's requests) are wrapped, and with prefix reuse
(``OffloadConfig.prefix_cache`` with layerwise offload) ``search_prefix_match`` is answered from the
library's store (the scheduler's search for a new request's cached prefix: the request's library request
adopts it, and the scheduler schedules only the rest; a request whose prefix another request of the step is
computing sits out the step instead, :mod:`~torch_kvoffload.integrations.hf.serving_prefix`;
``use_prefix_sharing`` is set on the instance so that the scheduler asks); on the manager, ``add_request`` (refuses a request longer than
``serving.max_request_tokens``) and ``_run_generation_loop`` (closes the serving state when the loop ends).
The step itself runs in the model's forward (``install._forward``). Asynchronous batching, CUDA graphs,
compiled CB paths, CPU swap, transformers' own block sharing and ``num_return_sequences > 1`` are turned off or refused for
an offloaded model (the configuration given is copied, not changed). Requests the library cannot serve fail
alone: ``add_request`` refuses a live id, an empty prompt and an over-long one; under ``add_requests``
(``generate_batch``) the scheduler's ``add_waiting_request`` fails the last two as error results; a step the
library fails fails only the requests whose own forward fails (each of the step's segments runs again alone;
``update_batch`` leaves their tokens out, then fails them), or the whole step's requests when the step
itself cannot run (``handle_batch_error``), never the loop; the
output router's ``deliver`` / ``deliver_batch`` release a request's id with its last output; ``stop`` and the
loop's end release the model for another manager. :func:`check_serving` checks a serving plan before any
request (a server calls it before its port opens).

Why one module: every override of transformers' private continuous-batching classes lives here, next to the
list of names they rely on (:data:`TRANSFORMERS_NAMES`) that importing it checks; splitting them would split
that list.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch

from torch_kvoffload.backend import SESSION_ATTR
from torch_kvoffload.integrations.hf.exclusive import exclusive

logger = logging.getLogger(__name__)

__all__ = [
    "OVERRIDDEN",
    "TRANSFORMERS_NAMES",
    "MLACacheAllocator",
    "check_serving",
    "disable_mla_continuous_batching",
    "enable_mla_continuous_batching",
]

_CB = "transformers.generation.continuous_batching"
#: ``(module, attribute, first release)``: overridden names that exist only from a transformers release on.
#: 5.25's ``PagedAttentionCache._create_allocator`` builds ``cache.MLACacheAllocator`` for a model with
#: ``kv_lora_rank`` instead of ``ATTN_TYPE_TO_ALLOCATOR["full_attention"]``.
_OVERRIDDEN_SINCE = ((f"{_CB}.cache", "MLACacheAllocator", "5.25.0"),)


def _installed_at_least(release: str) -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version(release)


#: The transformers private names (module, attribute) swapped while an enabled model builds its CB state
#: (those of :data:`_OVERRIDDEN_SINCE` only on the releases that have them).
OVERRIDDEN = (
    (f"{_CB}.cache", "ATTN_TYPE_TO_ALLOCATOR"),
    (f"{_CB}.cache", "group_layers_by_attn_type"),
    (f"{_CB}.cache", "FullAttentionCacheAllocator"),
    (f"{_CB}.initialization", "ATTN_TYPE_TO_ALLOCATOR"),
    (f"{_CB}.initialization", "group_layers_by_attn_type"),
    *((m, n) for m, n, since in _OVERRIDDEN_SINCE if _installed_at_least(since)),
)
#: ``(module, attribute, members)``: every transformers name this module subclasses, calls, wraps or
#: overrides (:data:`OVERRIDDEN` included), checked when the module is imported.
TRANSFORMERS_NAMES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    *((m, n, ()) for m, n in OVERRIDDEN),
    (
        f"{_CB}.cache_allocators",
        "FullAttentionCacheAllocator",
        ("_before_cache_tensor_init", "_after_cache_tensor_init", "get_read_indices", "get_write_indices"),
    ),
    (
        f"{_CB}.cache",
        "PagedAttentionCache",
        (
            "extend_read_and_write_indices",
            "can_store_request_tokens",
            "free_blocks",
            "free_all_requests",
            "search_prefix_match",
        ),
    ),
    (
        _CB,
        "ContinuousBatchingManager",
        ("_create_batch_processor", "add_request", "add_requests", "_run_generation_loop", "stop"),
    ),
    (
        f"{_CB}.continuous_api",
        "ContinuousBatchProcessor",
        ("update_batch", "handle_batch_error", "_handle_request_error"),
    ),
    (f"{_CB}.input_outputs", "ContinuousBatchingIOs", ("prepare_batch_update",)),
    (f"{_CB}.continuous_api", "OutputRouter", ("deliver", "deliver_batch", "fail_and_deliver")),
    (f"{_CB}.scheduler", "Scheduler", ("add_waiting_request",)),
    ("transformers.generation.configuration_utils", "ContinuousBatchingConfig", ()),
)
_LOCK = threading.RLock()
_FULL = "full_attention"


def _check_transformers_names() -> None:
    """``ImportError`` naming each :data:`TRANSFORMERS_NAMES` entry the installed transformers lacks."""
    import importlib

    import transformers

    from torch_kvoffload.integrations.hf.versions import supported_range

    missing = []
    for module_name, name, members in TRANSFORMERS_NAMES:
        try:
            obj = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{name}")
            continue
        missing += [f"{module_name}.{name}.{m}" for m in members if not hasattr(obj, m)]
    if missing:
        raise ImportError(
            f"torch_kvoffload's continuous batching overrides transformers names that transformers "
            f"{transformers.__version__} lacks: {', '.join(missing)} (supported: transformers{supported_range()})"
        )


_check_transformers_names()


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

    @classmethod
    def ledger(cls) -> type[MLACacheAllocator]:
        """A subclass keeping one element per token and layer: the block ledger of an offloaded model, whose
        KV the library holds (its ``update`` is never called)."""
        return type("MLALedgerAllocator", (cls,), {"widths": (1, 0, 0)})

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
def _mla_names(config: Any, ledger: bool = False) -> Iterator[None]:
    """Points :data:`OVERRIDDEN` at the MLA allocator for ``config`` (the ledger one when ``ledger``) and
    puts them back on exit."""
    import importlib

    allocator = MLACacheAllocator.ledger() if ledger else MLACacheAllocator.for_config(config)
    table = {_FULL: allocator}

    def group(cfg: Any) -> dict[str, list[int]]:
        # Why: V3.2's "indexed_attention" layers are full attention plus the indexer rows of the same allocator.
        return {_FULL: list(range(cfg.num_hidden_layers))}

    values = {"ATTN_TYPE_TO_ALLOCATOR": table, "group_layers_by_attn_type": group}
    values["FullAttentionCacheAllocator"] = allocator
    values["MLACacheAllocator"] = allocator  # transformers >= 5.25 (_OVERRIDDEN_SINCE)
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


def _create_batch_processor(manager: Any, original: Any, config: Any, serving: Any) -> Any:
    with _mla_names(config, ledger=serving is not None):
        processor = original()
    cache = processor.cache
    if serving is None:
        cache.update_indexer = functools.partial(_update_indexer, cache)
    else:
        if getattr(cache, "_kvoffload_serving", None) is not serving:
            _hook_cache(cache, serving)
        if "update_batch" not in vars(processor):
            _hook_processor(processor, serving)
        serving.close()
        serving.open()
    return processor


def _hook_processor(processor: Any, serving: Any) -> None:
    """The instance overrides of an offloaded model's batch processor: a request the library cannot serve
    fails alone when the scheduler takes it (transformers' own path for a request it rejects there), and a
    step the library failed fails its requests (``handle_batch_error``) instead of ending the loop."""
    scheduler = processor.scheduler
    add_waiting = scheduler.add_waiting_request
    update = processor.update_batch

    def add_waiting_request(state):
        new = state.max_new_tokens if state.max_new_tokens is not None else serving.max_tokens
        reason = serving.refusal(state.request_id, len(state.initial_tokens), int(new))
        if reason is not None:
            raise ValueError(reason)  # the caller fails this request alone and goes on
        return add_waiting(state)

    def update_batch():
        error, failed = serving.take_step_error(), serving.take_failed()
        if error is not None:
            return processor.handle_batch_error(error)
        if not failed:
            return update()
        # the step without the requests that failed alone (their tokens were never computed), then those fail
        io = processor.inputs_and_outputs
        states, tokens, logprobs = io.prepare_batch_update()
        kept, kept_tokens, kept_logprobs, dropped = [], [], [], []
        t = 0
        for future in states:
            token = logprob = None
            if future.has_new_token:
                token, logprob = tokens[t], (logprobs[t] if logprobs is not None else None)
                t += 1
            if future.state.request_id in failed:
                dropped.append(future.state)
                continue
            kept.append(future)
            if future.has_new_token:
                kept_tokens.append(token)
                kept_logprobs.append(logprob)
        io.prepare_batch_update = lambda: (kept, kept_tokens, kept_logprobs if logprobs is not None else None)
        try:
            update()
        finally:
            del io.prepare_batch_update
        for state in dropped:
            processor._handle_request_error(failed[state.request_id], state)
            scheduler.finish_request(state.request_id)

    scheduler.add_waiting_request = add_waiting_request
    processor.update_batch = update_batch


# ------------------------------------------------------------------------------- offloaded models
def _offload_cb_config(serving: Any, given: Any, gen: Any) -> Any:
    """A copy of the CB configuration ``given`` (or the default) an offloaded model runs with: synchronous,
    no graphs or compiled paths, no CPU swap or block sharing of transformers' own (the library's store
    answers the prefix search: :func:`_hook_cache`), as many blocks as the library's slots hold
    (transformers' cache is only its ledger), and admission left to the library (no safety margin)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = copy.deepcopy(given) if given is not None else ContinuousBatchingConfig()
    if int(getattr(gen, "num_return_sequences", 1) or 1) > 1:
        raise ValueError(
            "continuous batching of an offloaded model: num_return_sequences > 1 is not supported (forked "
            "requests would share the library's KV); run one request per sequence"
        )
    compiled = [n for n in ("varlen_compile_config", "decode_compile_config") if getattr(cfg, n) is not None]
    if compiled or cfg.default_compile_level:
        raise ValueError(
            "continuous batching of an offloaded model: compiled CB paths "
            f"({compiled or 'default_compile_level'}) are not supported; the library's attention runs eagerly"
        )
    for name in ("use_async_batching", "use_cuda_graph"):
        if getattr(cfg, name) not in (None, False, (False, False)):
            raise ValueError(
                f"continuous batching of an offloaded model: {name}={getattr(cfg, name)!r} is not supported "
                "(each step's requests are mapped to the library's as the step is packed)"
            )
        setattr(cfg, name, False if name == "use_async_batching" else (False, False))
    if cfg.max_batch_tokens is not None and int(cfg.max_batch_tokens) < 1:
        raise ValueError(
            f"continuous batching of an offloaded model: max_batch_tokens={cfg.max_batch_tokens} (tokens per "
            "step, --cb-max-batch-tokens) must be at least 1"
        )
    if cfg.max_batch_tokens is None:
        cfg.max_batch_tokens = min(serving.max_tokens, 512)
    # before the caches are sized for them: an impossible plan allocates nothing
    planned = serving.planned_slots()
    _check_step_buffers(cfg, planned, serving.max_tokens)
    slots = serving.plan()
    if slots != planned:  # a device budget settled the slots only once the caches were measured
        _check_step_buffers(cfg, slots, serving.max_tokens)
    cfg.num_blocks = _ledger_blocks(slots, serving.max_tokens, cfg.page_size)
    cfg.max_blocks_per_request = 0
    cfg.allow_block_sharing = False
    cfg.cpu_offload_space = 0.0
    if cfg.safety_margin is None:
        cfg.safety_margin = 0.0
    return cfg


def _ledger_blocks(slots: int, tokens: int, page_size: int) -> int:
    """Blocks of transformers' paged cache for ``slots`` requests of ``tokens`` tokens (one spare each)."""
    return slots * (math.ceil(tokens / page_size) + 1)


#: Bytes per element of transformers' per-step buffers that span every token its cache could read (fp32).
_STEP_BUFFER_ITEMSIZE = 4


def _check_step_buffers(cfg: Any, slots: int, tokens: int) -> None:
    """``ValueError`` naming ``serving.max_request_tokens`` when transformers' per-step buffers for ``cfg``
    would not fit in the host memory available now. transformers sizes them ``max_batch_tokens`` x every token
    its cache could read (``num_blocks`` x ``page_size``), fp32 (measured on 5.24: 37 MB for 512 x 18 432);
    they are allocated when the manager starts, whatever the requests' real lengths."""
    from torch_kvoffload.store.sizes import available_memory_bytes, check_host_bytes

    readable = _ledger_blocks(slots, tokens, int(cfg.page_size)) * int(cfg.page_size)
    nbytes = int(cfg.max_batch_tokens) * readable * _STEP_BUFFER_ITEMSIZE
    what = (
        f"transformers' step buffers for {slots} requests of serving.max_request_tokens={tokens} tokens "
        f"(max_batch_tokens {cfg.max_batch_tokens} x {readable} tokens readable x {_STEP_BUFFER_ITEMSIZE} bytes)"
    )
    where = "continuous batching of an offloaded model"
    check_host_bytes(where, what, nbytes)
    available = available_memory_bytes()
    if available and nbytes > available:
        raise ValueError(
            f"{where}: {what} = {nbytes} bytes exceeds the host memory available now ({available} bytes); lower "
            "serving.max_request_tokens, serving.max_requests or max_batch_tokens"
        )


def check_serving(model: Any, continuous_batching_config: Any = None) -> int:
    """Check, before any request, that the offloaded ``model`` can serve continuous batching with
    ``continuous_batching_config`` (``None``: the default) and its ``OffloadConfig.serving``: the device budget
    holds the requests, the host pool and transformers' step buffers fit in host memory, every option is
    supported. Sizes the caches as serving will; returns the requests held at once. ``ValueError`` naming the
    field otherwise. A server calls it before it opens its port."""
    session = getattr(model, SESSION_ATTR, None)
    if session is None:
        raise ValueError(f"check_serving: {type(model).__name__} is not offloaded (torch_kvoffload.offload)")
    serving = _serving_of(session)
    _offload_cb_config(serving, continuous_batching_config, model.generation_config)
    return serving.slots


def _hook_cache(cache: Any, serving: Any) -> None:
    """The instance overrides of an offloaded model's paged cache (see the module docstring)."""
    extend = cache.extend_read_and_write_indices
    can_store = cache.can_store_request_tokens
    free_blocks = cache.free_blocks
    free_all = cache.free_all_requests

    def extend_read_and_write_indices(request_id, past_length, query_length, read_index, write_index):
        serving.record(request_id, past_length, query_length)
        return extend(request_id, past_length, query_length, read_index, write_index)

    def can_store_request_tokens(state, request_len, dry_run=False):
        if serving.prefixes.waits(state.request_id):
            return False
        if not serving.can_admit(state.request_id, state.current_len() + request_len):
            return False
        fits = can_store(state, request_len, dry_run)
        if fits and not dry_run:
            serving.scheduled(state.request_id)
        return fits

    def free_blocks_(request_id, no_cache=False):
        try:
            free_blocks(request_id, no_cache)
        finally:
            serving.finish(request_id)

    def free_all_requests(clear_ledgers=False):
        try:
            free_all(clear_ledgers)
        finally:
            serving.finish_all()

    if serving.session.core.prefix.enabled:  # the scheduler asks for a new request's cached prefix
        cache.use_prefix_sharing = True
        cache.search_prefix_match = serving.prefixes.adopt
    cache.extend_read_and_write_indices = extend_read_and_write_indices
    cache.can_store_request_tokens = can_store_request_tokens
    cache.free_blocks = free_blocks_
    cache.free_all_requests = free_all_requests
    cache._kvoffload_serving = serving


def _hook_manager(manager: Any, serving: Any) -> None:
    """``add_request`` refuses (``ValueError``, before transformers takes it) an id that is live already, a
    request without ``max_new_tokens``, an empty prompt and one longer than ``serving.max_request_tokens``;
    under ``add_requests`` (``generate_batch``) the last two become error results instead (the scheduler's
    refusal), so that the other prompts are still answered. The ids are released when their last output is
    delivered. The generation loop closes the serving state on exit; ``stop`` (or the loop's end) lets
    another manager be created."""
    add_request = manager.add_request
    add_requests = manager.add_requests
    batching = threading.local()
    run_loop = manager._run_generation_loop
    stop = manager.stop
    router = manager.output_router
    deliver, deliver_batch = router.deliver, router.deliver_batch

    @functools.wraps(add_request)
    def add_request_(input_ids, request_id=None, max_new_tokens=None, *args, **kwargs):
        new = manager.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if new is None:
            raise ValueError(
                "continuous batching of an offloaded model: pass max_new_tokens (each request's KV is reserved "
                "for its prompt + max_new_tokens)"
            )
        if not getattr(batching, "active", False):
            reason = serving.refusal(request_id or "(new)", len(input_ids), int(new))
            if reason is not None:
                raise ValueError(reason)
        if request_id is not None:
            serving.claim(request_id)
        try:
            given = add_request(input_ids, request_id, max_new_tokens, *args, **kwargs)
        except BaseException:
            if request_id is not None:
                serving.release(request_id)
            raise
        if given is None and request_id is not None:  # not taken (the manager accepts no request now)
            serving.release(request_id)
        elif given is not None and request_id is None:
            serving.claim(given)  # an id of transformers' own numbering
        return given

    @functools.wraps(add_requests)
    def add_requests_(*args, **kwargs):
        batching.active = True
        try:
            return add_requests(*args, **kwargs)
        finally:
            batching.active = False

    def ended(output: Any) -> None:
        if output.error is not None or output.is_finished():
            serving.release(output.request_id)

    def deliver_(output):
        try:
            return deliver(output)
        finally:
            ended(output)

    def deliver_batch_(outputs):
        try:
            return deliver_batch(outputs)
        finally:
            for output in outputs:
                ended(output)

    def run_generation_loop(*args, **kwargs):
        try:
            return run_loop(*args, **kwargs)
        finally:
            serving.close()
            serving.release_ownership(manager)

    @functools.wraps(stop)
    def stop_(*args, **kwargs):
        try:
            return stop(*args, **kwargs)
        finally:
            thread = manager._generation_thread
            if thread is None or not thread.is_alive():
                serving.release_ownership(manager)

    manager.add_request = add_request_
    manager.add_requests = add_requests_
    manager._run_generation_loop = run_generation_loop
    manager.stop = stop_
    router.deliver = deliver_
    router.deliver_batch = deliver_batch_


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
    # a method bound to the model: copy.deepcopy(model) rebinds it to the copy (and the copy's session)
    model.init_continuous_batching = types.MethodType(_init_continuous_batching, model)


def _init_continuous_batching(
    model: Any,
    generation_config: Any = None,
    continuous_batching_config: Any = None,
    workload_hints: Any = None,
) -> Any:
    """``model.init_continuous_batching`` of an enabled model (see the module docstring)."""
    session = getattr(model, SESSION_ATTR, None)
    if session is None:
        return _new_manager(model, None, generation_config, continuous_batching_config, workload_hints)
    who = f"{type(model).__name__}.init_continuous_batching"
    serving = _serving_of(session)
    # a generate() holds the session between its forwards: sizing the caches for serving would end its sequence
    with exclusive(session, who):
        if serving.is_open:
            raise RuntimeError(
                f"{who}: a manager of this offloaded model is serving; stop it first (one manager at a time "
                "holds the model's KV caches)"
            )
        serving.take_ownership(_PENDING, who)  # refuses while another manager holds the model
        try:
            gen = generation_config if generation_config is not None else model.generation_config
            cb_config = _offload_cb_config(serving, continuous_batching_config, gen)
            manager = _new_manager(model, serving, generation_config, cb_config, workload_hints)
        except BaseException:
            serving.release_ownership(_PENDING)
            raise
        serving.release_ownership(_PENDING)
        serving.take_ownership(manager, who)
    return manager


class _Pending:
    """Holds a model's serving ownership while its manager is being built."""


_PENDING = _Pending()


def _new_manager(
    model: Any, serving: Any, generation_config: Any, continuous_batching_config: Any, workload_hints: Any
) -> Any:
    """transformers' manager for ``model`` built with the MLA allocator, its overrides installed."""
    config = model.config.get_text_config()
    original_init = type(model).init_continuous_batching.__get__(model)
    with _mla_names(config, ledger=serving is not None):
        manager = original_init(generation_config, continuous_batching_config, workload_hints)
    if "_create_batch_processor" not in vars(manager):
        original = manager._create_batch_processor
        manager._create_batch_processor = functools.partial(
            _create_batch_processor, manager, original, config, serving
        )
        if serving is not None:
            _hook_manager(manager, serving)
    return manager


def _serving_of(session: Any) -> Any:
    from torch_kvoffload.integrations.hf.serving import ServingRequests

    if session.serving is None:
        session.serving = ServingRequests(session)
    return session.serving


def disable_mla_continuous_batching(model: Any) -> None:
    """Undoes :func:`enable_mla_continuous_batching` on ``model`` (a no-op if it was not enabled)."""
    vars(model).pop("init_continuous_batching", None)

"""``OffloadSession``: where an offloaded Hugging Face model keeps its KV, and the attention over it.

A session is built from a :class:`~torch_kvoffload.core.spec.ModelSpec` and an
:class:`~torch_kvoffload.core.config.OffloadConfig`. It registers itself in ``ops.mla_runtime.runtimes`` under
:attr:`OffloadSession.name` (the ``mla_cache_write`` / ``mla_cache_attention`` ops call it) and, with
layerwise offload on, a hook object in ``ops.layer_hooks.runtimes`` under :attr:`layerwise_runtime`.

Around every model forward the caller runs ``begin_forward(input_ids, attention_mask, cache_position,
past=..., owner=cache)`` and ``end_forward()``; in between, per layer: projections → ``layer_wait`` +
``layer_prefetch`` → ``mla_cache_write`` → ``layer_save`` → ``mla_cache_attention`` → W_UV → ``o_proj``,
every op taking ``layer_caches(layer)`` as its ``caches``.

Requests. Batch row ``r`` of a sequence is request ``r``: its tokens are the row's real tokens (left
padding, ``attention_mask == 0``, is dropped; only left padding is accepted), at logical positions
``0 .. len-1``. One sequence (one ``OffloadCache``) is served at a time; a forward with an empty cache
starts a new one. Every cache is paged in ``block_size`` blocks; request ``r`` owns device blocks
``r*M .. r*M+M-1`` (``M`` = blocks per request), so its rows are contiguous.

Where the KV lives.

* Layerwise (``layerwise`` on): every forward, prefill and decode alike, runs the layerwise pipeline over
  the planned physical buffers (``num_shared_buffers`` buffers shared by the reusable layers). Full blocks
  are saved to the host store and loaded back by the next forward. The partial last block of each request
  survives between forwards in a small per-layer device *tail* (``[batch, block_size, ·]`` per component,
  counted in ``device_kv_bytes``): after a layer's write its partial block is copied into the tail, and the
  next forward copies it back into the buffer after ``layer_wait``. A prompt prefix found in the store is
  loaded instead of written: the model still computes its projections, its attention reads the loaded KV.
  Attention reads the layer's buffer (dense causal, or the indexer's top-k over the buffer's indexer keys).
* Sparse decode (``sparse`` on; models with a lightning indexer): every new row goes to the host pool
  (``SparseDecodeOffload.append``); the indexer keys go to a device indexer cache (floating, or int8 +
  fp32 scale with ``indexer_dtype="int8"``). A decode step (one new token per request) runs the fused
  indexer + residency + Copy-SFA path (``SparseDecodeOffload.attend``); a multi-token forward (prefill)
  selects with the indexer over the device indexer cache and attends over the forward's own rows plus,
  for a chunked prefill, the request's earlier rows read from the host pool for that layer only.
* Resident sparse (``sparse={"offload": False}``): the whole main KV stays on the device, paged like the
  indexer cache (one page of :attr:`reserved_tokens` rows per request, grown in place); every forward,
  decode steps included, selects with the indexer over the device indexer cache and runs absorbed sparse
  MLA attention over the selected resident rows. No host pool, no hot buffers (hits / misses stay 0).
  With layerwise on, prefill runs the layerwise pipeline as below and decode steps the resident path.
* Both: prefill runs the layerwise pipeline (its attention over the buffer, top-k from the device indexer
  cache) and appends the rows to the host pool; decode steps run the sparse path only. The layer buffers
  are released at the sequence's first decode step (decode holds only the hot buffers and the indexer
  cache) and allocated again for the next sequence; a multi-token forward after decode steps takes the
  sparse prefill path.
* KVPP (``kvpp`` on, alone; every rank of the group runs the same model replica and the same forwards):
  each layer's bundle (``c_kv``, ``k_pe`` [, indexer key]) is paged ``[num_blocks, block_size, D]`` in
  the KVPP runtime's views — an owned layer's persistent buffer, another layer's scratch buffer.
  ``begin_forward`` schedules the forward with the blocks holding each request's earlier tokens,
  ``kvpp_wait_layer`` / ``kvpp_prefetch_layer`` before each layer's first KV access bring the owner's
  broadcast, every rank writes the new rows itself and attends over the view (dense causal, or the
  indexer's top-k); ``end_forward`` completes the forward. Sizes are fixed per sequence, as with sparse.

P/D (``config.pd``): the session's role (:mod:`torch_kvoffload.integrations.hf.pd`) is :attr:`pd`. On a
prefill node the layer buffers come from the role's transport and always carry the indexer keys; on a
decode node :meth:`begin_external_sequence` starts a sequence whose prompt KV is placed from outside.

Sizing and lifetime: a sequence's requests live from the forward that starts it (``past == 0``) until
the next such forward, :meth:`end_sequence`, or a failed forward (which releases them at once: a failed
call leaves nothing reserved, and the next fresh forward works). Each fresh forward sizes the caches for
its own batch and tokens per request: the larger of its width and the planned size (``generate`` plans
prompt width + ``max_new_tokens`` - 1, the tokens whose KV is ever written; :meth:`reserve` plans
explicitly), growing or shrinking what the previous sequence used. Device caches hold only what a request
can use: layer buffers whole blocks of those tokens, tails ``min(block_size, tokens)`` rows, the sparse
indexer cache exactly ``tokens`` rows (one page per request), hot buffers ``min(capacity, tokens)`` rows
(with a top-k of ``min(top_k, tokens)``, which selects every row as the configured one would). A running
sequence that outgrows its size grows the device caches in place (``stats()["resizes"]``); the host pool,
a KVPP runtime and a P/D session keep the size of the sequence's first forward (outgrowing them is a
``ValueError``).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from torch_kvoffload._utils import check_int
from torch_kvoffload.counters import Counters
from torch_kvoffload.layerwise.planner import LayerCacheSpec, TensorSpec
from torch_kvoffload.ops import layer_hooks, mla_runtime
from torch_kvoffload.ops.indexer import hadamard_quant_int8, lightning_indexer, quant_lightning_indexer
from torch_kvoffload.ops.sparse_attention import sparse_mla_attention

if TYPE_CHECKING:
    from torch_kvoffload.core.config import OffloadConfig
    from torch_kvoffload.core.spec import ModelSpec
    from torch_kvoffload.kvpp import KVPPConfig, KVPPGroup, KVPPRuntime
    from torch_kvoffload.layerwise.runtime import LayerwiseOffloadRuntime
    from torch_kvoffload.sparse.runtime import SparseDecodeOffload

logger = logging.getLogger(__name__)

__all__ = ["OffloadSession"]

T = TypeVar("T")

_ids = itertools.count()
_LAYERWISE_TOTALS = (
    "bytes_loaded",
    "bytes_saved",
    "loads",
    "saves",
    "store_hits",
    "store_misses",
    "store_errors",
    "forward_retries",
)
_SESSION_COUNTERS = (
    "forwards",
    "prefill_forwards",
    "decode_forwards",
    "prefill_host_bytes_h2d",
    "resizes",
    "failed_forwards",
)
_KVPP_TOTALS = ("broadcasts", "broadcast_spans", "bytes_broadcast", "waits", "wait_seconds")
# queries per chunk of the dense attention (bounds the [Q, H, L] score tensor)
_DENSE_CHUNK = 256


class _LayerHooks:
    """What ``layer_wait`` / ``layer_prefetch`` / ``layer_save`` call: the session's layerwise runtime
    during forwards that run the layerwise pipeline, nothing during sparse decode steps. ``caches`` is the
    session's ``layer_caches(layer)``, whose first tensors are the runtime's own."""

    def __init__(self, session: OffloadSession) -> None:
        self._session = session

    def _target(self, caches):
        s = self._session
        if s._fwd is None or not s._fwd.layerwise:
            return None, None
        rt = s._rt
        assert rt is not None
        n = s._lw_components
        return rt, (None if caches is None else list(caches)[:n])

    def _call(self, method: str, layer, caches) -> None:
        rt, own = self._target(caches)
        if rt is not None:
            getattr(rt, method)(layer, own)

    def wait_layer(self, layer, caches=None) -> None:
        self._call("wait_layer", layer, caches)

    def prefetch_layer(self, layer, caches=None) -> None:
        self._call("prefetch_layer", layer, caches)

    def save_layer(self, layer, caches=None) -> None:
        self._call("save_layer", layer, caches)


@dataclass
class _Forward:
    """Index tensors of one forward (device tensors unless noted)."""

    B: int
    S: int
    past: int
    decode: bool  # a sparse decode step
    layerwise: bool  # runs the layerwise pipeline
    old_len: list[int]  # per request, tokens before this forward (host ints)
    new_len: list[int]
    sel: torch.Tensor  # int64 [N]: flat (b * S + s) of the real positions, request-major
    pos: torch.Tensor  # int64 [N]: their logical positions
    row: torch.Tensor  # int64 [N]: their request
    phys: torch.Tensor  # int64 [N]: their paged row (row * M * bs + pos)
    block_table: torch.Tensor  # int32 [B, M]
    index_table: torch.Tensor  # int32 [B, pages]: the sparse indexer cache's pages of each request
    index_phys: torch.Tensor  # int64 [N]: the rows' rows in the sparse indexer cache
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    seq_lens_k: torch.Tensor  # int32 [B]
    cached: list[int] = field(default_factory=list)  # layerwise: prefix tokens loaded per request
    write: torch.Tensor | None = None  # bool [N]: rows written into the layer buffer
    tail_restore: tuple[torch.Tensor, torch.Tensor] | None = None  # (tail rows, paged rows)
    tail_keep: tuple[torch.Tensor, torch.Tensor] | None = None  # (paged rows, tail rows)
    new_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _world_size() -> int:
    """World size of the default process group (``ValueError`` when torch.distributed is not initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "KVPP needs torch.distributed initialised (init_process_group) on every rank of its group before "
            "the model is offloaded"
        )
    return dist.get_world_size()


def _nbytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class OffloadSession:
    """The KV store and attention of one offloaded model (see the module docstring).

    Parameters
    ----------
    spec : ModelSpec
        With layerwise offload, with the weights' fingerprint (:meth:`ModelSpec.with_weights`): the store
        keys carry it, so models of one architecture with other weights never read each other's KV.
    config : OffloadConfig
        Resolved (``None`` fields off). Sparse offload needs ``spec.has_indexer``.
    name : str, optional
        Registry name (default: unique per session).
    """

    def __init__(self, spec: ModelSpec, config: OffloadConfig, *, name: str | None = None) -> None:
        if config.layerwise is not None and not spec.weights_fingerprint:
            raise ValueError(
                f"OffloadSession: layerwise offload of {spec.model_class} keys its store by the weights, but "
                "the spec has no weights_fingerprint; pass inspect_model(model).with_weights(model)"
            )
        if config.sparse is not None and not spec.has_indexer:
            raise ValueError(
                f"torch_kvoffload cannot offload {spec.model_class}: sparse attention (sparse=..., offloaded or "
                "resident) needs a lightning indexer (index_topk / indexer module), which this model does not have"
            )
        self.kvpp_on = config.kvpp_requested
        self._kvpp_cfg: KVPPConfig | None = None
        if self.kvpp_on:
            try:
                self._kvpp_cfg = config.kvpp_config(spec, world_size=_world_size())
            except ValueError as exc:
                raise ValueError(f"torch_kvoffload cannot offload {spec.model_class}: {exc}") from exc
        self.spec = spec
        self.config = config
        self.name = name or f"hf-{spec.model_class}-{next(_ids)}"
        self.block_size = config.resolved_block_size
        self.layerwise_on = config.layerwise is not None
        self.sparse_on = config.sparse is not None
        # sparse attention with the whole main KV resident on the device (no host pool, no hot buffers)
        self.resident_on = config.sparse is not None and not config.sparse.offload
        if self.resident_on:
            self._check_resident_dtype(spec, config)
        self.int8_indexer = config.sparse is not None and config.sparse.indexer_dtype == "int8"
        pd_prefill = config.pd is not None and config.pd.role == "prefill"
        # the layer buffers carry the indexer keys when no separate device indexer cache exists, and on a
        # P/D prefill node (the decode peer reads the indexer from them)
        self._lw_indexer = self.layerwise_on and spec.has_indexer and (not self.sparse_on or pd_prefill)
        self._lw_components = 2 + (1 if self._lw_indexer else 0)
        self.counters = Counters(_SESSION_COUNTERS)
        self._lw_totals = Counters(_LAYERWISE_TOTALS)
        self._store = config.layerwise.store.build() if self.layerwise_on else None
        self._rt: LayerwiseOffloadRuntime | None = None
        self._sparse: SparseDecodeOffload | None = None
        self._index_cache: list[tuple[torch.Tensor, ...]] = []
        self._resident: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (kv_c, k_pe), paged
        self._tails: list[tuple[torch.Tensor, ...]] = []
        self._batch = 0
        self._max_tokens = 0  # tokens per request of the paged caches (whole blocks)
        self._kv_rows = 0  # tokens per request the device caches are sized for
        self._planned: tuple[int, int] | None = None
        self._tokens: list[list[int]] = []
        self._request_ids: list[int] = []
        self._reserved: list[int] = []  # request ids holding host-pool blocks
        self._next_request = 0
        self._seen = 0
        self._owner: Any = None
        self._broken = False
        self._fwd: _Forward | None = None
        self._closed = False
        mla_runtime.runtimes.register(self.name, self)
        self.layerwise_runtime: str | None = None
        if self.layerwise_on:
            self.layerwise_runtime = f"{self.name}/layerwise"
            layer_hooks.runtimes.register(self.layerwise_runtime, _LayerHooks(self))
        self.kvpp_runtime: str | None = None
        self._kvpp: KVPPRuntime | None = None
        self._kvpp_totals = Counters(_KVPP_TOTALS)
        self._kvpp_group: KVPPGroup | None = None
        if self._kvpp_cfg is not None:
            from torch_kvoffload.kvpp import create_kvpp_group

            cfg = self._kvpp_cfg
            try:
                self._kvpp_group = create_kvpp_group(
                    dp=1, pp=1, pcp=cfg.pcp_size, tp=cfg.tp_size, device=spec.device
                )
            except BaseException:
                self.close()
                raise
            self.kvpp_runtime = f"{self.name}/kvpp"
        #: the P/D role (``integrations.hf.pd``) when ``config.pd`` is set
        self.pd: Any = None
        if config.pd is not None:
            from torch_kvoffload.integrations.hf.pd import make_role

            try:
                self.pd = make_role(self, config.pd)
            except BaseException:
                self.close()
                raise

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadSession:
        """A new, empty session for a deep copy of the model: the spec (its attention modules mapped through
        ``memo`` to the copy's; the copy has these weights, so the same weights fingerprint) and config
        copied, its own runtimes and store, no sequence. A KVPP or P/D
        session is not copied (``NotImplementedError``): its peers would not know of the copy."""
        if self.kvpp_on or self.pd is not None:
            raise NotImplementedError(
                f"copy.deepcopy of an offloaded {self.spec.model_class} with KVPP or P/D is not supported: the "
                "copy would need its own process group / peer; offload a fresh model on every rank instead"
            )
        new = object.__new__(type(self))
        memo[id(self)] = new  # the spec's attention modules refer back to the session
        new.__init__(copy.deepcopy(self.spec, memo), copy.deepcopy(self.config, memo))
        return new

    # ------------------------------------------------------------------------------------ sizing
    @property
    def blocks_per_request(self) -> int:
        """Blocks of ``block_size`` tokens each request owns in the paged caches (0 before sizing)."""
        return -(-self._max_tokens // self.block_size) if self._max_tokens else 0

    @property
    def reserved_tokens(self) -> int:
        """Tokens per request the device caches are sized for (0 before sizing)."""
        return self._kv_rows

    def plan_generation(self, batch: int, max_tokens: int) -> None:
        """The next sequence is a ``generate`` of ``batch`` requests of at most ``max_tokens`` tokens
        (prompt width + ``max_new_tokens``, padding included). Its last token is sampled and never fed
        back, so a forward on a fresh cache with ``batch`` rows sizes the caches for ``max_tokens - 1``
        tokens, until the next plan (``generate(use_cache=False)`` starts a sequence every step: they all
        keep that size)."""
        where = "OffloadSession.plan_generation"
        batch = check_int(where, "batch", batch, minimum=1)
        max_tokens = check_int(where, "max_tokens", max_tokens, minimum=1)
        self._planned = (batch, max(1, max_tokens - 1))

    def reserve(self, batch: int, max_tokens: int) -> None:
        """Size the buffers, host pool and indexer cache for ``batch`` requests of ``max_tokens`` tokens.

        Between sequences the caches are resized to exactly this (grown or shrunk; a P/D session keeps
        sizes that suffice), and the next sequence is planned at this size. While a sequence runs, only
        growth of that sequence: see :meth:`_grow`.
        """
        where = "OffloadSession.reserve"
        batch = check_int(where, "batch", batch, minimum=1)
        max_tokens = check_int(where, "max_tokens", max_tokens, minimum=1)
        if self._fwd is not None:
            raise RuntimeError(f"{where}: a forward is running")
        if self._closed:
            raise RuntimeError(f"{where}: the session is closed")
        if self._live():
            self._grow(batch, max_tokens)
            return
        self._size(batch, max_tokens)
        self._planned = (batch, max_tokens)

    def _live(self) -> bool:
        """Whether a sequence holds KV (its requests own host-pool blocks or tails)."""
        return bool(self._tokens) and self._seen > 0

    def _built(self) -> bool:
        return (
            self._batch > 0
            and (not self.sparse_on or self.resident_on or self._sparse is not None)
            and (not self.resident_on or bool(self._resident))
            and (not self.kvpp_on or self._kvpp is not None)
        )

    def _size(self, batch: int, tokens: int) -> None:
        """Between sequences: caches for ``batch`` requests of ``tokens`` tokens (see :meth:`reserve`)."""
        same = batch == self._batch and (
            tokens == self._kv_rows or (self.pd is not None and tokens <= self._kv_rows)
        )
        if not (same and self._built()):
            self._build(batch, tokens)
        elif self.layerwise_on and self._rt is None:
            self._build_layerwise()

    def _grow(self, batch: int, tokens: int) -> None:
        """The running sequence needs ``tokens`` tokens per request: grow the device caches in place.

        Layer buffers and tails (layerwise) hold nothing a later forward needs except the tails, which are
        copied; the sparse indexer cache is copied into the larger one and the hot buffers reallocated
        (their rows reload from the host pool). The host pool, a KVPP runtime and a P/D session keep the
        sizes of the sequence's first forward: outgrowing them is a ``ValueError``.
        """
        if batch != self._batch:
            raise ValueError(
                f"OffloadSession: the running sequence has {self._batch} requests, got a batch of {batch}"
            )
        if tokens <= self._kv_rows:
            return
        fixed = (
            self.kvpp_on
            or self.pd is not None
            or (self._sparse is not None and tokens > self._sparse.pool.reserved_tokens(self._request_ids[0]))
        )
        if fixed:
            raise ValueError(
                f"OffloadSession: the running sequence needs {tokens} tokens per request but {self._kv_rows} "
                "were reserved; pass max_new_tokens to generate() (or call reserve() before the first forward)"
            )
        old_rows, old_M = self._kv_rows, self.blocks_per_request
        self._kv_rows = tokens
        self._max_tokens = max(self._max_tokens, -(-tokens // self.block_size) * self.block_size)
        try:
            if self._rt is not None and self.blocks_per_request != old_M:
                self._retire_layerwise(self._rt)
                self._rt = None
                self._build_layerwise()
            elif self._tails:
                self._build_tails()
            if self.sparse_on:
                self._grow_sparse(old_rows)
        except BaseException:  # e.g. out of memory: the sequence cannot continue
            self._fail_sequence()
            self._discard_caches()
            raise
        self.counters.add("resizes")
        logger.info(
            "offload session %s: the running sequence grew to %d tokens per request, device KV %d bytes",
            self.name, tokens, self.device_kv_bytes(),
        )  # fmt: skip

    def _hot_sizes(self, top_k: int, capacity: int) -> tuple[int, int]:
        """``(top_k, capacity)`` of the hot buffers for requests of :attr:`reserved_tokens` tokens: a
        request never has more rows than that, and a top-k covering its whole context selects what the
        configured one would (every row)."""
        k = min(top_k, self._kv_rows)
        return k, max(k, min(capacity, self._kv_rows))

    def _index_paging(self) -> tuple[int, int]:
        """``(rows per page, pages per request)`` of the sparse indexer cache: one page of exactly
        :attr:`reserved_tokens` rows per request, or the session's blocks on a P/D session (the prefill
        peer writes indexer keys block by block)."""
        if self.pd is not None:
            return self.block_size, self.blocks_per_request
        return self._kv_rows, 1

    def _new_index_cache(self) -> list[tuple[torch.Tensor, ...]]:
        spec, dev = self.spec, self.spec.device
        page, pages = self._index_paging()
        n = self._batch * pages
        if self.int8_indexer:
            return [
                (
                    torch.zeros(n, page, spec.index_head_dim, dtype=torch.int8, device=dev),
                    torch.zeros(n, page, dtype=torch.float32, device=dev),
                )
                for _ in range(spec.num_layers)
            ]
        return [
            (torch.zeros(n, page, spec.index_head_dim, dtype=spec.dtype, device=dev),)
            for _ in range(spec.num_layers)
        ]

    def _new_resident(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the resident main KV ``(kv_c [pages, page, Dc], k_pe [pages, page, Dr])`` in the model
        dtype, paged as the indexer cache (one page of :attr:`reserved_tokens` rows per request)."""
        spec, dev = self.spec, self.spec.device
        page, pages = self._index_paging()
        n = self._batch * pages
        return [
            (
                torch.zeros(n, page, spec.kv_lora_rank, dtype=spec.dtype, device=dev),
                torch.zeros(n, page, spec.rope_dim, dtype=spec.dtype, device=dev),
            )
            for _ in range(spec.num_layers)
        ]

    def _copy_rows(self, old_caches, new_caches, old_rows: int) -> None:
        """Copy each request's rows from caches paged ``old_rows`` per request into the current paging."""
        page, pages = self._index_paging()
        for old_layer, new_layer in zip(old_caches, new_caches, strict=True):
            for src, dst in zip(old_layer, new_layer, strict=True):
                s = src.view(self._batch * old_rows, *src.shape[2:])
                d = dst.view(self._batch * pages * page, *dst.shape[2:])
                for r, toks in enumerate(self._tokens):
                    n, at = len(toks), r * pages * page
                    d[at : at + n] = s[r * old_rows : r * old_rows + n]

    def _grow_sparse(self, old_rows: int) -> None:
        """Indexer cache, resident main KV and hot buffers for the grown :attr:`reserved_tokens` (see
        :meth:`_grow`)."""
        old, self._index_cache = self._index_cache, self._new_index_cache()
        self._copy_rows(old, self._index_cache, old_rows)
        if self.resident_on:
            old_main, self._resident = self._resident, self._new_resident()
            self._copy_rows(old_main, self._resident, old_rows)
        sp = self._sparse
        if sp is None:
            return
        cfg = sp.config
        k, cap = self._hot_sizes(cfg.top_k, cfg.hot_capacity)
        if (k, cap) != (sp.top_k, sp.capacity):
            sp.resize_hot(cap, k)

    @staticmethod
    def _check_resident_dtype(spec: ModelSpec, config: OffloadConfig) -> None:
        """The resident main KV is kept in the model's dtype: a different ``sparse.kv_dtype`` is refused."""
        from torch_kvoffload._utils import dtype_name, parse_dtype

        assert config.sparse is not None
        want = config.sparse.kv_dtype
        if want is not None and parse_dtype("sparse.kv_dtype", want) != spec.dtype:
            raise ValueError(
                f"OffloadConfig.sparse: offload=False keeps the main KV resident in the model's dtype "
                f"{dtype_name(spec.dtype)}; got kv_dtype={want!r}"
            )

    @property
    def _resident_top_k(self) -> int:
        """Top-k of the resident sparse attention: the configured one (default the model's
        ``index_topk``), at most :attr:`reserved_tokens` (a top-k covering every row selects them all)."""
        assert self.config.sparse is not None
        top_k = self.config.sparse.top_k or self.spec.index_topk
        return min(top_k, self._kv_rows)

    def _build(self, batch: int, tokens: int) -> None:
        """Allocate every cache for ``batch`` requests of ``tokens`` tokens (between sequences)."""
        spec, bs = self.spec, self.block_size
        M = -(-tokens // bs)
        nb = batch * M
        self._discard_caches()
        self._batch, self._kv_rows, self._max_tokens = batch, tokens, M * bs
        try:
            if self.layerwise_on:
                self._build_layerwise()
            if self.kvpp_on:
                self._build_kvpp(nb)
            if self.resident_on:
                self._index_cache = self._new_index_cache()
                self._resident = self._new_resident()
            elif self.sparse_on:
                from torch_kvoffload.sparse.runtime import SparseDecodeOffload

                scfg = self.config.sparse_config(spec, host_pool_blocks=nb)
                k, cap = self._hot_sizes(scfg.top_k, scfg.hot_capacity)
                scfg = scfg.model_copy(update={"top_k": k, "capacity": cap})
                self._sparse = SparseDecodeOffload(
                    scfg, num_layers=spec.num_layers, max_rows=batch, kv_lora_rank=spec.kv_lora_rank,
                    rope_dim=spec.rope_dim, device=spec.device,
                )  # fmt: skip
                self._index_cache = self._new_index_cache()
        except BaseException:
            self._discard_caches()
            raise
        self.counters.add("resizes")
        logger.info(
            "offload session %s: %d requests x %d tokens, device KV %d bytes",
            self.name, batch, tokens, self.device_kv_bytes(),
        )  # fmt: skip

    def _discard_caches(self) -> None:
        """Free every cache (the session is unsized afterwards); the sequence's requests go with them."""
        rt, sp = self._rt, self._sparse
        self._rt = self._sparse = None
        self._index_cache, self._tails, self._reserved, self._resident = [], [], [], []
        self._batch = self._kv_rows = self._max_tokens = 0
        try:
            if rt is not None:
                self._retire_layerwise(rt)
        finally:
            if sp is not None:
                sp.close()

    def _build_layerwise(self) -> None:
        """The layerwise runtime (physical layer buffers) and tails for the reserved sizes."""
        spec, bs, batch = self.spec, self.block_size, self._batch
        dev, dt = spec.device, spec.dtype
        nb = batch * self.blocks_per_request
        idx = (TensorSpec((nb, bs, spec.index_head_dim), dt),) if self._lw_indexer else None
        main = (TensorSpec((nb, bs, spec.kv_lora_rank), dt), TensorSpec((nb, bs, spec.rope_dim), dt))
        specs = [LayerCacheSpec(main, idx) for _ in range(spec.num_layers)]
        lw = self.config.layerwise
        # the architecture, the weights (fine-tunes of one architecture never share KV) and the components
        parts = (lw.model_id, spec.fingerprint, spec.weights_fingerprint, "i" if self._lw_indexer else "m")
        model_id = "/".join(p for p in parts if p)
        lw = lw.model_copy(update={"model_id": model_id})
        if self.pd is not None and hasattr(self.pd, "build_runtime"):
            self._rt = self.pd.build_runtime(lw, specs, store=self._store)
        else:
            self._rt = lw.build_runtime(specs, device=dev, store=self._store)
        self._build_tails()

    @property
    def _tail_rows(self) -> int:
        """Rows per request of a tail: a partial block, never more than a request's tokens."""
        return min(self.block_size, self._kv_rows)

    def _build_tails(self) -> None:
        """Per-layer tails ``[batch, tail rows, D]`` for the current sizes; rows already kept are copied."""
        spec, batch, rows = self.spec, self._batch, self._tail_rows
        if self._tails and self._tails[0][0].shape[:2] == (batch, rows):
            return
        widths = [spec.kv_lora_rank, spec.rope_dim] + ([spec.index_head_dim] if self._lw_indexer else [])
        old = self._tails if self._tails and self._tails[0][0].shape[0] == batch else []
        self._tails = [
            tuple(torch.zeros(batch, rows, w, dtype=spec.dtype, device=spec.device) for w in widths)
            for _ in range(spec.num_layers)
        ]
        for new_layer, old_layer in zip(self._tails, old, strict=False):
            for t, o in zip(new_layer, old_layer, strict=True):
                n = min(rows, o.shape[1])
                t[:, :n] = o[:, :n]

    def _build_kvpp(self, num_blocks: int) -> None:
        """This rank's KVPP runtime: one bundle per layer (``c_kv``, ``k_pe`` [, ``index_k``], the model's
        dtype, ``[num_blocks, block_size, D]`` each), owned layers persistent, the others in scratch."""
        from torch_kvoffload.kvpp import BundleSpec

        self._retire_kvpp()
        spec = self.spec
        assert self._kvpp_cfg is not None and self._kvpp_group is not None
        bundle = BundleSpec.mla(
            self.block_size, spec.kv_lora_rank, spec.rope_dim, spec.dtype,
            index_dim=spec.index_head_dim if spec.has_indexer else 0, index_dtype=spec.dtype,
        )  # fmt: skip
        self._kvpp = self._kvpp_cfg.build_runtime(
            self._kvpp_group, dict.fromkeys(range(spec.num_layers), bundle), num_blocks=num_blocks,
            device=spec.device, name=self.kvpp_runtime,
        )  # fmt: skip

    def _retire_kvpp(self) -> None:
        rt, self._kvpp = getattr(self, "_kvpp", None), None
        if rt is None:
            return
        snap = rt.counters.snapshot()
        for k in _KVPP_TOTALS:
            self._kvpp_totals.add(k, snap.get(k, 0))
        rt.close()

    def _retire_layerwise(self, rt: LayerwiseOffloadRuntime) -> None:
        snap = rt.counters.snapshot()
        for k in _LAYERWISE_TOTALS:
            self._lw_totals.add(k, snap.get(k, 0))
        rt.close()

    # ---------------------------------------------------------------------------------- the cache
    def new_cache(self) -> Any:
        """A fresh ``transformers.Cache`` bound to this session (holds no KV itself)."""
        from torch_kvoffload.integrations.hf.cache import new_offload_cache

        return new_offload_cache(self)

    def layer_caches(self, layer: int) -> list[torch.Tensor]:
        """The tensors passed as ``caches`` to every op of ``layer``: the layer buffer's components
        (layerwise), then the indexer cache and the hot buffers (sparse). Empty before the first forward."""
        self._check_layer("layer_caches", layer)
        out: list[torch.Tensor] = []
        if self._rt is not None:
            out += list(self._rt.layer_caches(layer))
        if self._kvpp is not None:
            out += self._kvpp.caches(layer)
        if self._sparse is not None:
            out += [*self._index_cache[layer], self._sparse.hot_kv_c[layer], self._sparse.hot_k_pe[layer]]
        if self._resident:
            out += [*self._index_cache[layer], *self._resident[layer]]
        return out

    def _paged(self, layer: int) -> list[torch.Tensor]:
        """The layer's paged ``[num_blocks, block_size, D]`` components this forward reads and writes:
        the layerwise buffer, or the KVPP view (owned: persistent; otherwise a scratch buffer)."""
        if self._kvpp is not None:
            return self._kvpp.caches(layer)
        assert self._rt is not None
        return list(self._rt.layer_caches(layer))

    def _check_layer(self, fn: str, layer: object) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.spec.num_layers:
            raise ValueError(
                f"OffloadSession.{fn}: layer must be an int in [0, {self.spec.num_layers}), got {layer!r}"
            )
        return layer

    # --------------------------------------------------------------------------------- forwards
    def begin_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache_position: torch.Tensor | None = None,
        *,
        past: int | None = None,
        owner: Any = None,
    ) -> None:
        """Start a forward of ``input_ids int64 [B, S]``.

        ``attention_mask [B, past + S]`` (0 = padding; only left padding) or ``None`` (no padding).
        ``past`` (tokens already seen, padding included) defaults to ``cache_position[0]``, else the
        session's count; ``past == 0`` ends the previous sequence and starts a new one (sizing the caches
        for it, see the module docstring). ``owner``: the cache object of the
        sequence (a later forward with another owner and ``past > 0`` is an error).
        """
        if self._closed:
            raise RuntimeError("OffloadSession.begin_forward: the session is closed")
        if self._fwd is not None:
            raise RuntimeError("OffloadSession.begin_forward: a forward is running; call end_forward()")
        if (
            not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or input_ids.dtype.is_floating_point
        ):
            raise ValueError(
                f"OffloadSession.begin_forward: 'input_ids' must be an int tensor [B, S], got "
                f"{getattr(input_ids, 'dtype', type(input_ids))} {list(getattr(input_ids, 'shape', []))}"
            )
        B, S = input_ids.shape
        if S == 0:
            raise ValueError("OffloadSession.begin_forward: 'input_ids' has no positions")
        if past is None:
            past = (
                int(cache_position[0]) if cache_position is not None else (self._seen if self._tokens else 0)
            )
        if past < 0:
            raise ValueError(f"OffloadSession.begin_forward: past must be >= 0, got {past}")
        if past == 0:
            # a fresh forward ends the previous sequence (its requests are released), even one rejected below
            self.end_sequence()
        if past > 0:
            if self._broken:
                raise RuntimeError(
                    "OffloadSession.begin_forward: an earlier forward of this sequence failed; start a new one"
                )
            if owner is not None and owner is not self._owner:
                raise ValueError(
                    "OffloadSession.begin_forward: this cache's sequence is not the one the session holds "
                    "(a session serves one sequence at a time)"
                )
            if past != self._seen or len(self._tokens) != B:
                raise ValueError(
                    f"OffloadSession.begin_forward: the sequence has {len(self._tokens)} requests and {self._seen} "
                    f"positions, got a batch of {B} with past={past}"
                )
        if attention_mask is None:
            new_mask = torch.ones(B, S, dtype=torch.bool)
        else:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, past + S):
                raise ValueError(
                    f"OffloadSession.begin_forward: 'attention_mask' must be a 2-D tensor [B, past + S] = "
                    f"[{B}, {past + S}], got {getattr(attention_mask, 'shape', type(attention_mask))}"
                )
            new_mask = attention_mask[:, past:].to("cpu").bool()
        if past > 0 and not bool(new_mask.all()):
            raise ValueError(
                "OffloadSession.begin_forward: padding after the first forward is not supported (only left "
                "padding of the prompt)"
            )
        if past == 0:
            monotone = bool((new_mask[:, 1:].int() >= new_mask[:, :-1].int()).all()) if S > 1 else True
            if not monotone or not bool(new_mask[:, -1].all()):
                raise ValueError(
                    "OffloadSession.begin_forward: 'attention_mask' must be left padding (zeros, then ones, "
                    "every row ending with a real token)"
                )
        ids_cpu = input_ids.to("cpu")
        n_new = new_mask.sum(dim=1).tolist()
        old_len = [0] * B if past == 0 else [len(t) for t in self._tokens]
        new_len = [o + n for o, n in zip(old_len, n_new, strict=True)]
        # sizing: a fresh forward sizes the caches for its sequence; a later one may only grow it
        if past == 0:
            want = max(new_len)
            if self._planned is not None and self._planned[0] == B:
                want = max(want, self._planned[1])
            self._size(B, want)
        elif max(new_len) > self._kv_rows:
            self._grow(B, max(new_len))
        decode = self.sparse_on and past > 0 and S == 1
        if decode and self._rt is not None:
            # prefill is over: decode reads the host pool and the hot buffers only
            self._retire_layerwise(self._rt)
            self._rt, self._tails = None, []
        layerwise = self.layerwise_on and not decode and self._rt is not None
        if past == 0:
            self._start_sequence(B, owner)
        for b in range(B):
            self._tokens[b].extend(ids_cpu[b][new_mask[b]].tolist())
        self._fwd = self._plan_forward(B, S, past, decode, layerwise, new_mask, old_len, new_len)
        self.counters.add("forwards")
        self.counters.add("decode_forwards" if decode else "prefill_forwards")
        if layerwise:
            try:
                self._begin_layerwise(self._fwd)
            except BaseException:
                self._fwd = None
                self._fail_sequence()
                raise
        if self._kvpp is not None:
            try:
                self._kvpp.scheduler.begin_forward(any(old_len), self._history_blocks(old_len))
            except BaseException:
                f, self._fwd = self._fwd, None
                self._close_failed_forward(f)
                self._fail_sequence()
                raise

    def _history_blocks(self, old_len: list[int]) -> torch.Tensor:
        """``int64 [B, M]``: per request the blocks holding its tokens before this forward, ``-1`` padded:
        what a KVPP broadcast must bring (every rank writes the forward's new rows itself)."""
        bs, M = self.block_size, self.blocks_per_request
        table = torch.full((len(old_len), M), -1, dtype=torch.int64)
        for r, old in enumerate(old_len):
            n = -(-old // bs)
            table[r, :n] = torch.arange(r * M, r * M + n)
        return table

    def end_sequence(self) -> None:
        """Release the running sequence's requests (host-pool blocks, residency rows); the caches stay
        sized for the next sequence. A forward continuing the released sequence is an error. Called by
        every forward that starts a new sequence and when a forward fails; idempotent."""
        reserved, self._reserved = self._reserved, []
        sp = self._sparse
        if sp is not None and reserved:
            try:
                for rid in reserved:
                    sp.release(rid)
            except Exception as exc:  # a failed transfer: drop the runtime rather than keep its blocks
                logger.warning(
                    "offload session %s: releasing requests failed (%s); caches rebuilt", self.name, exc
                )
                self._discard_caches()
        self._tokens, self._seen, self._owner = [], 0, None

    def _fail_sequence(self) -> None:
        """A forward of the running sequence failed: release its requests; it cannot continue."""
        self.counters.add("failed_forwards")
        try:
            self.end_sequence()
        finally:
            self._broken = True

    def _start_sequence(self, B: int, owner: Any) -> None:
        self.end_sequence()
        self._tokens = [[] for _ in range(B)]
        self._request_ids = list(range(self._next_request, self._next_request + B))
        self._next_request += B
        self._seen = 0
        self._owner = owner
        self._broken = False
        if self._sparse is not None:
            try:
                for rid in self._request_ids:
                    self._sparse.reserve(rid, self._max_tokens)
                    self._reserved.append(rid)
            except BaseException:
                self._fail_sequence()
                raise

    def _plan_forward(self, B, S, past, decode, layerwise, new_mask, old_len, new_len) -> _Forward:
        dev, bs = self.spec.device, self.block_size
        M = self.blocks_per_request
        flat = new_mask.reshape(-1)
        sel = torch.nonzero(flat).reshape(-1)
        row = sel // S
        rank = torch.cumsum(new_mask.int(), dim=1) - 1  # index among the row's new tokens
        pos = torch.tensor(old_len, dtype=torch.int64)[row] + rank.reshape(-1)[sel].to(torch.int64)
        phys = row * (M * bs) + pos
        n_new = [n - o for o, n in zip(old_len, new_len, strict=True)]
        cu = torch.tensor([0, *itertools.accumulate(n_new)], dtype=torch.int32)
        table = torch.arange(B, dtype=torch.int32)[:, None] * M + torch.arange(M, dtype=torch.int32)[None, :]
        page, pages = self._index_paging() if self.sparse_on else (bs, M)
        index_table = (
            torch.arange(B, dtype=torch.int32)[:, None] * pages
            + torch.arange(pages, dtype=torch.int32)[None, :]
        )
        return _Forward(
            B=B, S=S, past=past, decode=decode, layerwise=layerwise, old_len=old_len, new_len=new_len,
            sel=sel.to(dev), pos=pos.to(dev), row=row.to(dev), phys=phys.to(dev),
            block_table=table.to(dev), index_table=index_table.to(dev),
            index_phys=(row * (pages * page) + pos).to(dev), cu_seqlens_q=cu.to(dev),
            seq_lens_k=torch.tensor(new_len, dtype=torch.int32).to(dev),
        )  # fmt: skip

    def _begin_layerwise(self, f: _Forward, max_cached_tokens: list[int] | None = None) -> None:
        rt = self._rt
        assert rt is not None
        bs, M, tr = self.block_size, self.blocks_per_request, self._tail_rows
        table = f.block_table.cpu().tolist()
        if self.pd is not None and hasattr(self.pd, "begin_forward"):
            self.pd.begin_forward(table)
        try:
            caps = {} if max_cached_tokens is None else {"max_cached_tokens": max_cached_tokens}
            cached = rt.begin_forward([list(t) for t in self._tokens], table, **caps)
        except BaseException:
            if self.pd is not None and hasattr(self.pd, "end_forward"):
                self.pd.end_forward()
            raise
        restore_src, restore_dst, keep_src, keep_dst = [], [], [], []
        for r, (c, old, new) in enumerate(zip(cached, f.old_len, f.new_len, strict=True)):
            full_old = old // bs * bs
            if old > 0 and c < full_old:
                rt.end_forward()
                raise RuntimeError(
                    f"OffloadSession: the host store no longer holds blocks of request {r} ({c} of {full_old} "
                    "cached tokens found); raise the store capacity (layerwise.store.capacity_bytes)"
                )
            for p in range(max(c, full_old), old):  # rows of the partial block kept in the tail
                restore_src.append(r * tr + p - full_old)
                restore_dst.append(r * M * bs + p)
            full_new = new // bs * bs
            for p in range(full_new, new):
                keep_src.append(r * M * bs + p)
                keep_dst.append(r * tr + p - full_new)
        dev = self.spec.device
        f.cached = cached
        f.write = f.pos >= torch.tensor(cached, dtype=torch.int64, device=dev)[f.row]
        if restore_src:
            f.tail_restore = (torch.tensor(restore_src, device=dev), torch.tensor(restore_dst, device=dev))
        if keep_src:
            f.tail_keep = (torch.tensor(keep_src, device=dev), torch.tensor(keep_dst, device=dev))

    def run_forward(
        self,
        body: Callable[[], T],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache_position: torch.Tensor | None = None,
        *,
        past: int | None = None,
        owner: Any = None,
    ) -> T:
        """:meth:`begin_forward`, ``body()`` (the model's forward), :meth:`end_forward`; a ``body`` that
        raises aborts the forward (:meth:`abort_forward`) and the error propagates.

        Except when blocks of the prefix the layerwise lookup found cannot be loaded when their layer
        needs them (a record that fails its checksum or size on a store that checks at read time, a store
        read that failed, a block evicted in between: :class:`PrefixEvictedError`): then the forward runs
        again, each request's prefix cut at its first missing block (every later block of the chained
        prefix is computed too), and returns what the unmodified model would. Counted in
        ``forward_retries``. Only where the rows before the forward are all in whole blocks the cut keeps
        (any forward that starts a sequence); otherwise the error propagates as for any other failure.
        """
        self.begin_forward(input_ids, attention_mask, cache_position, past=past, owner=owner)
        caps: list[int] | None = None
        while True:
            f = self._fwd
            try:
                out = body()
            except BaseException as exc:
                caps = self._retry_caps(f, caps, exc)
                if caps is None:
                    self.abort_forward()
                    raise
                try:
                    self._retry_layerwise(f, caps)
                except BaseException:
                    self._fwd = None
                    self._fail_sequence()
                    raise
                continue
            self.end_forward()
            return out

    def _retry_caps(self, f: _Forward | None, caps: list[int] | None, exc: BaseException) -> list[int] | None:
        """The prefix caps of the next try of layerwise forward ``f``, which raised ``exc``; ``None`` when
        it cannot run again (another error, a P/D role, blocks of the requests' earlier tokens missing, or
        earlier tokens in a partial block whose device tail the failed try may have overwritten)."""
        from torch_kvoffload.layerwise.runtime import PrefixEvictedError

        rt = self._rt
        if not isinstance(exc, PrefixEvictedError) or f is None or f is not self._fwd or rt is None:
            return None
        if not f.layerwise or self.pd is not None or len(exc.usable_tokens) != len(f.cached):
            return None
        if any(old % self.block_size for old in f.old_len):
            return None
        if any(u < old for u, old in zip(exc.usable_tokens, f.old_len, strict=True)):
            return None
        return rt.retry_caps(f.cached, caps, exc)

    def _retry_layerwise(self, f: _Forward, caps: list[int]) -> None:
        """Close ``f``'s failed layerwise forward and begin it again with the prefixes capped at ``caps``."""
        assert self._rt is not None
        self._rt.end_aborted_forward()
        f.cached, f.write, f.tail_restore, f.tail_keep = [], None, None, None
        self._begin_layerwise(f, caps)

    def end_forward(self) -> None:
        """Finish the forward: wait for its layerwise transfers (raising the first failure)."""
        f = self._fwd
        if f is None:
            raise RuntimeError("OffloadSession.end_forward: no forward is running")
        self._fwd = None
        try:
            if f.layerwise and self._rt is not None:
                self._rt.end_forward()
            if self._kvpp is not None:
                self._kvpp.scheduler.end_forward()
        except BaseException:
            self._fail_sequence()
            raise
        finally:
            if f.layerwise and self.pd is not None and hasattr(self.pd, "end_forward"):
                self.pd.end_forward()
        self._seen = f.past + f.S

    def abort_forward(self) -> None:
        """Close a forward that raised and release its sequence's requests; the sequence cannot continue
        (the next forward must start anew). Idempotent."""
        f, self._fwd = self._fwd, None
        self._close_failed_forward(f)
        self._fail_sequence()

    def _close_failed_forward(self, f: _Forward | None) -> None:
        """End the runtimes' part of a failed forward ``f``; their errors are logged (the forward's own
        error is the one reported)."""
        if f is None:
            return
        steps = []
        if f.layerwise and self._rt is not None:
            steps.append(("layerwise", self._rt.end_forward))
        if self._kvpp is not None:
            steps.append(("KVPP", self._kvpp.scheduler.end_forward))
        if f.layerwise and self.pd is not None and hasattr(self.pd, "end_forward"):
            steps.append(("P/D", self.pd.end_forward))
        for what, step in steps:
            try:
                step()
            except Exception as exc:
                logger.warning("offload session %s: closing a failed %s forward: %s", self.name, what, exc)

    def _need(self, fn: str, layer: int) -> _Forward:
        if self._fwd is None:
            raise RuntimeError(f"OffloadSession.{fn}: no forward is running; call begin_forward()")
        self._check_layer(fn, layer)
        return self._fwd

    # ------------------------------------------------------------------------------- cache write
    def cache_write(
        self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor, index_k: torch.Tensor | None
    ) -> None:
        """Store this forward's new rows of ``layer`` (``kv_c [B,S,Dc]``, ``k_pe [B,S,Dr]``,
        ``index_k [B,S,Di]`` or None) where the configuration keeps them."""
        f = self._need("cache_write", layer)
        spec = self.spec
        if kv_c.shape != (f.B, f.S, spec.kv_lora_rank) or k_pe.shape != (f.B, f.S, spec.rope_dim):
            raise ValueError(
                f"kvoffload::mla_cache_write: 'kv_c' / 'k_pe' must be [{f.B}, {f.S}, {spec.kv_lora_rank}] / "
                f"[{f.B}, {f.S}, {spec.rope_dim}], got {list(kv_c.shape)} / {list(k_pe.shape)}"
            )
        needs_index = spec.has_indexer
        if needs_index and (index_k is None or index_k.shape != (f.B, f.S, spec.index_head_dim)):
            raise ValueError(
                f"kvoffload::mla_cache_write: 'index_k' must be [{f.B}, {f.S}, {spec.index_head_dim}] for "
                f"{spec.model_class}, got {None if index_k is None else list(index_k.shape)}"
            )
        rows_c = kv_c.reshape(-1, spec.kv_lora_rank)[f.sel].to(spec.dtype)
        rows_pe = k_pe.reshape(-1, spec.rope_dim)[f.sel].to(spec.dtype)
        rows_i = index_k.reshape(-1, spec.index_head_dim)[f.sel] if needs_index else None
        if f.layerwise:
            assert self._rt is not None
            comps = [c.view(-1, c.shape[-1]) for c in self._rt.layer_caches(layer)]
            tails = [t.view(-1, t.shape[-1]) for t in self._tails[layer]]
            news = [rows_c, rows_pe] + ([rows_i.to(spec.dtype)] if self._lw_indexer else [])
            assert f.write is not None
            w = f.write
            for comp, tail, new in zip(comps, tails, news, strict=True):
                if f.tail_restore is not None:
                    comp.index_copy_(0, f.tail_restore[1], tail[f.tail_restore[0]])
                comp.index_copy_(0, f.phys[w], new[w])
                if f.tail_keep is not None:
                    tail.index_copy_(0, f.tail_keep[1], comp[f.tail_keep[0]])
        elif self._kvpp is not None:
            news = [rows_c, rows_pe] + ([rows_i.to(spec.dtype)] if needs_index else [])
            for comp, new in zip(self._kvpp.caches(layer), news, strict=True):
                comp.view(-1, comp.shape[-1]).index_copy_(0, f.phys, new)
        if self._resident:
            kv_c_pages, k_pe_pages = self._resident[layer]
            kv_c_pages.view(-1, spec.kv_lora_rank).index_copy_(0, f.index_phys, rows_c)
            k_pe_pages.view(-1, spec.rope_dim).index_copy_(0, f.index_phys, rows_pe)
        if self._sparse is not None:
            ids = [self._request_ids[r] for r in f.row.tolist()]
            self._sparse.append(layer, ids, f.pos, rows_c, rows_pe)
        if self.sparse_on:
            assert rows_i is not None
            cache = self._index_cache[layer]
            if self.int8_indexer:
                q8, sc = hadamard_quant_int8(rows_i)
                cache[0].view(-1, spec.index_head_dim).index_copy_(0, f.index_phys, q8)
                cache[1].view(-1).index_copy_(0, f.index_phys, sc)
            else:
                cache[0].view(-1, spec.index_head_dim).index_copy_(0, f.index_phys, rows_i.to(cache[0].dtype))
            if self._sparse is not None and not f.decode and not f.layerwise:
                f.new_rows[layer] = (rows_c, rows_pe)

    # --------------------------------------------------------------------------------- attention
    def cache_attention(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        index_q: torch.Tensor | None,
        index_weights: torch.Tensor | None,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Absorbed MLA attention of ``layer`` (see ``kvoffload::mla_cache_attention``)."""
        f = self._need("cache_attention", layer)
        spec = self.spec
        B, S, H = f.B, f.S, spec.num_heads
        if q_nope.shape != (B, S, H, spec.kv_lora_rank) or q_pe.shape != (B, S, H, spec.rope_dim):
            raise ValueError(
                f"kvoffload::mla_cache_attention: 'q_nope' / 'q_pe' must be [{B}, {S}, {H}, {spec.kv_lora_rank}] / "
                f"[{B}, {S}, {H}, {spec.rope_dim}], got {list(q_nope.shape)} / {list(q_pe.shape)}"
            )
        if spec.has_indexer and index_q is None:
            raise ValueError(
                f"kvoffload::mla_cache_attention: {spec.model_class} needs 'index_q' and 'index_weights'"
            )
        qn = q_nope.reshape(B * S, H, -1)[f.sel]
        qp = q_pe.reshape(B * S, H, -1)[f.sel]
        iq = iw = None
        if index_q is not None and index_weights is not None:
            iq = index_q.reshape(B * S, *index_q.shape[2:])[f.sel]
            iw = index_weights.reshape(B * S, -1)[f.sel].float()
        if f.decode and self._sparse is not None:
            res = self._decode_attention(layer, f, qn, qp, iq, iw, scale)
        else:
            kv_c, k_pe, base = self._key_rows(layer, f)
            if iq is not None:
                topk = self._select(layer, f, iq, iw)
                starts = torch.tensor(base, dtype=torch.int64, device=topk.device)
                req = torch.repeat_interleave(
                    torch.arange(B, device=topk.device),
                    f.cu_seqlens_q[1:].long() - f.cu_seqlens_q[:-1].long(),
                )
                idx = torch.where(topk >= 0, topk.long() + starts[req][:, None], -1).to(torch.int32)
                res = sparse_mla_attention(qn, qp, kv_c, k_pe, idx, scale)[0]
            else:
                res = self._dense_attention(f, qn, qp, kv_c, k_pe, base, scale)
        out.zero_()
        out.view(B * S, H, -1).index_copy_(0, f.sel, res.to(out.dtype))

    def _key_rows(self, layer: int, f: _Forward) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``(kv_c [N, Dc], k_pe [N, Dr], start of each request's row 0)`` for a multi-token forward."""
        spec, bs, M = self.spec, self.block_size, self.blocks_per_request
        if f.layerwise or self._kvpp is not None:
            c, pe = self._paged(layer)[:2]
            return c.view(-1, spec.kv_lora_rank), pe.view(-1, spec.rope_dim), [r * M * bs for r in range(f.B)]
        if self._resident:
            c, pe = self._resident[layer]
            page, pages = self._index_paging()
            starts = [r * pages * page for r in range(f.B)]
            return c.view(-1, spec.kv_lora_rank), pe.view(-1, spec.rope_dim), starts
        # sparse only: the forward's own rows, after each request's earlier rows read from the host pool
        assert self._sparse is not None
        rows_c, rows_pe = f.new_rows[layer]
        if f.past == 0:
            starts = [0, *itertools.accumulate(n - o for o, n in zip(f.old_len, f.new_len, strict=True))][:-1]
            return rows_c, rows_pe, starts
        self._sparse.sync()
        pool = self._sparse.pool
        host_c = pool.kv_c(layer).reshape(-1, spec.kv_lora_rank)
        host_pe = pool.k_pe(layer).reshape(-1, spec.rope_dim)
        parts_c, parts_pe, starts, off, pos = [], [], [], 0, 0
        for r, (old, new) in enumerate(zip(f.old_len, f.new_len, strict=True)):
            slots = pool.slots(self._request_ids[r], torch.arange(old))
            parts_c += [host_c[slots].to(spec.device), rows_c[pos : pos + new - old]]
            parts_pe += [host_pe[slots].to(spec.device), rows_pe[pos : pos + new - old]]
            self.counters.add("prefill_host_bytes_h2d", old * pool.row_bytes)
            starts.append(off)
            off += new
            pos += new - old
        return torch.cat(parts_c), torch.cat(parts_pe), starts

    def _index_cache_of(self, layer: int) -> tuple[torch.Tensor, ...]:
        if self.sparse_on:
            return self._index_cache[layer]
        if self._kvpp is not None:
            return (self._kvpp.caches(layer)[2],)
        assert self._rt is not None and self._lw_indexer
        return (self._rt.layer_caches(layer)[2],)

    def _select(self, layer: int, f: _Forward, iq: torch.Tensor, iw: torch.Tensor) -> torch.Tensor:
        """Top-k logical positions ``int32 [N, K]`` of a multi-token forward (−1 padded)."""
        if self._sparse is not None:
            top_k = self._sparse.top_k
        elif self.resident_on:
            top_k = self._resident_top_k
        else:
            top_k = self.spec.index_topk
        cache = self._index_cache_of(layer)
        table = f.index_table if self.sparse_on else f.block_table
        args = (table, f.cu_seqlens_q, f.seq_lens_k)
        if self.int8_indexer:
            q8, qs = hadamard_quant_int8(iq)
            return quant_lightning_indexer(q8, qs, iw, cache[0], cache[1], *args, top_k)
        return lightning_indexer(iq.to(cache[0].dtype), iw, cache[0], *args, top_k)

    def _decode_attention(self, layer, f, qn, qp, iq, iw, scale) -> torch.Tensor:
        from torch_kvoffload.sparse.runtime import DecodeRows, IndexerInputs

        sp = self._sparse
        assert sp is not None and iq is not None and iw is not None
        cache = self._index_cache[layer]
        common = dict(q=iq, weights=iw, block_table=f.index_table, cu_seqlens_q=f.cu_seqlens_q,
                      seq_lens_k=f.seq_lens_k)  # fmt: skip
        if self.int8_indexer:
            indexer = IndexerInputs(**common, k_int8_cache=cache[0], k_scale_cache=cache[1])
        else:
            common["q"] = iq.to(cache[0].dtype)
            indexer = IndexerInputs(**common, k_cache=cache[0])
        ids = torch.tensor(self._request_ids, dtype=torch.int64)
        rows = DecodeRows(
            request_ids=ids,
            stable_len=torch.tensor(f.new_len, dtype=torch.int64),
            host_block_table=sp.pool.block_table(self._request_ids, max_blocks=self.blocks_per_request),
        )
        return sp.attend(layer, qn.contiguous(), qp.contiguous(), scale, indexer, rows).out

    def _dense_attention(self, f, qn, qp, kv_c, k_pe, base, scale) -> torch.Tensor:
        """Causal absorbed attention over each request's rows ``[base, base + len)`` (fp32 softmax)."""
        out = torch.empty_like(qn)
        cu = f.cu_seqlens_q.tolist()
        for r in range(f.B):
            old, new = f.old_len[r], f.new_len[r]
            keys_c = kv_c[base[r] : base[r] + new].float()
            keys_pe = k_pe[base[r] : base[r] + new].float()
            kpos = torch.arange(new, device=qn.device)
            for q0 in range(cu[r], cu[r + 1], _DENSE_CHUNK):
                q1 = min(q0 + _DENSE_CHUNK, cu[r + 1])
                qpos = old + torch.arange(q0 - cu[r], q1 - cu[r], device=qn.device)
                s = torch.einsum("qhc,kc->qhk", qn[q0:q1].float(), keys_c)
                s = (s + torch.einsum("qhr,kr->qhk", qp[q0:q1].float(), keys_pe)) * scale
                s = s.masked_fill((kpos[None, :] > qpos[:, None])[:, None, :], -math.inf)
                out[q0:q1] = torch.einsum("qhk,kc->qhc", torch.softmax(s, dim=-1), keys_c).to(out.dtype)
        return out

    # ------------------------------------------------------------------------ KV placed from outside
    @property
    def layerwise_offload(self) -> LayerwiseOffloadRuntime | None:
        """The layerwise runtime over the current layer buffers (``None`` when off or released)."""
        return self._rt

    @property
    def sparse_offload(self) -> SparseDecodeOffload | None:
        """The sparse decode runtime (its ``pool`` is the host KV pool); ``None`` when off or not sized."""
        return self._sparse

    def indexer_caches(self) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, the device indexer cache of sparse offload: ``([num_pages, page, index_dim],)`` in the
        model dtype, or int8 keys and fp32 scales ``[num_pages, page]``. On a P/D session pages are the
        session's blocks and request ``r`` of the sequence owns blocks ``r * M .. r * M + M - 1`` (``M`` =
        :attr:`blocks_per_request`); otherwise request ``r`` owns page ``r`` of :attr:`reserved_tokens` rows."""
        return list(self._index_cache)

    @property
    def request_ids(self) -> list[int]:
        """The host-pool request id of each batch row of the running sequence."""
        return list(self._request_ids)

    def begin_external_sequence(self, tokens: list[list[int]], width: int, owner: Any) -> list[int]:
        """Start a sequence whose first ``width`` positions (padding included) were computed elsewhere.

        ``tokens[r]``: request ``r``'s real tokens (at most ``width``); ``owner``: the sequence's cache,
        whose ``seen_tokens`` the caller sets to ``width``. The caller places every request's main KV in the
        host pool (blocks ``sparse_offload.pool.blocks_of(request_ids[r])``) and indexer keys in
        :meth:`indexer_caches` before the next forward, which continues at ``past = width``. Needs sparse
        offload sized by :meth:`reserve`; returns :attr:`request_ids`.
        """
        where = "OffloadSession.begin_external_sequence"
        if self._fwd is not None:
            raise RuntimeError(f"{where}: a forward is running")
        if self._sparse is None:
            raise ValueError(f"{where}: needs sparse decode offload, sized by reserve(batch, max_tokens)")
        if len(tokens) != self._batch:
            raise ValueError(f"{where}: {len(tokens)} requests, {self._batch} were reserved")
        lens = [len(t) for t in tokens]
        if (
            not isinstance(width, int)
            or width < max(lens, default=0)
            or width >= self._kv_rows
            or min(lens) < 1
        ):
            raise ValueError(
                f"{where}: every request needs 1..width tokens and width < the reserved {self._kv_rows}; "
                f"got width={width!r}, lengths {lens}"
            )
        if self._rt is not None:  # decode continues on the sparse path only
            self._retire_layerwise(self._rt)
            self._rt, self._tails = None, []
        self._start_sequence(len(tokens), owner)
        self._tokens = [[int(x) for x in t] for t in tokens]
        self._seen = width
        return self.request_ids

    # ------------------------------------------------------------------------------ observability
    def device_kv_bytes(self) -> int:
        """Bytes of KV the session holds on the compute device now (from the allocated tensors): layer
        buffers and tails, hot buffers, indexer cache."""
        tensors: list[torch.Tensor] = []
        if self._rt is not None:
            for layer in range(self.spec.num_layers):
                tensors += list(self._rt.layer_caches(layer))
            for t in self._tails:
                tensors += list(t)
        if self._kvpp is not None:
            alloc = self._kvpp.allocation
            tensors += [*alloc.persistent.values(), *alloc.draft.values(), *alloc.scratch]
        if self._sparse is not None:
            tensors += [*self._sparse.hot_kv_c, *self._sparse.hot_k_pe]
        for t in [*self._index_cache, *self._resident]:
            tensors += list(t)
        return _nbytes(t for t in tensors if t.device.type == self.spec.device.type)

    def dense_kv_bytes(self) -> int:
        """What the unmodified model's cache holds for the tokens seen (padding included, as it counts)."""
        spec = self.spec
        per_token = spec.kv_lora_rank + spec.rope_dim + spec.index_head_dim
        return spec.num_layers * len(self._tokens) * self._seen * per_token * spec.dtype.itemsize

    def stats(self) -> dict[str, float]:
        """Counters and memory figures.

        ``device_kv_bytes``, ``dense_kv_bytes``; ``bytes_h2d`` / ``bytes_d2h`` (everything the session's
        copies moved: layer loads / saves, sparse misses / appends, chunked-prefill host reads);
        ``hits`` / ``misses`` / ``evictions`` (sparse residency); ``layer_loads`` / ``layer_saves``
        (layerwise per-layer transfers), ``store_hits`` / ``store_misses`` (blocks found / not found);
        ``corrupt_records`` (records of the session's store that failed their checksum or size: damaged or
        truncated, each a miss, recomputed) and ``store_errors`` (store calls that failed: backend gets /
        puts of a remote store, and lookups; each a miss or a dropped put) — the store's counts, so a store
        several sessions share reports theirs too; ``forward_retries`` (forwards run again because blocks
        of their prefix could not be loaded, see :meth:`run_forward`);
        ``forwards``, ``prefill_forwards``, ``decode_forwards``, ``failed_forwards``; ``resizes`` (times the
        device caches were allocated for new sizes, growth of a running sequence included),
        ``reserved_tokens`` (tokens per request they are sized for), ``reserved_requests`` (requests
        holding host-pool blocks) and ``resident_rows`` (residency rows held; both 0 once a sequence
        ended or failed). KVPP: ``broadcasts`` (layer broadcasts
        issued), ``bytes_broadcast``, ``kvpp_owned_layers`` (layers this rank stores persistently),
        ``kvpp_persistent_bytes`` / ``kvpp_scratch_bytes`` (this rank's owned bundles / its two scratch
        buffers; their sum is in ``device_kv_bytes``).
        """
        lw = self._lw_totals.snapshot()
        if self._rt is not None:
            snap = self._rt.counters.snapshot()
            lw = {k: lw[k] + snap.get(k, 0) for k in _LAYERWISE_TOTALS}
        sp = self._sparse.counters.snapshot() if self._sparse is not None else {}
        own = self.counters.snapshot()
        store = self._store.counters.snapshot() if self._store is not None else {}
        kv = self._kvpp_totals.snapshot()
        if self._kvpp is not None:
            snap = self._kvpp.counters.snapshot()
            kv = {k: kv[k] + snap.get(k, 0) for k in _KVPP_TOTALS}
        alloc = self._kvpp.allocation if self._kvpp is not None else None
        out = {
            "device_kv_bytes": self.device_kv_bytes(),
            "dense_kv_bytes": self.dense_kv_bytes(),
            "bytes_h2d": lw["bytes_loaded"] + sp.get("bytes_h2d", 0) + own["prefill_host_bytes_h2d"],
            "bytes_d2h": lw["bytes_saved"] + sp.get("bytes_d2h", 0),
            "hits": sp.get("hits", 0),
            "misses": sp.get("misses", 0),
            "evictions": sp.get("evictions", 0),
            "layer_loads": lw["loads"],
            "layer_saves": lw["saves"],
            "store_hits": lw["store_hits"],
            "store_misses": lw["store_misses"],
            "corrupt_records": store.get("corrupt_records", 0),
            "store_errors": store.get("store_errors", 0) + lw["store_errors"],
            "forward_retries": lw["forward_retries"],
            "broadcasts": kv["broadcasts"],
            "forwards": own["forwards"],
            "prefill_forwards": own["prefill_forwards"],
            "decode_forwards": own["decode_forwards"],
            "failed_forwards": own["failed_forwards"],
            "resizes": own["resizes"],
            "reserved_tokens": self._kv_rows,
            "reserved_requests": len(self._reserved),
            "resident_rows": self._sparse.rows_alive if self._sparse is not None else 0,
        }
        if self.kvpp_on:
            out.update(
                bytes_broadcast=kv["bytes_broadcast"],
                kvpp_owned_layers=len(alloc.plan.owned) if alloc is not None else 0,
                kvpp_persistent_bytes=alloc.persistent_bytes if alloc is not None else 0,
                kvpp_scratch_bytes=alloc.scratch_bytes if alloc is not None else 0,
            )
        return out

    def close(self) -> None:
        """Stop the runtimes and unregister. Idempotent."""
        if self._closed:
            return
        self._closed = True
        mla_runtime.runtimes.unregister(self.name)
        if self.layerwise_runtime is not None:
            layer_hooks.runtimes.unregister(self.layerwise_runtime)
        pd = getattr(self, "pd", None)
        if pd is not None:
            pd.stop()  # endpoints first: outstanding transfers fail instead of holding the buffers
        if self._rt is not None:
            self._retire_layerwise(self._rt)
            self._rt = None
        if self._sparse is not None:
            self._sparse.close()
        self._retire_kvpp()
        if pd is not None:
            pd.close()
        if self._store is not None and hasattr(self._store, "close"):
            self._store.close()

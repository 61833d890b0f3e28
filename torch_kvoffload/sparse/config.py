"""Configuration of sparse decode offload (DESIGN §7)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, StrictBool, StrictInt, field_validator, model_validator

from torch_kvoffload._utils import dtype_name, parse_dtype
from torch_kvoffload.config import ConfigModel, parse_lax_bool
from torch_kvoffload.kv.fp8_rows import FP8_KV, check_indexer_format, check_kv_format
from torch_kvoffload.ops.fp8 import kv_row_bytes
from torch_kvoffload.store.sizes import check_host_bytes

if TYPE_CHECKING:
    from torch_kvoffload.kv.spec import ModelSpec

__all__ = [
    "MAIN_KV_DTYPES",
    "MAX_BLOCK_SIZE",
    "MAX_CAPACITY",
    "MAX_POOL_ROWS",
    "MAX_TOP_K",
    "IndexerDtype",
    "SparseDecodeConfig",
    "SparseOptions",
    "resolve_sparse_config",
]

#: Main-KV dtypes the sparse ops (``sparse_mla_attention``, Copy-SFA) run: bf16 in production, fp32 for
#: testing. fp16 is a plain floating type too, but no sparse kernel computes in it.
MAIN_KV_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)

#: The indexer caches' formats: the model's floating dtype, Hadamard + int8 (LIC8), Hadamard + FP8 rows.
IndexerDtype = Literal["bf16", "int8", "fp8_e4m3"]

#: Largest tokens per block of any paged cache (a block is the unit of every transfer and allocation).
MAX_BLOCK_SIZE = 1 << 16
#: Largest sparse top-k (rows selected per query and layer).
MAX_TOP_K = 1 << 16
#: Largest hot-buffer capacity (rows per decode row and layer).
MAX_CAPACITY = 1 << 18
#: Largest host pool, in rows per layer (``host_pool_blocks * block_size``): positions and block ids are
#: int32 in the sparse ops' tables.
MAX_POOL_ROWS = (1 << 31) - 1


class SparseDecodeConfig(ConfigModel):
    """Sparse decode offload: full main KV in a host pool, per-layer hot buffers on the device.

    ``capacity`` is the hot-buffer rows per decode row and layer (default ``2 * top_k``); ``host_pool_blocks``
    the number of ``block_size``-token blocks of the host pool (per layer); ``policy`` the residency
    eviction policy (``"lru"`` or ``"score"``); ``indexer_dtype`` selects the floating (``"bf16"``: the
    indexer cache's own floating dtype, bf16 in production), the Hadamard + int8 (``"int8"``) or
    DeepSeek's Hadamard + FP8 (``"fp8_e4m3"``: 132-byte rows for a 128-wide head, scores from FP8 queries
    and keys; ``index_head_dim`` a power of two of at least 128) indexer path; ``fused`` uses the fused
    manage op and Copy-SFA (default) instead of separate ops.

    ``kv_dtype`` is the main KV's dtype: ``"bf16"`` or ``"fp32"`` (any alias of ``_utils.DTYPE_ALIASES``
    or a torch dtype; stored as the short name), or ``"fp8_e4m3"``: the host pool and hot buffers keep
    DeepSeek's FP8 rows (``uint8 [.., Dc + 4 * Dc / 128 + 2 * Dr]``, 656 bytes for ``Dc = 512, Dr = 64``),
    quantized as rows are appended, dequantized where attention reads them (``kv_lora_rank`` a multiple of
    128, checked by :func:`resolve_sparse_config`).

    Rejected at construction, each with its own ``ValueError``: ``capacity < top_k``; ``policy="score"``
    with a quantized ``indexer_dtype`` (the int8 and FP8 indexers return no scores); a main KV dtype that
    is neither ``"fp8_e4m3"`` nor a plain floating type (other packed / quantised main caches such as int8,
    C8, TQ4) or that no sparse op runs (fp16);
    ``context_parallel_size > 1``; ``pipeline_parallel_size > 1``; ``hybrid_kv_layout``.

    Sizes are plain ints (a bool, a float or a string is rejected) within bounds: ``1 <= top_k <=
    MAX_TOP_K``, ``1 <= capacity <= MAX_CAPACITY``, ``1 <= block_size <= MAX_BLOCK_SIZE`` and
    ``host_pool_blocks * block_size <= MAX_POOL_ROWS``; a size out of bounds is a ``ValueError`` naming
    the field.
    """

    top_k: StrictInt = Field(gt=0, le=MAX_TOP_K)
    capacity: StrictInt | None = Field(default=None, gt=0, le=MAX_CAPACITY)
    host_pool_blocks: StrictInt = Field(gt=0)
    block_size: StrictInt = Field(default=128, gt=0, le=MAX_BLOCK_SIZE)
    policy: Literal["lru", "score"] = "lru"
    indexer_dtype: IndexerDtype = "bf16"
    kv_dtype: str = "bf16"
    fused: bool = True
    context_parallel_size: StrictInt = Field(default=1, gt=0)
    pipeline_parallel_size: StrictInt = Field(default=1, gt=0)
    hybrid_kv_layout: bool = False

    @field_validator("fused", "hybrid_kv_layout", mode="before")
    @classmethod
    def _lax_bool(cls, value: Any, info: Any) -> bool:
        return parse_lax_bool(info.field_name, value)

    @field_validator("kv_dtype", mode="before")
    @classmethod
    def _main_kv_dtype(cls, value: Any) -> str:
        if value == FP8_KV:
            return FP8_KV
        names = [dtype_name(d) for d in MAIN_KV_DTYPES]
        try:
            dtype = parse_dtype("sparse decode offload: kv_dtype", value)
        except ValueError:
            raise ValueError(
                f"sparse decode offload: main KV dtype {value!r} is not supported; the main (latent) KV "
                f"must be a plain floating dtype the sparse ops run ({', '.join(names)}) or {FP8_KV!r} "
                "(DeepSeek's FP8 rows); other packed / quantised main caches (int8, C8, TQ4, ...) are rejected"
            ) from None
        if dtype not in MAIN_KV_DTYPES:
            raise ValueError(
                f"sparse decode offload: main KV dtype {value!r} is not supported; sparse MLA attention and "
                f"Copy-SFA run {', '.join(names)} only"
            )
        return dtype_name(dtype)

    @model_validator(mode="after")
    def _check(self) -> SparseDecodeConfig:
        if self.capacity is None:
            object.__setattr__(self, "capacity", 2 * self.top_k)
        assert self.capacity is not None
        if self.capacity < self.top_k:
            raise ValueError(
                f"sparse decode offload: hot-buffer capacity {self.capacity} is smaller than top_k "
                f"{self.top_k}; every selected row must fit (capacity >= top_k, default 2 * top_k)"
            )
        if self.host_pool_blocks * self.block_size > MAX_POOL_ROWS:
            raise ValueError(
                f"sparse decode offload: host_pool_blocks {self.host_pool_blocks} x block_size {self.block_size} "
                f"= {self.host_pool_blocks * self.block_size} rows per layer exceeds {MAX_POOL_ROWS} (positions "
                "and block ids are int32)"
            )
        if self.policy == "score" and self.indexer_dtype != "bf16":
            raise ValueError(
                f"sparse decode offload: policy 'score' evicts by the indexer's scores, which the "
                f"{self.indexer_dtype} indexer path does not return; use policy 'lru' with indexer_dtype "
                f"{self.indexer_dtype!r}"
            )
        if self.context_parallel_size > 1:
            raise ValueError(
                f"sparse decode offload does not support context parallelism "
                f"(context_parallel_size={self.context_parallel_size}); use 1"
            )
        if self.pipeline_parallel_size > 1:
            raise ValueError(
                f"sparse decode offload does not support pipeline parallelism "
                f"(pipeline_parallel_size={self.pipeline_parallel_size}); use 1"
            )
        if self.hybrid_kv_layout:
            raise ValueError(
                "sparse decode offload does not support hybrid KV cache layouts (hybrid_kv_layout=True)"
            )
        return self

    @property
    def fp8_kv(self) -> bool:
        """Whether the host pool and hot buffers keep FP8 rows (``kv_dtype="fp8_e4m3"``)."""
        return self.kv_dtype == FP8_KV

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The dtype the host pool and hot buffers store: ``kv_dtype``, or ``uint8`` (the bytes of FP8 rows)."""
        if self.fp8_kv:
            return torch.uint8
        return parse_dtype("SparseDecodeConfig.kv_dtype", self.kv_dtype, MAIN_KV_DTYPES)

    def row_dims(self, kv_lora_rank: int, rope_dim: int) -> tuple[int, int]:
        """Widths of the stored ``(kv_c, k_pe)`` rows of a model's ``(Dc, Dr)``: the same, or for FP8 rows one
        ``Dc + 4 * Dc / 128 + 2 * Dr``-byte row and an empty rotary part."""
        if self.fp8_kv:
            return kv_row_bytes(kv_lora_rank, rope_dim), 0
        return kv_lora_rank, rope_dim

    @property
    def hot_capacity(self) -> int:
        """``capacity`` with its default applied."""
        assert self.capacity is not None
        return self.capacity


# SparseDecodeConfig fields that only sparse decode offload (host pool + hot buffers) has
_OFFLOAD_ONLY = ("capacity", "host_pool_blocks", "policy", "fused")


class SparseOptions(ConfigModel):
    """Sparse attention over the lightning indexer's top-k (models with an indexer).

    ``offload``: ``True`` (default) keeps the whole main (latent) KV in a host pool and only per-layer hot
    top-k buffers on the device (sparse decode offload); ``False`` keeps the whole latent KV resident on
    the device and attends over the top-k rows in place (absorbed sparse MLA attention without offload:
    what a server runs when the KV fits, and the baseline offload is measured against). With
    ``offload=False`` the host-pool and hot-buffer fields (``capacity``, ``host_pool_blocks``, ``policy``,
    ``fused``) are refused, and ``kv_dtype`` must be the model's dtype (checked when the session is built) or
    ``"fp8_e4m3"``: the resident latent KV kept as DeepSeek's FP8 rows (``kv_lora_rank`` a multiple of 128;
    656 bytes a token for 512 + 64 instead of 1,152 in bf16), quantized as the rows are written and
    dequantized where attention reads them; refused with ``offload=True``. ``"auto"``: each request's
    latent KV stays resident on the device while it fits in the device KV budget
    (``serving.device_kv_budget``, else what is free) and is spilled to the host pool (sparse decode
    offload's hot buffers then serve it) when it does not, promoted back when space frees
    (:class:`~torch_kvoffload.sparse.hybrid_backend.HybridSparseBackend`); ``kv_dtype`` the model's dtype or
    ``"fp8_e4m3"``.

    The other fields are those of :class:`~torch_kvoffload.sparse.config.SparseDecodeConfig` to set; the
    ones left ``None`` are resolved when the session is built (``top_k`` from the model's ``index_topk``,
    ``host_pool_blocks`` from the generation, ``kv_dtype`` from the model's dtype). The given ones are
    validated at construction with SparseDecodeConfig's own rules.
    """

    offload: StrictBool | Literal["auto"] = True
    top_k: StrictInt | None = None
    capacity: StrictInt | None = None
    host_pool_blocks: StrictInt | None = None
    block_size: StrictInt | None = None
    policy: Literal["lru", "score"] | None = None
    indexer_dtype: IndexerDtype | None = None
    kv_dtype: str | None = None
    fused: bool | None = None
    context_parallel_size: StrictInt | None = None
    pipeline_parallel_size: StrictInt | None = None
    hybrid_kv_layout: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _given_fields(cls, value: Any) -> Any:
        if isinstance(value, SparseDecodeConfig):
            value = value.model_dump(exclude_unset=True)
        if not isinstance(value, dict):
            return value
        known = set(SparseDecodeConfig.model_fields) | {"offload"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"sparse: unknown fields {unknown}; expected fields of SparseDecodeConfig "
                f"{sorted(SparseDecodeConfig.model_fields)} or 'offload'"
            )
        fields = dict(value)
        if "offload" in fields and fields["offload"] != "auto":
            fields["offload"] = parse_lax_bool("sparse.offload", fields["offload"])
        if fields.get("offload") is False:
            host_only = sorted(k for k in _OFFLOAD_ONLY if fields.get(k) is not None)
            if host_only:
                raise ValueError(
                    f"sparse: {host_only} configure the host pool and hot buffers of sparse decode offload; "
                    "offload=False keeps the whole main KV on the device and has neither"
                )
        # validate the given fields now (placeholders for the ones the model determines); the common
        # OffloadConfig.block_size is checked with the pool in resolve_sparse_config
        trial = {k: v for k, v in fields.items() if k != "offload"}
        trial.setdefault("top_k", trial.get("capacity") or 1)
        trial.setdefault("host_pool_blocks", 1)
        trial.setdefault("block_size", 1)
        SparseDecodeConfig.model_validate(trial)
        return fields

    def given(self) -> dict[str, Any]:
        """The SparseDecodeConfig fields set here (``offload`` and ``None`` left out)."""
        return {
            k: v
            for k, v in self.model_dump(exclude={"offload"}).items()
            if v is not None and k in SparseDecodeConfig.model_fields
        }


def resolve_sparse_config(
    options: SparseOptions, spec: ModelSpec, *, block_size: int, host_pool_blocks: int
) -> SparseDecodeConfig:
    """The full :class:`SparseDecodeConfig` of ``options`` for ``spec``: ``top_k`` defaults to the model's
    ``index_topk``, ``kv_dtype`` to its dtype; ``block_size`` is the session's (every cache is paged alike).

    ``ValueError`` if a field is out of bounds, the indexer format does not fit the model's indexer
    (:func:`check_indexer_format`), or the host pool it sizes (``spec``'s layers x
    ``host_pool_blocks`` x ``block_size`` rows of the main KV) exceeds this machine's physical memory
    (naming ``host_pool_blocks``).
    """
    fields = {
        "top_k": spec.index_topk,
        "host_pool_blocks": host_pool_blocks,
        "kv_dtype": dtype_name(spec.dtype),
        **options.given(),
        "block_size": block_size,
    }
    cfg = SparseDecodeConfig.model_validate(fields)
    check_indexer_format(cfg.indexer_dtype, spec)
    check_kv_format(cfg.kv_dtype, spec)
    row_bytes = sum(cfg.row_dims(spec.kv_lora_rank, spec.rope_dim)) * cfg.torch_kv_dtype.itemsize
    pool = spec.num_layers * cfg.host_pool_blocks * cfg.block_size * row_bytes
    check_host_bytes(f"sparse decode offload of {spec.model_class}", "host_pool_blocks (the host pool)", pool)
    return cfg

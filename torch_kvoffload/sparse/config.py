"""Configuration of sparse decode offload (DESIGN §7)."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, StrictInt, field_validator, model_validator

from torch_kvoffload._utils import dtype_name, parse_dtype
from torch_kvoffload.config import ConfigModel, parse_lax_bool

__all__ = [
    "MAIN_KV_DTYPES",
    "MAX_BLOCK_SIZE",
    "MAX_CAPACITY",
    "MAX_POOL_ROWS",
    "MAX_TOP_K",
    "SparseDecodeConfig",
]

#: Main-KV dtypes the sparse ops (``sparse_mla_attention``, Copy-SFA) run: bf16 in production, fp32 for
#: testing. fp16 is a plain floating type too, but no sparse kernel computes in it.
MAIN_KV_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)

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
    indexer cache's own floating dtype, bf16 in production) or the Hadamard + int8 (``"int8"``) indexer
    path; ``fused`` uses the fused manage op and Copy-SFA (default) instead of separate ops.

    ``kv_dtype`` is the main KV's dtype: ``"bf16"`` or ``"fp32"`` (any alias of ``_utils.DTYPE_ALIASES``
    or a torch dtype; stored as the short name).

    Rejected at construction, each with its own ``ValueError``: ``capacity < top_k``; ``policy="score"``
    with ``indexer_dtype="int8"`` (the int8 indexer returns no scores); a main KV dtype that
    is not a plain floating type (packed / quantised main caches such as int8, fp8, C8, TQ4) or that no
    sparse op runs (fp16);
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
    indexer_dtype: Literal["bf16", "int8"] = "bf16"
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
        names = [dtype_name(d) for d in MAIN_KV_DTYPES]
        try:
            dtype = parse_dtype("sparse decode offload: kv_dtype", value)
        except ValueError:
            raise ValueError(
                f"sparse decode offload: main KV dtype {value!r} is not supported; the main (latent) KV "
                f"must be a plain floating dtype the sparse ops run ({', '.join(names)}); "
                "packed / quantised main caches (int8, fp8, C8, TQ4, ...) are rejected"
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
        if self.policy == "score" and self.indexer_dtype == "int8":
            raise ValueError(
                "sparse decode offload: policy 'score' evicts by the indexer's scores, which the int8 indexer "
                "path (quant_lightning_indexer) does not return; use policy 'lru' with indexer_dtype 'int8'"
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
    def torch_kv_dtype(self) -> torch.dtype:
        """``kv_dtype`` as a torch dtype."""
        return parse_dtype("SparseDecodeConfig.kv_dtype", self.kv_dtype, MAIN_KV_DTYPES)

    @property
    def hot_capacity(self) -> int:
        """``capacity`` with its default applied."""
        assert self.capacity is not None
        return self.capacity

"""``torch.ops.kvoffload`` — schemas, fake kernels, reference kernels and typed public wrappers.

Importing this package defines every op (one module per op family), loads the C++ extension, whose
``TORCH_LIBRARY_IMPL`` blocks register the CPU kernels, and registers the Triton kernels for the
accelerators present (CUDA; Ascend through triton-ascend) when ``triton`` imports.
"""

import logging as _logging

from torch_kvoffload.ops import (
    copy,
    fp8,
    fp8_attention,
    fp8_copy_attention,
    fp8_indexer,
    indexer,
    kvpp,
    layer_hooks,
    mla_runtime,
    residency,
    sparse_attention,
)
from torch_kvoffload.ops._checks import unaliased_source
from torch_kvoffload.ops._hook_registry import sync_copies
from torch_kvoffload.ops._registry import (
    OpInfo,
    format_registered_ops,
    has_kernel,
    reference_kernel,
    register_device_kernel,
    registered_ops,
)
from torch_kvoffload.ops.copy import copy_blocks, copy_rows
from torch_kvoffload.ops.fp8 import (
    dequantize_index_k_fp8,
    dequantize_kv_fp8,
    quantize_index_k_fp8,
    quantize_kv_fp8,
)
from torch_kvoffload.ops.fp8_attention import fp8_sparse_mla_attention
from torch_kvoffload.ops.fp8_copy_attention import fp8_scatter_copy_sparse_mla_attention
from torch_kvoffload.ops.fp8_indexer import fp8_lightning_indexer, hadamard_quant_fp8
from torch_kvoffload.ops.indexer import (
    hadamard_quant_int8,
    lightning_indexer,
    lightning_indexer_scores,
    quant_lightning_indexer,
)
from torch_kvoffload.ops.kvpp import kvpp_prefetch_layer, kvpp_wait_layer
from torch_kvoffload.ops.layer_hooks import layer_prefetch, layer_save, layer_wait
from torch_kvoffload.ops.residency import (
    ResidencyOutputs,
    lightning_indexer_manage,
    new_residency_outputs,
    new_residency_state,
    residency_update,
)
from torch_kvoffload.ops.sparse_attention import scatter_copy_sparse_mla_attention, sparse_mla_attention
from torch_kvoffload.ops.triton import register_triton_kernels as _register_triton_kernels
from torch_kvoffload.ops.triton import triton_kernel

from torch_kvoffload._extension import load_extension as _load_extension  # isort: skip

_load_extension()
try:
    _register_triton_kernels()
except Exception as _exc:  # a broken triton install must not break the package: ops keep other kernels
    _logging.getLogger(__name__).warning("Triton kernels not registered: %s", _exc)

__all__ = [
    "OpInfo",
    "ResidencyOutputs",
    "copy",
    "copy_blocks",
    "copy_rows",
    "dequantize_index_k_fp8",
    "dequantize_kv_fp8",
    "format_registered_ops",
    "fp8",
    "fp8_attention",
    "fp8_copy_attention",
    "fp8_indexer",
    "fp8_lightning_indexer",
    "fp8_scatter_copy_sparse_mla_attention",
    "fp8_sparse_mla_attention",
    "hadamard_quant_fp8",
    "hadamard_quant_int8",
    "has_kernel",
    "indexer",
    "kvpp",
    "kvpp_prefetch_layer",
    "kvpp_wait_layer",
    "layer_hooks",
    "layer_prefetch",
    "layer_save",
    "layer_wait",
    "lightning_indexer",
    "lightning_indexer_manage",
    "lightning_indexer_scores",
    "mla_runtime",
    "new_residency_outputs",
    "new_residency_state",
    "quant_lightning_indexer",
    "quantize_index_k_fp8",
    "quantize_kv_fp8",
    "reference_kernel",
    "register_device_kernel",
    "registered_ops",
    "residency",
    "residency_update",
    "scatter_copy_sparse_mla_attention",
    "sparse_attention",
    "sparse_mla_attention",
    "sync_copies",
    "triton_kernel",
    "unaliased_source",
]

"""The Triton kernel registry: lookup, registration for the present accelerators, launch guards."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from torch_kvoffload.ops import has_kernel, triton_kernel
from torch_kvoffload.ops import triton as triton_ops

#: Ops whose Triton kernels these tests look up: the copy and indexer ops and the FP8 attention.
TRITON_OPS = (
    "copy_blocks",
    "copy_rows",
    "fp8_lightning_indexer",
    "fp8_sparse_mla_attention",
    "hadamard_quant_fp8",
    "hadamard_quant_int8",
    "lightning_indexer",
    "lightning_indexer_scores",
    "quant_lightning_indexer",
)

needs_triton = pytest.mark.skipif(not triton_ops.triton_available(), reason="triton is not importable")


@needs_triton
def test_every_listed_op_has_a_triton_kernel() -> None:
    kernels = triton_ops.triton_kernels()
    assert set(TRITON_OPS) <= set(kernels)
    for name in TRITON_OPS:
        assert triton_kernel(name) is kernels[name]
        assert callable(kernels[name])


@needs_triton
def test_unknown_op_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match="kvoffload op 'no_such_op' has no Triton kernel"):
        triton_kernel("no_such_op")


def test_missing_triton_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_ops, "_available", False)
    with pytest.raises(RuntimeError, match="triton is not importable; install it"):
        triton_kernel("copy_rows")
    assert triton_ops.register_triton_kernels() == []


@needs_triton
def test_registration_matches_the_machine() -> None:
    """Registered at import for CUDA when a device is present (a second call registers nothing new);
    nothing is registered for CUDA on a machine without one."""
    assert triton_ops.register_triton_kernels() == []
    for name in TRITON_OPS:
        assert has_kernel(name, "CUDA") == torch.cuda.is_available()


@needs_triton
def test_broken_family_module_is_skipped_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = types.ModuleType("torch_kvoffload.ops.triton.broken_family")
    broken.KERNELS = None  # not a dict
    monkeypatch.setitem(sys.modules, broken.__name__, broken)
    monkeypatch.setattr(triton_ops, "FAMILIES", (*triton_ops.FAMILIES, "broken_family", "absent_family"))
    monkeypatch.setattr(triton_ops, "_kernels", None)
    with caplog.at_level(logging.WARNING, logger=triton_ops.__name__):
        kernels = triton_ops.triton_kernels()
    assert set(TRITON_OPS) <= set(kernels)
    assert "broken_family" in caplog.text and "no KERNELS dict" in caplog.text
    assert "absent_family" not in caplog.text  # a family without a module is not an error


@needs_triton
def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dst = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match="kvoffload::copy_blocks: the Triton kernel got CPU tensors"):
        triton_kernel("copy_blocks")(torch.ones(2, 3), dst, torch.tensor([[0, 1]]))
    assert not dst.any()
    with pytest.raises(RuntimeError, match="kvoffload::hadamard_quant_int8: the Triton kernel got CPU"):
        triton_kernel("hadamard_quant_int8")(torch.ones(2, 4))

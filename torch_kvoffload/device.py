"""Accelerator detection and host memory: which device runs compute, pinned / huge-page host buffers.

``torch_npu`` is optional and probed lazily: importing it without CANN breaks ``import torch``, so it is
never imported at module top level, and an import failure of any kind means "no NPU". Moving bytes is
:mod:`torch_kvoffload.transfer`'s job.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import mmap
import sys
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "accelerator_type",
    "advise_huge_pages",
    "default_device",
    "empty_host",
    "free_device_bytes",
    "pin_memory_enabled",
    "probe_npu",
    "set_thread_intraop_threads",
    "zeros_host",
]

# ------------------------------------------------------------------------------------------- detection


@functools.cache
def probe_npu() -> bool:
    """Whether ``torch_npu`` imports and reports an available NPU (guarded: any failure means no)."""
    try:
        importlib.import_module("torch_npu")
        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except (ImportError, RuntimeError, AttributeError, OSError) as exc:
        logger.debug("torch_npu not usable: %s", exc)
        return False


@functools.cache
def accelerator_type() -> str:
    """``"cuda"``, ``"npu"`` or ``"cpu"`` — the accelerator this process computes on."""
    if torch.cuda.is_available():
        return "cuda"
    if probe_npu():
        return "npu"
    return "cpu"


def default_device() -> torch.device:
    """The compute device: the current accelerator, or the CPU."""
    kind = accelerator_type()
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.accelerator.current_device_index())


def free_device_bytes(device: torch.device) -> int:
    """Bytes free on ``device`` now: the accelerator's free memory (``mem_get_info``), or for the CPU the
    physical memory not in use."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "npu":
        return int(torch.npu.mem_get_info(device)[0])  # type: ignore[attr-defined]  # torch_npu registered it
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pin_memory_enabled() -> bool:
    """Host buffers are pinned exactly when an accelerator copies from / to them."""
    return accelerator_type() != "cpu"


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back a large host tensor with transparent huge pages; return whether it agreed.

    Host KV pools are read a few random token rows at a time; with 4 KiB pages nearly every row costs a
    TLB miss. Advising before the first touch lets the kernel fault the pages in as 2 MiB pages (a hint:
    with THP disabled system-wide nothing changes).
    """
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or t.is_pinned():
        return False
    nbytes = t.untyped_storage().nbytes()
    if nbytes < 2 * _HUGE_PAGE or (libc := _libc()) is None:
        return False
    start = t.untyped_storage().data_ptr()
    begin = (start + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    length = (start + nbytes - begin) // mmap.PAGESIZE * mmap.PAGESIZE
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0


def empty_host(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised host tensor: pinned when an accelerator exists, else advised to use huge pages."""
    t = torch.empty(tuple(shape), dtype=dtype, pin_memory=pin_memory_enabled())
    advise_huge_pages(t)
    return t


def zeros_host(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Zero-filled host tensor, pinned when an accelerator exists."""
    return torch.zeros(tuple(shape), dtype=dtype, pin_memory=pin_memory_enabled())


def set_thread_intraop_threads(n: int) -> bool:
    """Give the calling thread ``n`` intra-op (OpenMP) threads; other threads keep theirs.

    ``torch.set_num_threads`` is process-wide (it would also shrink the compute threads' pools); this
    sets the calling thread's own OpenMP count through the C++ extension. Returns whether it was set
    (False without the extension: kernels then use the process-wide count).
    """
    from torch_kvoffload._extension import extension_module

    ext = extension_module()
    if ext is None:
        return False
    ext.set_thread_intraop_threads(n)
    return True

"""Which step a sparse decode runtime runs: the host step (the ops through the dispatcher) or the
host-sync-free device step (Triton launches; see :mod:`torch_kvoffload.sparse.device_step`)."""

from __future__ import annotations

import torch

from torch_kvoffload.ops.triton import interpreting, triton_available
from torch_kvoffload.sparse.host_pool import HostKVPool

__all__ = ["STEP_PATHS", "check_device_capacity", "resolve_step_path"]

STEP_PATHS = ("auto", "host", "device")


def resolve_step_path(
    where: str, step_path: object, device: torch.device, pool: HostKVPool, capacity: int
) -> bool:
    """Whether the device step runs for ``step_path`` (one of :data:`STEP_PATHS`).

    ``"host"``: no. ``"auto"``: on CUDA when triton imports and ``pool`` is pinned. ``"device"``: yes, or
    an error naming what is missing (triton; CUDA with a pinned pool, or CPU tensors under the Triton
    interpreter; a ``capacity`` the residency kernel takes).
    """
    if step_path not in STEP_PATHS:
        raise ValueError(f"{where}: step_path must be one of {list(STEP_PATHS)}, got {step_path!r}")
    if step_path == "host":
        return False
    pinned = pool.kv_c(0).is_pinned() and pool.k_pe(0).is_pinned()
    if step_path == "auto":
        return device.type == "cuda" and pinned and triton_available()
    if not triton_available():
        raise RuntimeError(f"{where}: step_path='device' runs Triton kernels; install triton")
    if device.type == "cpu":
        if not interpreting():
            raise ValueError(
                f"{where}: step_path='device' on CPU tensors runs only under the Triton interpreter "
                "(set TRITON_INTERPRET=1 before triton is imported)"
            )
    elif device.type != "cuda":
        raise ValueError(
            f"{where}: step_path='device' needs a CUDA device (its kernels read the pinned pool in place), "
            f"got {device}"
        )
    elif not pinned:
        raise ValueError(f"{where}: step_path='device' needs a pinned host pool (this one is pageable)")
    check_device_capacity(where, capacity)
    return True


def check_device_capacity(where: str, capacity: int) -> None:
    """``capacity`` within what the device step's residency kernel takes (``ValueError`` naming ``where``)."""
    from torch_kvoffload.ops.triton.residency import MAX_CAPACITY

    if capacity > MAX_CAPACITY:
        raise ValueError(f"{where}: step_path='device' takes a capacity of at most {MAX_CAPACITY} slots")

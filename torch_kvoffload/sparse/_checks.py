"""Argument checks shared by the sparse decode modules (layers, tensors, scales, request ids).

They run before anything is written. The checks of one step's inputs (block-table coverage included)
live beside those inputs in :mod:`torch_kvoffload.sparse.step_inputs`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

import torch

from torch_kvoffload._utils import check_int

__all__ = ["check_layer", "check_scale", "check_tensor", "host_ints"]


def check_layer(where: str, layer: object, num_layers: int) -> int:
    """``layer`` as an int in ``[0, num_layers)`` (``-1`` is an error, not the last layer)."""
    return check_int(where, "layer", layer, minimum=0, maximum=num_layers - 1)


def check_tensor(
    where: str,
    arg: str,
    t: object,
    *,
    shape: Sequence[int | None] | None = None,
    dim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    devices: Sequence[torch.device] | None = None,
) -> torch.Tensor:
    """``t`` as a tensor of the given shape (``None`` = any size), dims, dtypes and devices."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: '{arg}' must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(w is None or s == w for s, w in zip(t.shape, shape, strict=True))
        if not ok:
            want = ", ".join("*" if w is None else str(w) for w in shape)
            raise ValueError(f"{where}: '{arg}' must have shape [{want}], got {list(t.shape)}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{where}: '{arg}' must have {dim} dims, got shape {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{where}: '{arg}' must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if devices is not None and t.device not in devices:
        raise ValueError(f"{where}: '{arg}' must be on {' or '.join(map(str, devices))}, got {t.device}")
    return t


def check_scale(where: str, scale: object) -> float:
    """``scale`` as a finite float (a bool is not a scale)."""
    if isinstance(scale, bool) or not isinstance(scale, Real) or not math.isfinite(float(scale)):
        raise ValueError(f"{where}: 'scale' must be a finite float, got {scale!r}")
    return float(scale)


def host_ints(where: str, arg: str, values: object, n: int) -> list[int]:
    """Request ids (a sequence of ints or an integer tensor ``[n]``) as ``n`` Python ints ``>= 0``.

    They are scheduler metadata: pass them as a CPU tensor or a list (a device tensor is read back,
    which synchronises with the device).
    """
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{where}: '{arg}' must be an int64 / int32 tensor [{n}], got {values.dtype} {list(values.shape)}"
            )
        out = values.tolist()
    elif isinstance(values, Sequence) and not isinstance(values, str | bytes):
        out = [check_int(where, f"{arg}[{i}]", v) for i, v in enumerate(values)]
    else:
        raise TypeError(
            f"{where}: '{arg}' must be a sequence of ints or a tensor, got {type(values).__name__}"
        )
    if len(out) != n:
        raise ValueError(f"{where}: '{arg}' must hold {n} entries (one per row), got {len(out)}")
    bad = [v for v in out if v < 0]
    if bad:
        raise ValueError(f"{where}: '{arg}' entries must be >= 0, got {bad[0]}")
    return out

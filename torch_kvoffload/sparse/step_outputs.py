"""What one decode step of one layer produces: :class:`StepResult`, the per-layer buffers it is written
into (:class:`StepOutputs`) and the hand-off from a step's residency update to its copy and attention
(:class:`PreparedStep`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from torch_kvoffload.ops.residency import ResidencyOutputs, new_residency_outputs

__all__ = ["PreparedStep", "StepOutputs", "StepResult"]


@dataclass
class StepResult:
    """``out [T, H, Dc]`` (latent space), ``lse fp32 [T, H]``, ``topk int32 [T, K]``, the residency
    outputs of the step and ``rows``, the residency row (hot-buffer row) of each decode row.

    On an accelerator (and with the device step) the tensors are views of per-layer buffers reused by
    the next :meth:`~torch_kvoffload.sparse.SparseDecodeOffload.attend` of the same layer (so a step
    allocates no outputs); on CPU they are fresh tensors.
    """

    out: torch.Tensor
    lse: torch.Tensor
    topk: torch.Tensor
    residency: ResidencyOutputs
    rows: list[int]


@dataclass
class PreparedStep:
    """A step after its residency update (steps 3–4) wrote the scratch ``state`` of its rows and ``res``.

    ``rows_t int64 [T]``: the residency rows on the device; ``state``: scratch ``(slot_to_token [T, C],
    lru_order [T, C], row_request [T])`` to commit once the step succeeded; ``out`` / ``lse`` / ``topk``
    / ``res``: the step's outputs. ``copy_and_attend()`` runs steps 5–7 into ``out`` / ``lse`` and
    returns the rows copied host→device (an int, or an integer tensor whose sum it is).
    """

    rows_t: torch.Tensor
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    out: torch.Tensor
    lse: torch.Tensor
    topk: torch.Tensor
    res: ResidencyOutputs
    copy_and_attend: Callable[[], int | torch.Tensor]


class StepOutputs:
    """The outputs ``out, lse, topk, residency outputs`` of a step of ``T`` rows.

    ``fresh=True`` (the CPU host step): new tensors every step. Otherwise views of per-layer buffers of
    ``max_rows`` rows, made once per ``(layer, heads)`` on ``device`` and reused (a step allocates no
    outputs); :meth:`clear` drops them when their sizes change.
    """

    def __init__(self, max_rows: int, kv_lora_rank: int, device: torch.device, *, fresh: bool) -> None:
        self.max_rows, self.kv_lora_rank, self.device, self.fresh = max_rows, kv_lora_rank, device, fresh
        self._buffers: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # (layer, heads) -> buffers

    def get(
        self, layer: int, T: int, H: int, K: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ResidencyOutputs]:
        """``out [T, H, Dc]`` in ``dtype``, ``lse fp32 [T, H]``, ``topk int32 [T, K]`` and residency
        outputs of ``T`` rows and top-k ``K``."""
        Dc, dev = self.kv_lora_rank, self.device
        if self.fresh:  # the int32 outputs as views of one allocation (a step makes three, not eight)
            out = torch.empty(T, H, Dc, dtype=dtype)
            lse = torch.empty(T, H, dtype=torch.float32)
            ints = torch.empty(4 * T * K + 2 * T, dtype=torch.int32)
            topk, *per_k, miss_count, evictions = ints.split([T * K] * 4 + [T, T])
            res = ResidencyOutputs(*(t.view(T, K) for t in per_k), miss_count, evictions)
            return out, lse, topk.view(T, K), res
        key = (layer, H)
        if key not in self._buffers:
            R = self.max_rows
            res = new_residency_outputs(R, K, dev)
            self._buffers[key] = (torch.empty(R, H, Dc, dtype=dtype, device=dev),
                                  torch.empty(R, H, dtype=torch.float32, device=dev),
                                  torch.empty(R, K, dtype=torch.int32, device=dev), *res.as_tuple())  # fmt: skip
        out, lse, topk, *res_bufs = self._buffers[key]
        return out[:T], lse[:T], topk[:T], ResidencyOutputs(*(t[:T] for t in res_bufs))

    def clear(self) -> None:
        """Forget the buffers (the next step makes them with the current sizes)."""
        self._buffers.clear()

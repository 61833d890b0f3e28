"""A Hugging Face forward's token inputs as the KV core takes them: shapes and real (non-padding) positions.

Only left padding is accepted, and only in the first forward of a sequence (``past == 0``): every row then
ends with a real token, and later forwards feed real tokens only.
"""

from __future__ import annotations

import torch

__all__ = ["forward_shape", "new_positions"]

_WHERE = "OffloadSession.begin_forward"


def forward_shape(input_ids: object) -> tuple[int, int]:
    """``(B, S)`` of ``input_ids``, an integer tensor ``[B, S]`` with ``S > 0`` (``ValueError`` otherwise)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise ValueError(
            f"{_WHERE}: 'input_ids' must be an int tensor [B, S], got "
            f"{getattr(input_ids, 'dtype', type(input_ids))} {list(getattr(input_ids, 'shape', []))}"
        )
    B, S = input_ids.shape
    if S == 0:
        raise ValueError(f"{_WHERE}: 'input_ids' has no positions")
    return B, S


def new_positions(attention_mask: torch.Tensor | None, B: int, S: int, past: int) -> torch.Tensor:
    """``bool [B, S]`` (host): the real positions among the new ones (left padding only)."""
    if attention_mask is None:
        return torch.ones(B, S, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, past + S):
        raise ValueError(
            f"{_WHERE}: 'attention_mask' must be a 2-D tensor [B, past + S] = [{B}, {past + S}], got "
            f"{getattr(attention_mask, 'shape', type(attention_mask))}"
        )
    new_mask = attention_mask[:, past:].to("cpu").bool()
    if past > 0 and not bool(new_mask.all()):
        raise ValueError(
            f"{_WHERE}: padding after the first forward is not supported (only left padding of the prompt)"
        )
    if past == 0:
        monotone = bool((new_mask[:, 1:].int() >= new_mask[:, :-1].int()).all()) if S > 1 else True
        if not monotone or not bool(new_mask[:, -1].all()):
            raise ValueError(
                f"{_WHERE}: 'attention_mask' must be left padding (zeros, then ones, every row ending with "
                "a real token)"
            )
    return new_mask

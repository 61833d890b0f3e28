"""A Hugging Face forward's token inputs as the KV core takes them: shapes and real (non-padding) positions.

Any 0/1 ``attention_mask [B, past + S]`` (bool or integer dtype) is accepted, as transformers accepts it:
padding may be left, right or between real tokens, in any forward of a sequence (a later forward may feed a
chunk with padding too), and a row may have no real token in a forward. Each row's real tokens are its
request's tokens; a padding position keeps no KV, but its query attends as the unmodified model's does,
over the real tokens before it (see :mod:`torch_kvoffload.core.kv`).
"""

from __future__ import annotations

import torch

__all__ = ["forward_shape", "model_positions", "new_positions"]

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


def new_positions(
    attention_mask: torch.Tensor | None,
    B: int,
    S: int,
    past: int,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bool [B, S]`` (host): the real positions among the new ones.

    ``attention_mask``: ``None`` (no padding) or a bool / integer tensor ``[B, past + S]`` of 0 (padding)
    and 1 (real token), padding anywhere. ``seen``: when given, the sequence's mask so far (``bool [B,
    past]``, best on the mask's device), which the mask's first ``past`` columns must equal (a mask that
    hides earlier real tokens, or shows earlier padding, cannot be served: the padding kept no KV; the
    earlier columns' values were checked when they were new). ``ValueError`` otherwise.
    """
    if attention_mask is None:
        return torch.ones(B, S, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, past + S):
        raise ValueError(
            f"{_WHERE}: 'attention_mask' must be a 2-D tensor [B, past + S] = [{B}, {past + S}], got "
            f"{getattr(attention_mask, 'shape', type(attention_mask))}"
        )
    dtype = attention_mask.dtype
    if dtype.is_floating_point or dtype.is_complex:
        raise ValueError(f"{_WHERE}: 'attention_mask' must be a bool or integer tensor of 0 / 1, got {dtype}")
    # the earlier columns are compared where the mask lives: only the new ones are read to the host (a
    # decode step's mask is [B, past + 1])
    if seen is not None and not torch.equal(attention_mask[:, :past], seen.to(attention_mask.device, dtype)):
        raise ValueError(
            f"{_WHERE}: the attention_mask's first {past} columns must be the sequence's mask so far "
            "(padding keeps no KV: earlier positions cannot turn real, nor real ones into padding)"
        )
    mask = attention_mask[:, past:].to("cpu")
    if dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        bad = sorted(set(mask[(mask != 0) & (mask != 1)].tolist()))[:5]
        raise ValueError(
            f"{_WHERE}: 'attention_mask' must hold 0 (padding) and 1 (real token) only, got values {bad}"
        )
    return mask.bool()


def model_positions(
    position_ids: torch.Tensor | None, B: int, S: int, past: int, new_mask: torch.Tensor
) -> list[list[int]]:
    """Per row, the model positions (the rotary positions the model computes their KV at) of the real new
    tokens ``new_mask bool [B, S]`` (host): ``position_ids [B, S]`` or ``[1, S]`` (every row) when given,
    else transformers' default ``past .. past + S - 1`` (the cache's length counts the padding, so a
    left-padded row's first real token sits at its number of pads).

    ``position_ids`` of another shape or dtype are left for the model to reject (transformers' rotary
    embedding fails on them); their tokens get random negative positions, which no other forward's match.
    """
    if position_ids is None:
        pos = torch.arange(past, past + S, dtype=torch.int64).expand(B, S)
    elif (
        isinstance(position_ids, torch.Tensor)
        and position_ids.dim() == 2
        and position_ids.shape[1] == S
        and position_ids.shape[0] in (1, B)
        and not position_ids.dtype.is_floating_point
        and position_ids.dtype != torch.bool
    ):
        pos = position_ids.to("cpu", torch.int64).expand(B, S)
    else:
        pos = torch.randint(-(2**62), -1, (B, S), dtype=torch.int64)
    return [pos[b][new_mask[b]].tolist() for b in range(B)]

"""Independent pure-PyTorch references shared by the op and end-to-end tests."""

from __future__ import annotations

import math

import torch


def dense_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention over the rows listed in ``indices``, one query token at a time, in fp32.

    ``q_nope [T, H, Dc]``, ``q_pe [T, H, Dr]``, ``kv_c [N, Dc]``, ``k_pe [N, Dr]``, ``indices int [T, K]``
    (``-1`` ignored; a row listed twice is attended twice). For token ``t``:
    ``s = scale * (q_nope[t] @ kv_c[sel].T + q_pe[t] @ k_pe[sel].T)``, ``out[t] = softmax(s) @ kv_c[sel]``,
    ``lse[t] = logsumexp(s)``, where ``sel`` are the valid entries of ``indices[t]``. A token without a
    valid entry gets ``out = 0`` and ``lse = -inf``.

    Returns ``out [T, H, Dc]`` in ``q_nope``'s dtype and ``lse float32 [T, H]``, on ``q_nope``'s device.
    """
    t_count, heads, dc = q_nope.shape
    out = torch.zeros(t_count, heads, dc, dtype=torch.float32)
    lse = torch.full((t_count, heads), -math.inf, dtype=torch.float32)
    for t in range(t_count):
        sel = [int(i) for i in indices[t].tolist() if i >= 0]
        if not sel:
            continue
        rows = torch.tensor(sel, dtype=torch.long)
        c = kv_c.detach().cpu()[rows].float()  # [k, Dc]
        pe = k_pe.detach().cpu()[rows].float()  # [k, Dr]
        s = (q_nope[t].detach().cpu().float() @ c.T + q_pe[t].detach().cpu().float() @ pe.T) * scale
        out[t] = torch.softmax(s, dim=-1) @ c
        lse[t] = torch.logsumexp(s, dim=-1)
    return out.to(device=q_nope.device, dtype=q_nope.dtype), lse.to(q_nope.device)

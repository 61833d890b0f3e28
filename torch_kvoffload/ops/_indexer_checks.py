"""Argument checks of the lightning-indexer ops: structure (shapes, dtypes, devices; what a fake kernel
can check) and values (the request description and the block table, read from the index tensors).

The ops of :mod:`torch_kvoffload.ops.indexer` run them in their fake kernels and validators (the
``validate_*`` functions every kernel calls before writing anything).
"""

from __future__ import annotations

import torch

from torch_kvoffload.ops import _checks

FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def _check_paging(
    op: str,
    num_tokens: int,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
) -> None:
    """Structure of the request description shared by every indexer op."""
    for arg, t, dim in (("block_table", block_table, 2), ("cu_seqlens_q", cu_seqlens_q, 1)):
        _checks.check_dtype(op, arg, t, (torch.int32,))
        _checks.check_dim(op, arg, t, dim)
    _checks.check_dtype(op, "seq_lens_k", seq_lens_k, (torch.int32,))
    _checks.check_dim(op, "seq_lens_k", seq_lens_k, 1)
    batch = block_table.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        _checks.fail(
            op,
            f"argument 'cu_seqlens_q' must have shape [{batch + 1}] (batch + 1 from 'block_table'), "
            f"got {list(cu_seqlens_q.shape)}",
        )
    if seq_lens_k.shape[0] != batch:
        _checks.fail(
            op,
            f"argument 'seq_lens_k' must have shape [{batch}] (batch from 'block_table'), "
            f"got {list(seq_lens_k.shape)}",
        )


def _check_paging_values(
    op: str,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
) -> None:
    """Value checks of the request description (reads the index tensors)."""
    cu = cu_seqlens_q.tolist()
    lens = seq_lens_k.tolist()
    if cu[0] != 0:
        _checks.fail(op, f"argument 'cu_seqlens_q' entry 0 must be 0, got {cu[0]}")
    for b in range(len(lens)):
        if cu[b + 1] < cu[b]:
            _checks.fail(
                op,
                f"argument 'cu_seqlens_q' must be non-decreasing, got entry {b + 1} = {cu[b + 1]} "
                f"< entry {b} = {cu[b]}",
            )
    if cu[-1] != num_tokens:
        _checks.fail(
            op,
            f"argument 'cu_seqlens_q' last entry must equal the number of query tokens {num_tokens}, "
            f"got {cu[-1]}",
        )
    max_blocks = block_table.shape[1]
    capacity = max_blocks * block_size
    table = block_table.tolist()
    for b, s in enumerate(lens):
        if s < 0 or s > capacity:
            _checks.fail(
                op,
                f"argument 'seq_lens_k' entry {b} is {s}, expected a value in [0, {capacity}] "
                f"(max_blocks {max_blocks} x block_size {block_size})",
            )
        q = cu[b + 1] - cu[b]
        if s - (q - 1) < 0 and q > 0:
            _checks.fail(
                op,
                f"argument 'seq_lens_k' entry {b} is {s}, but request {b} has {q} query tokens: the first "
                f"query would see {s - (q - 1)} keys (need seq_len_k >= num_queries - 1)",
            )
        for j in range((s + block_size - 1) // block_size):
            blk = table[b][j]
            if blk < 0 or blk >= num_blocks:
                _checks.fail(
                    op,
                    f"argument 'block_table' entry [{b}, {j}] is {blk}, expected a value in [0, {num_blocks})",
                    IndexError,
                )


def _check_top_k(op: str, top_k: int) -> None:
    if top_k < 0:
        _checks.fail(op, f"argument 'top_k' must be >= 0, got {top_k}")


def _indexer_structure(
    op: str,
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
) -> None:
    _checks.check_dtype(op, "q", q, FLOAT_DTYPES)
    _checks.check_dim(op, "q", q, 3)
    _checks.check_dim(op, "weights", weights, 2)
    _checks.check_dim(op, "k_cache", k_cache, 3)
    if weights.dtype not in (q.dtype, torch.float32):
        _checks.fail(
            op,
            f"argument 'weights' must have dtype {q.dtype} (as 'q') or torch.float32, got {weights.dtype}",
            TypeError,
        )
    _checks.check_same_dtype(op, "q", q, "k_cache", k_cache)
    if tuple(weights.shape) != tuple(q.shape[:2]):
        _checks.fail(
            op,
            f"argument 'weights' must have shape {list(q.shape[:2])} ([T, H] of 'q'), got {list(weights.shape)}",
        )
    if k_cache.shape[2] != q.shape[2]:
        _checks.fail(
            op,
            f"argument 'k_cache' must have head dim {q.shape[2]} (as 'q'), got shape {list(k_cache.shape)}",
        )
    _check_paging(op, q.shape[0], block_table, cu_seqlens_q, seq_lens_k)
    for arg, t in (("weights", weights), ("k_cache", k_cache)):
        if t.device != q.device:
            _checks.fail(op, f"argument '{arg}' must be on {q.device} (as 'q'), got {t.device}")


def _check_paging_of(op: str, num_tokens: int, k_cache: torch.Tensor, block_table, cu_seqlens_q, seq_lens_k):
    _check_paging_values(
        op, num_tokens, k_cache.shape[0], k_cache.shape[1], block_table, cu_seqlens_q, seq_lens_k
    )


def _hadamard_structure(op: str, x: torch.Tensor) -> None:
    _checks.check_dtype(op, "x", x, FLOAT_DTYPES)
    _checks.check_dim(op, "x", x, 1, at_least=True)
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        _checks.fail(op, f"argument 'x' must have a power-of-two last dim, got shape {list(x.shape)}")


def _quant_structure(
    op, q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
) -> None:
    _checks.check_dtype(op, "q_int8", q_int8, (torch.int8,))
    _checks.check_dim(op, "q_int8", q_int8, 3)
    _checks.check_dtype(op, "q_scale", q_scale, (torch.float32,))
    _checks.check_dtype(op, "weights", weights, (torch.float32, torch.bfloat16))
    _checks.check_dtype(op, "k_int8_cache", k_int8_cache, (torch.int8,))
    _checks.check_dim(op, "k_int8_cache", k_int8_cache, 3)
    _checks.check_dtype(op, "k_scale_cache", k_scale_cache, (torch.float32,))
    _checks.check_dim(op, "k_scale_cache", k_scale_cache, 2)
    th = list(q_int8.shape[:2])
    for arg, t in (("q_scale", q_scale), ("weights", weights)):
        if list(t.shape) != th:
            _checks.fail(
                op, f"argument '{arg}' must have shape {th} ([T, H] of 'q_int8'), got {list(t.shape)}"
            )
    if k_int8_cache.shape[2] != q_int8.shape[2]:
        _checks.fail(
            op,
            f"argument 'k_int8_cache' must have head dim {q_int8.shape[2]} (as 'q_int8'), "
            f"got shape {list(k_int8_cache.shape)}",
        )
    if list(k_scale_cache.shape) != list(k_int8_cache.shape[:2]):
        _checks.fail(
            op,
            f"argument 'k_scale_cache' must have shape {list(k_int8_cache.shape[:2])} ([num_blocks, block_size] "
            f"of 'k_int8_cache'), got {list(k_scale_cache.shape)}",
        )
    _check_paging(op, q_int8.shape[0], block_table, cu_seqlens_q, seq_lens_k)
    for arg, t in (
        ("q_scale", q_scale),
        ("weights", weights),
        ("k_int8_cache", k_int8_cache),
        ("k_scale_cache", k_scale_cache),
    ):
        if t.device != q_int8.device:
            _checks.fail(op, f"argument '{arg}' must be on {q_int8.device} (as 'q_int8'), got {t.device}")


def _validate_quant(
    q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
) -> None:
    op = "quant_lightning_indexer"
    _quant_structure(
        op, q_int8, q_scale, weights, k_int8_cache, k_scale_cache, block_table, cu_seqlens_q, seq_lens_k
    )
    _check_paging_of(op, q_int8.shape[0], k_int8_cache, block_table, cu_seqlens_q, seq_lens_k)

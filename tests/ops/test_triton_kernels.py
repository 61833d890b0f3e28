"""Building blocks of the Triton kernels against independent formulas: the per-row top-k selection
(ties, signed zeros, NaN, short rows, several tiles) and the copy kernel's layout handling."""

from __future__ import annotations

import math

import pytest
import torch

from torch_kvoffload.ops import reference_kernel
from torch_kvoffload.ops import triton as triton_ops

pytestmark = pytest.mark.skipif(
    not (triton_ops.triton_available() and triton_ops.interpreting()),
    reason="needs triton and TRITON_INTERPRET=1 (CPU tensors)",
)


def _expected_topk(scores: torch.Tensor, visible: list[int], top_k: int) -> list[list[int]]:
    """Per row: visible positions by descending score, NaN first (as a descending sort puts it),
    equal scores (−0.0 == +0.0) by lower position, −1 padding."""
    out = []
    for t, n in enumerate(visible):
        row = scores[t, :n].tolist()
        order = sorted(range(n), key=lambda s, r=row: (0 if math.isnan(r[s]) else 1, -r[s], s))[:top_k]
        out.append(order + [-1] * (top_k - len(order)))
    return out


@pytest.mark.parametrize(
    ("width", "top_k"),
    [(40, 1), (150, 7), (150, 64), (200, 130), (33, 50), (16, 16)],
)
def test_topk_kernel_matches_sorted_order(width: int, top_k: int) -> None:
    from torch_kvoffload.ops.triton.indexer import _topk

    rows = 4
    scores = torch.randint(-3, 4, (rows, width)).float()  # many ties
    scores[0, ::5] = -0.0
    scores[0, 1::5] = 0.0
    scores[1, 3] = math.nan
    scores[1, 7] = -math.nan
    scores[1, 9] = math.inf
    scores[2, :] = -math.inf  # visible keys with −inf scores still count before padding
    visible = [width, width - 3, width // 2, 0]
    for t, n in enumerate(visible):
        scores[t, n:] = -math.inf
    got = _topk(scores, torch.tensor(visible), top_k)
    assert got.dtype == torch.int32 and got.shape == (rows, top_k)
    assert got.tolist() == _expected_topk(scores, visible, top_k)


def test_coalesce_merges_only_jointly_contiguous_dims() -> None:
    from torch_kvoffload.ops.triton.copy import _coalesce

    # contiguous [2, 3, 4] in both: one dim
    assert _coalesce((2, 3, 4), (12, 4, 1), (12, 4, 1)) == ([24], [1], [1])
    # dst transposed in its last two dims: nothing merges past the first dim
    assert _coalesce((2, 3, 4), (12, 4, 1), (12, 1, 3)) == ([2, 3, 4], [12, 4, 1], [12, 1, 3])
    # size-1 dims drop out; an all-ones shape keeps one unit dim
    assert _coalesce((1, 5, 1), (5, 1, 1), (10, 2, 2)) == ([5], [1], [2])
    assert _coalesce((1, 1), (1, 1), (1, 1)) == ([1], [1], [1])


def test_copy_blocks_layout_beyond_the_kernel_dims_uses_the_reference_path() -> None:
    """A block layout with more than four non-mergeable dims still copies correctly."""
    from torch_kvoffload.ops.triton.copy import MAX_INNER_DIMS

    shape = (4, 2, 3, 2, 3, 2)
    src = torch.randn(shape)
    dst = torch.zeros(2, 3, 2, 3, 2, 4).permute(5, 4, 3, 2, 1, 0)  # every dim strided differently
    assert dst.shape == shape and len(shape) - 1 > MAX_INNER_DIMS
    mapping = torch.tensor([[3, 0], [0, 2]])
    expected = dst.clone()
    reference_kernel("copy_blocks")(src, expected, mapping)
    triton_ops.triton_kernel("copy_blocks")(src, dst, mapping)
    assert torch.equal(dst, expected)
    assert torch.equal(dst[0], src[3]) and torch.equal(dst[2], src[0]) and not dst[1].any()


@pytest.mark.parametrize("quant", [False, True])
def test_indexer_buffers_scores_in_token_chunks(monkeypatch: pytest.MonkeyPatch, quant: bool) -> None:
    """With a score buffer smaller than the call, the top-k ops score and select chunk by chunk of
    tokens (here one or two tokens per chunk) and still equal the reference. Integer data, and two heads
    keep the fp32 sums order-free, so the comparison is exact."""
    from torch_kvoffload.ops import hadamard_quant_int8
    from torch_kvoffload.ops.triton import indexer as triton_indexer

    width_blocks, bs, heads, dim = 5, 16, 2, 16
    monkeypatch.setattr(triton_indexer, "SCORE_BUFFER", 2 * width_blocks * bs - 1)
    nb = 12
    table = torch.randperm(nb)[: 2 * width_blocks].view(2, width_blocks).to(torch.int32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    lens = torch.tensor([70, 33], dtype=torch.int32)
    q = torch.randint(-3, 4, (5, heads, dim)).float()
    w = torch.randint(-2, 3, (5, heads)).float()
    k = torch.randint(-3, 4, (nb, bs, dim)).float()
    if quant:
        qi, qs = hadamard_quant_int8(q)
        ki, ks = hadamard_quant_int8(k)
        args = (qi, qs, w, ki, ks, table, cu, lens, 9)
        name = "quant_lightning_indexer"
    else:
        args = (q, w, k, table, cu, lens, 9)
        name = "lightning_indexer"
    expected = reference_kernel(name)(*args)
    assert torch.equal(triton_ops.triton_kernel(name)(*args), expected)

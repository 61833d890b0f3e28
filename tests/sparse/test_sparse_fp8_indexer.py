"""Sparse decode offload with ``indexer_dtype="fp8_e4m3"``: the runtime selects from the FP8 indexer rows
(``hadamard_quant_fp8`` on the query, ``fp8_lightning_indexer``) and attends over the host pool's rows
at those positions, step after step; a step missing its FP8 rows is refused and leaves the runtime
usable."""

from __future__ import annotations

import math

import pytest
import torch
from support.references import dense_mla_attention

from torch_kvoffload.ops import fp8_lightning_indexer, hadamard_quant_fp8
from torch_kvoffload.sparse import DecodeRows, IndexerInputs, SparseDecodeConfig, SparseDecodeOffload

LAYERS, DC, DR, H, HI, DI = 2, 32, 8, 4, 8, 128
BS, TOP_K, ROWS, MAX_LEN = 8, 6, 2, 48
SCALE = 1.0 / math.sqrt(DC + DR)


def test_decode_steps_select_from_fp8_rows_and_attend_over_the_selected_host_rows():
    g = torch.Generator().manual_seed(0)
    cfg = SparseDecodeConfig(
        top_k=TOP_K, host_pool_blocks=16, block_size=BS, indexer_dtype="fp8_e4m3", kv_dtype="fp32"
    )
    rt = SparseDecodeOffload(cfg, num_layers=LAYERS, max_rows=ROWS, kv_lora_rank=DC, rope_dim=DR,
                             device=torch.device("cpu"))  # fmt: skip
    ids, lengths = [0, 1], [20, 13]
    nb = rt.pool.num_blocks
    rows = hadamard_quant_fp8(torch.zeros(1, DI)).shape[-1]
    k_rows = [torch.zeros(nb, BS, rows, dtype=torch.uint8) for _ in range(LAYERS)]
    kv = {(r, layer): torch.randn(MAX_LEN, DC + DR, generator=g) for r in ids for layer in range(LAYERS)}
    for r in ids:
        rt.reserve(r, MAX_LEN)
    try:
        for step in range(4):
            lengths = [n + 1 for n in lengths] if step else lengths
            bt = rt.pool.block_table(ids, max_blocks=MAX_LEN // BS)
            seq = torch.tensor(lengths, dtype=torch.int32)
            for layer in range(LAYERS):
                for r, n in zip(ids, lengths, strict=True):  # the rows so far, in the pool and the FP8 cache
                    pos = torch.arange(n - 1, n) if step else torch.arange(n)
                    rows_kv = kv[r, layer][pos]
                    rt.append(
                        layer, [r] * len(pos), pos, rows_kv[:, :DC].contiguous(), rows_kv[:, DC:].contiguous()
                    )
                    slots = rt.pool.slots(r, pos)
                    k_rows[layer][slots // BS, slots % BS] = hadamard_quant_fp8(
                        torch.randn(len(pos), DI, generator=g)
                    )
                idx = IndexerInputs(
                    q=torch.randn(ROWS, HI, DI, generator=g), weights=torch.rand(ROWS, HI, generator=g),
                    block_table=bt, cu_seqlens_q=torch.arange(ROWS + 1, dtype=torch.int32), seq_lens_k=seq,
                    k_fp8_rows=k_rows[layer],
                )  # fmt: skip
                q_nope, q_pe = torch.randn(ROWS, H, DC, generator=g), torch.randn(ROWS, H, DR, generator=g)
                if step == 1 and layer == 0:  # refused before anything changes; the same step then runs
                    bad = IndexerInputs(**{**idx.__dict__, "k_fp8_rows": None})
                    with pytest.raises(ValueError, match=r"FP8 indexer path needs indexer\.k_fp8_rows"):
                        rt.attend(
                            layer, q_nope, q_pe, SCALE, bad, DecodeRows(torch.tensor(ids), seq.long(), bt)
                        )
                res = rt.attend(
                    layer, q_nope, q_pe, SCALE, idx, DecodeRows(torch.tensor(ids), seq.long(), bt)
                )
                want_topk = fp8_lightning_indexer(
                    hadamard_quant_fp8(idx.q), idx.weights, k_rows[layer], bt, idx.cu_seqlens_q, seq, TOP_K
                )
                assert torch.equal(res.topk, want_topk)
                for i, r in enumerate(ids):
                    keys = kv[r, layer]
                    want, _ = dense_mla_attention(
                        q_nope[i : i + 1],
                        q_pe[i : i + 1],
                        keys[:, :DC],
                        keys[:, DC:],
                        want_topk[i : i + 1],
                        SCALE,
                    )
                    torch.testing.assert_close(res.out[i : i + 1], want, rtol=1e-5, atol=1e-5)
    finally:
        rt.close()

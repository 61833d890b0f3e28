"""Sparse decode offload with ``kv_dtype="fp8_e4m3"``: the host pool and the hot buffers keep DeepSeek's FP8
latent rows (``uint8 [.., Dc + 4 * Dc / 128 + 2 * Dr]``, an empty rotary part), appended floating rows are
quantized on their way into the pool, a miss moves one row's bytes and attention reads the rows dequantized.

The reference: dense MLA attention over the ground truth passed through FlashMLA's quantization as
``support.fp8_reference`` writes it (latent values per 128-tile, RoPE values rounded to bf16), at the top-k
positions the step selected."""

from __future__ import annotations

import math

import pytest
import torch
from support.fp8_reference import latent_quant_dequant
from support.references import dense_mla_attention

from torch_kvoffload.ops.fp8 import kv_row_bytes
from torch_kvoffload.sparse import DecodeRows, IndexerInputs, SparseDecodeConfig, SparseDecodeOffload
from torch_kvoffload.sparse.host_pool import HostKVPool

CPU = torch.device("cpu")
LAYERS, DC, DR, H, HI, DI = 2, 256, 16, 4, 8, 16
BS, TOP_K, CAP, MAX_LEN = 8, 6, 10, 64
ROW = kv_row_bytes(DC, DR)  # 256 e4m3 values, 2 fp32 scales, 16 bf16 RoPE values
SCALE = 1.0 / math.sqrt(DC + DR)
FP8 = "fp8_e4m3"


def _config(**kw) -> SparseDecodeConfig:
    base = dict(top_k=TOP_K, capacity=CAP, host_pool_blocks=32, block_size=BS, kv_dtype=FP8)
    return SparseDecodeConfig(**{**base, **kw})


def _runtime(cfg: SparseDecodeConfig, device: torch.device = CPU, **kw) -> SparseDecodeOffload:
    return SparseDecodeOffload(
        cfg, num_layers=LAYERS, max_rows=3, kv_lora_rank=DC, rope_dim=DR, device=device, **kw
    )


def test_the_config_keeps_fp8_rows_as_bytes():
    cfg = _config()
    assert cfg.fp8_kv and cfg.torch_kv_dtype == torch.uint8
    assert cfg.row_dims(DC, DR) == (DC + 4 * (DC // 128) + 2 * DR, 0) == (ROW, 0)
    assert _config(kv_dtype="bf16").row_dims(DC, DR) == (DC, DR)
    with pytest.raises(ValueError, match="int8"):
        _config(kv_dtype="int8")


@pytest.mark.parametrize("fused", [True, False])
def test_decode_steps_over_fp8_rows_equal_attention_over_the_quantized_ground_truth(fused):
    g = torch.Generator().manual_seed(1)
    rt = _runtime(_config(fused=fused))
    ids, lengths = [0, 1, 2], [30, 17, 41]
    # varied magnitudes per tile: the per-tile scales matter
    kv = {(r, ly): torch.randn(MAX_LEN, DC, generator=g) * torch.rand(1, DC, generator=g) * 8 for r in ids for ly in range(LAYERS)}  # fmt: skip
    pe = {(r, ly): torch.randn(MAX_LEN, DR, generator=g) for r in ids for ly in range(LAYERS)}
    ik = {(r, ly): torch.randn(MAX_LEN, DI, generator=g) for r in ids for ly in range(LAYERS)}
    k_cache = [torch.zeros(rt.pool.num_blocks, BS, DI) for _ in range(LAYERS)]
    for r in ids:
        rt.reserve(r, MAX_LEN)
    try:
        for step in range(5):
            order = [2, 0, 1] if step % 2 else ids  # rows in another order: not one ascending run
            lens = [n + step for n in lengths]
            for ly in range(LAYERS):
                for r, n in zip(ids, lens, strict=True):
                    pos = torch.arange(n - 1, n) if step else torch.arange(n)
                    rt.append(ly, [r] * len(pos), pos, kv[r, ly][pos], pe[r, ly][pos])
                    slots = rt.pool.slots(r, torch.arange(MAX_LEN))
                    k_cache[ly][slots // BS, slots % BS] = ik[r, ly]
            seq = torch.tensor([lens[ids.index(r)] for r in order], dtype=torch.int32)
            bt = rt.pool.block_table(order, max_blocks=MAX_LEN // BS)
            before = rt.counters.snapshot()
            for ly in range(LAYERS):
                idx = IndexerInputs(
                    q=torch.randn(3, HI, DI, generator=g), weights=torch.rand(3, HI, generator=g), block_table=bt,
                    cu_seqlens_q=torch.arange(4, dtype=torch.int32), seq_lens_k=seq, k_cache=k_cache[ly],
                )  # fmt: skip
                q_nope, q_pe = torch.randn(3, H, DC, generator=g), torch.randn(3, H, DR, generator=g)
                res = rt.attend(ly, q_nope, q_pe, SCALE, idx, DecodeRows(torch.tensor(order), seq.long(), bt))
                for t, r in enumerate(order):
                    want, _ = dense_mla_attention(
                        q_nope[t : t + 1], q_pe[t : t + 1], latent_quant_dequant(kv[r, ly]),
                        pe[r, ly].bfloat16().float(), res.topk[t : t + 1], SCALE,
                    )  # fmt: skip
                    # fp32 sums of 272 products of latent values up to ~30, in another order than the reference's
                    torch.testing.assert_close(res.out[t : t + 1], want, rtol=1e-4, atol=1e-4)
            after = rt.counters.snapshot()
            misses = after["misses"] - before["misses"]
            assert after["bytes_h2d"] - before["bytes_h2d"] == misses * ROW
            if step:
                assert after["hits"] > before["hits"]  # the hot buffers' FP8 rows serve later steps
        n_rows = sum(lengths) + 4 * len(ids)
        assert rt.counters.snapshot()["bytes_d2h"] == LAYERS * n_rows * ROW
    finally:
        rt.close()


def test_the_pool_and_hot_buffers_hold_the_rows_bytes_and_bad_rows_change_nothing():
    rt = _runtime(_config())
    g = torch.Generator().manual_seed(2)
    try:
        assert rt.pool.kv_c(0).shape == (rt.pool.num_blocks, BS, ROW) and rt.pool.dtype == torch.uint8
        assert rt.pool.k_pe(0).shape[-1] == 0 and rt.pool.row_bytes == ROW
        assert rt.hot_kv_c[0].shape == (3, CAP, ROW) and rt.hot_kv_c[0].dtype == torch.uint8
        assert rt.device_bytes() == LAYERS * 3 * CAP * ROW
        rt.reserve(7, MAX_LEN)
        kv, pe = torch.randn(5, DC, generator=g), torch.randn(5, DR, generator=g)
        rt.append(0, [7] * 5, torch.arange(5), kv, pe)
        pool_before = rt.pool.kv_c(0).clone()
        with pytest.raises(ValueError, match=rf"kv_c.*{DC}"):  # the model's width, not the row's
            rt.append(0, [7] * 5, torch.arange(5, 10), torch.randn(5, ROW), pe)
        assert torch.equal(rt.pool.kv_c(0), pool_before)
        rt.append(0, [7] * 5, torch.arange(5, 10), kv, pe)  # and the runtime goes on
        slots = rt.pool.slots(7, torch.arange(10))
        stored = rt.pool.rows(0)[0][slots]
        from torch_kvoffload.ops.fp8_attention import dequantize_rows

        got_c, got_pe = dequantize_rows(stored, DC)
        torch.testing.assert_close(got_c, latent_quant_dequant(torch.cat([kv, kv])), rtol=0, atol=0)
        torch.testing.assert_close(got_pe, torch.cat([pe, pe]).bfloat16().float(), rtol=0, atol=0)
    finally:
        rt.close()


@pytest.mark.parametrize("indexer", ["bf16", FP8])
def test_the_device_step_equals_the_host_step(indexer):
    """The host-sync-free device step (Triton launches: on a CUDA device where there is one, else under the
    interpreter) over FP8 rows, with the floating indexer or the FP8 one (its queries quantized on the
    device, scores from FP8 rows): the host step's top-k, hot-buffer bytes and counts, and its output within
    fp32 rounding, step after step, with the rows in order and out of order."""
    from torch_kvoffload.ops.fp8_indexer import hadamard_quant_fp8
    from torch_kvoffload.ops.triton import interpreting, triton_available

    on_gpu = torch.cuda.is_available()
    if not (triton_available() and (interpreting() or on_gpu)):
        pytest.skip("needs triton on a CUDA device or under TRITON_INTERPRET=1")
    device = torch.device("cuda") if on_gpu else CPU
    g = torch.Generator().manual_seed(5)
    fp8_index = indexer == FP8
    di = 128 if fp8_index else DI  # FP8 indexer rows: 128-wide Hadamard groups
    cfg = _config(indexer_dtype=indexer)
    host, dev = _runtime(cfg, device, step_path="host"), _runtime(cfg, device, step_path="device")
    assert dev.device_step and not host.device_step
    ids, lengths = [0, 1, 2], [21, 14, 30]
    k_cache = [torch.randn(host.pool.num_blocks, BS, di, generator=g).to(device) for _ in range(LAYERS)]
    keys = {"k_fp8_rows": [hadamard_quant_fp8(k) for k in k_cache]} if fp8_index else {"k_cache": k_cache}
    try:
        for rt in (host, dev):
            for r in ids:
                rt.reserve(r, MAX_LEN)
        # the FP8 indexer's own launches: a prefill step and a decode step out of order (the residency and copy
        # paths after them are the floating variant's, stepped further)
        for step in range(2 if fp8_index else 4):
            order = [1, 2, 0] if step % 2 else ids
            lens = [n + step for n in lengths]
            for ly in range(LAYERS):
                for r, n in zip(ids, lens, strict=True):
                    pos = torch.arange(n - 1, n) if step else torch.arange(n)
                    kv, pe = torch.randn(len(pos), DC, generator=g), torch.randn(len(pos), DR, generator=g)
                    for rt in (host, dev):
                        rt.append(ly, [r] * len(pos), pos, kv.to(device), pe.to(device))
            seq = torch.tensor([lens[ids.index(r)] for r in order], dtype=torch.int32)
            bt = host.pool.block_table(order, max_blocks=MAX_LEN // BS)
            assert torch.equal(bt, dev.pool.block_table(order, max_blocks=MAX_LEN // BS))
            for ly in range(LAYERS):
                idx = IndexerInputs(
                    q=torch.randn(3, HI, di, generator=g).to(device), weights=torch.rand(3, HI, generator=g).to(device),
                    block_table=bt.to(device), cu_seqlens_q=torch.arange(4, dtype=torch.int32).to(device),
                    seq_lens_k=seq.to(device), **{name: k[ly] for name, k in keys.items()},
                )  # fmt: skip
                q_nope = torch.randn(3, H, DC, generator=g).to(device)
                q_pe = torch.randn(3, H, DR, generator=g).to(device)
                rows = DecodeRows(torch.tensor(order), seq.long(), bt)
                a = host.attend(ly, q_nope, q_pe, SCALE, idx, rows)
                b = dev.attend(ly, q_nope, q_pe, SCALE, idx, rows)
                assert torch.equal(a.topk, b.topk)
                torch.testing.assert_close(b.out, a.out, rtol=1e-4, atol=1e-4)
                assert torch.equal(host.hot_kv_c[ly], dev.hot_kv_c[ly])
                for r, n in zip(ids, lens, strict=True):  # the written rows (the rest is uninitialised)
                    at = host.pool.slots(r, torch.arange(n))
                    assert torch.equal(host.pool.rows(ly)[0][at], dev.pool.rows(ly)[0][at])
        for name in ("hits", "misses", "bytes_h2d", "bytes_d2h"):
            assert host.counters.snapshot()[name] == dev.counters.snapshot()[name], name
    finally:
        host.close()
        dev.close()


def test_fp16_queries_are_refused():
    rt = _runtime(_config())
    try:
        rt.reserve(0, MAX_LEN)
        rt.append(0, [0] * 9, torch.arange(9), torch.randn(9, DC), torch.randn(9, DR))
        bt = rt.pool.block_table([0], max_blocks=MAX_LEN // BS)
        seq = torch.tensor([9], dtype=torch.int32)
        idx = IndexerInputs(
            q=torch.randn(1, HI, DI), weights=torch.rand(1, HI), block_table=bt,
            cu_seqlens_q=torch.arange(2, dtype=torch.int32), seq_lens_k=seq,
            k_cache=torch.zeros(rt.pool.num_blocks, BS, DI),
        )  # fmt: skip
        rows = DecodeRows(torch.tensor([0]), seq.long(), bt)
        with pytest.raises(ValueError, match=r"q_nope.*float16"):
            rt.attend(0, torch.randn(1, H, DC).half(), torch.randn(1, H, DR).half(), SCALE, idx, rows)
        for dtype in (torch.float32, torch.bfloat16):  # then both query dtypes run
            out = rt.attend(
                0, torch.randn(1, H, DC, dtype=dtype), torch.randn(1, H, DR, dtype=dtype), SCALE, idx, rows
            )
            assert out.out.dtype == dtype and bool(torch.isfinite(out.out).all())
    finally:
        rt.close()


def test_a_shared_pool_of_fp8_rows_is_attached_by_name_with_its_dims():
    owner = HostKVPool.create(LAYERS, 4, BS, ROW, 0, torch.uint8, shared=True)
    try:
        owner.kv_c(1)[2, 3] = torch.arange(ROW, dtype=torch.int64).remainder(251).to(torch.uint8)
        reader = HostKVPool.attach(owner.name, kv_lora_rank=ROW, rope_dim=0, dtype="uint8")
        try:
            assert reader.dtype == torch.uint8 and reader.k_pe(0).shape == (4, BS, 0)
            assert torch.equal(reader.kv_c(1)[2, 3], owner.kv_c(1)[2, 3])
        finally:
            reader.close()
        with pytest.raises(ValueError, match="rope_dim = 0, expected 16"):
            HostKVPool.attach(owner.name, rope_dim=16)
        with pytest.raises(ValueError, match="dtype"):
            HostKVPool.attach(owner.name, dtype=torch.bfloat16)
    finally:
        owner.close()
    with pytest.raises(ValueError, match="floating dtype or uint8"):
        HostKVPool.create(LAYERS, 4, BS, ROW, 0, torch.int8)

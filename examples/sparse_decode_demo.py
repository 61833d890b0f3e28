"""Sparse decode offload demo: a synthetic MLA + lightning-indexer decode loop.

Four requests with 1–3k-token histories decode 24 tokens each through ``SparseDecodeOffload`` (fused
manage + Copy-SFA, LRU residency, hot capacity 2 x top-k), on the accelerator when there is one, else on
the CPU. The full latent KV lives in the host pool; the device keeps only the per-layer hot buffers. The
scheduler hands the batch over in a different order every step: hot rows belong to requests, so the hits
stay. The script checks every output against dense attention over the same top-k, then prints the
counters and the device memory against a dense device cache.

    python examples/sparse_decode_demo.py
"""

from __future__ import annotations

import math

import torch

from torch_kvoffload.device import default_device
from torch_kvoffload.sparse import DecodeRows, IndexerInputs, SparseDecodeConfig, SparseDecodeOffload

LAYERS, DC, DR, HEADS, IDX_HEADS, IDX_DIM = 2, 512, 64, 8, 4, 128
BLOCK, TOP_K = 64, 256
HISTORY = [1024, 1536, 2048, 3072]
STEPS = 24


def main() -> None:
    torch.manual_seed(0)
    rows = len(HISTORY)
    max_len = max(HISTORY) + STEPS
    blocks_per_req = math.ceil(max_len / BLOCK)
    cfg = SparseDecodeConfig(
        top_k=TOP_K, host_pool_blocks=rows * blocks_per_req, block_size=BLOCK, kv_dtype="fp32", policy="lru"
    )
    dev = default_device()
    rt = SparseDecodeOffload(cfg, num_layers=LAYERS, max_rows=rows, kv_lora_rank=DC, rope_dim=DR, device=dev)
    scale = 1.0 / math.sqrt(DC + DR)
    ids = list(range(rows))
    for rid in ids:
        rt.reserve(rid, max_len)
    order_gen = torch.Generator().manual_seed(1)
    # prefill history: in production it arrives from the prefill node; here it is random
    dense_kv = [torch.randn(rows, max_len, DC) for _ in range(LAYERS)]
    dense_pe = [torch.randn(rows, max_len, DR) for _ in range(LAYERS)]
    index_k = [torch.zeros(rt.pool.num_blocks, BLOCK, IDX_DIM, device=dev) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        for r, n in enumerate(HISTORY):
            slots = rt.pool.slots(r, torch.arange(n))
            b, o = slots // BLOCK, slots % BLOCK
            rt.pool.kv_c(layer)[b, o] = dense_kv[layer][r, :n]
            rt.pool.k_pe(layer)[b, o] = dense_pe[layer][r, :n]
            index_k[layer][b.to(dev), o.to(dev)] = torch.randn(n, IDX_DIM, device=dev)
    lengths = torch.tensor(HISTORY)
    # a row's indexer query drifts slowly from step to step, so consecutive top-k selections overlap
    q_base = [torch.randn(rows, IDX_HEADS, IDX_DIM) for _ in range(LAYERS)]
    worst = 0.0
    for _step in range(STEPS):
        pos = lengths.clone()
        lengths += 1
        order = torch.randperm(rows, generator=order_gen).tolist()  # this step's batch order
        bt = rt.pool.block_table(order, max_blocks=blocks_per_req)
        for layer in range(LAYERS):
            # (1) new token K/V computed on the device, (2) appended to the host pool
            rt.append(
                layer,
                ids,
                pos,
                dense_kv[layer][torch.arange(rows), pos].to(dev),
                dense_pe[layer][torch.arange(rows), pos].to(dev),
            )
            slots = torch.cat([rt.pool.slots(r, pos[r : r + 1]) for r in ids]).to(dev)
            index_k[layer][slots // BLOCK, slots % BLOCK] = torch.randn(rows, IDX_DIM, device=dev)
            # (3)-(7) select, manage, copy misses, attend
            q_nope, q_pe = torch.randn(rows, HEADS, DC), torch.randn(rows, HEADS, DR)
            q_idx = q_base[layer][order] + 0.3 * torch.randn(rows, IDX_HEADS, IDX_DIM)
            indexer = IndexerInputs(
                q=q_idx.to(dev), weights=torch.ones(rows, IDX_HEADS, device=dev), block_table=bt.to(dev),
                cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32, device=dev),
                seq_lens_k=lengths[order].to(dev, torch.int32), k_cache=index_k[layer],
            )  # fmt: skip
            res = rt.attend(
                layer, q_nope.to(dev), q_pe.to(dev), scale, indexer,
                DecodeRows(torch.tensor(order), lengths[order] - 1, bt),
            )  # fmt: skip
            out, topk = res.out.cpu(), res.topk.cpu()
            for t, r in enumerate(order):
                sel = topk[t][topk[t] >= 0].long()
                kv, pe = dense_kv[layer][r, sel], dense_pe[layer][r, sel]
                p = torch.softmax(scale * (q_nope[t] @ kv.T + q_pe[t] @ pe.T), dim=-1)
                want = p @ kv
                worst = max(worst, float((out[t] - want).norm() / want.norm()))
    c = rt.counters.snapshot()
    total = c["hits"] + c["misses"]
    tokens = int(lengths.sum())
    hot, dense = rt.device_bytes(), rt.dense_device_bytes(tokens)
    print(f"device {dev}; max relative error vs dense attention over the same top-k: {worst:.2e}")
    print(
        f"hits {int(c['hits'])}  misses {int(c['misses'])}  hit rate {c['hits'] / total:.3f}  evictions {int(c['evictions'])}"
    )
    print(
        f"H2D {c['bytes_h2d'] / 2**20:.1f} MiB  D2H {c['bytes_d2h'] / 2**20:.2f} MiB over {STEPS} steps x {LAYERS} layers"
    )
    full = STEPS * LAYERS * tokens * rt.pool.row_bytes  # reloading whole layers every step instead
    print(f"full-layer reload would move {full / 2**20:.0f} MiB ({full / max(c['bytes_h2d'], 1):.0f}x more)")
    print(
        f"device main KV: {hot / 2**20:.1f} MiB hot buffers vs {dense / 2**20:.1f} MiB dense ({hot / dense:.1%})"
    )
    rt.close()


if __name__ == "__main__":
    main()

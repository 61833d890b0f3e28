"""Sparse decode step per layer: Copy-SFA vs gather + PyTorch attention vs dense attention; int8 vs fp32
indexer top-k agreement.

DeepSeek-V3.2 shapes: 16 heads, kv_lora_rank Dc = 512, rope Dr = 64, top-k K = 2048, hot-buffer capacity
C = 4096 rows per decode row, bf16 main KV in a paged host pool (128-token blocks). Per context length and
decode step (``--rows`` decode rows, one query token each):

* ``copy_sfa``: ``scatter_copy_sparse_mla_attention`` — copy the missed rows (``--miss`` of K) host→hot
  buffer, then sparse attention over the K hot slots;
* ``gather_torch_bf16`` / ``gather_torch_fp32``: gather the K selected rows from the host pool with
  ``index_select`` every step (no hot buffer), then PyTorch attention (matmul, softmax, matmul) in bf16,
  or in fp32 after converting the gathered rows; the faster of the two is the baseline;
* ``dense_fp32``: dense attention over the whole context with PyTorch fp32 matmuls over a pre-converted
  fp32 copy of the context (the fastest dense PyTorch path on CPUs without bf16 matmul units; the
  conversion is not timed, which favours dense).

All variants of one context are timed round-robin in the same run (median wall time). The indexer part
measures, on random data, how many of the fp32 indexer's top-k positions the int8 path
(``hadamard_quant_int8`` + ``quant_lightning_indexer``) also selects (64 heads, D = 128, top-2048).

    python benchmarks/sparse_ops_bench.py [--contexts 8192 32768 131072] [--rows 4] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from torch_kvoffload.ops import (
    hadamard_quant_int8,
    lightning_indexer,
    quant_lightning_indexer,
    scatter_copy_sparse_mla_attention,
)

H, DC, DR, TOPK, CAP, BLOCK = 16, 512, 64, 2048, 4096, 128
RESULTS = Path(__file__).resolve().parent / "results" / "sparse_ops_bench.json"


def timed_round_robin(fns: dict[str, Callable[[], object]], repeat: int, bar: tqdm) -> dict[str, float]:
    """Median seconds of each function, timed in turns so machine noise hits all alike (1 warm-up)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        bar.update(1)
    return {k: statistics.median(v) for k, v in times.items()}


def decode_step_case(context: int, rows: int, miss: float, repeat: int, bar: tqdm) -> dict[str, float]:
    dt = torch.bfloat16
    scale = (DC + DR) ** -0.5
    blocks_per_row = context // BLOCK
    num_blocks = rows * blocks_per_row
    host_c = torch.randn(num_blocks, BLOCK, DC, dtype=dt)
    host_pe = torch.randn(num_blocks, BLOCK, DR, dtype=dt)
    table = torch.randperm(num_blocks).view(rows, blocks_per_row).to(torch.int32)
    q_nope = torch.randn(rows, H, DC, dtype=dt)
    q_pe = torch.randn(rows, H, DR, dtype=dt)

    # Steady state: hot buffers full, the residency table picked K slots, `miss` of them newly filled.
    hot_c = torch.randn(rows, CAP, DC, dtype=dt)
    hot_pe = torch.randn(rows, CAP, DR, dtype=dt)
    n_miss = int(TOPK * miss)
    topk_tokens = torch.stack([torch.randperm(context)[:TOPK] for _ in range(rows)]).to(torch.int32)
    slots = torch.stack([torch.randperm(CAP)[:TOPK] for _ in range(rows)]).to(torch.int32)
    miss_tokens = topk_tokens[:, :n_miss].contiguous()
    miss_slots = slots[:, :n_miss].contiguous()
    miss_count = torch.full((rows,), n_miss, dtype=torch.int32)
    out = torch.empty(rows, H, DC, dtype=dt)
    lse = torch.empty(rows, H)

    def copy_sfa() -> None:
        scatter_copy_sparse_mla_attention(
            q_nope, q_pe, host_c, host_pe, table, hot_c, hot_pe, miss_tokens, miss_slots, miss_count, slots,
            scale, out, lse,
        )  # fmt: skip

    # Gather baseline: flat host rows of the top-k tokens, gathered with index_select every step.
    tok = topk_tokens.long()
    flat = (table.long().gather(1, tok // BLOCK) * BLOCK + tok % BLOCK).view(-1)
    pool_c, pool_pe = host_c.view(-1, DC), host_pe.view(-1, DR)
    q_cat = torch.cat([q_nope, q_pe], dim=-1)

    def gather(to_float: bool):
        def run() -> torch.Tensor:
            rc = pool_c.index_select(0, flat).view(rows, TOPK, DC)
            rp = pool_pe.index_select(0, flat).view(rows, TOPK, DR)
            k = torch.cat([rc, rp], dim=-1)
            q, v = q_cat, rc
            if to_float:
                q, k, v = q.float(), k.float(), v.float()
            s = torch.bmm(q, k.transpose(1, 2)).float() * scale
            p = torch.softmax(s, dim=-1)
            return torch.bmm(p.to(v.dtype), v).to(dt)

        return run

    # Dense baseline: every context row of each request, fp32 (converted once, outside the timing).
    dense_k = [
        torch.cat([host_c[table[r].long()].view(-1, DC), host_pe[table[r].long()].view(-1, DR)], -1).float()
        for r in range(rows)
    ]
    q_f = q_cat.float()

    def dense() -> torch.Tensor:
        outs = []
        for r in range(rows):
            s = (q_f[r] @ dense_k[r].T) * scale
            p = torch.softmax(s, dim=-1)
            outs.append(p @ dense_k[r][:, :DC])
        return torch.stack(outs).to(dt)

    fns = {
        "copy_sfa": copy_sfa,
        "gather_torch_bf16": gather(False),
        "gather_torch_fp32": gather(True),
        "dense_fp32": dense,
    }
    t = timed_round_robin(fns, repeat, bar)
    gather_best = min(t["gather_torch_bf16"], t["gather_torch_fp32"])
    return {
        "context": context,
        "rows": rows,
        "miss_rows_per_row": n_miss,
        **{f"{k}_ms": v * 1e3 for k, v in t.items()},
        "dense_over_copy_sfa": t["dense_fp32"] / t["copy_sfa"],
        "gather_over_copy_sfa": gather_best / t["copy_sfa"],
    }


def indexer_agreement(context: int, tokens: int, heads: int, bar: tqdm) -> dict[str, float]:
    """Share of the fp32 indexer's top-k positions that the int8 path also selects (random data)."""
    dim, block = 128, 128
    q = torch.randn(tokens, heads, dim)
    w = torch.randn(tokens, heads) * heads**-0.5
    nb = context // block
    k = torch.randn(nb, block, dim)
    table = torch.randperm(nb).view(1, nb).to(torch.int32)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([context], dtype=torch.int32)
    start = time.perf_counter()
    ref = lightning_indexer(q, w, k, table, cu, lens, TOPK)
    t_float = time.perf_counter() - start
    qi, qs = hadamard_quant_int8(q)
    ki, ks = hadamard_quant_int8(k)
    start = time.perf_counter()
    got = quant_lightning_indexer(qi, qs, w, ki, ks, table, cu, lens, TOPK)
    t_int8 = time.perf_counter() - start
    per_token = []
    for a, b in zip(ref.tolist(), got.tolist(), strict=True):
        valid = {x for x in a if x >= 0}
        per_token.append(len(valid & set(b)) / max(1, len(valid)))
    bar.update(1)
    return {
        "context": context,
        "tokens": tokens,
        "heads": heads,
        "top_k": TOPK,
        "agreement_mean": statistics.mean(per_token),
        "agreement_min": min(per_token),
        "float_indexer_ms_per_token": t_float * 1e3 / tokens,
        "int8_indexer_ms_per_token": t_int8 * 1e3 / tokens,
    }


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers, *[[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--rows", type=int, default=4, help="decode rows (requests) per step")
    parser.add_argument(
        "--miss", type=float, default=0.10, help="fraction of the top-k missing the hot buffer"
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--indexer-heads", type=int, default=64)
    parser.add_argument("--indexer-tokens", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)

    steps, agreement = [], []
    with tqdm(total=len(args.contexts) * (args.repeat + 1), desc="sparse ops") as bar:
        for ctx in args.contexts:
            steps.append(decode_step_case(ctx, args.rows, args.miss, args.repeat, bar))
            agreement.append(indexer_agreement(ctx, args.indexer_tokens, args.indexer_heads, bar))

    step_rows = [
        [s["context"], s["copy_sfa_ms"], s["gather_torch_bf16_ms"], s["gather_torch_fp32_ms"], s["dense_fp32_ms"],
         s["dense_over_copy_sfa"], s["gather_over_copy_sfa"]]
        for s in steps
    ]  # fmt: skip
    agree_rows = [
        [a["context"], a["heads"], a["top_k"], a["agreement_mean"], a["agreement_min"],
         a["float_indexer_ms_per_token"], a["int8_indexer_ms_per_token"]]
        for a in agreement
    ]  # fmt: skip
    print("\nDecode step per layer (bf16, 16 heads, Dc 512, Dr 64, K 2048, C 4096), median ms:")
    headers = ["context", "copy_sfa", "gather bf16", "gather fp32", "dense fp32", "dense/csfa", "gather/csfa"]
    print(table(headers, step_rows))
    print("\nIndexer top-k set agreement, int8 vs fp32 (random data):")
    print(table(["context", "heads", "top_k", "mean", "min", "fp32 ms/tok", "int8 ms/tok"], agree_rows))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "args": vars(args),
        "decode_step": steps,
        "indexer_agreement": agreement,
    }
    RESULTS.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()

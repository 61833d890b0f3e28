"""Sparse decode offload benchmark: residency update cost and residency policies on top-k traces.

1. ``kvoffload::residency_update`` cost in ns per (row, slot) for R = 64, K = 2048, C = 4096 on traces with
   70 % step-to-step reuse, with 1 and 2 threads, C++ kernel vs the pure-PyTorch reference (goal:
   <= 3 ns per (row, slot) per thread). A memory-bound calibration (copying R x C int32) is measured in the
   same run so that figures from a loaded machine can be read relative to it.
2. Hit rate of LRU, ``score`` and Belady's offline optimum on traces with reuse 0.5 / 0.7 / 0.9 over 256
   steps at capacity 1x / 1.5x / 2x / 3x top-k, and the bytes moved host->device per step and layer
   (misses x row bytes, DeepSeek row: (512 + 64) x bf16) against reloading the full layer every step.
3. One ``SparseDecodeOffload.attend`` (a layer's decode step: indexer, residency, miss copy, attention)
   with the batch in the same order every step (Copy-SFA on the rows' slice of the hot buffers) and
   shuffled every step (miss copy with ``copy_rows``, attention over the whole hot buffer).

Writes ``benchmarks/results/sparse_decode_bench.json`` and ``sparse_decode_bench.png``.

    python benchmarks/sparse_decode_bench.py            # default run (a few minutes)
    python benchmarks/sparse_decode_bench.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # research utilities, not shipped
from residency_policies import belady_misses, make_reuse_trace, simulate_policy

from torch_kvoffload.ops import new_residency_outputs, new_residency_state, reference_kernel
from torch_kvoffload.sparse import DecodeRows, IndexerInputs, SparseDecodeConfig, SparseDecodeOffload

RESULTS = Path(__file__).resolve().parent / "results"
ROW_BYTES = (512 + 64) * 2  # one token row of one layer: latent + rope, bf16


def _reuse_topk(
    steps: int, rows: int, top_k: int, length: int, reuse: float, seed: int
) -> list[torch.Tensor]:
    """Per-row top-k sequences over ``length`` positions keeping ``reuse`` of the previous selection."""
    g = torch.Generator().manual_seed(seed)
    keep = round(reuse * top_k)
    prev = torch.stack([torch.randperm(length, generator=g)[:top_k] for _ in range(rows)])
    out = [prev]
    for _ in range(steps - 1):
        cur = []
        for r in range(rows):
            kept = prev[r][torch.randperm(top_k, generator=g)[:keep]]
            mask = torch.ones(length, dtype=torch.bool)
            mask[prev[r]] = False
            fresh = mask.nonzero().flatten()
            fresh = fresh[torch.randperm(fresh.numel(), generator=g)[: top_k - keep]]
            cur.append(torch.cat([kept, fresh])[torch.randperm(top_k, generator=g)])
        prev = torch.stack(cur)
        out.append(prev)
    return [t.to(torch.int32) for t in out]


def bench_update_cost(rows: int, top_k: int, capacity: int, steps: int, ref_steps: int) -> list[dict]:
    length = 16 * capacity
    trace = _reuse_topk(steps + 2, rows, top_k, length, 0.7, seed=0)
    ids = torch.arange(rows, dtype=torch.int64)
    stable = torch.full((rows,), length, dtype=torch.int64)
    scores = torch.randn(rows, length)
    results = []
    prev_threads = torch.get_num_threads()
    kernels = [
        ("cpp", torch.ops.kvoffload.residency_update, steps),
        ("reference", reference_kernel("residency_update"), ref_steps),
    ]
    cases = [(t, p, k) for t in (1, 2) for p in ("lru", "score") for k in kernels]
    for threads, policy, (name, fn, n_steps) in tqdm(cases, desc="residency_update cost"):
        torch.set_num_threads(threads)
        state = new_residency_state(rows, capacity)
        out = new_residency_outputs(rows, top_k)
        for tk in trace[:2]:  # warm the rows up
            fn(*state, tk, ids, stable, scores, policy, *out.as_tuple())
        times = []
        for tk in trace[2 : 2 + n_steps]:
            t0 = time.perf_counter()
            fn(*state, tk, ids, stable, scores, policy, *out.as_tuple())
            times.append(time.perf_counter() - t0)
        sec = sorted(times)[len(times) // 2]
        ns = sec * 1e9 / (rows * capacity)
        best = min(times) * 1e9 / (rows * capacity)
        results.append(dict(kernel=name, threads=threads, policy=policy, ms_per_step=sec * 1e3,
                            ns_per_row_slot=ns, ns_per_row_slot_thread=ns * threads,
                            best_ns_per_row_slot=best, best_ns_per_row_slot_thread=best * threads,
                            misses_per_row=float(out.miss_count.float().mean())))  # fmt: skip
    # calibration: copy of the R x C int32 state, same threads
    calib = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        a = torch.randint(0, 100, (rows, capacity), dtype=torch.int32)
        b = torch.empty_like(a)
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            b.copy_(a)
            ts.append(time.perf_counter() - t0)
        calib[threads] = sorted(ts)[10] * 1e9 / a.numel()
    torch.set_num_threads(prev_threads)
    for r in results:
        r["calibration_copy_ns_per_int32"] = calib[r["threads"]]
    return results


def bench_policies(steps: int, top_k: int, reuses: list[float], factors: list[float]) -> list[dict]:
    results = []
    cases = [(r, f) for r in reuses for f in factors]
    traces = {r: make_reuse_trace(steps, top_k, r, seed=1) for r in tqdm(reuses, desc="traces")}
    for reuse, factor in tqdm(cases, desc="policies"):
        trace = traces[reuse]
        capacity = round(factor * top_k)
        lru = simulate_policy(trace, capacity, "lru")
        score = simulate_policy(trace, capacity, "score")
        opt = belady_misses(trace, capacity)
        mean_len = sum(s.numel() for s in trace.scores) / steps
        # step 0 loads the whole selection under every policy; per-step figures exclude it
        steady = trace.accesses - top_k
        row = dict(reuse=reuse, measured_reuse=trace.measured_reuse(), capacity_factor=factor, capacity=capacity,
                   top_k=top_k, steps=steps, mean_seq_len=mean_len)  # fmt: skip
        for name, res in (("lru", lru), ("score", score), ("belady", opt)):
            row[f"{name}_hit_rate"] = res.hit_rate
            row[f"{name}_steady_hit_rate"] = 1.0 - (res.misses - top_k) / steady
            row[f"{name}_h2d_bytes_per_step"] = (res.misses - top_k) / (steps - 1) * ROW_BYTES
        row["full_reload_bytes_per_step"] = mean_len * ROW_BYTES
        results.append(row)
    return results


def bench_step(rows: int, top_k: int, context: int, steps: int) -> list[dict]:
    """ms per ``attend`` (one layer) for a fixed and a shuffled batch order, DeepSeek row widths, bf16."""
    dc, dr, heads, idx_heads, idx_dim, bs = 512, 64, 16, 4, 128, 64
    blocks = context // bs + 1
    results = []
    for order_kind in ("fixed", "shuffled"):
        cfg = SparseDecodeConfig(top_k=top_k, host_pool_blocks=rows * blocks, block_size=bs, kv_dtype="bf16")
        rt = SparseDecodeOffload(cfg, num_layers=1, max_rows=rows, kv_lora_rank=dc, rope_dim=dr,
                                 device=torch.device("cpu"))  # fmt: skip
        g = torch.Generator().manual_seed(0)
        for r in range(rows):
            rt.reserve(r, context + steps + 1)
        rt.pool.kv_c(0).normal_(generator=g)
        rt.pool.k_pe(0).normal_(generator=g)
        k_cache = torch.randn(rt.pool.num_blocks, bs, idx_dim, generator=g).bfloat16()
        q_base = torch.randn(rows, idx_heads, idx_dim, generator=g)
        times = []
        for step in range(steps):
            order = list(range(rows))
            if order_kind == "shuffled":
                order = torch.randperm(rows, generator=g).tolist()
            seq = torch.full((rows,), context + step, dtype=torch.int32)
            bt = rt.pool.block_table(order, max_blocks=blocks)
            idx = IndexerInputs(
                q=(q_base[order] + 0.3 * torch.randn(rows, idx_heads, idx_dim, generator=g)).bfloat16(),
                weights=torch.ones(rows, idx_heads).bfloat16(), block_table=bt,
                cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32), seq_lens_k=seq, k_cache=k_cache,
            )  # fmt: skip
            q_nope = torch.randn(rows, heads, dc, generator=g).bfloat16()
            q_pe = torch.randn(rows, heads, dr, generator=g).bfloat16()
            t0 = time.perf_counter()
            rt.attend(
                0, q_nope, q_pe, (dc + dr) ** -0.5, idx, DecodeRows(torch.tensor(order), seq.long(), bt)
            )
            times.append(time.perf_counter() - t0)
        c = rt.counters.snapshot()
        rt.close()
        steady = sorted(times[1:])  # step 0 loads every selected row
        results.append(dict(order=order_kind, rows=rows, top_k=top_k, context=context, steps=steps,
                            ms_per_layer_step=steady[len(steady) // 2] * 1e3,
                            hit_rate=c["hits"] / max(1, c["hits"] + c["misses"]),
                            h2d_bytes_per_step=c["bytes_h2d"] / steps))  # fmt: skip
    return results


def plot(policy_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reuses = sorted({r["reuse"] for r in policy_rows})
    fig, axes = plt.subplots(1, len(reuses), figsize=(4.5 * len(reuses), 3.6), sharey=True)
    axes = [axes] if len(reuses) == 1 else list(axes)
    for ax, reuse in zip(axes, reuses, strict=True):
        rows = sorted((r for r in policy_rows if r["reuse"] == reuse), key=lambda r: r["capacity_factor"])
        x = [r["capacity_factor"] for r in rows]
        for name, style in (("lru", "o-"), ("score", "s-"), ("belady", "^--")):
            ax.plot(x, [r[f"{name}_steady_hit_rate"] for r in rows], style, label=name)
        ax.set_title(f"step-to-step reuse {reuse}")
        ax.set_xlabel("hot capacity / top-k")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("hit rate (steady state)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--policy-top-k", type=int, default=512, help="top-k of the policy traces")
    args = p.parse_args()
    if args.quick:
        cost = bench_update_cost(8, 256, 512, steps=3, ref_steps=1)
        pol = bench_policies(32, 64, [0.5, 0.9], [1.0, 2.0])
        step = bench_step(4, 256, 4096, steps=4)
    else:
        cost = bench_update_cost(64, 2048, 4096, steps=9, ref_steps=1)
        pol = bench_policies(256, args.policy_top_k, [0.5, 0.7, 0.9], [1.0, 1.5, 2.0, 3.0])
        step = bench_step(16, 2048, 32768, steps=8)

    print("\nresidency_update cost (median and best step; goal <= 3 ns per (row, slot) per thread)")
    print(f"{'kernel':<10}{'policy':<8}{'threads':>8}{'ms/step':>10}{'ns/(row,slot)':>15}{'x threads':>11}"
          f"{'best x thr':>12}{'copy ns/int32':>15}")  # fmt: skip
    for r in cost:
        print(f"{r['kernel']:<10}{r['policy']:<8}{r['threads']:>8}{r['ms_per_step']:>10.2f}{r['ns_per_row_slot']:>15.2f}"
              f"{r['ns_per_row_slot_thread']:>11.2f}{r['best_ns_per_row_slot_thread']:>12.2f}"
              f"{r['calibration_copy_ns_per_int32']:>15.3f}")  # fmt: skip
    cpp = {(r["policy"], r["threads"]): r for r in cost if r["kernel"] == "cpp"}
    for r in cost:
        if r["kernel"] == "reference":
            r["cpp_speedup"] = r["ms_per_step"] / cpp[(r["policy"], r["threads"])]["ms_per_step"]
            print(
                f"C++ speedup over the reference ({r['policy']}, {r['threads']} thr): {r['cpp_speedup']:.0f}x"
            )

    print("\nhit rate (steady state, step 0 excluded) and H2D bytes per step and layer")
    print(
        f"{'reuse':>6}{'cap/K':>7}{'LRU':>8}{'score':>8}{'Belady':>8}{'LRU MB':>9}{'full MB':>9}{'ratio':>8}"
    )
    for r in pol:
        ratio = r["full_reload_bytes_per_step"] / max(r["lru_h2d_bytes_per_step"], 1.0)
        r["full_reload_over_lru"] = ratio
        print(f"{r['reuse']:>6}{r['capacity_factor']:>7}{r['lru_steady_hit_rate']:>8.3f}{r['score_steady_hit_rate']:>8.3f}"
              f"{r['belady_steady_hit_rate']:>8.3f}{r['lru_h2d_bytes_per_step'] / 2**20:>9.3f}"
              f"{r['full_reload_bytes_per_step'] / 2**20:>9.3f}{ratio:>8.1f}")  # fmt: skip

    print("\nSparseDecodeOffload.attend, one layer (median of the steps after the first)")
    print(
        f"{'order':<10}{'rows':>6}{'top_k':>7}{'context':>9}{'ms/step':>10}{'hit rate':>10}{'H2D MB/step':>13}"
    )
    for r in step:
        print(f"{r['order']:<10}{r['rows']:>6}{r['top_k']:>7}{r['context']:>9}{r['ms_per_layer_step']:>10.2f}"
              f"{r['hit_rate']:>10.3f}{r['h2d_bytes_per_step'] / 2**20:>13.2f}")  # fmt: skip

    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "sparse_decode_bench_quick" if args.quick else "sparse_decode_bench"
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"update_cost": cost, "policies": pol, "step": step}, indent=2)
    )
    plot(pol, RESULTS / f"{name}.png")
    print(f"\nwrote {RESULTS / (name + '.json')} and {name}.png")


if __name__ == "__main__":
    main()

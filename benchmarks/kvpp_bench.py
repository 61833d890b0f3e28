"""KVPP benchmark: capacity gain, broadcast traffic that follows the tokens, and hidden broadcast time.

1. Capacity (DeepSeek-V3-like: 61 target layers + 1 local MTP layer; main KV 512 + 64 bf16 and a 128-dim
   bf16 indexer key per token; 128-token blocks) at TP 2 / 4 / 8: blocks with KVPP / blocks without, for
   the same memory — from the budget formula (the fullest rank decides, every rank numbers blocks alike)
   and from a real allocation (zero-filled buffers) at a scaled-down budget (``--alloc-gib``, default
   0.5 GiB, because the full-size budget of a serving accelerator does not fit this machine's memory).
2. Traffic: 2 processes (gloo, loopback) serve the same decode forwards twice — broadcasting the
   forward's block runs, then whole bundle spans — with live requests holding 10 % of the pool
   (``--occupancy``). Blocks are handed out by a free-list allocator after request churn, so requests'
   blocks are scattered as in a serving engine. Reports bytes broadcast per forward, the ratio to the
   whole-span broadcast, the runs per layer, and checks the outputs are bit-identical.
3. Overlap: per decode step of the same 2-process run, side by side: the compute-only step (no broadcast),
   the step with KVPP one-layer-ahead prefetch of the block runs, and the same broadcasts back to back
   without compute. Hidden fraction = 1 − (time the compute thread waited) / (serial broadcast time); the
   first layer's broadcast has nothing before it in the forward, so with L layers at most (L − 1) / L can
   hide.

The compute workload is a plain stand-in for attention, not a model: per layer, each request gathers its
cached rows through its block table and the hidden state goes through a few matmuls with them
(``--compute-reps`` sets how much compute a layer has to hide a broadcast behind). The KVPP runtime is
driven directly (``build_kvpp_runtime``, ``begin_forward`` / ``wait_layer`` /
``end_forward``). Prints tables and writes ``benchmarks/results/kvpp_bench.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from _common import format_table, launch_gloo, write_json

from torch_kvoffload.kvpp import (
    BundleSpec,
    KVPPAllocation,
    KVPPConfig,
    KVPPPlan,
    assign_owners,
    block_runs,
    build_kvpp_runtime,
    create_kvpp_group,
)

GIB = 1024**3

# ------------------------------------------------------------------------------------------- capacity


def v3_bundle() -> BundleSpec:
    return BundleSpec.mla(128, 512, 64, torch.bfloat16, index_dim=128, index_dtype=torch.bfloat16)


def capacity_formula(tp: int, available: int, layers: int = 61, mtp: int = 1) -> dict:
    bundle = v3_bundle().bytes_per_block
    base_bpb = (layers + mtp) * bundle
    owners = assign_owners(range(layers), tp)
    plan = KVPPPlan(dict.fromkeys(range(layers), bundle), owners, 0, mtp * bundle)
    blocks = plan.group_num_blocks(available, tp)
    base_blocks = available // base_bpb
    return {
        "tp": tp,
        "bundle_bytes_per_block": bundle,
        "max_owned_layers": max(sum(1 for o in owners.values() if o == r) for r in range(tp)),
        "bytes_per_block_kvpp": plan.bytes_per_block,
        "bytes_per_block_base": base_bpb,
        "blocks_kvpp": blocks,
        "blocks_base": base_blocks,
        "gain": blocks / base_blocks,
    }


def capacity_real(tp: int, available: int, layers: int = 61, mtp: int = 1) -> dict:
    """Allocate for real on every rank of the group (one after the other) and the baseline."""
    spec = v3_bundle()
    bundles = dict.fromkeys(range(layers), spec)
    drafts = {layers + i: spec for i in range(mtp)}
    owners = assign_owners(bundles, tp)
    bpb = {k: s.bytes_per_block for k, s in bundles.items()}
    draft_bpb = sum(s.bytes_per_block for s in drafts.values())
    blocks = KVPPPlan(bpb, owners, 0, draft_bpb).group_num_blocks(available, tp)
    allocated = []
    for rank in range(tp):
        alloc = KVPPAllocation(KVPPPlan(bpb, owners, rank, draft_bpb), bundles, blocks, "cpu", drafts)
        assert alloc.allocated_bytes <= available
        allocated.append(alloc.allocated_bytes)
        del alloc
    base_blocks = available // ((layers + mtp) * spec.bytes_per_block)
    base = [torch.zeros(spec.bytes_per_block * base_blocks, dtype=torch.uint8) for _ in range(layers + mtp)]
    base_bytes = sum(t.numel() for t in base)
    del base
    return {
        "tp": tp,
        "available_bytes": available,
        "blocks_kvpp": blocks,
        "blocks_base": base_blocks,
        "gain": blocks / base_blocks,
        "max_allocated_bytes": max(allocated),
        "base_allocated_bytes": base_bytes,
    }


# ------------------------------------------------------------------------------ block tables (engine)


def churned_block_tables(
    num_blocks: int, occupancy: float, requests: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    """Block tables of ``requests`` live requests holding ``occupancy`` of the pool, from a free-list
    allocator (take from the head, freed blocks back at the tail) after rounds of requests of random
    lengths arriving and finishing. Returns the tables and each request's token count."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    live: list[list[int]] = []
    for _ in range(6):  # churn: fill most of the pool, then finish a random half
        while len(free) > num_blocks // 4:
            n = min(len(free) - num_blocks // 4, rng.randint(1, max(1, num_blocks // 16)))
            live.append([free.pop(0) for _ in range(n)])
        rng.shuffle(live)
        for table in live[: len(live) // 2]:
            free.extend(table)
        live = live[len(live) // 2 :]
    for table in live:
        free.extend(table)
    target = round(num_blocks * occupancy)
    sizes = [target // requests + int(i < target % requests) for i in range(requests)]
    tables = [[free.pop(0) for _ in range(n)] for n in sizes]
    return tables, [n * 16 - rng.randint(0, 15) for n in sizes]  # block size 16, last block partial


# -------------------------------------------------------------------------------------------- workers


def launch(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (``_common.launch_gloo``)."""
    launch_gloo(fn, world, *args, timeout_s=120)


def _layer_compute(
    layer: int,
    x: torch.Tensor,
    caches: dict[str, torch.Tensor],
    tables: list[list[int]],
    lengths: list[int],
    weight: torch.Tensor,
    reps: int,
) -> torch.Tensor:
    """Attention stand-in for a decode step: each request writes its new ``c_kv`` row, gathers its cached
    rows through its block table, and its hidden state ``x[r]`` (``[kv_lora_rank]``, fp32) goes through
    ``reps`` rounds of ``tanh(h·W + softmax(rows·h)·rows)``."""
    c_kv = caches["c_kv"]
    bs = c_kv.shape[1]
    out = []
    for r, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        pos = min(length, len(table) * bs - 1)
        c_kv[table[pos // bs], pos % bs] = x[r].to(c_kv.dtype)
        rows = c_kv[torch.tensor(table)].reshape(-1, c_kv.shape[-1])[: pos + 1].float()
        h = x[r]
        for _ in range(reps):
            h = torch.tanh(h @ weight + (rows @ h).softmax(0) @ rows)
        out.append(h)
    return torch.stack(out)


def _traffic_worker(
    rank: int, world: int, num_layers: int, num_blocks: int, tables, lengths, steps: int, reps: int, out: str
) -> None:
    group = create_kvpp_group(dp=1, pp=1, pcp=1, tp=world, device=torch.device("cpu"))
    cfg = KVPPConfig(enable_kvpp=True, tp_size=world, attention="sfa", wait_timeout_s=120)
    spec = BundleSpec.mla(16, 512, 64, torch.bfloat16, index_dim=128, index_dtype=torch.bfloat16)
    rt = build_kvpp_runtime(cfg, group, dict.fromkeys(range(num_layers), spec), num_blocks=num_blocks)
    sched = rt.scheduler
    hidden = 512  # = kv_lora_rank: the stand-in works in latent space
    weights = [
        torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(i)) / 24
        for i in range(num_layers)
    ]

    def reset() -> None:  # the owners' caches hold the same seeded history before each mode
        for layer in rt.plan.owned:
            g = torch.Generator().manual_seed(100 + layer)
            for v in rt.views(layer).values():
                v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))

    def forward(step: int, mode: str) -> tuple[torch.Tensor, float, float]:
        """One decode forward: ``mode`` "runs" (broadcast the block runs), "whole" (whole spans) or
        "compute" (no KVPP at all). Returns the outputs, seconds, and seconds waited for broadcasts."""
        x = torch.randn(len(tables), hidden, generator=torch.Generator().manual_seed(step))
        dist.barrier()
        t0 = time.perf_counter()
        waited0 = sched.counters.get("wait_seconds")
        if mode != "compute":
            sched.begin_forward(True, tables if mode == "runs" else None)
        for layer in range(num_layers):
            if mode != "compute":
                sched.wait_layer(layer)
            x = _layer_compute(
                layer, x, rt.views(layer), tables, [n + step for n in lengths], weights[layer], reps
            )
        if mode != "compute":
            sched.end_forward()
        return x, time.perf_counter() - t0, sched.counters.get("wait_seconds") - waited0

    def serial(block_tables) -> float:
        """The forward's broadcasts back to back, without compute (``None``: whole spans)."""
        dist.barrier()
        t0 = time.perf_counter()
        sched.begin_forward(True, block_tables)
        for layer in range(num_layers):
            sched.wait_layer(layer)
        sched.end_forward()
        return time.perf_counter() - t0

    result: dict = {"rank": rank, "modes": {}, "runs": None}
    for mode in ("runs", "whole"):
        reset()
        outputs, per_forward = [], []
        for step in range(steps):
            before = sched.counters.get("bytes_broadcast")
            y, _, _ = forward(step, mode)
            per_forward.append(sched.counters.get("bytes_broadcast") - before)
            outputs.append(y)
        result["modes"][mode] = {"outputs": outputs, "bytes_per_forward": per_forward}
    sched.begin_forward(True, tables)
    result["runs"] = sched.block_runs
    sched.end_forward()
    # overlap: interleave compute-only, KVPP (block runs) and serial broadcasts per step
    rows = []
    for step in range(steps):
        order = ["compute", "runs", "serial", "serial_whole"]
        order = order[step % 4 :] + order[: step % 4]
        row = {}
        for mode in order:
            if mode.startswith("serial"):
                row[mode] = serial(tables if mode == "serial" else None)
            else:
                _, seconds, waited = forward(steps + step, mode)
                row[mode] = seconds
                if mode == "runs":
                    row["waited"] = waited
        rows.append(row)
    result["overlap"] = rows
    result["bundle_bytes_per_block"] = spec.bytes_per_block
    rt.close()
    torch.save(result, out.format(rank=rank))


def traffic_and_overlap(args) -> dict:
    tables, lengths = churned_block_tables(args.pool_blocks, args.occupancy, args.requests, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank{rank}.pt")
        launch(
            _traffic_worker,
            2,
            args.layers,
            args.pool_blocks,
            tables,
            lengths,
            args.steps,
            args.compute_reps,
            out,
        )
        per_rank = [torch.load(out.format(rank=r), weights_only=False) for r in range(2)]
    bundle = per_rank[0]["bundle_bytes_per_block"]
    runs = per_rank[0]["modes"]["runs"]
    whole = per_rank[0]["modes"]["whole"]
    identical = all(
        torch.equal(a, b)
        for res in per_rank
        for a, b in zip(res["modes"]["runs"]["outputs"], res["modes"]["whole"]["outputs"], strict=True)
    ) and all(
        torch.equal(a, b)
        for a, b in zip(
            per_rank[0]["modes"]["runs"]["outputs"], per_rank[1]["modes"]["runs"]["outputs"], strict=True
        )
    )
    used = len({b for t in tables for b in t})
    runs_used = per_rank[0]["runs"]
    covered = sum(t - s for s, t in runs_used)
    summary = {
        "layers": args.layers,
        "pool_blocks": args.pool_blocks,
        "occupancy": args.occupancy,
        "requests": args.requests,
        "blocks_in_tables": used,
        "bundle_bytes_per_block": bundle,
        "runs_per_layer": len(runs_used),
        "blocks_broadcast": covered,
        "bytes_per_forward_runs": statistics.median(runs["bytes_per_forward"]),
        "bytes_per_forward_whole": statistics.median(whole["bytes_per_forward"]),
        "outputs_identical": identical,
    }
    summary["ratio"] = summary["bytes_per_forward_runs"] / summary["bytes_per_forward_whole"]
    # the worst case for runs: the same number of blocks scattered uniformly over the pool (planned from
    # the runs alone, no broadcast): the run budget then merges gaps and moves gap blocks too
    scattered = [random.Random(1).sample(range(args.pool_blocks), used)]
    summary["scattered"] = {}
    for max_runs in (16, 64, None):
        planned = block_runs(scattered, args.pool_blocks, max_runs=max_runs)
        summary["scattered"][str(max_runs)] = {
            "runs": len(planned),
            "blocks_broadcast": sum(t - s for s, t in planned),
            "ratio": sum(t - s for s, t in planned) / args.pool_blocks,
        }
    overlap = []
    for res in per_rank:
        med = {k: statistics.median(r[k] for r in res["overlap"]) for k in res["overlap"][0]}
        overlap.append(
            {
                "rank": res["rank"],
                "median_seconds": med,
                "hidden_fraction": 1 - med["waited"] / med["serial"],
                "bound": (args.layers - 1) / args.layers,
                "step_overhead_vs_compute": med["runs"] / med["compute"] - 1,
            }
        )
    return {"traffic": summary, "overlap": overlap}


# ----------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--available-gib", type=float, default=40.0, help="KV memory for the formula")
    parser.add_argument("--alloc-gib", type=float, default=0.5, help="scaled-down budget for real allocation")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pool-blocks", type=int, default=1024, help="blocks of 16 tokens in the pool")
    parser.add_argument(
        "--occupancy", type=float, default=0.10, help="share of the pool the live requests hold"
    )
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--compute-reps", type=int, default=12, help="matmul rounds per request and layer")
    args = parser.parse_args()

    results: dict = {"formula": [], "real": []}
    for tp in (2, 4, 8):
        results["formula"].append(capacity_formula(tp, int(args.available_gib * GIB)))
        results["real"].append(capacity_real(tp, int(args.alloc_gib * GIB)))
    bundle = results["formula"][0]["bundle_bytes_per_block"]
    print(f"DeepSeek-V3-like capacity (61 layers + 1 MTP, bundle {bundle} B/block, {args.available_gib} GiB)")
    print(
        format_table(
            ["TP", "owned", "B/blk base", "B/blk KVPP", "blocks base", "blocks KVPP", "gain", "real gain"],
            [
                [
                    f["tp"],
                    f["max_owned_layers"],
                    f["bytes_per_block_base"],
                    f["bytes_per_block_kvpp"],
                    f["blocks_base"],
                    f["blocks_kvpp"],
                    f["gain"],
                    r["gain"],
                ]
                for f, r in zip(results["formula"], results["real"], strict=True)
            ],
        )
    )

    t0 = time.perf_counter()
    results.update(traffic_and_overlap(args))
    tr = results["traffic"]
    print(
        f"\nTraffic, 2 processes (gloo, loopback): {tr['layers']} layers, {tr['pool_blocks']} blocks, "
        f"{tr['requests']} requests holding {tr['blocks_in_tables']} blocks ({tr['occupancy']:.0%})"
    )
    print(
        format_table(
            ["runs/layer", "blocks bcast", "B/forward runs", "B/forward whole", "ratio", "identical"],
            [
                [
                    tr["runs_per_layer"],
                    tr["blocks_broadcast"],
                    int(tr["bytes_per_forward_runs"]),
                    int(tr["bytes_per_forward_whole"]),
                    tr["ratio"],
                    tr["outputs_identical"],
                ]
            ],
        )
    )
    print("Same block count scattered uniformly over the pool (planned runs, no broadcast):")
    print(
        format_table(
            ["max runs", "runs/layer", "blocks bcast", "ratio"],
            [[k, v["runs"], v["blocks_broadcast"], v["ratio"]] for k, v in tr["scattered"].items()],
        )
    )
    print(f"\nOverlap (median of {args.steps} decode steps, block-run broadcasts)")
    print(
        format_table(
            [
                "rank",
                "compute ms",
                "kvpp ms",
                "serial runs ms",
                "serial whole ms",
                "waited ms",
                "hidden",
                "bound",
                "kvpp/compute-1",
            ],
            [
                [
                    o["rank"],
                    o["median_seconds"]["compute"] * 1e3,
                    o["median_seconds"]["runs"] * 1e3,
                    o["median_seconds"]["serial"] * 1e3,
                    o["median_seconds"]["serial_whole"] * 1e3,
                    o["median_seconds"]["waited"] * 1e3,
                    o["hidden_fraction"],
                    o["bound"],
                    o["step_overhead_vs_compute"],
                ]
                for o in results["overlap"]
            ],
        )
    )
    results["config"] = vars(args)
    results["multi_process_seconds"] = time.perf_counter() - t0
    path = write_json("kvpp_bench", results)
    print(f"\nwrote {path}")
    assert all(math.isfinite(r["gain"]) for r in results["formula"])
    assert tr["outputs_identical"], "block-run broadcast changed the outputs"


if __name__ == "__main__":
    main()

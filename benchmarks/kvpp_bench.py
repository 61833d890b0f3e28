"""KVPP benchmark: capacity gain and how much of the broadcast hides behind compute.

1. Capacity (DeepSeek-V3-like: 61 target layers + 1 local MTP layer; main KV 512 + 64 bf16 and a 128-dim
   bf16 indexer key per token; 128-token blocks) at TP 2 / 4 / 8: blocks with KVPP / blocks without, for
   the same memory — from the budget formula (the fullest rank decides, every rank numbers blocks alike)
   and from a real allocation (zero-filled buffers) at a scaled-down budget (``--alloc-gib``, default
   0.5 GiB, because the full-size budget of a serving accelerator does not fit this machine's memory).
2. Overlap: a 2-process gloo run (loopback) of a toy MLA stack decoding with long histories. Per decode
   step, side by side in one run: the compute-only step (no broadcast), the step with KVPP one-layer-ahead
   prefetch, and the same broadcasts issued back to back without compute. Hidden fraction
   = 1 − (time the compute thread waited for broadcasts) / (serial broadcast time). The first layer's
   broadcast has no compute before it in the forward, so with L layers at most (L − 1) / L can hide; and a
   wait also covers the skew between ranks (a broadcast completes only when both ranks joined it), which
   on a loaded machine with fewer cores than busy threads can exceed the transfer itself.

Prints tables and writes ``benchmarks/results/kvpp_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from torch_kvoffload.kvpp import BundleSpec, KVPPAllocation, KVPPPlan, assign_owners
from torch_kvoffload.kvpp.launch import spawn_local
from torch_kvoffload.kvpp.toy_mla import ToyMLA, ToyMLAConfig, make_batches, step_inputs

GIB = 1024**3
RESULTS = Path(__file__).resolve().parent / "results" / "kvpp_bench.json"


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
        "gain_per_block_formula": base_bpb / plan.bytes_per_block,
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
    per_rank = []
    for rank in range(tp):
        plan = KVPPPlan(bpb, owners, rank, draft_bpb)
        t0 = time.perf_counter()
        alloc = KVPPAllocation(plan, bundles, blocks, "cpu", drafts)
        seconds = time.perf_counter() - t0
        assert alloc.allocated_bytes <= available
        per_rank.append({"rank": rank, "allocated_bytes": alloc.allocated_bytes, "seconds": seconds})
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
        "max_allocated_bytes": max(r["allocated_bytes"] for r in per_rank),
        "base_allocated_bytes": base_bytes,
        "per_rank": per_rank,
    }


# -------------------------------------------------------------------------------------------- overlap


def _overlap_worker(
    rank: int, world: int, cfg_dict: dict, requests: int, history: int, steps: int, out: str
) -> None:
    from torch_kvoffload.kvpp.groups import create_kvpp_group
    from torch_kvoffload.kvpp.runtime import build_kvpp_runtime

    cfg = ToyMLAConfig(**cfg_dict)
    group = create_kvpp_group(dp=1, pp=1, pcp=1, tp=world, device=torch.device("cpu"))
    layers = list(range(cfg.num_layers))
    spec = cfg.bundle()
    script = [tuple((r, history) for r in range(requests))] + [tuple((r, 1) for r in range(requests))] * (
        3 * steps
    )
    batches = make_batches(cfg, script)
    num_blocks = batches[-1].requests[-1][2][-1] + 1
    rt = build_kvpp_runtime(
        group, dict.fromkeys(layers, spec), 0, name=f"bench-{rank}", num_blocks=num_blocks
    )
    sched, model = rt.scheduler, ToyMLA(cfg)
    import torch.distributed as dist

    def hook(layer: int, views: dict) -> None:
        sched.wait_for_layer(layer)

    def forward(i: int, with_history: bool) -> float:
        x = step_inputs(model, batches[i], script[i])
        dist.barrier(group=None)
        t0 = time.perf_counter()
        sched.schedule_forward(with_history)
        for layer in layers:
            x = model.layer(layer, x, batches[i], rt.views, hook)
        sched.complete_forward()
        return time.perf_counter() - t0

    def serial() -> float:
        dist.barrier(group=None)
        t0 = time.perf_counter()
        for layer in layers:
            rt.scheduler.transport.broadcast(
                layer, rt.allocation.bundle_span(layer), rt.plan.owners[layer]
            ).wait()
        return time.perf_counter() - t0

    # The history is not prefilled through the model (O(T^2) attention on this CPU would dominate the
    # run): the owners' buffers hold random KV for it instead; decode steps then read all of it.
    for layer in rt.plan.owned:
        g = torch.Generator().manual_seed(layer)
        for v in rt.views(layer).values():
            v.copy_(torch.randn(v.shape, generator=g) * 0.1)
    rows = []
    i = 1
    for step in tqdm(range(steps), desc=f"rank {rank} decode", disable=rank != 0):
        row: dict[str, float] = {}
        # rotate the order of the three measurements so none is always first after the barrier
        for mode in ("kvpp", "compute", "serial")[step % 3 :] + ("kvpp", "compute", "serial")[: step % 3]:
            if mode == "serial":
                row["serial_broadcast"] = serial()
                continue
            w0 = sched.counters.get("wait_seconds")
            row[mode] = forward(i, mode == "kvpp")
            if mode == "kvpp":
                row["waited"] = sched.counters.get("wait_seconds") - w0
            i += 1
        rows.append(row)
    torch.save(
        {
            "rows": rows,
            "bundle_bytes": rt.allocation.bundle_span(0).numel(),
            "counters": sched.counters.snapshot(),
        },
        out.format(rank=rank),
    )
    sched.close()


def overlap(steps: int, requests: int, history: int) -> dict:
    cfg = ToyMLAConfig(
        num_layers=8, hidden=256, heads=8, kv_lora_rank=256, rope_dim=32, index_dim=64, block_size=16
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank{rank}.pt")
        spawn_local(_overlap_worker, 2, asdict(cfg), requests, history, steps, out, timeout=600)
        per_rank = [torch.load(out.format(rank=r), weights_only=False) for r in range(2)]
    summary = {
        "config": asdict(cfg),
        "requests": requests,
        "history_tokens": history,
        "steps": steps,
        "ranks": [],
    }
    for rank, res in enumerate(per_rank):
        rows = res["rows"]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        hidden_wait = 1 - med["waited"] / med["serial_broadcast"]
        overhead = med["kvpp"] / med["compute"] - 1
        summary["ranks"].append(
            {
                "rank": rank,
                "median_seconds": med,
                "bundle_bytes": res["bundle_bytes"],
                "hidden_fraction_wait": hidden_wait,
                "step_overhead_vs_compute": overhead,
                "broadcast_gbps": res["bundle_bytes"] * cfg.num_layers / med["serial_broadcast"] / 1e9,
            }
        )
    return summary


# ----------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--available-gib", type=float, default=40.0, help="KV memory for the formula")
    parser.add_argument("--alloc-gib", type=float, default=0.5, help="scaled-down budget for real allocation")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--history", type=int, default=1024)
    args = parser.parse_args()

    results: dict = {"formula": [], "real": []}
    available = int(args.available_gib * GIB)
    for tp in tqdm((2, 4, 8), desc="capacity"):
        results["formula"].append(capacity_formula(tp, available))
        results["real"].append(capacity_real(tp, int(args.alloc_gib * GIB)))
    print(
        f"\nDeepSeek-V3-like capacity (61 layers + 1 MTP, bundle {results['formula'][0]['bundle_bytes_per_block']} B/block)"
    )
    print(
        f"{'TP':>3} {'owned':>6} {'B/blk base':>11} {'B/blk KVPP':>11} {'blocks base':>12} {'blocks KVPP':>12} {'gain':>6} | "
        f"{'real (' + str(args.alloc_gib) + ' GiB)':>16} {'gain':>6}"
    )
    for f, r in zip(results["formula"], results["real"], strict=True):
        print(
            f"{f['tp']:>3} {f['max_owned_layers']:>6} {f['bytes_per_block_base']:>11} {f['bytes_per_block_kvpp']:>11} "
            f"{f['blocks_base']:>12} {f['blocks_kvpp']:>12} {f['gain']:>6.2f} | "
            f"{str(r['blocks_base']) + ' -> ' + str(r['blocks_kvpp']):>16} {r['gain']:>6.2f}"
        )

    results["overlap"] = overlap(args.steps, args.requests, args.history)
    ov = results["overlap"]
    print(
        f"\nOverlap, 2 processes, gloo loopback ({ov['requests']} requests x {ov['history_tokens']} tokens of history, "
        f"{ov['config']['num_layers']} layers, median of {ov['steps']} decode steps)"
    )
    print(
        f"{'rank':>4} {'compute ms':>11} {'kvpp ms':>9} {'serial bcast ms':>16} {'waited ms':>10} {'hidden':>7} {'kvpp/compute-1':>15} {'GB/s':>6}"
    )
    for r in ov["ranks"]:
        m = r["median_seconds"]
        print(
            f"{r['rank']:>4} {m['compute'] * 1e3:>11.2f} {m['kvpp'] * 1e3:>9.2f} {m['serial_broadcast'] * 1e3:>16.2f} "
            f"{m['waited'] * 1e3:>10.2f} {r['hidden_fraction_wait']:>7.2f} {r['step_overhead_vs_compute']:>+15.2%} {r['broadcast_gbps']:>6.2f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {RESULTS}")
    assert all(math.isfinite(r["gain"]) for r in results["formula"])


if __name__ == "__main__":
    main()

"""How much of the layerwise pipeline loss is the store's Python on the transfer thread.

The same pipeline (16 MLA-shaped layers, B = 2, prefetch depth 2, 12 blocks loaded and 12 saved per
layer, one GEMM of compute per layer) runs against two stores, interleaved:

* ``LocalKVStore`` as shipped: every load / save job runs the store's Python (loads: reading the entries
  the lookup leased; saves: key checks, allocation, publishing; one mapping tensor per job) around its
  ``copy_blocks`` calls;
* a replaying variant: after recording the arena mappings of a first identical forward, it runs each job
  as the recorded ``copy_blocks`` calls only. It is a diagnostic, not a store (it trusts that nothing
  moved in the arena): the difference between the two bounds what moving the store's per-job Python off
  the transfer thread can gain.

Prints Σ compute / wall per forward (compute measured alone right before each forward) for both, and
writes ``benchmarks/results/layerwise_store_python.json``.

    python benchmarks/layerwise_store_python.py [--rounds 4] [--forwards 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from layerwise_bench import Compute, Setup, add_workload_args, filled_store

from torch_kvoffload.ops.copy import copy_blocks
from torch_kvoffload.store.local import LocalKVStore


class ReplayingStore(LocalKVStore):
    """Diagnostic only: replays the ``copy_blocks`` calls recorded for an identical earlier batch call."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        # (src, dst, mapping, streaming): the store writes its arena with streaming stores
        self._recorded: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]] = {}
        self._recording: list | None = None

    def _replay_or_record(self, kind: str, keys, layout, call):
        key = (kind, tuple(keys), id(layout))
        copies = self._recorded.get(key)
        if copies is not None:
            for src, dst, mapping, streaming in copies:
                copy_blocks(src, dst, mapping, streaming=streaming)
            return [True] * len(keys) if kind == "get" else None
        self._recording = []
        try:
            result = call()
        finally:
            self._recorded[key], self._recording = self._recording, None
        return result

    def batch_get_blocks(self, keys, layout, blocks):
        return self._replay_or_record(
            "get", keys, layout, lambda: super(ReplayingStore, self).batch_get_blocks(keys, layout, blocks)
        )

    def batch_get_leased_blocks(self, segments, layout, blocks):
        keys = [k for lease, a, b in segments for k in lease.keys[a:b]]
        return self._replay_or_record(
            "get",
            keys,
            layout,
            lambda: super(ReplayingStore, self).batch_get_leased_blocks(segments, layout, blocks),
        )

    def batch_put_blocks(self, keys, layout, blocks):
        return self._replay_or_record(
            "put", keys, layout, lambda: super(ReplayingStore, self).batch_put_blocks(keys, layout, blocks)
        )

    def _part_copies(self, arena, layout, offsets, blocks, *, out):
        copies = super()._part_copies(arena, layout, offsets, blocks, out=out)
        if self._recording is not None:
            self._recording.extend(copies)
        return copies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds per store")
    p.add_argument("--forwards", type=int, default=9, help="measured forwards per round")
    p.add_argument("--compute-ms", type=float, default=1.8, help="per-layer compute")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "layerwise_store_python.json"))
    add_workload_args(p)
    a = p.parse_args()
    torch.set_num_threads(1)
    args = argparse.Namespace(**vars(a), streams=1)  # the workload of layerwise_bench, one transfer thread
    compute = Compute(a.compute_dim)
    compute.calibrate(a.compute_ms * 1e-3)

    ratios: dict[str, list[float]] = {"LocalKVStore": [], "replayed copies": []}
    rounds = [(name, cls) for _ in range(a.rounds) for name, cls in
              (("LocalKVStore", LocalKVStore), ("replayed copies", ReplayingStore))]  # fmt: skip
    for name, cls in tqdm(rounds, desc="rounds"):
        store = filled_store(args, cls)
        s = Setup(args, 2, 2, store)
        for _ in range(2):  # the replaying store records here
            s.forward(compute)
        for _ in range(a.forwards):
            c = compute.time_layers(args.layers)
            wall, _ = s.forward(compute)
            ratios[name].append(c / wall)
        s.rt.close()
        store.close()

    rows = {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
            for name, v in ratios.items()}  # fmt: skip
    print(f"\nB = 2, depth 2, {args.layers} layers, compute {a.compute_ms} ms per layer: Σ compute / wall")
    print(f"{'store':<16} {'median':>7} {'min':>6} {'max':>6}")
    for name, r in rows.items():
        print(f"{name:<16} {r['median']:>7.3f} {r['min']:>6.2f} {r['max']:>6.2f}")
    print(f"load average at the end (1 / 5 / 15 min): {os.getloadavg()}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"args": vars(a), "rows": rows, "load_average_at_end": os.getloadavg()}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

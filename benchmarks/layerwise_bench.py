"""Layerwise prefill offload: how well transfers overlap compute, and the device KV footprint.

Workload (per forward, CPU): N MLA-shaped layers (``c_kv`` + ``k_pe``, fp32), one request whose prefix of
``--prefix-blocks`` blocks is in the host store (loaded for every layer) and ``--new-blocks`` new blocks
that are computed and saved for every layer. Per-layer "compute" is one GEMM on the main thread, sized
so that it takes about ``--compute-ratio`` x the measured per-layer transfer time (or exactly
``--compute-ms``: the same compute for runtimes whose transfers differ in speed); transfers run on the
runtime's TransferStream worker thread (the C++ copies release the GIL). ``--quick``: 3 repetitions.

Measured side by side in one run:
* per-layer compute time (compute alone, no runtime),
* per-layer transfer time (loads + saves alone, no compute: the runtime's load/save seconds),
* wall time of the pipelined forward for B in {1, 2, 4} and prefetch depth in {1, 2, 3},
* pipeline efficiency = max(sum compute, sum transfer) / wall (1.0 = perfect overlap),
* the machine's overlap ceiling: the same compute next to a thread of plain C++ copies of the same
  duration over a working set as large as the transfers', max(alone times) / wall, without the runtime
  (shared cores, caches and memory bandwidth cap it),
* the bare schedule: the same loads and saves (same bytes, blocks, buffers, dependencies and order, whole
  transfers on one worker thread) next to the same compute, with no runtime, store, lookup or bookkeeping
  (plain ``copy_blocks`` between per-layer host tensors and the layer buffers): what the pipeline's shape
  allows on this machine, max(sum compute, sum transfer) / its wall,
* compute and transfer time inside the pipelined forwards (how much they slowed each other down),
* main-KV device bytes vs no offload (every layer its own buffer),
* the cores other processes used meanwhile (``foreign``: machine busy time minus this process's).

Writes ``benchmarks/results/layerwise_bench.json``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from torch_kvoffload.device import set_thread_intraop_threads
from torch_kvoffload.layerwise import (
    LayerCacheSpec,
    LayerwiseOffloadRuntime,
    TensorSpec,
    allocate_layer_buffers,
    plan_layer_buffers,
)
from torch_kvoffload.ops import copy_blocks
from torch_kvoffload.store.local import LocalKVStore
from torch_kvoffload.transfer import TransferEvent, TransferStream

#: CPU tuning of the runtime that is not a constructor argument: name -> the runtime attribute holding it
TUNING = {"critical_parts": "_critical_parts", "wake_delay": "_wake_delay"}


def _specs(args) -> list[LayerCacheSpec]:
    nb = args.prefix_blocks + args.new_blocks + 1
    main = (
        TensorSpec((nb, args.block_size, args.kv_lora_rank), torch.float32),
        TensorSpec((nb, args.block_size, args.rope_dim), torch.float32),
    )
    return [LayerCacheSpec(main) for _ in range(args.layers)]


class Compute:
    """A per-layer compute stand-in: one ``[rows, dim] @ [dim, dim]`` GEMM on the main thread.

    Prefill compute is a few large GEMMs per layer, so like a real model it leaves the interpreter (and
    the GIL) for long stretches; ``rows`` is calibrated to the requested time.
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.b = torch.randn(dim, dim) / dim**0.5
        self.rows = 64
        self.a = torch.randn(self.rows, dim)

    def __call__(self) -> None:
        self.sink = (self.a @ self.b)[0, 0]

    def time_layers(self, layers: int) -> float:
        """Wall time of ``layers`` calls (compute alone, no runtime)."""
        t0 = time.perf_counter()
        for _ in range(layers):
            self()
        return time.perf_counter() - t0

    def calibrate(self, seconds: float) -> None:
        self.rows, self.a = 256, torch.randn(256, self.dim)
        samples = []
        for _ in range(15):
            t0 = time.perf_counter()
            self()
            samples.append((time.perf_counter() - t0) / self.rows)
        self.rows = max(1, round(seconds / statistics.median(samples)))
        self.a = torch.randn(self.rows, self.dim)


class Setup:
    def __init__(
        self,
        args,
        b: int,
        depth: int,
        store: LocalKVStore,
        streams: int | None = None,
        *,
        runtime_cls: type = LayerwiseOffloadRuntime,
        **runtime_kwargs,
    ) -> None:
        """``runtime_kwargs``: constructor arguments of ``runtime_cls``, and the CPU tuning of
        :data:`TUNING` (set on the runtime's private attributes when the constructor does not take it)."""
        self.args = args
        self.plan = plan_layer_buffers(_specs(args), b, [0])
        self.bufs = allocate_layer_buffers(self.plan, "cpu")
        accepted = inspect.signature(runtime_cls).parameters
        tuning = {k: runtime_kwargs.pop(k) for k in list(runtime_kwargs) if k in TUNING and k not in accepted}
        self.rt = runtime_cls(
            self.plan,
            self.bufs,
            store,
            prefetch_depth=depth,
            model_id="bench",
            transfer_streams=streams or args.streams,
            **runtime_kwargs,
        )
        for name, value in tuning.items():
            setattr(self.rt, TUNING[name], value)
        # the hook methods (runtimes of older revisions, loaded by layerwise_paired.py, named them
        # wait / save, and before that before_attention / after_cache_write)
        if hasattr(self.rt, "wait_layer"):
            self.wait_layer, self.save_layer = self.rt.wait_layer, self.rt.save_layer
        elif hasattr(self.rt, "wait"):
            self.wait_layer, self.save_layer = self.rt.wait, self.rt.save
        else:
            self.wait_layer, self.save_layer = self.rt.before_attention, self.rt.after_cache_write
        bs = args.block_size
        self.tokens = [torch.arange((args.prefix_blocks + args.new_blocks) * bs + 1)]
        self.table = [list(range(args.prefix_blocks + args.new_blocks + 1))]
        self.cached = [args.prefix_blocks * bs]

    def forward(self, compute: Compute | None) -> tuple[float, float]:
        """Wall time of one forward, and the time spent inside compute during it."""
        rt = self.rt
        in_compute = 0.0
        t0 = time.perf_counter()
        rt.begin_forward(self.tokens, self.table, self.cached)
        for layer in range(self.plan.num_layers):
            self.wait_layer(layer)
            if compute is not None:
                c0 = time.perf_counter()
                compute()
                in_compute += time.perf_counter() - c0
            self.save_layer(layer)
        rt.end_forward()
        return time.perf_counter() - t0, in_compute


class BareSchedule:
    """The runtime's transfer schedule without the runtime: per layer, the prefix blocks are copied from a
    host tensor into the layer's buffer and the new blocks back out, with ``copy_blocks`` on one worker
    thread. A load waits for the save of its buffer's previous user and is issued once that user finished
    computing, up to ``depth`` layers ahead; the compute thread waits for each layer's load and, at the
    end, for every save. Wake delays as the runtime's (none for transfers waited for at once)."""

    def __init__(self, setup: Setup) -> None:
        args, self.plan = setup.args, setup.plan
        self.depth = setup.rt.prefetch_depth
        self.wake_delay = setup.rt._wake_delay
        self.bufs = setup.bufs
        p, n = args.prefix_blocks, args.new_blocks
        comps = setup.bufs.layer_caches(0)
        # per layer and component: p prefix blocks (read) then n saved blocks (written)
        self.host = [
            [torch.ones((p + n, *c.shape[1:]), dtype=c.dtype) for c in comps] for _ in range(args.layers)
        ]
        self.load_map = torch.stack([torch.arange(p), torch.arange(p)], dim=1)
        self.save_map = torch.stack([torch.arange(p, p + n), torch.arange(p, p + n)], dim=1)
        self.stream = TransferStream("bare")
        self.stream.submit(set_thread_intraop_threads, 1).wait()

    def _load(self, layer: int) -> None:
        for src, dst in zip(self.host[layer], self.bufs.layer_caches(layer), strict=True):
            copy_blocks(src, dst, self.load_map)

    def _save(self, layer: int) -> None:
        for src, dst in zip(self.bufs.layer_caches(layer), self.host[layer], strict=True):
            copy_blocks(src, dst, self.save_map, streaming=True)

    def forward(self, compute: Compute) -> float:
        plan, n = self.plan, self.plan.num_layers
        loads: dict[int, TransferEvent] = {}
        saves: dict[int, TransferEvent] = {}
        computed: set[int] = set()

        def issue(current: int) -> None:
            for layer in range(current, min(n, current + self.depth + 1)):
                prev = plan.previous_user[layer]
                if layer in loads or (layer != current and prev is not None and prev not in computed):
                    continue
                after = [saves[prev]] if prev is not None and prev in saves else []
                delay = 0.0 if layer == current else self.wake_delay
                loads[layer] = self.stream.submit(self._load, layer, after=after, wake_delay=delay)

        t0 = time.perf_counter()
        for layer in range(n):
            issue(layer)
            loads[layer].wait()
            compute()
            computed.add(layer)
            reused = layer + 1 < n and plan.previous_user[layer + 1] == layer
            critical = layer == n - 1 or reused
            saves[layer] = self.stream.submit(
                self._save, layer, wake_delay=0.0 if critical else self.wake_delay
            )
        for ev in saves.values():
            ev.wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.stream.close()


def record_bytes(args) -> int:
    """One stored block of one layer: ``c_kv`` + ``k_pe``, fp32."""
    return (args.kv_lora_rank + args.rope_dim) * args.block_size * 4


def filled_store(args, store_cls=LocalKVStore, runtime_cls=LayerwiseOffloadRuntime) -> LocalKVStore:
    """A store holding every block the measured forwards use: the prefix they load and the new blocks,
    whose saves then overwrite in place (one forward without compute saves them all). Filled by
    ``runtime_cls``, so its keys are the ones that class's runtimes read."""
    store = store_cls(2 * args.layers * (args.prefix_blocks + args.new_blocks + 1) * record_bytes(args))
    warm = Setup(args, 1, 1, store, runtime_cls=runtime_cls)
    warm.rt.begin_forward(warm.tokens, warm.table, [0])
    for layer in range(args.layers):
        warm.wait_layer(layer)
        warm.save_layer(layer)
    warm.rt.end_forward()
    warm.rt.close()
    return store


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


class ForeignLoad:
    """Cores used by other processes while a section ran: busy time of the whole machine (``/proc/stat``)
    minus this process's own CPU time, over the wall time. The pipeline needs a core per thread; when
    other work takes one, compute and transfers share the rest and the efficiency drops with it."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return None
        own = os.times()
        busy = (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        return busy, own.user + own.system, time.perf_counter()

    def cores(self) -> float | None:
        end = self._sample()
        if end is None or self.start is None or end[2] <= self.start[2]:
            return None
        other = (end[0] - self.start[0]) - (end[1] - self.start[1])
        return max(0.0, other / (end[2] - self.start[2]))


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload's shape: layers, cache layout, blocks loaded and saved, the compute's GEMM size."""
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--prefix-blocks", type=int, default=12)
    p.add_argument("--new-blocks", type=int, default=12)
    p.add_argument("--compute-dim", type=int, default=512)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument(
        "--compute-ratio",
        type=float,
        default=1.5,
        help="per-layer compute / transfer time (prefill: compute dominates, transfers still matter)",
    )
    p.add_argument(
        "--compute-ms",
        type=float,
        default=None,
        help="fix the per-layer compute time instead of calibrating it to the transfers (compares runtimes "
        "whose transfers differ in speed against the same compute)",
    )
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="3 repetitions instead of --reps")
    p.add_argument("--streams", type=int, default=1, help="transfer streams (1: one worker thread)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (compute and copies)")
    p.add_argument(
        "--switch-interval",
        type=float,
        default=sys.getswitchinterval(),
        help="sys.setswitchinterval: how long a thread may hold the GIL while another waits for it",
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "layerwise_bench.json"))
    args = p.parse_args()
    if args.quick:
        args.reps = 3
    torch.set_num_threads(args.threads)
    sys.setswitchinterval(args.switch_interval)

    record = record_bytes(args)
    store = filled_store(args)

    # Per-layer transfer time alone: no compute, and B = 1 so every load waits for the previous layer's
    # save: the transfers run one at a time and their times are not inflated by each other. Whole, on the
    # transfer thread (critical_parts=1): the time one thread takes to move a layer's blocks.
    probe = Setup(args, 1, 1, store, critical_parts=1)
    probe.forward(None)

    def transfer_alone() -> float:
        probe.rt.counters.reset()
        probe.forward(None)
        c = probe.rt.counters.snapshot()
        return c["load_seconds"] + c["save_seconds"]

    compute = Compute(args.compute_dim)
    per_layer = _median([transfer_alone() for _ in range(3)]) / args.layers

    def compute_target() -> float:
        if args.compute_ms is not None:
            return args.compute_ms * 1e-3 * args.layers
        return args.compute_ratio * _median([transfer_alone() for _ in range(3)])

    compute.calibrate(
        args.compute_ms * 1e-3 if args.compute_ms is not None else args.compute_ratio * per_layer
    )

    def compute_alone() -> float:
        return compute.time_layers(args.layers)

    # refine the size on whole passes (a GEMM's time is not exactly linear in its rows)
    for _ in range(2):
        target = compute_target()
        got = _median([compute_alone() for _ in range(3)])
        compute.rows = max(1, round(compute.rows * target / got))
        print(
            f"compute calibration: target {target * 1e3:.1f} ms, got {got * 1e3:.1f} ms -> {compute.rows} rows"
        )
        compute.a = torch.randn(compute.rows, compute.dim)

    # The machine's own overlap ceiling, without the runtime: the same compute on this thread while a
    # second thread runs plain C++ copies (GIL released) of the same total duration. On a machine whose
    # cores are shared (or oversubscribed) the two slow each other down and no pipeline can beat this.
    # The copies walk a working set as large as the forward's transfers (one chunk per layer and
    # direction), so they stress the caches and memory like the real transfers do.
    chunk = args.prefix_blocks * record
    copy_src = torch.ones(2 * args.layers, chunk, dtype=torch.uint8)
    copy_dst = torch.zeros_like(copy_src)
    t0 = time.perf_counter()
    for i in range(2 * args.layers):
        copy_dst[i].copy_(copy_src[i])
    per_copy = (time.perf_counter() - t0) / (2 * args.layers)
    copy_iters = max(1, round(transfer_alone() / per_copy))

    def copies() -> None:
        for i in range(copy_iters):
            j = i % (2 * args.layers)
            copy_dst[j].copy_(copy_src[j])

    def overlap_ceiling() -> float:
        t0 = time.perf_counter()
        copies()
        alone = time.perf_counter() - t0
        c_alone = compute_alone()
        th = threading.Thread(target=copies)
        t0 = time.perf_counter()
        th.start()
        compute_alone()
        th.join()
        return max(alone, c_alone) / (time.perf_counter() - t0)

    layer_bytes = _specs(args)[0].main_nbytes
    rows = []
    configs = [(b, d) for b in (1, 2, 4) for d in (1, 2, 3)]
    all_c, all_t = [], []
    run_load = ForeignLoad()
    for b, depth in tqdm(configs, desc="layerwise pipeline"):
        row_load = ForeignLoad()
        s = Setup(args, b, depth, store)
        bare = BareSchedule(s)
        s.forward(compute)
        bare.forward(compute)
        walls, inside, sc, st, ceil, bare_walls = [], [], [], [], [], []
        s.rt.counters.reset()
        for _ in range(args.reps):
            # the references are measured next to each pipelined forward, so drifting machine load
            # affects both sides of the ratio alike
            sc.append(compute_alone())
            st.append(transfer_alone())
            ceil.append(overlap_ceiling())
            w, ic = s.forward(compute)
            walls.append(w)
            inside.append(ic)
            bare_walls.append(bare.forward(compute))
        c = s.rt.counters.snapshot()
        s.rt.close()
        bare.close()
        wall, sum_compute, sum_transfer = _median(walls), _median(sc), _median(st)
        all_c += sc
        all_t += st
        rows.append(
            {
                "B": b,
                "prefetch_depth": depth,
                "physical_buffers": s.plan.num_physical_buffers,
                "sum_compute_ms": sum_compute * 1e3,
                "sum_transfer_ms": sum_transfer * 1e3,
                "wall_ms": wall * 1e3,
                "efficiency": max(sum_compute, sum_transfer) / wall,
                "machine_overlap_ceiling": _median(ceil),
                "bare_schedule_efficiency": max(sum_compute, sum_transfer) / _median(bare_walls),
                # compute slowed down by the concurrent transfers (and by anything else on the machine)
                "compute_in_pipeline_ms": _median(inside) * 1e3,
                # transfer-thread time inside the pipelined forwards (mean per forward)
                "transfer_in_pipeline_ms": (c["load_seconds"] + c["save_seconds"]) / args.reps * 1e3,
                "waits_per_forward": c["waits"] / args.reps,
                "wait_ms_per_forward": c["wait_seconds"] / args.reps * 1e3,
                "device_kv_bytes": s.plan.main_bytes,
                "foreign_cores": row_load.cores(),
                "footprint_vs_no_offload": s.plan.main_bytes / (args.layers * layer_bytes),
            }
        )
    probe.rt.close()
    sum_compute, sum_transfer = _median(all_c), _median(all_t)

    result = {
        "args": vars(args),
        "per_layer_compute_ms": sum_compute / args.layers * 1e3,
        "per_layer_transfer_ms": sum_transfer / args.layers * 1e3,
        "sum_compute_ms": sum_compute * 1e3,
        "sum_transfer_ms": sum_transfer * 1e3,
        "bytes_per_layer_moved": (args.prefix_blocks + args.new_blocks) * record,
        "no_offload_device_kv_bytes": args.layers * layer_bytes,
        "load_average_at_end": os.getloadavg(),
        "foreign_cores": run_load.cores(),
        "rows": rows,
    }
    print(
        f"\nN={args.layers} layers, per layer: compute {result['per_layer_compute_ms']:.2f} ms, "
        f"transfer {result['per_layer_transfer_ms']:.2f} ms "
        f"({args.prefix_blocks} blocks loaded + {args.new_blocks} saved, {record / 2**10:.0f} KiB each)"
    )
    print(f"sum compute {sum_compute * 1e3:.1f} ms, sum transfer {sum_transfer * 1e3:.1f} ms")
    print(
        f"{'B':>2} {'depth':>5} {'phys':>4} {'Σc ms':>7} {'Σt ms':>7} {'wall ms':>8} {'effic.':>6} {'bare':>5} {'ceil.':>5} "
        f"{'c in pipe':>9} {'t in pipe':>9} {'waits':>5} {'wait ms':>7} {'KV vs none':>10} {'foreign':>7}"
    )
    for r in rows:
        print(
            f"{r['B']:>2} {r['prefetch_depth']:>5} {r['physical_buffers']:>4} {r['sum_compute_ms']:>7.1f} "
            f"{r['sum_transfer_ms']:>7.1f} {r['wall_ms']:>8.1f} {r['efficiency']:>6.2f} "
            f"{r['bare_schedule_efficiency']:>5.2f} "
            f"{r['machine_overlap_ceiling']:>5.2f} "
            f"{r['compute_in_pipeline_ms']:>9.1f} {r['transfer_in_pipeline_ms']:>9.1f} {r['waits_per_forward']:>5.1f} "
            f"{r['wait_ms_per_forward']:>7.1f} {r['footprint_vs_no_offload']:>10.3f} "
            f"{r['foreign_cores'] if r['foreign_cores'] is not None else float('nan'):>7.2f}"
        )
    print(f"load average at the end (1 / 5 / 15 min): {os.getloadavg()}")
    foreign = result["foreign_cores"]
    if foreign is not None:
        print(f"cores used by other processes during the run: {foreign:.2f} (of {os.cpu_count()})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

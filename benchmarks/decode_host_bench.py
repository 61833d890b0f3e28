"""Host overhead of a decode step on a tiny DeepseekV32 (compute negligible): unmodified vs resident sparse vs
offloaded sparse, side by side.

The model is the tests' tiny random DeepseekV32 (``tests/support/hf_models.py``: hidden 256, 4 heads,
kv_lora_rank 64, rope 16, indexer 32 heads x 32, top-k 16) with ``--layers`` layers, fp32, one CPU thread.
At these widths the math is microseconds, so a step's time is mostly Python and dispatch: the figure that
bounds a decode step on an accelerator (per layer, before any math). Three variants of the same weights:

* ``unmodified``: the transformers model and its own cache;
* ``resident``: ``OffloadConfig(layerwise=None, sparse={"offload": False})``;
* ``offloaded``: ``OffloadConfig(layerwise=None, sparse={})``.

Each round runs one greedy ``generate`` of ``--new`` tokens per variant, in an order that rotates every round;
a forward pre-/post-hook on the model times every forward, and the decode steps (every forward after the
prompt's) give the step time. Reported: the median step (ms) and its ratio to the unmodified model's (the
median over rounds of each round's ratio: the variants of one round see the same machine), the attention
modules' time per layer (hooks on every attention module), and for the library variants the **host time per
layer**: the wall time of the KV core's ``cache_write`` + ``cache_attention`` per layer (timed around the calls
in the same rounds) minus the time of the kernel ops they run (every other ``kvoffload::`` op inside them, from
``torch.profiler`` over ``--profile-steps`` decode steps; the profiler's own overhead inflates the ops it
records, so only the kernels' share is taken from it). Greedy tokens of the variants are compared.

Writes ``benchmarks/results/decode_host_bench.{json,md,png}``.

    python benchmarks/decode_host_bench.py              # 8 layers, prompt 64, 32 new tokens, 7 rounds
    python benchmarks/decode_host_bench.py --smoke      # a check of the script (files in /tmp)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch
from _common import RESULTS_DIR, VARIANT_COLOURS, format_table, machine_info, pyplot, write_json
from support.hf_models import build_model

import torch_kvoffload
from torch_kvoffload import OffloadConfig
from torch_kvoffload.core.kv import KVCore

VARIANTS = ("unmodified", "resident", "offloaded")
# the profiler's labels of the core's two calls per layer
CACHE_OPS = ("kvoffload::mla_cache_write", "kvoffload::mla_cache_attention")


def build(variant: str, layers: int, top_k: int) -> torch.nn.Module:
    model = build_model("deepseek_v32", num_hidden_layers=layers, index_topk=top_k)
    if variant == "resident":
        torch_kvoffload.offload(model, OffloadConfig(layerwise=None, sparse={"offload": False}))
    elif variant == "offloaded":
        torch_kvoffload.offload(model, OffloadConfig(layerwise=None, sparse={}))
    return model


class CacheOpTimer:
    """Wall time of the KV core's ``cache_write`` / ``cache_attention`` (what the eager attention and the
    ``kvoffload::mla_cache_*`` ops' kernels call) during decode forwards."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.active = False  # set by StepTimer: a decode forward is running
        self.profiling = False  # mark each call for torch.profiler (kernel_time_per_layer)
        for name, label in zip(("cache_write", "cache_attention"), CACHE_OPS, strict=True):
            setattr(KVCore, name, self._timed(getattr(KVCore, name), label))

    def _timed(self, fn, label: str):
        def timed(*args, **kwargs):
            if self.profiling:
                with torch.profiler.record_function(label):
                    return fn(*args, **kwargs)
            if not self.active:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


class StepTimer:
    """Times every forward of ``model`` and the time spent in its attention modules."""

    def __init__(self, model: torch.nn.Module, ops: CacheOpTimer) -> None:
        self.ops = ops
        self.forwards: list[float] = []
        self.attention: list[float] = []  # per forward: seconds in attention modules
        self._start = 0.0
        self._attn_start = 0.0
        self._attn = 0.0
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)
        for module in model.modules():
            if type(module).__name__.endswith("Attention") and hasattr(module, "kv_a_proj_with_mqa"):
                module.register_forward_pre_hook(self._attn_pre)
                module.register_forward_hook(self._attn_post)

    def _pre(self, *_: object) -> None:
        self.ops.active = bool(self.forwards)  # every forward after the prompt's is a decode step
        self._attn = 0.0
        self._start = time.perf_counter()

    def _post(self, *_: object) -> None:
        self.ops.active = False
        self.forwards.append(time.perf_counter() - self._start)
        self.attention.append(self._attn)

    def _attn_pre(self, *_: object) -> None:
        self._attn_start = time.perf_counter()

    def _attn_post(self, *_: object) -> None:
        self._attn += time.perf_counter() - self._attn_start

    def reset(self) -> None:
        self.forwards.clear()
        self.attention.clear()


def generate(model: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def kernel_time_per_layer(
    model: torch.nn.Module, ids: torch.Tensor, steps: int, layers: int, ops: CacheOpTimer
) -> float:
    """Profile one generate; µs per decode-layer call in the kernel ops the core's cache calls ran."""
    from torch.profiler import ProfilerActivity, profile

    ops.profiling = True
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            generate(model, ids, steps + 1)
    finally:
        ops.profiling = False
    events = [e for e in prof.events() if e.name.startswith("kvoffload::")]
    outer = [e for e in events if e.name in CACHE_OPS]
    # the prompt's forward is the first `layers` calls of each cache op: decode calls only
    decode_outer = sorted(outer, key=lambda e: e.time_range.start)[2 * layers :]
    spans = [(e.time_range.start, e.time_range.end) for e in decode_outer]
    total = sum(e.time_range.elapsed_us() for e in decode_outer)
    kernels = 0.0
    for e in events:
        if e.name in CACHE_OPS:
            continue
        s = e.time_range.start
        inside = any(a <= s <= b for a, b in spans)
        # count only outermost kernel ops (an op calling another op is timed once)
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("kvoffload::"):
            parent = parent.cpu_parent
        if inside and (parent is None or parent.name in CACHE_OPS):
            kernels += e.time_range.elapsed_us()
    del total
    return kernels / (steps * layers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--profile-steps", type=int, default=16)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--output-dir", type=Path, default=None)
    args = p.parse_args()
    if args.smoke:
        args.layers, args.new, args.rounds, args.profile_steps = 2, 4, 2, 2
        args.output_dir = args.output_dir or Path(tempfile.mkdtemp(prefix="decode_host_bench_"))
    torch.set_num_threads(1)
    out_dir = args.output_dir or RESULTS_DIR

    ids = torch.randint(3, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    models = {v: build(v, args.layers, args.top_k) for v in VARIANTS}
    op_timer = CacheOpTimer()
    timers = {v: StepTimer(m, op_timer) for v, m in models.items()}
    tokens = {v: generate(m, ids, args.new) for v, m in models.items()}  # warm-up, and the tokens
    equal = {v: bool(torch.equal(tokens[v], tokens["unmodified"])) for v in VARIANTS}

    steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    attention: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cache_ops: dict[str, list[float]] = {v: [] for v in VARIANTS}  # µs per decode-layer call, per round
    for r in range(args.rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        medians = {}
        for v in order:
            timers[v].reset()
            op_timer.seconds, op_timer.calls = 0.0, 0
            generate(models[v], ids, args.new)
            if op_timer.calls:
                cache_ops[v].append(op_timer.seconds * 1e6 / (op_timer.calls / 2))
            dec = timers[v].forwards[1:]
            medians[v] = statistics.median(dec)
            steps[v] += dec
            attention[v] += timers[v].attention[1:]
        for v in VARIANTS:
            ratios[v].append(medians[v] / medians["unmodified"])
        print(
            f"round {r + 1}/{args.rounds}: " + ", ".join(f"{v} {medians[v] * 1e3:.2f} ms" for v in VARIANTS)
        )

    host = {}
    for v in VARIANTS[1:]:
        ops_us = statistics.median(cache_ops[v])
        kernels_us = kernel_time_per_layer(models[v], ids, args.profile_steps, args.layers, op_timer)
        host[v] = {"cache_ops_us": ops_us, "kernels_us": kernels_us, "host_us": ops_us - kernels_us}
    rows, results = [], {}
    for v in VARIANTS:
        step_ms = statistics.median(steps[v]) * 1e3
        attn_us = statistics.median(attention[v]) * 1e6 / args.layers
        res = {"step_ms": step_ms, "ratio": statistics.median(ratios[v]), "attention_us_per_layer": attn_us,
               "tokens_equal": equal[v], **host.get(v, {})}  # fmt: skip
        results[v] = res
        h = host.get(v)
        rows.append([
            v, step_ms, res["ratio"], attn_us, "-" if h is None else h["cache_ops_us"],
            "-" if h is None else h["kernels_us"], "-" if h is None else h["host_us"], equal[v],
        ])  # fmt: skip
    headers = ["variant", "step ms", "x unmodified", "attention us/layer", "cache ops us/layer",
               "kernels us/layer", "host us/layer", "tokens equal"]  # fmt: skip
    table = format_table(headers, rows)
    print(table)
    config = {k: getattr(args, k) for k in ("layers", "prompt", "new", "top_k", "rounds", "profile_steps")}
    payload = {"config": config, "results": results}
    if out_dir == RESULTS_DIR:
        path = write_json("decode_host_bench", payload)
    else:
        import json

        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "decode_host_bench.json"
        path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    md = out_dir / "decode_host_bench.md"
    md.write_text(f"# decode host overhead, tiny DeepseekV32\n\n{config}\n\n```\n{table}\n```\n")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = list(VARIANTS)
        ax.bar(names, [results[v]["step_ms"] for v in names], color=[VARIANT_COLOURS[v] for v in names])
        for i, v in enumerate(names):
            ax.text(i, results[v]["step_ms"], f"{results[v]['ratio']:.2f}x", ha="center", va="bottom")
        ax.set_ylabel("decode step (ms, median)")
        ax.set_title(f"tiny DeepseekV32, {args.layers} layers, 1 thread")
        fig.tight_layout()
        fig.savefig(out_dir / "decode_host_bench.png", dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

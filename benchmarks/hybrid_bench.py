"""A load ramp in one device KV budget: resident sparse vs offloaded sparse vs hybrid (``offload="auto"``).

The model is serving_bench's (a DeepseekV32 with production per-layer KV widths: kv_lora_rank 512, rope 64,
lightning indexer 64 heads x 128; a narrower body so the CPU runs it), served by transformers' continuous
batching (``generate_batch``). Every variant gets the same device KV budget: what the resident variant
takes for ``--resident-requests`` requests of ``--prompt + --new`` tokens. Each variant's server is sized once
for the most requests its budget holds (``serving.device_kv_budget`` alone: resident by its full KV,
offloaded and hybrid by their offloaded footprint: hot buffers and indexer rows), and the load ramps from 1
to ``--max-load`` requests in flight (all added at once; more than a server holds wait in its queue).

At each load: requests held at once (the most the server runs together) and decode tokens/s (rows / median
time of the steps whose rows are all decode rows, over the steps holding the most requests, in the fastest
of ``--rounds`` rounds; the variants rotate order every round). Hybrid's spills / promotions are reported;
the tokens of every run are compared with the resident run's at the same load (the same greedy tokens are
expected: where a row lives never changes a token).

On this machine the "device" is the CPU: the budget is an accounting limit, the compute is real.

Writes ``benchmarks/results/hybrid_bench.json``, ``.md`` and ``.png`` (tok/s and requests held against the
load, three lines each).

    python benchmarks/hybrid_bench.py            # 2 layers, 472-token prompts (~10 minutes)
    python benchmarks/hybrid_bench.py --quick    # 1 layer, 104-token prompts (~2 minutes)
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time
from typing import Any

import torch
from _common import RESULTS_DIR, VARIANT_COLOURS, format_table, pyplot, write_json
from serving_bench import PAD, PRODUCTION_TOP_K, VOCAB, StepTimes, build

import torch_kvoffload
from torch_kvoffload.integrations.hf.serving import serving_slots

VARIANTS = ("resident", "offloaded", "hybrid")
SPARSE = {"resident": {"offload": False}, "offloaded": {}, "hybrid": {"offload": "auto"}}
COLOURS = {**VARIANT_COLOURS, "hybrid": "tab:purple"}


def budget_and_caps(base: torch.nn.Module, tokens: int, args) -> tuple[int, dict[str, int]]:
    """The device KV budget (the resident variant's for ``args.resident_requests``) and the requests each
    variant's server holds in it."""
    probe = torch_kvoffload.offload(
        copy.deepcopy(base),
        {"sparse": SPARSE["resident"], "serving": {"max_request_tokens": tokens,
                                                   "max_requests": args.resident_requests}},
    )  # fmt: skip
    slots, per, fixed = serving_slots(probe._kvoffload_session)
    budget = fixed + slots * per
    probe._kvoffload_session.close()
    caps = {}
    for v in VARIANTS:
        m = torch_kvoffload.offload(
            copy.deepcopy(base),
            {"sparse": SPARSE[v], "serving": {"max_request_tokens": tokens, "device_kv_budget": budget}},
        )
        caps[v] = serving_slots(m._kvoffload_session)[0]
        m._kvoffload_session.close()
    return budget, caps


def serve(base, variant: str, prompts, new: int, budget: int, cap: int, args) -> dict[str, Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    tokens = len(prompts[0]) + new
    serving = {"max_request_tokens": tokens, "device_kv_budget": budget}
    model = torch_kvoffload.offload(copy.deepcopy(base), {"sparse": SPARSE[variant], "serving": serving})
    cb = ContinuousBatchingConfig(page_size=args.page_size, max_batch_tokens=args.max_batch_tokens)
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=VOCAB + 1, pad_token_id=PAD)
    clock = StepTimes(model)
    t0 = time.perf_counter()
    try:
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    finally:
        clock.remove()
    wall = time.perf_counter() - t0
    stats = torch_kvoffload.stats(model)
    model._kvoffload_session.close()
    errors = [o.error for o in out.values() if o.error is not None]
    if errors or len(out) != len(prompts):
        raise RuntimeError(f"{variant}: {len(out)}/{len(prompts)} results, errors {errors[:2]}")
    order = sorted(out, key=lambda rid: int(rid.rsplit("_", 1)[1]))
    held = max((rows for rows, dec, *_ in clock.steps if dec), default=0)
    full = [s for rows, dec, s, _, _ in clock.steps if dec and rows == held]
    return {
        "variant": variant, "load": len(prompts), "held": held, "cap": cap, "wall_s": wall,
        "tokens": [list(out[r].generated_tokens) for r in order],
        "decode_steps_s": full,
        "stats": {k: stats.get(k, 0) for k in ("spills", "promotions", "started_offloaded", "misses",
                                                "spill_bytes_d2h", "promote_bytes_h2d", "device_kv_bytes")},
    }  # fmt: skip


def ramp(args) -> dict[str, Any]:
    base = build(args.layers, args.top_k, torch.float32, args.seed, args.prompt + args.new + 64)
    tokens = args.prompt + args.new
    budget, caps = budget_and_caps(base, tokens, args)
    print(f"budget {budget} bytes: requests held {caps}", flush=True)
    g = torch.Generator().manual_seed(args.seed + 1)
    loads = [n for n in args.loads if n <= args.max_load]
    prompts = [torch.randint(3, VOCAB, (args.prompt,), generator=g).tolist() for _ in range(max(loads))]
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    plan = [(v, n) for n in loads for v in VARIANTS]
    for rnd in range(args.rounds):  # the order rotates every round: machine noise hits every run alike
        shift = rnd * len(VARIANTS) // max(1, args.rounds)
        for v, n in plan:
            v = VARIANTS[(VARIANTS.index(v) + shift) % len(VARIANTS)]
            r = serve(base, v, prompts[:n], args.new, budget, caps[v], args)
            step = statistics.median(r["decode_steps_s"]) if r["decode_steps_s"] else None
            print(f"round {rnd}: load {n} {v}: held {r['held']}, step "
                  f"{'-' if step is None else f'{1e3 * step:.1f} ms'} ({r['wall_s']:.1f} s) {r['stats']}", flush=True)  # fmt: skip
            first = runs.setdefault((v, n), {**r, "round_step_s": []})
            first["round_step_s"].append(step)
    for (_, n), r in runs.items():
        medians = [m for m in r["round_step_s"] if m is not None]
        r["decode_step_s"] = min(medians) if medians else None
        r["decode_tok_s"] = r["held"] / r["decode_step_s"] if medians else None
        r["tokens_equal_resident"] = r["tokens"] == runs[("resident", n)]["tokens"]
    for r in runs.values():
        del r["tokens"]
    for n in loads:
        best = max(runs[(v, n)]["decode_tok_s"] or 0 for v in ("resident", "offloaded"))
        h = runs[("hybrid", n)]
        h["vs_best"] = (h["decode_tok_s"] or 0) / best if best else None
        h["vs_resident"] = (h["decode_tok_s"] or 0) / (runs[("resident", n)]["decode_tok_s"] or math.nan)
    return {"budget_bytes": budget, "caps": caps, "loads": loads, "runs": list(runs.values())}


def table(result: dict[str, Any]) -> str:
    runs = {(r["variant"], r["load"]): r for r in result["runs"]}
    rows = []
    for n in result["loads"]:
        cells = [n]
        for v in VARIANTS:
            r = runs[(v, n)]
            tok = r["decode_tok_s"]
            cells += [r["held"], "-" if tok is None else f"{tok:.1f}"]
        h = runs[("hybrid", n)]
        cells += [f"{h['vs_best']:.2f}" if h["vs_best"] else "-", h["stats"]["spills"], h["stats"]["promotions"],
                  h["stats"]["started_offloaded"], all(runs[(v, n)]["tokens_equal_resident"] for v in VARIANTS)]  # fmt: skip
        rows.append(cells)
    headers = ["load"]
    for v in VARIANTS:
        headers += [f"{v} held", f"{v} tok/s"]
    headers += ["hybrid / best", "spills", "promotions", "started offloaded", "tokens equal"]
    caps = ", ".join(f"{v} {c}" for v, c in result["caps"].items())
    return (
        f"device KV budget {result['budget_bytes']} bytes; requests held at most: {caps}\n\n"
        + format_table(headers, [[str(c) for c in r] for r in rows])
    )


def plot(result: dict[str, Any], path) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = {(r["variant"], r["load"]): r for r in result["runs"]}
    loads = result["loads"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for v in VARIANTS:
        ax[0].plot(loads, [runs[(v, n)]["decode_tok_s"] or 0 for n in loads], "o-", label=v, color=COLOURS[v])
        ax[1].plot(loads, [runs[(v, n)]["held"] for n in loads], "o-", label=v, color=COLOURS[v])
    ax[0].set(
        xlabel="requests in flight", ylabel="decode tokens/s", title="throughput", xscale="log", xticks=loads
    )
    ax[0].set_xticklabels(loads)
    ax[1].set(xlabel="requests in flight", ylabel="requests held at once", title="requests held", xscale="log",
              xticks=loads)  # fmt: skip
    ax[1].set_xticklabels(loads)
    ax[0].legend()
    fig.suptitle(
        f"one device KV budget ({result['budget_bytes'] / 2**20:.1f} MiB), load ramp (CPU: accounting budget)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    # prompt + new a multiple of the 128-token block: every variant's caches hold exactly the requests' rows
    p.add_argument("--prompt", type=int, default=472)
    p.add_argument("--new", type=int, default=40, help="new tokens per request (the decode window)")
    p.add_argument("--top-k", type=int, default=None, help="default 2048 x prompt / 32K")
    p.add_argument("--resident-requests", type=int, default=4, help="budget: the resident KV of this many")
    p.add_argument("--loads", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--max-load", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="1 layer, 128-token prompts, loads to 16, one round")
    args = p.parse_args()
    if args.quick:
        args.layers, args.prompt, args.new, args.rounds, args.max_load = 1, 104, 24, 1, 16
    if args.top_k is None:
        args.top_k = max(1, PRODUCTION_TOP_K * args.prompt // 32768)
    t0 = time.perf_counter()
    result = ramp(args)
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    report = table(result)
    print(report)
    name = "hybrid_bench_quick" if args.quick else "hybrid_bench"
    path = write_json(name, {"config": vars(args), "wall_s": time.perf_counter() - t0, **result})
    (RESULTS_DIR / f"{name}.md").write_text(f"# {name}\n\n```\n{report}\n```\n")
    print(f"wrote {path}")
    plot(result, RESULTS_DIR / f"{name}.png")


if __name__ == "__main__":
    main()

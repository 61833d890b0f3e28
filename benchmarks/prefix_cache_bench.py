"""Time to first token against the cached share of a prompt: prefix reuse on vs off, side by side.

A random DeepseekV32 (or DeepseekV3 with ``--family deepseek_v3``) with DeepSeek's KV widths
(``kv_lora_rank`` 512, rope 64, indexer 128 wide; narrow elsewhere: hidden 512, 4 heads, ``--layers``
layers), fp32, the library's default configuration (layerwise offload + sparse decode offload; ``--mode
sparse`` / ``resident``: sparse decode offload / resident sparse attention alone, whose blocks go to the
prefix store after each forward). Two
sessions of the same weights: ``reuse`` (``prefix_cache`` on) and ``recompute`` (off). For each prompt
length and cached share, a *seed* prompt whose first ``share`` of tokens the measured prompt repeats is
generated on the ``reuse`` model first (its blocks go to the store; so they do on the ``recompute`` model,
which computes everything anyway), then the measured prompt is generated with ``max_new_tokens=1`` on both
models in an order that rotates every round: the time of that call is the TTFT. Reported: the median TTFT of
each, their ratio (median over rounds of each round's ratio), the prompt tokens served from the store, and
whether the two generated the same token (they must).

Writes ``benchmarks/results/prefix_cache_bench.{json,md,png}``.

    python benchmarks/prefix_cache_bench.py                    # 2K and 8K prompts, 0/50/90/99 % cached
    python benchmarks/prefix_cache_bench.py --lengths 2048 32768
    python benchmarks/prefix_cache_bench.py --mode sparse       # sparse decode offload alone
    python benchmarks/prefix_cache_bench.py --smoke            # a check of the script (files in /tmp)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch
from _common import RESULTS_DIR, format_table, machine_info, pyplot
from support.hf_models import build_model

import torch_kvoffload

VARIANTS = ("recompute", "reuse")
WIDTHS = dict(
    hidden_size=512, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, qk_rope_head_dim=64,
    qk_nope_head_dim=64, v_head_dim=64, q_lora_rank=256, intermediate_size=1024, moe_intermediate_size=256,
    index_head_dim=128, index_n_heads=8, index_topk=2048,
)  # fmt: skip


MODES = {
    "default": None,
    "sparse": torch_kvoffload.OffloadConfig(sparse={}),
    "resident": torch_kvoffload.OffloadConfig(sparse={"offload": False}),
}


def build(variant: str, family: str, layers: int, length: int, mode: str = "default") -> torch.nn.Module:
    widths = dict(WIDTHS) if family == "deepseek_v32" else {
        k: v for k, v in WIDTHS.items() if not k.startswith("index")
    }  # fmt: skip
    model = build_model(family, num_hidden_layers=layers, max_position_embeddings=2 * length, **widths)
    config = MODES[mode] or torch_kvoffload.OffloadConfig.default(family == "deepseek_v32")
    return torch_kvoffload.offload(model, config.model_copy(update={"prefix_cache": variant == "reuse"}))


def first_token(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
    return time.perf_counter() - start, out[:, -1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="deepseek_v32", choices=("deepseek_v32", "deepseek_v3"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.5, 0.9, 0.99])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mode", default="default", choices=list(MODES))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--output-dir", type=Path, default=None)
    args = p.parse_args()
    if args.smoke:
        args.layers, args.lengths, args.rounds = 2, [512], 1
        args.output_dir = args.output_dir or Path(tempfile.mkdtemp(prefix="prefix_cache_bench_"))
    out_dir = args.output_dir or RESULTS_DIR
    gen = torch.Generator().manual_seed(0)

    rows, results = [], []
    for length in args.lengths:
        models = {v: build(v, args.family, args.layers, length, args.mode) for v in VARIANTS}
        first_token(models["reuse"], torch.randint(3, 1000, (1, 64), generator=gen))  # warm-up
        first_token(models["recompute"], torch.randint(3, 1000, (1, 64), generator=gen))
        for share in args.shares:
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            ratios, same, served = [], True, []
            for r in range(args.rounds):
                base = torch.randint(3, 1000, (1, length), generator=gen)
                cached = int(length * share)
                seed = torch.cat(
                    [base[:, :cached], torch.randint(3, 1000, (1, length - cached), generator=gen)], 1
                )
                for v in VARIANTS:  # the shared part goes to each model's store
                    first_token(models[v], seed)
                before = torch_kvoffload.stats(models["reuse"])["prefix_store_tokens"]
                got = {}
                for v in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                    t, got[v] = first_token(models[v], base)
                    times[v].append(t)
                served.append(torch_kvoffload.stats(models["reuse"])["prefix_store_tokens"] - before)
                same = same and bool(torch.equal(got["reuse"], got["recompute"]))
                ratios.append(times["reuse"][-1] / times["recompute"][-1])
            res = {
                "length": length, "share": share, "ttft_recompute_s": statistics.median(times["recompute"]),
                "ttft_reuse_s": statistics.median(times["reuse"]), "ratio": statistics.median(ratios),
                "served_tokens": statistics.median(served), "tokens_equal": same,
            }  # fmt: skip
            results.append(res)
            rows.append([length, f"{share:.0%}", res["ttft_recompute_s"], res["ttft_reuse_s"], res["ratio"],
                         int(res["served_tokens"]), same])  # fmt: skip
            print(rows[-1], flush=True)
    headers = ["prompt", "cached", "TTFT recompute s", "TTFT reuse s", "reuse / recompute", "served tokens",
               "same token"]  # fmt: skip
    table = format_table(headers, rows)
    print(table)
    config = {k: getattr(args, k) for k in ("family", "layers", "lengths", "shares", "rounds", "mode")}
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "prefix_cache_bench" + ("" if args.mode == "default" else f"_{args.mode}")
    path = out_dir / f"{stem}.json"
    path.write_text(
        json.dumps({"machine": machine_info(), "config": config, "results": results}, indent=2) + "\n"
    )
    title = f"prefix reuse, {args.family} {args.mode} ({args.layers} layers, DeepSeek KV widths), CPU"
    (out_dir / f"{stem}.md").write_text(f"# {title}\n\n{config}\n\n```\n{table}\n```\n")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for length in args.lengths:
            pts = [r for r in results if r["length"] == length]
            ax.plot(
                [r["share"] * 100 for r in pts],
                [r["ratio"] for r in pts],
                marker="o",
                label=f"{length} tokens",
            )
        ax.set_xlabel("cached share of the prompt (%)")
        ax.set_ylabel("TTFT reuse / recompute")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / f"{stem}.png", dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Beam search on a production-width DeepseekV32: unmodified vs resident sparse vs offloaded sparse.

The model is ``hf_generate_bench.py``'s (hidden 2048, MLA with kv_lora_rank 512, lightning indexer 64 x 128,
top-k 2048, ``--layers`` layers, fp32, sdpa); its three variants share the weights: ``unmodified`` (the
transformers model and its ``DynamicCache``), ``resident`` (``{"sparse": {"offload": False}}``) and
``offloaded`` (``{"sparse": {}}``: the latent KV in the host pool). Each beam is a request of the library's
KV core; every step transformers calls ``cache.reorder_cache(beam_idx)``, which ends the requests no beam
continues and forks the others.

Per prompt length (batch 1) each round times ``generate(prompt, num_beams=B, do_sample=False,
max_new_tokens=N)`` of every variant, in an order that rotates each round. Beforehand (untimed) the prompt but
its last token is prefilled into a fresh cache in ``--chunk``-token chunks, already as the ``B`` rows
``generate`` expands it to (the library sizes a sequence's slots at its first forward, so a batch-1 prefill
cannot be repeated to ``B`` rows afterwards; a chunked prefill bounds the indexer's ``[B, S, H, T]`` scores).
So the timed ``generate`` is the beam decode: the last prompt token, then ``N - 1`` steps. The reorders are
timed by wrapping ``OffloadCache.reorder_cache`` and ``DynamicCache.reorder_cache``. Reported per length:
median generate seconds, the offloaded / resident ratio (of the medians, and paired: median of the rounds'
ratios), reorder ms per generate and per step, the offloaded variant's ``stats()`` counters over a generate,
and whether the variants' tokens are equal (random weights can give exact indexer ties, so a difference is
reported, not raised). The JSON and PNG are rewritten after every length, so a run stopped early keeps the
lengths it finished.

    python benchmarks/hf_beam_bench.py            # 1K and 4K prompts, 4 beams, 16 new tokens, 2 layers
    python benchmarks/hf_beam_bench.py --smoke    # a check of the script (< 2 minutes; files in /tmp)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS_DIR, VARIANT_COLOURS, format_table, machine_info, pyplot, write_json
from hf_generate_bench import build

import torch_kvoffload
from torch_kvoffload.integrations.hf.cache import _classes

VARIANTS = ("unmodified", "resident", "offloaded")
COUNTERS = ("bytes_h2d", "hits", "misses")


class ReorderClock:
    """Calls of and seconds in ``reorder_cache`` of the library's cache and ``DynamicCache`` (wrapped)."""

    def __init__(self) -> None:
        from transformers import DynamicCache

        self.calls, self.seconds = 0, 0.0
        self._classes = (_classes()[0], DynamicCache)
        self._originals = [cls.reorder_cache for cls in self._classes]

    def __enter__(self) -> ReorderClock:
        for cls, fn in zip(self._classes, self._originals, strict=True):
            cls.reorder_cache = self._wrap(fn)
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, fn in zip(self._classes, self._originals, strict=True):
            cls.reorder_cache = fn

    def _wrap(self, fn):
        def timed(cache, beam_idx):
            t0 = time.perf_counter()
            try:
                return fn(cache, beam_idx)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return timed


def prefilled_cache(name: str, model: torch.nn.Module, prompt: torch.Tensor, args) -> Any:
    """A cache holding ``prompt [1, n]`` but its last token in ``args.beams`` rows."""
    from transformers import DynamicCache

    if name == "unmodified":
        cache = DynamicCache(config=model.config)
    else:
        session = model._kvoffload_session
        session.end_sequence()  # the previous generate's requests: a new sequence is sized anew
        session.reserve(args.beams, prompt.shape[1] + args.new + 1)
        cache = session.new_cache()
    rows = prompt[:, :-1].expand(args.beams, -1)
    with torch.no_grad():
        for start in range(0, rows.shape[1], args.chunk):
            model(input_ids=rows[:, start : start + args.chunk], cache=cache)
    return cache


def timed_generate(name: str, model: torch.nn.Module, prompt: torch.Tensor, clock: ReorderClock, args):
    """``(seconds, reorder calls, reorder seconds, counters delta or None, sequences)`` of one generate."""
    cache = prefilled_cache(name, model, prompt, args)
    before = None if name == "unmodified" else torch_kvoffload.stats(model)
    calls, spent = clock.calls, clock.seconds
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), cache=cache, num_beams=args.beams,
            do_sample=False, max_new_tokens=args.new, min_new_tokens=args.new,
        )  # fmt: skip
    dt = time.perf_counter() - t0
    delta = None
    if before is not None:
        after = torch_kvoffload.stats(model)
        keys = [k for k in after if k in COUNTERS or "fork" in k or "cow" in k or "share" in k]
        delta = {k: after[k] - before.get(k, 0) for k in keys}
    return dt, clock.calls - calls, clock.seconds - spent, delta, out[:, prompt.shape[1] :]


def run_length(n: int, models: dict[str, torch.nn.Module], clock: ReorderClock, args) -> dict[str, Any]:
    prompt = torch.randint(3, 4096, (1, n), generator=torch.Generator().manual_seed(args.seed + n))
    rec: dict[str, dict[str, list]] = {
        v: {"s": [], "calls": [], "reorder_s": [], "stats": []} for v in VARIANTS
    }
    tokens: dict[str, torch.Tensor] = {}
    for r in range(args.rounds):
        for name in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
            dt, calls, spent, delta, seq = timed_generate(name, models[name], prompt, clock, args)
            for key, value in zip(
                ("s", "calls", "reorder_s", "stats"), (dt, calls, spent, delta), strict=True
            ):
                rec[name][key].append(value)
            tokens.setdefault(name, seq)
            print(f"  {n} round {r}: {name} {dt:.2f} s ({calls} reorders, {1e3 * spent:.1f} ms)", flush=True)
    out: dict[str, Any] = {"prompt_len": n}
    for name, d in rec.items():
        calls = statistics.median(d["calls"])
        reorder_ms = 1e3 * statistics.median(d["reorder_s"])
        out[name] = {
            "generate_s": statistics.median(d["s"]), "generate_s_all": d["s"], "reorder_calls": calls,
            "reorder_ms_per_generate": reorder_ms, "reorder_ms_per_step": reorder_ms / max(1, calls),
        }  # fmt: skip
        if d["stats"][0] is not None:
            out[name]["stats_per_generate"] = {
                k: statistics.median(s[k] for s in d["stats"]) for k in d["stats"][0]
            }
    off, res = rec["offloaded"]["s"], rec["resident"]["s"]
    out["offloaded_over_resident"] = statistics.median(off) / statistics.median(res)
    out["offloaded_over_resident_paired"] = statistics.median(o / r for o, r in zip(off, res, strict=True))
    ref = tokens["unmodified"]
    out["tokens_equal"] = {v: bool(torch.equal(tokens[v], ref)) for v in ("resident", "offloaded")}
    out["tokens_equal"]["resident_offloaded"] = bool(torch.equal(tokens["resident"], tokens["offloaded"]))
    out["tokens"] = {v: t.tolist() for v, t in tokens.items()}
    return out


def print_table(results: list[dict[str, Any]]) -> None:
    rows = []
    for r in results:
        st = r["offloaded"].get("stats_per_generate", {})
        rows.append(
            [r["prompt_len"], *[r[v]["generate_s"] for v in VARIANTS], r["offloaded_over_resident"],
             r["offloaded_over_resident_paired"], *[r[v]["reorder_ms_per_generate"] for v in VARIANTS],
             *[r[v]["reorder_ms_per_step"] for v in VARIANTS], int(r["offloaded"]["reorder_calls"]),
             int(st.get("bytes_h2d", 0)), f"{int(st.get('hits', 0))}/{int(st.get('misses', 0))}",
             "/".join("y" if r["tokens_equal"][k] else "n"
                      for k in ("resident", "offloaded", "resident_offloaded"))]
        )  # fmt: skip
    headers = ["prompt", "gen s unmod", "gen s res", "gen s off", "off/res", "off/res paired",
               "reorder ms/gen unmod", "res", "off", "reorder ms/step unmod", "res", "off", "reorders",
               "H2D B/gen off", "hits/misses off", "tokens eq res/off/res=off"]  # fmt: skip
    print(format_table(headers, rows))
    extra = {k for r in results for k in r["offloaded"].get("stats_per_generate", {}) if k not in COUNTERS}
    print(f"(medians over rounds; fork / copy-on-write counters in stats(): {sorted(extra) or 'none'})")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    colour = VARIANT_COLOURS
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(results))
    for i, v in enumerate(VARIANTS):
        xs = [j + (i - 1) * 0.27 for j in x]
        ax[0].bar(xs, [r[v]["generate_s"] for r in results], 0.27, label=v, color=colour[v])
        ax[1].bar(xs, [r[v]["reorder_ms_per_step"] for r in results], 0.27, label=v, color=colour[v])
    for a, label in ((ax[0], "generate s (median)"), (ax[1], "reorder_cache ms per step (median)")):
        a.set_xticks(list(x), [str(r["prompt_len"]) for r in results])
        a.set(xlabel="prompt tokens", ylabel=label)
        a.legend()
    fig.suptitle(f"beam search, {results[0]['beams']} beams, {results[0]['new_tokens']} new tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def write(args, out_dir: Path, wall_s: float, results: list[dict[str, Any]]) -> None:
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    payload = {"config": config, "wall_s": wall_s, "results": results}
    if out_dir.resolve() == RESULTS_DIR.resolve():
        path = write_json("hf_beam_bench", payload)
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "hf_beam_bench.json"
        path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    print(f"wrote {path} ({wall_s:.0f} s)")
    plot(results, out_dir / "hf_beam_bench.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--new", type=int, default=16, help="max_new_tokens (and min_new_tokens)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--chunk", type=int, default=256, help="prefill chunk (the indexer's scores: [B, S, H, T])"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--smoke", action="store_true", help="a small run checking the script (< 2 minutes)")
    p.add_argument(
        "--output-dir", type=Path, default=None, help="default benchmarks/results/ (/tmp with --smoke)"
    )
    args = p.parse_args()
    if args.smoke:
        args.lengths, args.rounds, args.new, args.layers = [64, 256], 1, 4, 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    base = build(args.layers, args.seed, max(16384, max(args.lengths) + args.new + 16))
    models = {"unmodified": base}
    for name, cfg in (("resident", {"sparse": {"offload": False}}), ("offloaded", {"sparse": {}})):
        models[name] = torch_kvoffload.offload(copy.deepcopy(base), cfg)
    out_dir = args.output_dir
    if out_dir is None:  # a smoke run leaves the committed results alone
        out_dir = Path(tempfile.mkdtemp(prefix="hf_beam_bench_smoke_")) if args.smoke else RESULTS_DIR
    results = []
    with ReorderClock() as clock:
        warm = torch.randint(3, 4096, (1, 32), generator=torch.Generator().manual_seed(args.seed))
        for name, model in models.items():  # untimed: first-call allocations and dispatch
            timed_generate(name, model, warm, clock, args)
        for n in args.lengths:  # the files are rewritten after every length: a long run keeps what it has
            results.append(
                {**run_length(n, models, clock, args), "beams": args.beams, "new_tokens": args.new}
            )
            print_table(results)
            write(args, out_dir, time.perf_counter() - t0, results)
    for name in ("resident", "offloaded"):
        models[name]._kvoffload_session.close()


if __name__ == "__main__":
    main()

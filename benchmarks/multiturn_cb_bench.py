"""Multi-turn chat under continuous batching, in process: the library's prefix reuse beside transformers' own
block sharing, before and after other traffic.

A DeepseekV3 with DeepSeek's KV widths (``kv_lora_rank`` 512, rope 64; hidden 512, 4 heads, ``--layers``
layers, random weights, fp32) serves ``--conversations`` conversations of ``--turns`` turns through one
continuous-batching manager (``init_continuous_batching``, streamed requests, blocks of 128 tokens, 512
tokens per step). Each turn is a wave: every conversation sends its whole conversation so far (a shared
``--system``-token system prompt, then its questions and answers) plus a new ``--message``-token question
at once, and answers ``--answer`` tokens (greedy). TTFT is the time from ``add_request`` to the first
streamed token. V3, not V3.2: transformers' continuous batching serves V3's MLA with its own allocator,
which supports block sharing; V3.2's indexer needs the library.

Variants (one model, copied):

- ``offload, reuse off``: ``torch_kvoffload.offload`` with layerwise offload (the default for V3),
  ``prefix_cache=False``.
- ``offload, reuse on``: the same with prefix reuse (the default): a request takes the prompt blocks its
  host store holds over and computes the rest.
- ``transformers, block sharing``: the unmodified model, transformers' continuous batching with
  ``allow_block_sharing=True``: a request reuses the blocks still on the device.
- ``... after other traffic``: the two reuse variants again, with ``--filler`` unrelated requests served at
  once between the waves, long enough together to fill transformers' paged cache of ``--blocks`` blocks
  (the live conversations fit in it): the cached blocks of the finished turns are evicted; the library's
  host store keeps every block.

Reported per variant and turn: TTFT p50 / p90, and tokens taken over from a cache per turn. Writes
``benchmarks/results/multiturn_cb_bench.{json,md,png}``.

    python benchmarks/multiturn_cb_bench.py            # 8 conversations x 4 turns
    python benchmarks/multiturn_cb_bench.py --smoke    # a check of the script (files in /tmp)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch
from _common import RESULTS_DIR, format_table, machine_info, pyplot
from prefix_cache_bench import WIDTHS
from support.hf_models import build_model
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import torch_kvoffload

BLOCK = 128
STEP_TOKENS = 512
VARIANTS = (
    ("offload, reuse off", "offload", False, False),
    ("offload, reuse on", "offload", True, False),
    ("transformers, block sharing", "transformers", True, False),
    ("offload, reuse on, after other traffic", "offload", True, True),
    ("transformers, block sharing, after other traffic", "transformers", True, True),
)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Taken:
    """Tokens transformers' scheduler took over from its cache (``search_prefix_match``), while installed."""

    def __init__(self) -> None:
        from transformers.generation.continuous_batching.cache import PagedAttentionCache

        self.cls, self.real, self.total = PagedAttentionCache, PagedAttentionCache.search_prefix_match, 0

    def __enter__(self) -> _Taken:
        real = self.real

        def search(cache, request_id, prompt_ids):
            found = real(cache, request_id, prompt_ids)
            self.total += found
            return found

        self.cls.search_prefix_match = search
        return self

    def __exit__(self, *exc) -> None:
        self.cls.search_prefix_match = self.real


def run_variant(model: torch.nn.Module, engine: str, reuse: bool, traffic: bool, args) -> dict:
    tokens = max(args.system + args.turns * (args.message + args.answer) + BLOCK, _filler_tokens(args) + 2)
    if engine == "offload":
        model = torch_kvoffload.offload(copy.deepcopy(model), {
            "layerwise": {}, "block_size": BLOCK, "prefix_cache": reuse,
            "serving": {"max_requests": args.conversations, "max_request_tokens": tokens},
        })  # fmt: skip
        cb = ContinuousBatchingConfig(page_size=BLOCK, max_batch_tokens=STEP_TOKENS)
    else:
        model = copy.deepcopy(model)
        cb = ContinuousBatchingConfig(
            page_size=BLOCK, max_batch_tokens=STEP_TOKENS, allow_block_sharing=True, num_blocks=args.blocks
        )
    gen = GenerationConfig(max_new_tokens=args.answer, do_sample=False, eos_token_id=999_999, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    conversations = [_tokens(args.system, 7) for _ in range(args.conversations)]
    ttft = [[0.0] * args.conversations for _ in range(args.turns)]
    answers: list[list[list[int]]] = [[] for _ in range(args.conversations)]
    taken_per_turn = []

    def ask(c: int, t: int) -> None:
        rid = f"c{c}-t{t}"
        start, first, out = time.perf_counter(), None, None
        manager.add_request(conversations[c], request_id=rid, max_new_tokens=args.answer, streaming=True)
        for out in manager.request_id_iter(rid):
            if first is None and len(out.generated_tokens):
                first = time.perf_counter() - start
            if out.is_finished():
                break
        assert out is not None and out.error is None, out.error if out is not None else "no output"
        ttft[t][c] = first if first is not None else time.perf_counter() - start
        answers[c].append(list(out.generated_tokens))

    try:
        with _Taken() as hf_taken:
            for t in range(args.turns):
                for c in range(args.conversations):
                    conversations[c] = conversations[c] + _tokens(args.message, 1000 * c + t)
                before = _taken(model, engine, hf_taken)
                threads = [threading.Thread(target=ask, args=(c, t)) for c in range(args.conversations)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                taken_per_turn.append(_taken(model, engine, hf_taken) - before)
                for c in range(args.conversations):
                    conversations[c] = conversations[c] + answers[c][-1]
                if traffic and t + 1 < args.turns:  # unrelated requests between the waves
                    ids = [f"filler-{t}-{i}" for i in range(args.filler)]
                    for i, rid in enumerate(ids):
                        manager.add_request(_tokens(_filler_tokens(args), 50_000 + 100 * t + i), request_id=rid,
                                            max_new_tokens=2)  # fmt: skip
                    for rid in ids:
                        result = manager.get_result(rid, timeout=600)
                        assert result is not None and result.error is None, rid
    finally:
        manager.stop(block=True)
    return {"ttft": ttft, "answers": answers, "taken": taken_per_turn}


def _filler_tokens(args) -> int:
    """Tokens of each filler prompt: together the filler requests need all but 4 of transformers' blocks."""
    return (args.blocks - 4) * BLOCK // args.filler


def _taken(model: torch.nn.Module, engine: str, hf_taken: _Taken) -> int:
    if engine == "offload":
        return int(torch_kvoffload.stats(model)["prefix_store_tokens"])
    return hf_taken.total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=1024)
    p.add_argument("--message", type=int, default=64)
    p.add_argument("--answer", type=int, default=32)
    p.add_argument("--filler", type=int, default=8, help="unrelated requests between waves (other traffic)")
    p.add_argument("--blocks", type=int, default=None, help="transformers' paged cache, in blocks")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--output-dir", type=Path, default=None)
    args = p.parse_args()
    if args.smoke:
        args.layers, args.conversations, args.turns, args.system, args.message, args.answer, args.filler = (
            1, 2, 3, 256, 16, 8, 2,
        )  # fmt: skip
        args.output_dir = args.output_dir or Path(tempfile.mkdtemp(prefix="multiturn_cb_bench_"))
    per_conversation = -(-(args.system + args.turns * (args.message + args.answer)) // BLOCK)
    # the live conversations fit, with a little room: cached blocks of finished requests are what goes
    args.blocks = args.blocks or args.conversations * per_conversation + 8
    out_dir = args.output_dir or RESULTS_DIR
    torch.set_num_threads(1)
    widths = {k: v for k, v in WIDTHS.items() if not k.startswith("index")}
    positions = 2 * (args.system + args.turns * (args.message + args.answer) + BLOCK)
    model = build_model(
        "deepseek_v3", num_hidden_layers=args.layers, max_position_embeddings=positions, **widths
    )

    results = {}
    for name, engine, reuse, traffic in VARIANTS:
        print(f"{name} ...", flush=True)
        results[name] = run_variant(model, engine, reuse, traffic, args)
    baseline = results[VARIANTS[0][0]]
    same = {name: r["answers"] == baseline["answers"] for name, r in results.items()}

    rows, per_variant = [], {}
    for name, _, _, _ in VARIANTS:
        turns = []
        for t in range(args.turns):
            v = sorted(results[name]["ttft"][t])
            p50, p90 = statistics.median(v), v[min(len(v) - 1, int(0.9 * len(v)))]
            base = statistics.median(baseline["ttft"][t])
            turns.append({"turn": t + 1, "p50_s": p50, "p90_s": p90, "taken_tokens": results[name]["taken"][t],
                          "p50_speedup_vs_reuse_off": base / p50})  # fmt: skip
            rows.append([name, t + 1, p50, p90, results[name]["taken"][t], base / p50])
        per_variant[name] = turns
    headers = ["variant", "turn", "TTFT p50 s", "TTFT p90 s", "tokens taken over", "p50 reuse off / this"]
    table = format_table(headers, rows)
    print(table)
    print(f"answers equal to reuse off: {same}")
    config = {k: getattr(args, k) for k in ("layers", "conversations", "turns", "system", "message", "answer",
                                            "filler", "blocks")}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine_info(), "config": config, "per_variant": per_variant, "answers_equal": same}
    path = out_dir / "multiturn_cb_bench.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    title = (
        f"multi-turn CB in process, {args.conversations} conversations, DeepseekV3 {args.layers} layers, CPU"
    )
    (out_dir / "multiturn_cb_bench.md").write_text(
        f"# {title}\n\n{config}\n\n```\n{table}\n```\n\nanswers equal to reuse off: {same}\n"
    )
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, turns in per_variant.items():
            ax.plot([r["turn"] for r in turns], [r["p50_s"] for r in turns], marker="o", label=name)
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT p50 (s)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "multiturn_cb_bench.png", dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

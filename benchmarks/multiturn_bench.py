"""Multi-turn chat on ``python -m torch_kvoffload.serve``: time to first token per turn, prefix reuse on vs off.

A DeepseekV32 (or DeepseekV3 with ``--family deepseek_v3``) with DeepSeek's KV widths (``kv_lora_rank``
512, rope 64, indexer 128 wide; hidden 512, 4 heads, ``--layers`` layers, random weights) and a word-level
tokenizer is saved to a temporary directory and served twice, one server after the other, with the
library's default configuration (layerwise offload, + sparse decode offload for V3.2) and ``prefix_cache``
on (``reuse``) or off (``recompute``). ``--conversations``
clients chat at once over the OpenAI API on loopback, ``--turns`` turns each: the first message is a
``--system``-word system prompt plus a ``--message``-word question, every later turn appends the answer
(``--answer`` tokens, greedy) and a new ``--message``-word question, and the whole conversation is sent
again (the chat API carries no state). Each turn is streamed; its TTFT is the time to the first streamed
token. Reported per turn and variant: TTFT p50 / p90 over the conversations, and the ratio of the p50s; the
answers of the two variants are compared (greedy: they must be equal).

Writes ``benchmarks/results/multiturn_bench.{json,md,png}`` (``multiturn_bench_v3.*`` for DeepseekV3).

    python benchmarks/multiturn_bench.py             # 8 conversations x 6 turns, 1024-word system prompt
    python benchmarks/multiturn_bench.py --smoke     # a check of the script (files in /tmp)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch
from _common import RESULTS_DIR, format_table, machine_info, pyplot
from prefix_cache_bench import WIDTHS
from support.hf_models import build_model
from support.serving import running_server, save_tokenizer, words

VARIANTS = ("recompute", "reuse")


#: every user message ends with ``w5`` (the assistant's turn starts), so a conversation's next prompt starts
#: with the tokens its previous turn held: prompt, then answer (as chat templates of real models do)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% if m['role'] == 'user' %}w5 {% endif %}{% endfor %}"
)


def save_model_dir(path: Path, family: str, layers: int, positions: int) -> Path:
    widths = (
        WIDTHS if family == "deepseek_v32" else {k: v for k, v in WIDTHS.items() if not k.startswith("index")}
    )
    model = build_model(family, num_hidden_layers=layers, max_position_embeddings=positions, **widths)
    model.save_pretrained(path)
    save_tokenizer(path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    for extra in path.glob("chat_template.*"):  # a template file would win over the config's
        extra.unlink()
    return path


def chat_stream(url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """``(seconds to the first streamed token, the answer)`` of one streamed chat completion."""
    import urllib.request

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start, first, text = time.perf_counter(), None, ""
    with urllib.request.urlopen(request, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content") or ""
            if delta and first is None:
                first = time.perf_counter() - start
            text += delta
    return (first if first is not None else time.perf_counter() - start), text


def converse(url: str, model: str, args, c: int) -> tuple[list[float], list[str]]:
    """One conversation of ``args.turns`` turns; per turn its TTFT and answer."""
    messages: list[dict] = []
    ttfts, answers = [], []
    for t in range(args.turns):
        question = words(args.message, seed=1000 * c + t)
        if t == 0:
            question = words(args.system, seed=7) + " " + question  # the system prompt every client shares
        messages.append({"role": "user", "content": question})
        ttft, answer = chat_stream(url, model, messages, args.answer)
        messages.append({"role": "assistant", "content": answer})
        ttfts.append(ttft)
        answers.append(answer)
    return ttfts, answers


def run_variant(variant: str, model_dir: Path, args) -> dict:
    tokens = args.system + args.turns * (args.message + args.answer) + 64
    config = {
        "layerwise": {}, **({"sparse": {}} if args.family == "deepseek_v32" else {}), "prefix_cache": variant == "reuse",
        "serving": {"max_requests": args.conversations, "max_request_tokens": tokens},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, running_server(model_dir, Path(tmp), config) as (url, _, _):
        chat_stream(url, str(model_dir), [{"role": "user", "content": words(16, seed=3)}], 2)  # warm-up
        with ThreadPoolExecutor(args.conversations) as pool:
            runs = list(pool.map(lambda c: converse(url, str(model_dir), args, c), range(args.conversations)))
    return {"ttft": [[r[0][t] for r in runs] for t in range(args.turns)], "answers": [r[1] for r in runs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="deepseek_v32", choices=("deepseek_v32", "deepseek_v3"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system", type=int, default=1024)
    p.add_argument("--message", type=int, default=64)
    p.add_argument("--answer", type=int, default=32)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--output-dir", type=Path, default=None)
    args = p.parse_args()
    if args.smoke:
        args.layers, args.conversations, args.turns, args.system, args.message, args.answer = (
            1,
            2,
            3,
            256,
            16,
            8,
        )
        args.output_dir = args.output_dir or Path(tempfile.mkdtemp(prefix="multiturn_bench_"))
    out_dir = args.output_dir or RESULTS_DIR
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        positions = 2 * (args.system + args.turns * (args.message + args.answer) + 64)
        model_dir = save_model_dir(Path(tmp) / "model", args.family, args.layers, positions)
        results = {v: run_variant(v, model_dir, args) for v in VARIANTS}

    same = results["reuse"]["answers"] == results["recompute"]["answers"]
    rows, per_turn = [], []
    for t in range(args.turns):
        stats = {}
        for v in VARIANTS:
            ttft = sorted(results[v]["ttft"][t])
            stats[v] = (statistics.median(ttft), ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))])
        ratio = stats["recompute"][0] / stats["reuse"][0]
        per_turn.append({"turn": t + 1, **{f"{v}_p50_s": stats[v][0] for v in VARIANTS},
                         **{f"{v}_p90_s": stats[v][1] for v in VARIANTS}, "p50_speedup": ratio})  # fmt: skip
        rows.append([t + 1, *stats["recompute"], *stats["reuse"], ratio])
    headers = [
        "turn",
        "recompute p50 s",
        "recompute p90 s",
        "reuse p50 s",
        "reuse p90 s",
        "p50 recompute / reuse",
    ]
    table = format_table(headers, rows)
    print(table)
    print(f"answers equal: {same}")
    config = {
        k: getattr(args, k)
        for k in ("family", "layers", "conversations", "turns", "system", "message", "answer")
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine_info(), "config": config, "per_turn": per_turn, "answers_equal": same}
    stem = "multiturn_bench" if args.family == "deepseek_v32" else "multiturn_bench_v3"
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    name = "DeepseekV32" if args.family == "deepseek_v32" else "DeepseekV3"
    title = f"multi-turn chat, {args.conversations} conversations, {name} {args.layers} layers, CPU"
    (out_dir / f"{stem}.md").write_text(
        f"# {title}\n\n{config}\n\n```\n{table}\n```\n\nanswers equal: {same}\n"
    )
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        turns = [r["turn"] for r in per_turn]
        for v in VARIANTS:
            ax.plot(turns, [r[f"{v}_p50_s"] for r in per_turn], marker="o", label=f"{v} p50")
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(title, fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / f"{stem}.png", dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

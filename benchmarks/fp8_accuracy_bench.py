"""Accuracy of the FP8 formats: indexer top-k overlap, attention output error, greedy-token agreement.

* **Indexer** (``sparse.indexer_dtype``), DeepSeek-V3.2 widths (64 heads, D = 128, top-2048) on random
  data: the share of the fp32 indexer's top-k positions that the FP8 path (``hadamard_quant_fp8`` +
  ``fp8_lightning_indexer``) selects too, beside the int8 path and bf16 keys.
* **Latent rows** (the 656-byte format), DeepSeek widths (128 heads, Dc = 512, Dr = 64, 2,048 selected
  rows): relative error of ``fp8_sparse_mla_attention``'s output against fp32 attention over the
  unquantized rows, beside bf16 rows.
* **Generation**: a tiny DeepseekV32 (128-wide indexer head, kv_lora_rank 128) generating ``--new`` tokens
  greedily from ``--prompts`` random prompts with ``indexer_dtype="fp8_e4m3"`` (and ``"int8"``), FP8 latent
  rows (``kv_dtype="fp8_e4m3"``) and both FP8 formats against the same offloaded model with the model's dtype: the first position that differs, and the share of equal
  positions (a random tiny model's logits are close together, so any change of the selection soon
  changes a token: a pessimistic measure).

* **Bytes moved** (sparse offload, ``kv_dtype="fp8_e4m3"`` against the model's bf16 rows): one layer of
  production KV widths (Dc = 512, Dr = 64, top-k ``--h2d-top-k``), a ``--h2d-prompt``-token prompt, 16
  greedy tokens: host-to-device bytes per decode step, misses, host pool bytes per token. Both runs use the
  same (bf16) indexer, so they select the same rows and miss alike: the bytes differ by the rows' size.

Random data is the hard case for a top-k (scores close together); a trained model's scores are more
spread. Results: ``benchmarks/results/fp8_accuracy_bench.{json,png}``.

    python benchmarks/fp8_accuracy_bench.py [--contexts 4096 16384] [--new 128] [--prompts 4]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import RESULTS_DIR, format_table, pyplot, write_json

from torch_kvoffload.ops import (
    fp8_lightning_indexer,
    fp8_sparse_mla_attention,
    hadamard_quant_fp8,
    hadamard_quant_int8,
    lightning_indexer,
    quant_lightning_indexer,
    quantize_kv_fp8,
    sparse_mla_attention,
)

TOPK, HEADS, DIM = 2048, 64, 128
#: the generation runs: the model's dtype, then each FP8 / int8 choice of sparse offload
FORMATS = {
    "bf16": {},
    "fp8_e4m3": {"indexer_dtype": "fp8_e4m3"},
    "int8": {"indexer_dtype": "int8"},
    "fp8_latent": {"kv_dtype": "fp8_e4m3"},
    "fp8_both": {"kv_dtype": "fp8_e4m3", "indexer_dtype": "fp8_e4m3"},
}


def _overlap(truth: torch.Tensor, got: torch.Tensor) -> list[float]:
    out = []
    for x, y in zip(truth.tolist(), got.tolist(), strict=True):
        valid = {v for v in x if v >= 0}
        out.append(len(valid & set(y)) / max(1, len(valid)))
    return out


def indexer_overlap(context: int, tokens: int, seed: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, HEADS, DIM, generator=g)
    w = torch.randn(tokens, HEADS, generator=g) * HEADS**-0.5
    nb = context // 128
    k = torch.randn(nb, 128, DIM, generator=g)
    table = torch.randperm(nb, generator=g).view(1, nb).to(torch.int32)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([context], dtype=torch.int32)
    truth = lightning_indexer(q, w, k, table, cu, lens, TOPK)
    fp8 = fp8_lightning_indexer(hadamard_quant_fp8(q), w, hadamard_quant_fp8(k), table, cu, lens, TOPK)
    qi, qs = hadamard_quant_int8(q)
    ki, ks = hadamard_quant_int8(k)
    int8 = quant_lightning_indexer(qi, qs, w, ki, ks, table, cu, lens, TOPK)
    bf16 = lightning_indexer(q.bfloat16(), w, k.bfloat16(), table, cu, lens, TOPK)
    row = {"context": context, "tokens": tokens}
    for name, got in (("fp8", fp8), ("int8", int8), ("bf16", bf16)):
        per = _overlap(truth, got)
        row[f"{name}_overlap_mean"], row[f"{name}_overlap_min"] = statistics.mean(per), min(per)
    return row


def attention_error(tokens: int, seed: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    heads, dc, dr, n = 128, 512, 64, 8192
    q_nope, q_pe = torch.randn(tokens, heads, dc, generator=g), torch.randn(tokens, heads, dr, generator=g)
    kv_c, k_pe = torch.randn(n, dc, generator=g), torch.randn(n, dr, generator=g)
    idx = torch.stack([torch.randperm(n, generator=g)[:TOPK] for _ in range(tokens)]).to(torch.int32)
    scale = (dc + dr) ** -0.5
    truth, _ = sparse_mla_attention(q_nope, q_pe, kv_c, k_pe, idx, scale)
    fp8, _ = fp8_sparse_mla_attention(q_nope, q_pe, quantize_kv_fp8(kv_c, k_pe), idx, scale)
    bf16, _ = sparse_mla_attention(q_nope, q_pe, kv_c.bfloat16().float(), k_pe.bfloat16().float(), idx, scale)

    def rel(x: torch.Tensor) -> float:
        return float((x - truth).norm() / truth.norm())

    return {"tokens": tokens, "fp8_rel_error": rel(fp8), "bf16_rows_rel_error": rel(bf16)}


def generation_agreement(new: int, prompts: int) -> dict[str, float]:
    from support.hf_models import SMALL, build_model

    import torch_kvoffload

    widths = {**SMALL, "index_head_dim": 128, "index_n_heads": 16, "index_topk": 16, "kv_lora_rank": 128}
    ref = build_model("deepseek_v32", **widths)
    runs = {}
    for fmt, sparse in FORMATS.items():
        model = torch_kvoffload.offload(copy.deepcopy(ref), {"sparse": sparse})
        outs = []
        for p in range(prompts):
            ids = torch.randint(3, 1000, (1, 64), generator=torch.Generator().manual_seed(p))
            with torch.no_grad():
                outs.append(
                    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)[0, 64:]
                )
        runs[fmt] = outs
    out: dict[str, float] = {"new_tokens": new, "prompts": prompts}
    for fmt in list(FORMATS)[1:]:
        first, equal = [], []
        for a, b in zip(runs["bf16"], runs[fmt], strict=True):
            diff = (a != b).nonzero()
            first.append(int(diff[0, 0]) if diff.numel() else new)
            equal.append(float((a == b).float().mean()))
        out[f"{fmt}_first_difference_mean"] = statistics.mean(first)
        out[f"{fmt}_equal_overall"] = statistics.mean(equal)
    return out


def h2d_bytes(prompt: int, top_k: int, new: int = 16) -> dict[str, dict[str, float]]:
    """Host-to-device bytes of sparse offload's decode steps with bf16 rows and with FP8 rows."""
    from serving_bench import build

    import torch_kvoffload

    base = build(1, top_k, torch.bfloat16, 0, prompt + new + 16)
    ids = torch.randint(3, 4000, (1, prompt), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, sparse in (("bf16", {}), ("fp8_e4m3", {"kv_dtype": "fp8_e4m3"})):
        # no prefix reuse: a fresh prompt's prefill reads nothing from the host, every H2D byte is a decode miss
        model = torch_kvoffload.offload(copy.deepcopy(base), {"sparse": sparse, "prefix_cache": False})
        with torch.no_grad():
            tokens = model.generate(ids, max_new_tokens=new, do_sample=False)
        after = torch_kvoffload.stats(model)
        steps = new - 1  # the first token comes from the prefill
        out[name] = {
            "h2d_bytes_per_step": after["bytes_h2d"] / steps,
            "misses_per_step": after["misses"] / steps,
            "host_pool_bytes_per_token": after["host_pool_bytes"] / (after["reserved_tokens"] or 1),
            "tokens": tokens[0, prompt:].tolist(),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--h2d-prompt", type=int, default=2048)
    parser.add_argument("--h2d-top-k", type=int, default=512)
    args = parser.parse_args()

    indexer = [indexer_overlap(c, args.tokens, seed=i) for i, c in enumerate(args.contexts)]
    print("indexer top-2048 overlap with the fp32 indexer (64 heads, D = 128, random data)")
    print(format_table(
        ["context", "fp8 mean", "fp8 min", "int8 mean", "int8 min", "bf16 mean"],
        [[r["context"], r["fp8_overlap_mean"], r["fp8_overlap_min"], r["int8_overlap_mean"],
          r["int8_overlap_min"], r["bf16_overlap_mean"]] for r in indexer],
    ))  # fmt: skip
    attention = attention_error(args.tokens, seed=7)
    print("\nsparse attention output, relative error against fp32 rows (128 heads, 512 + 64, 2,048 rows)")
    print(format_table(["rows", "rel. error"], [["fp8 (656 B)", attention["fp8_rel_error"]],
                                               ["bf16 (1,152 B)", attention["bf16_rows_rel_error"]]]))  # fmt: skip
    generation = generation_agreement(args.new, args.prompts)
    print(f"\ngreedy generation against the model's dtype ({args.prompts} prompts x {args.new} tokens)")
    print(format_table(
        ["format", "first difference (mean)", "equal overall"],
        [[fmt, generation[f"{fmt}_first_difference_mean"], generation[f"{fmt}_equal_overall"]]
         for fmt in list(FORMATS)[1:]],
    ))  # fmt: skip
    moved = h2d_bytes(args.h2d_prompt, args.h2d_top_k)
    print(
        f"\nsparse offload, bytes moved ({args.h2d_prompt}-token prompt, top-{args.h2d_top_k}, Dc 512 + Dr 64)"
    )
    print(format_table(
        ["rows", "H2D bytes / step", "misses / step", "host pool bytes / token"],
        [[n, r["h2d_bytes_per_step"], r["misses_per_step"], r["host_pool_bytes_per_token"]] for n, r in moved.items()],
    ))  # fmt: skip
    ratio = moved["fp8_e4m3"]["h2d_bytes_per_step"] / moved["bf16"]["h2d_bytes_per_step"]
    print(f"FP8 / bf16 H2D bytes per step: {ratio:.3f} ({(ratio - 1) * 100:+.1f} %); same misses: "
          f"{moved['fp8_e4m3']['misses_per_step'] == moved['bf16']['misses_per_step']}")  # fmt: skip
    path = write_json(
        "fp8_accuracy_bench",
        {
            "indexer": indexer,
            "attention": attention,
            "generation": generation,
            "h2d": {**moved, "ratio": ratio},
        },
    )
    print(f"\n{path}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = [r["context"] for r in indexer]
        for name, colour in (("fp8", "tab:green"), ("int8", "tab:orange"), ("bf16", "tab:blue")):
            ax.plot(xs, [r[f"{name}_overlap_mean"] for r in indexer], marker="o", color=colour, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("top-2048 overlap with fp32")
        ax.set_title("Indexer top-k overlap, random data")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS_DIR / "fp8_accuracy_bench.png", dpi=120)


if __name__ == "__main__":
    main()

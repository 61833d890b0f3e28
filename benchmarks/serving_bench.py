"""Continuous batching in a fixed device KV budget: unmodified vs resident sparse vs offloaded sparse.

The model: a DeepseekV32 with production per-layer KV widths (kv_lora_rank 512, rope 64, lightning indexer
64 heads x 128, index_topk 2048) and a narrower body so the CPU can run it (hidden 1024, 8 heads of 128 + 64,
q_lora_rank 512, dense MLP 2048, ``--layers`` layers, sdpa). Variants of the same weights, all served by
transformers' continuous batching (``generate_batch``):

* ``unmodified``: ``enable_mla_continuous_batching(model)``: HF's attention over the MLA paged cache, one
  ``[512 | 64 | 128]`` row per token and layer;
* ``resident``: ``offload(model, {"sparse": {"offload": False}, "serving": ...})``: absorbed sparse attention
  over the indexer's top-k, the latent KV resident on the device;
* ``offloaded``: ``{"sparse": {}, "serving": ...}``: the latent KV in the host pool, per-layer hot top-k
  buffers and the indexer cache on the device;
* ``offloaded_int8``: the same with ``"indexer_dtype": "int8"`` (Hadamard + int8 indexer cache);
* ``offloaded_fp8``: the same with ``"indexer_dtype": "fp8_e4m3"`` (DeepSeek's FP8 indexer, 132-byte rows);
* ``offloaded_fp8_kv``: sparse offload with both FP8 formats, ``{"kv_dtype": "fp8_e4m3", "indexer_dtype":
  "fp8_e4m3"}`` (host pool and hot buffers of 656-byte latent rows, the indexer cache of 132-byte rows);
* ``resident_fp8`` (capacity only): the resident KV as FP8 latent rows (656 bytes) with the FP8 indexer.

On this machine the "device" is the CPU: the device KV budget is an accounting limit (bytes the caches count
as device memory), the compute is real.

1. Capacity (pure accounting, the production model in ``--capacity-dtype``, top-k 2048): the budget is the
   unmodified model's dense cache for ``--budget-requests`` requests of ``--target-tokens`` tokens. Requests
   of 8K and 32K tokens that fit in it: unmodified as HF's paged cache counts (blocks of ``--page-size``
   tokens, ``MLACacheAllocator.get_bytes_per_page`` x layers per block, a request holds ceil(T / page)
   blocks; the two trash sectors HF adds are outside the budget); library variants ``serving.slots`` from
   ``serving_slots(session)`` with ``serving = {"max_request_tokens": T, "device_kv_budget": budget}``
   (measured on the allocated caches). Beside each figure the design's limit per request, dense KV bytes of a
   request / the variant's device bytes per request (indexer cache + hot buffers, or the resident KV).
2. Decode throughput at the batch each variant's 32K budget allows, measured at a short context the CPU can
   prefill (``--prompt`` tokens, top-k scaled to ``--top-k``, by default 2048 x prompt / 32K): each variant
   serves exactly that many requests (unmodified: ``num_blocks`` for that many; library: ``max_requests``)
   with ``max_new_tokens`` long enough that all of them decode together for ``--window`` steps. A forward
   hook times every CB step; decode tokens/s = batch / step time, the median time of the steps whose rows are
   all decode rows and number the batch, in the fastest of ``--rounds`` rounds (the runs rotate order every
   round; other work on a shared CPU slows whole rounds). Also at equal batch: offloaded variants at the unmodified model's batch,
   resident at the offloaded variants' batches, for the per-step offload overhead (offloaded / resident - 1).
3. Time to first token under a burst: ``--burst`` requests (default: the most any variant holds) added at
   once to each variant held to its 32K capacity; TTFT = first token timestamp - request creation
   (``record_timestamps``).
4. Tokens: every request's greedy tokens are compared with the unmodified model's for the same prompt (over
   their common length; random weights can give exact indexer ties, so a difference is reported, not raised).

Writes ``benchmarks/results/serving_bench.json``, ``.md`` (the tables) and ``.png``.

    python benchmarks/serving_bench.py            # 2 layers, 512-token prompts, fp32 compute (~10 minutes)
    python benchmarks/serving_bench.py --quick    # 1 layer, 128-token prompts (< 2 minutes)
    python benchmarks/serving_bench.py --capacity-only    # the capacity table alone (seconds)
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS_DIR, VARIANT_COLOURS, format_table, pyplot, write_json

import torch_kvoffload
from torch_kvoffload.integrations.hf.continuous_batching import (
    MLACacheAllocator,
    enable_mla_continuous_batching,
)
from torch_kvoffload.integrations.hf.serving import serving_slots

VARIANTS = ("unmodified", "resident", "offloaded", "offloaded_int8", "offloaded_fp8", "offloaded_fp8_kv")
#: measured for capacity only (accounting): the resident KV as FP8 rows
FP8_VARIANTS = ("resident_fp8",)
CAPACITY_VARIANTS = (*VARIANTS, *FP8_VARIANTS)
LIBRARY = {
    "resident": {"offload": False}, "offloaded": {}, "offloaded_int8": {"indexer_dtype": "int8"},
    "resident_fp8": {"offload": False, "kv_dtype": "fp8_e4m3", "indexer_dtype": "fp8_e4m3"},
    "offloaded_fp8": {"indexer_dtype": "fp8_e4m3"},
    "offloaded_fp8_kv": {"kv_dtype": "fp8_e4m3", "indexer_dtype": "fp8_e4m3"},
}  # fmt: skip
COLOURS = {
    **VARIANT_COLOURS, "offloaded_int8": "tab:red", "offloaded_fp8": "tab:purple", "resident_fp8": "tab:brown",
    "offloaded_fp8_kv": "tab:pink",
}  # fmt: skip
KV_LORA, ROPE, INDEX_DIM, PRODUCTION_TOP_K = 512, 64, 128, 2048
VOCAB, PAD = 4096, 0


def build(layers: int, top_k: int, dtype: torch.dtype, seed: int, max_positions: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, DeepseekV32Config

    cfg = DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=layers,
        kv_lora_rank=KV_LORA, q_lora_rank=512, qk_rope_head_dim=ROPE, qk_nope_head_dim=128, v_head_dim=128,
        index_topk=top_k, index_head_dim=INDEX_DIM, index_n_heads=64, max_position_embeddings=max_positions,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).eval()
    # Why: a zero pad embedding makes the indexer's scores tie exactly (top-k order arbitrary).
    with torch.no_grad():
        model.model.embed_tokens.weight[PAD].normal_(0.0, model.config.initializer_range)
    return model


def library_model(base: torch.nn.Module, variant: str, serving: dict[str, int]) -> torch.nn.Module:
    return torch_kvoffload.offload(
        copy.deepcopy(base), {"sparse": dict(LIBRARY[variant]), "serving": serving}
    )


# ----------------------------------------------------------------------------------------- capacity
def capacity(args) -> dict[str, Any]:
    """Requests of each ``args.lengths`` that fit in the budget, per variant (accounting only)."""
    dtype = getattr(torch, args.capacity_dtype)
    base = build(args.layers, PRODUCTION_TOP_K, dtype, args.seed, max(args.lengths) + 16)
    row = (KV_LORA + ROPE + INDEX_DIM) * dtype.itemsize  # bytes per token and layer of the dense MLA cache
    budget = args.budget_requests * args.target_tokens * row * args.layers
    block = MLACacheAllocator.for_config(base.config).get_bytes_per_page(0, 0, dtype, args.page_size)
    block *= args.layers  # HF's block: one page per layer
    out: dict[str, Any] = {"budget_bytes": budget, "dtype": args.capacity_dtype, "lengths": {}}
    for T in args.lengths:
        dense = T * row * args.layers
        blocks = math.ceil(T / args.page_size)
        rec = {
            "unmodified": {
                "requests": (budget // block) // blocks, "bytes_per_request": blocks * block,
                "fixed_bytes": 0, "design_limit": dense / (blocks * block),
            }
        }  # fmt: skip
        for v in LIBRARY:
            model = library_model(base, v, {"max_request_tokens": T, "device_kv_budget": budget})
            session = model._kvoffload_session
            slots, per, fixed = serving_slots(session)
            rec[v] = {
                "requests": slots, "bytes_per_request": per, "fixed_bytes": fixed, "design_limit": dense / per,
                "device_kv_bytes": session.device_kv_bytes(),
            }  # fmt: skip
            session.close()
            del model
        for v in CAPACITY_VARIANTS:
            rec[v]["vs_unmodified"] = rec[v]["requests"] / rec["unmodified"]["requests"]
        out["lengths"][str(T)] = {"dense_bytes_per_request": dense, **rec}
        print(
            f"capacity at {T} tokens: " + ", ".join(f"{v} {rec[v]['requests']}" for v in CAPACITY_VARIANTS),
            flush=True,
        )
    return out


# ------------------------------------------------------------------------------------------- serving
class StepTimes:
    """Wall time of every CB step of a model (forward pre-/post-hooks) and of its layers' attention modules
    (the lightning indexer included) and indexer modules in it: ``(rows, all decode, seconds, attention
    seconds, indexer seconds)``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.steps: list[tuple[int, bool, float, float, float]] = []
        self._open: tuple[int, bool, float] | None = None
        self._spent = {"attn": 0.0, "indexer": 0.0}
        self._entered: dict[str, float] = {}
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post),
        ]
        for layer in model.model.layers:
            for key, module in (
                ("attn", layer.self_attn),
                ("indexer", getattr(layer.self_attn, "indexer", None)),
            ):
                if module is not None:
                    self._handles.append(module.register_forward_pre_hook(self._enter(key)))
                    self._handles.append(module.register_forward_hook(self._leave(key)))

    def _enter(self, key: str):
        def hook(module, args) -> None:
            self._entered[key] = time.perf_counter()

        return hook

    def _leave(self, key: str):
        def hook(module, args, out) -> None:
            self._spent[key] += time.perf_counter() - self._entered[key]

        return hook

    def _pre(self, module, args, kwargs) -> None:
        cu = kwargs.get("cu_seq_lens_q")
        q = torch.diff(cu).tolist() if cu is not None else []
        self._spent = {"attn": 0.0, "indexer": 0.0}
        self._open = (len(q), bool(q) and all(n == 1 for n in q), time.perf_counter())

    def _post(self, module, args, out) -> None:
        if self._open is not None:
            rows, decode, t0 = self._open
            self.steps.append(
                (rows, decode, time.perf_counter() - t0, self._spent["attn"], self._spent["indexer"])
            )
            self._open = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def serve(
    base: torch.nn.Module, variant: str, batch: int, prompts: list[list[int]], new: int, args
) -> dict[str, Any]:
    """``generate_batch(prompts)`` on ``variant`` holding at most ``batch`` requests at once."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    tokens = max(len(p) for p in prompts) + new
    cb = ContinuousBatchingConfig(page_size=args.page_size, max_batch_tokens=args.max_batch_tokens)
    if variant == "unmodified":
        model = copy.deepcopy(base)
        enable_mla_continuous_batching(model)
        cb.num_blocks = batch * math.ceil(tokens / args.page_size)
    else:
        model = library_model(base, variant, {"max_request_tokens": tokens, "max_requests": batch})
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=VOCAB + 1, pad_token_id=PAD)
    clock = StepTimes(model)
    t0 = time.perf_counter()
    try:
        out = model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=cb, record_timestamps=True
        )
    finally:
        clock.remove()
    wall = time.perf_counter() - t0
    stats = torch_kvoffload.stats(model) if variant != "unmodified" else {}
    if variant != "unmodified":
        model._kvoffload_session.close()
    errors = [o.error for o in out.values() if o.error is not None]
    if errors or len(out) != len(prompts):
        raise RuntimeError(
            f"{variant}: generate_batch gave {len(out)}/{len(prompts)} results, errors {errors[:2]}"
        )
    order = sorted(out, key=lambda rid: int(rid.rsplit("_", 1)[1]))
    full = [(s, a, i) for rows, dec, s, a, i in clock.steps if dec and rows == batch]
    return {
        "variant": variant, "batch": batch, "requests": len(prompts), "new_tokens": new, "wall_s": wall,
        "tokens": [list(out[r].generated_tokens) for r in order],
        "ttft_s": [out[r].timestamps[0] - out[r].created_time for r in order],
        "decode_steps_s": [s for s, _, _ in full],
        "decode_attn_s": [a for _, a, _ in full],
        "decode_indexer_s": [i for _, _, i in full],
        "prefill_or_mixed_s": sum(s for _, dec, s, _, _ in clock.steps if not dec),
        "decode_s": sum(s for _, dec, s, _, _ in clock.steps if dec),
        "steps": len(clock.steps),
        "stats": {k: stats[k] for k in ("bytes_h2d", "hits", "misses") if k in stats},
    }  # fmt: skip


def equal_tokens(run: dict[str, Any], reference: list[list[int]]) -> bool:
    return all(
        a[: min(len(a), len(b))] == b[: min(len(a), len(b))]
        for a, b in zip(run["tokens"], reference, strict=False)
    )


def throughput(args, caps: dict[str, int]) -> dict[str, Any]:
    base = build(args.layers, args.top_k, torch.float32, args.seed, args.prompt + 4096)
    g = torch.Generator().manual_seed(args.seed + 1)
    count = max(args.burst, *caps.values())
    prompts = [torch.randint(3, VOCAB, (args.prompt,), generator=g).tolist() for _ in range(count)]
    # Why: every request decodes with all others only after the last prompt is in; until then steps mix.
    chunks = math.ceil(args.prompt / args.max_batch_tokens)

    def new_for(batch: int) -> int:
        return math.ceil(batch * args.prompt / args.max_batch_tokens) + chunks + args.window

    plan = [(v, caps[v]) for v in VARIANTS]
    plan += [(v, caps["unmodified"]) for v in ("offloaded", "offloaded_int8", "offloaded_fp8")]
    plan += [("resident", caps[v]) for v in ("offloaded", "offloaded_int8", "offloaded_fp8")]
    plan = list(dict.fromkeys(plan))
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for rnd in range(args.rounds):  # the order rotates every round: machine noise hits every run alike
        shift = rnd * len(plan) // max(1, args.rounds)
        for v, batch in plan[shift:] + plan[:shift]:
            r = serve(base, v, batch, prompts[:batch], new_for(batch), args)
            print(
                f"round {rnd}: {v} batch {batch}: {len(r['decode_steps_s'])} full decode steps, "
                f"median {1e3 * statistics.median(r['decode_steps_s'] or [float('nan')]):.1f} ms "
                f"({r['wall_s']:.1f} s)", flush=True,
            )  # fmt: skip
            first = runs.setdefault(
                (v, batch),
                {
                    **r,
                    "wall_s": [],
                    "decode_steps_s": [],
                    "decode_attn_s": [],
                    "decode_indexer_s": [],
                    "repeatable": True,
                },
            )
            first["wall_s"].append(r["wall_s"])
            first.setdefault("round_step_s", []).append(
                statistics.median(r["decode_steps_s"]) if r["decode_steps_s"] else None
            )
            for key in ("decode_steps_s", "decode_attn_s", "decode_indexer_s"):
                first[key] += r[key]
            first["repeatable"] &= r["tokens"] == first["tokens"]
    for (_, batch), r in runs.items():
        steps = r["decode_steps_s"]
        r["full_decode_steps"] = len(steps)
        # Why: other work on a shared CPU slows whole rounds; the least disturbed round's median is the figure.
        medians = [m for m in r["round_step_s"] if m is not None]
        r["decode_step_s"] = min(medians) if medians else None
        r["decode_tok_s"] = batch / r["decode_step_s"] if steps else None
        r["decode_attn_ms"] = 1e3 * statistics.median(r["decode_attn_s"]) if steps else None
        r["decode_indexer_ms"] = 1e3 * statistics.median(r["decode_indexer_s"]) if steps else None
    bursts = []
    for v in VARIANTS:
        r = serve(base, v, caps[v], prompts[: args.burst], args.window, args)
        bursts.append(r)
        ttft = sorted(r["ttft_s"])
        print(
            f"burst {v} ({caps[v]} held): TTFT median {statistics.median(ttft):.2f} s, max {ttft[-1]:.2f} s"
        )
    ref = {len(r["tokens"]): r["tokens"] for r in bursts if r["variant"] == "unmodified"}[args.burst]
    for r in [*runs.values(), *bursts]:
        r["tokens_equal_unmodified"] = equal_tokens(r, ref)
    return {"runs": list(runs.values()), "bursts": bursts}


# -------------------------------------------------------------------------------------------- report
def capacity_table(cap: dict[str, Any]) -> str:
    """Requests that fit per length and variant (the FP8 formats too)."""
    rows = []
    for T, rec in cap["lengths"].items():
        for v in CAPACITY_VARIANTS:
            r = rec[v]
            rows.append(
                [T, v, r["requests"], f"{r['vs_unmodified']:.2f}x", f"{r['design_limit']:.2f}x",
                 f"{r['bytes_per_request'] / 2**20:.1f}", f"{r['fixed_bytes'] / 2**20:.1f}"]
            )  # fmt: skip
    return format_table(
        ["tokens", "variant", "requests", "vs unmod", "design limit", "MiB/req", "fixed MiB"], rows
    )


def tables(result: dict[str, Any], args) -> str:
    cap = result["capacity"]
    lines = [
        "On this CPU the 'device' KV budget is an accounting limit (bytes the caches count as device memory); "
        "the compute is real.",
        *(
            ["--quick: a check of the script; with so few steps its timings are noise, not results."]
            if args.quick
            else []
        ),
        f"Budget: {cap['budget_bytes'] / 2**20:.0f} MiB = the unmodified dense MLA cache of "
        f"{args.budget_requests} requests x {args.target_tokens} tokens, {args.layers} layer(s), "
        f"{cap['dtype']} (production widths 512 + 64 + 128, top-k 2048).",
        "",
        "Requests that fit (x the unmodified model; design limit per request = dense KV / device bytes per request):",
    ]
    lines.append(capacity_table(cap))
    thr = result["throughput"]
    lines += [
        "",
        f"Decode, measured at {args.prompt}-token prompts (top-k {args.top_k}, fp32 compute, {args.layers} "
        f"layer(s), {torch.get_num_threads()} threads, load average {result['load_average']}) at the batch "
        f"each variant's {args.target_tokens}-token budget allows, and at equal batches:",
    ]
    caps = {v: cap["lengths"][str(args.target_tokens)][v]["requests"] for v in VARIANTS}
    step = {(r["variant"], r["batch"]): r for r in thr["runs"]}
    unmod = step[("unmodified", caps["unmodified"])]
    rows = []
    for r in thr["runs"]:
        res = step.get(("resident", r["batch"]))
        overhead = (
            f"{100 * (r['decode_step_s'] / res['decode_step_s'] - 1):+.1f} %"
            if res is not None
            and r["variant"].startswith("offloaded")
            and r["decode_step_s"]
            and res["decode_step_s"]
            else ""
        )
        own = "yes" if caps[r["variant"]] == r["batch"] else ""
        rows.append(
            [r["variant"], r["batch"], own, r["full_decode_steps"], 1e3 * (r["decode_step_s"] or float("nan")),
             r["decode_attn_ms"] or float("nan"), r["decode_indexer_ms"] or "-",
             r["decode_tok_s"] or float("nan"),
             f"{(r['decode_tok_s'] or 0) / unmod['decode_tok_s']:.2f}x" if own else "", overhead,
             f"{r['prefill_or_mixed_s']:.1f} / {r['decode_s']:.1f}",
             ("y" if r["tokens_equal_unmodified"] else "n") + ("" if r["repeatable"] else " (rounds differ)")]
        )  # fmt: skip
    headers = ["variant", "batch", "its budget", "steps", "step ms", "attn ms", "indexer ms", "tok/s", "vs unmod", "vs resident",
               "prefill+mixed / decode s", "tokens = unmod"]  # fmt: skip
    lines.append(format_table(headers, rows))
    lines += [
        "step ms: median wall time of the CB steps whose rows are all decode rows and number the batch, in the "
        "fastest round; attn / indexer ms: median time (all rounds) in the layers' attention modules (indexer included) / indexer modules of those steps ('-': the library runs its own indexer op, inside attn); tok/s = batch / step; vs resident: per-step offload overhead at equal batch; prefill+mixed / "
        "decode s: time in the other steps / in all-decode steps (first round). The 32K capacity figures are "
        f"served here at {args.prompt}-token contexts: the unmodified model's step grows with the context (it "
        "reads and decompresses every cached row), the sparse variants' with top-k. The int8 and FP8 indexers "
        "quantise the scores: their top-k, so their tokens, may differ from the floating indexer's.",
    ]
    at = cap["lengths"][str(args.target_tokens)]
    res_at = {r["batch"]: r for r in thr["runs"] if r["variant"] == "resident"}
    lines += ["", f"Targets at {args.target_tokens} tokens:"]
    for v, goal in (
        ("offloaded_fp8_kv", 6.5),
        ("offloaded_fp8", 4.0),
        ("offloaded_int8", 4.0),
        ("offloaded", 2.5),
    ):
        got = at[v]["vs_unmodified"]
        lines.append(
            f"  requests {v} >= {goal}x unmodified: {got:.2f}x ({'met' if got >= goal else 'NOT met'})"
        )
    for v in ("offloaded_fp8_kv", "offloaded_fp8", "offloaded_int8", "offloaded"):
        got = (step[(v, caps[v])]["decode_tok_s"] or 0) / unmod["decode_tok_s"]
        lines.append(
            f"  decode tok/s {v} at its batch >= 3x unmodified at its batch: {got:.2f}x "
            f"({'met' if got >= 3 else 'NOT met'}; at the {args.prompt}-token context measured)"
        )
    for r in thr["runs"]:
        res = res_at.get(r["batch"])
        if (
            r["variant"].startswith("offloaded")
            and res is not None
            and r["decode_step_s"]
            and res["decode_step_s"]
        ):
            got = 100 * (r["decode_step_s"] / res["decode_step_s"] - 1)
            lines.append(
                f"  offload overhead {r['variant']} vs resident at batch {r['batch']} <= 10 %: {got:+.1f} % "
                f"({'met' if got <= 10 else 'NOT met'})"
            )
    lines += [
        "",
        f"Burst of {args.burst} requests at once, each variant holding its {args.target_tokens}-token capacity:",
    ]
    rows = []
    for r in thr["bursts"]:
        t = sorted(r["ttft_s"])
        rows.append(
            [r["variant"], r["batch"], statistics.median(t), t[int(0.9 * (len(t) - 1))], t[-1], r["wall_s"],
             "y" if r["tokens_equal_unmodified"] else "n"]
        )  # fmt: skip
    lines.append(
        format_table(["variant", "held", "TTFT p50 s", "p90 s", "max s", "burst wall s", "tokens eq"], rows)
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], args, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    cap = result["capacity"]["lengths"]
    caps = {v: cap[str(args.target_tokens)][v]["requests"] for v in VARIANTS}
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    lengths = list(cap)
    width = 0.8 / len(CAPACITY_VARIANTS)
    for i, v in enumerate(CAPACITY_VARIANTS):
        xs = [j + (i - (len(CAPACITY_VARIANTS) - 1) / 2) * width for j in range(len(lengths))]
        ax[0].bar(xs, [cap[T][v]["requests"] for T in lengths], width, label=v, color=COLOURS[v])
    ax[0].set_xticks(range(len(lengths)), lengths)
    ax[0].set(xlabel="tokens per request", ylabel="requests in the budget", title="capacity (accounting)")
    runs = {(r["variant"], r["batch"]): r for r in result["throughput"]["runs"]}
    own = [runs[(v, caps[v])] for v in VARIANTS]
    ax[1].bar(
        range(len(VARIANTS)), [r["decode_tok_s"] or 0 for r in own], color=[COLOURS[v] for v in VARIANTS]
    )
    ax[1].set_xticks(range(len(VARIANTS)), [f"{v}\n@{caps[v]}" for v in VARIANTS], fontsize=7)
    ax[1].set(ylabel="decode tokens/s", title=f"decode at the 32K batch ({args.prompt}-token context)")
    for r in result["throughput"]["bursts"]:
        t = sorted(r["ttft_s"])
        ax[2].plot(
            t,
            [(i + 1) / len(t) for i in range(len(t))],
            "o-",
            label=r["variant"],
            color=COLOURS[r["variant"]],
        )
    ax[2].set(xlabel="time to first token, s", ylabel="fraction of requests", title=f"burst of {args.burst}")
    ax[2].legend()
    fig.suptitle(
        "continuous batching in a fixed device KV budget (CPU: budget is accounting, compute is real)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768], help="capacity request lengths")
    p.add_argument("--target-tokens", type=int, default=32768, help="the length whose capacities are served")
    p.add_argument("--budget-requests", type=int, default=4, help="budget: dense cache of this many requests")
    p.add_argument("--capacity-dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=256, help="HF paged-cache tokens per block")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of the measured runs")
    p.add_argument(
        "--top-k", type=int, default=None, help="top-k of the measured runs (default 2048 x prompt / 32K)"
    )
    p.add_argument("--window", type=int, default=24, help="decode steps with every request in")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the decode runs (rotating order)")
    p.add_argument(
        "--burst", type=int, default=None, help="requests of the burst (default: the most any holds)"
    )
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="1 layer, 128-token prompts (< 2 minutes)")
    p.add_argument(
        "--capacity-only", action="store_true", help="only the capacity accounting (every variant, FP8 too)"
    )
    p.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args()
    if args.quick:
        args.layers, args.prompt, args.window, args.rounds = 1, 128, 6, 1
    if args.top_k is None:
        args.top_k = max(1, PRODUCTION_TOP_K * args.prompt // args.target_tokens)
    if args.target_tokens not in args.lengths:
        args.lengths.append(args.target_tokens)
    t0 = time.perf_counter()
    cap = capacity(args)
    if args.capacity_only:
        report = capacity_table(cap)
        print(report)
        path = write_json(
            "serving_bench_capacity", {"config": {**vars(args), "output_dir": None}, "capacity": cap}
        )
        (RESULTS_DIR / "serving_bench_capacity.md").write_text(
            f"# serving_bench_capacity\n\n```\n{report}\n```\n"
        )
        print(f"wrote {path}")
        return
    caps = {v: cap["lengths"][str(args.target_tokens)][v]["requests"] for v in VARIANTS}
    if args.burst is None:
        args.burst = max(caps.values())
    result = {"capacity": cap, "throughput": throughput(args, caps)}
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]  # other work on the CPU skews timings
    report = tables(result, args)
    print(report)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    payload = {"config": config, "wall_s": time.perf_counter() - t0, **result}
    name = "serving_bench_quick" if args.quick else "serving_bench"
    if args.output_dir.resolve() == RESULTS_DIR.resolve():
        path = write_json(name, payload)
    else:
        import json

        from _common import machine_info

        args.output_dir.mkdir(parents=True, exist_ok=True)
        path = args.output_dir / f"{name}.json"
        path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    (args.output_dir / f"{name}.md").write_text(f"# {name}\n\n```\n{report}\n```\n")
    print(f"wrote {path} ({payload['wall_s']:.0f} s)")
    plot(result, args, args.output_dir / f"{name}.png")


if __name__ == "__main__":
    main()

"""Decode of a production-width DeepseekV32: unmodified vs resident sparse vs offloaded sparse, side by side.

The model: hidden 2048, 16 heads of 128 + 64 (query / key) and 128 (value), kv_lora_rank 512, rope 64,
q_lora_rank 1536, lightning indexer 64 heads x 128, top-k 2048, few layers (``--layers``), fp32, sdpa.
Three variants of the same weights run in one process:

* ``unmodified``: the transformers model and its ``DynamicCache``;
* ``resident``: ``OffloadConfig(sparse={"offload": False})``, absorbed sparse MLA attention over the
  indexer's top-k with the whole latent KV on the device;
* ``offloaded``: ``OffloadConfig(sparse={})``, the latent KV in the host pool, hot top-k buffers on the
  device.

Per prompt length the caches are filled, then untimed decode steps run (``--warmup`` of each library
variant, one of the unmodified model), then ``--rounds`` rounds, each running ``--steps`` greedy decode
steps of each library variant, in an order that rotates every round (so machine noise hits every variant
alike); the unmodified model's ``--unmodified-steps`` timed steps (its steps take seconds at long contexts)
are spread evenly over the rounds, in the same rotation.

Filling. Up to ``--prefill-up-to`` tokens the prompt is prefilled through the model in chunks of
``--chunk`` tokens (the indexer's scores are ``[S, H, T]``); longer prompts (the indexer's prefill is
O(S^2)) are filled directly with the same random rows in every variant: ``kv_c [1, S, 512]``, ``k_pe
[1, S, 64]`` and ``index_k [1, S, 128]`` per layer go through ``kvoffload::mla_cache_write`` inside the
session's ``begin_forward`` / ``end_forward`` (library variants) and through ``DynamicCache.update`` /
``update_indexer`` (unmodified). Greedy tokens of the variants are compared over their common steps.

Reported per length: decode tokens/s (1 / median step time) with the step's p10 / p50 / p90 ms; the
offload overhead ``offloaded / resident - 1`` of the median step, of the median attention-module time
(forward pre-/post-hooks on every layer's attention module, all variants) and of the median cache-op time
(wall time of the ``kvoffload::mla_cache_write`` + ``mla_cache_attention`` calls, library variants), each
also paired (the median over rounds of the round's ratio); the offloaded variant's H2D bytes and hit rate
per step; device KV bytes of each variant. Device KV bytes at ``--kv-lengths`` are also reported against
the unmodified cache: measured from the cache tensors where the unmodified model ran at that length, else
the accounting ``layers x tokens x (512 + 64 + 128) x 4`` (``stats()["dense_kv_bytes"]``). ``--profile``
profiles decode steps of both library variants per length (torch.profiler, CPU).

Writes ``benchmarks/results/hf_generate_bench.json`` and ``hf_generate_bench.png``. One file of about 600
lines, like the other benchmarks a script that runs as it is: variant setup and filling, interleaved
timing, profiling, tables and plot each take a section.

    python benchmarks/hf_generate_bench.py                # 2K / 8K prefilled, 32K / 64K filled, 2 layers
    python benchmarks/hf_generate_bench.py --smoke        # a check of the script (< 2 minutes; files in /tmp)
    python benchmarks/hf_generate_bench.py --lengths 2048 --prefill-up-to 0 --kv-lengths --output-dir /tmp/x
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS_DIR, VARIANT_COLOURS, format_table, machine_info, pyplot, write_json

import torch_kvoffload
from torch_kvoffload.ops import mla_runtime

VARIANTS = ("unmodified", "resident", "offloaded")
LIBRARY = ("resident", "offloaded")
KV_LORA, ROPE, INDEX_DIM = 512, 64, 128


def build(layers: int, seed: int, max_positions: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, DeepseekV32Config

    cfg = DeepseekV32Config(
        vocab_size=4096, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=layers,
        kv_lora_rank=KV_LORA, q_lora_rank=1536, qk_rope_head_dim=ROPE, qk_nope_head_dim=128, v_head_dim=128,
        index_topk=2048, index_head_dim=INDEX_DIM, index_n_heads=64, max_position_embeddings=max_positions,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


# ----------------------------------------------------------------------------------------- timing
@dataclass
class StepClock:
    """Seconds spent in the attention modules and in the library's cache ops during the current step."""

    attn: float = 0.0
    ops: float = 0.0
    write: float = 0.0  # the mla_cache_write share of ``ops``
    op_calls: int = 0
    _entered: float = 0.0

    def reset(self) -> None:
        self.attn = self.ops = self.write = 0.0
        self.op_calls = 0

    def hook(self, model: torch.nn.Module) -> None:
        """Time every layer's attention module of ``model`` (forward pre-/post-hooks)."""
        for layer in model.model.layers:
            layer.self_attn.register_forward_pre_hook(self._pre)
            layer.self_attn.register_forward_hook(self._post)

    def _pre(self, module, args) -> None:
        self._entered = time.perf_counter()

    def _post(self, module, args, out) -> None:
        self.attn += time.perf_counter() - self._entered


CLOCK = StepClock()


@contextmanager
def timed_cache_ops():
    """Time the ``mla_cache_write`` / ``mla_cache_attention`` calls the library's attention makes through
    ``torch_kvoffload.ops.mla_runtime`` (the functions are wrapped for the duration)."""
    originals = {name: getattr(mla_runtime, name) for name in ("mla_cache_write", "mla_cache_attention")}

    def wrap(fn, is_write: bool):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                CLOCK.ops += dt
                CLOCK.write += dt if is_write else 0.0
                CLOCK.op_calls += 1

        return timed

    for name, fn in originals.items():
        setattr(mla_runtime, name, wrap(fn, name == "mla_cache_write"))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(mla_runtime, name, fn)


@dataclass
class Variant:
    name: str
    model: torch.nn.Module
    cache: Any
    tokens: list[int] = field(default_factory=list)
    fill_s: float = 0.0  # seconds of the prefill / direct fill, model build included
    step_s: list[float] = field(default_factory=list)
    attn_s: list[float] = field(default_factory=list)
    ops_s: list[float] = field(default_factory=list)
    write_s: list[float] = field(default_factory=list)

    @property
    def library(self) -> bool:
        return self.name in LIBRARY

    def step(self, record: bool) -> None:
        """One greedy decode step; its times are kept when ``record``."""
        CLOCK.reset()
        ids = torch.tensor([[self.tokens[-1]]])
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = self.model(input_ids=ids, cache=self.cache, use_cache=True).logits
        dt = time.perf_counter() - t0
        self.tokens.append(int(logits[0, -1].argmax()))
        if self.library and CLOCK.op_calls == 0:
            raise RuntimeError(
                f"{self.name}: the decode step made no mla_cache_write / mla_cache_attention call through "
                "torch_kvoffload.ops.mla_runtime; the cache-op timing cannot see the library's attention"
            )
        if record:
            self.step_s.append(dt)
            self.attn_s.append(CLOCK.attn)
            self.ops_s.append(CLOCK.ops)
            self.write_s.append(CLOCK.write)


def quantiles(xs: list[float]) -> dict[str, float]:
    """p10 / p50 / p90 of ``xs`` in milliseconds (nearest rank)."""
    s = sorted(xs)

    def at(q: float) -> float:
        return 1e3 * s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]

    return {"p10_ms": at(0.1), "p50_ms": 1e3 * statistics.median(s), "p90_ms": at(0.9)}


# ------------------------------------------------------------------------------------------ fill
def library_model(
    variant: str, layers: int, seed: int, max_positions: int, block_size: int
) -> torch.nn.Module:
    cfg = torch_kvoffload.OffloadConfig(sparse={"offload": variant == "offloaded"}, block_size=block_size)
    return torch_kvoffload.offload(build(layers, seed, max_positions), cfg)


def random_rows(layers: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer ``(kv_c [1,n,512], k_pe [1,n,64], index_k [1,n,128])`` fp32: unit-scale rows, as the
    model's normalised latents and indexer keys are."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(1, n, KV_LORA, generator=g), torch.randn(1, n, ROPE, generator=g),
         torch.randn(1, n, INDEX_DIM, generator=g))
        for _ in range(layers)
    ]  # fmt: skip


def fill_library(model: torch.nn.Module, cache: Any, rows, n: int) -> None:
    """Place ``rows`` as the first ``n`` tokens of ``cache``'s sequence without running the model."""
    session = model._kvoffload_session
    session.begin_forward(torch.full((1, n), 3, dtype=torch.int64), past=0, owner=cache)
    try:
        for layer, (kv_c, k_pe, index_k) in enumerate(rows):
            torch.ops.kvoffload.mla_cache_write(
                session.name, layer, kv_c, k_pe, index_k, session.layer_caches(layer)
            )
    except BaseException:
        session.abort_forward()
        raise
    session.end_forward()
    cache.seen_tokens = n


def fill_unmodified(cache: Any, rows) -> None:
    for layer, (kv_c, k_pe, index_k) in enumerate(rows):
        cache.update(kv_c.unsqueeze(1), k_pe.unsqueeze(1), layer)
        cache.update_indexer(index_k, layer)


def prefill(model: torch.nn.Module, cache: Any, prompt: torch.Tensor, chunk: int) -> int:
    """Chunked prefill; the greedy first token."""
    with torch.no_grad():
        for start in range(0, prompt.shape[1], chunk):
            logits = model(input_ids=prompt[:, start : start + chunk], cache=cache, use_cache=True).logits
    return int(logits[0, -1].argmax())


def dense_cache_bytes(cache: Any) -> int:
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values, getattr(layer, "indexer_keys", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def make_variants(n: int, args, names=VARIANTS) -> tuple[dict[str, Variant], bool]:
    """The variants holding the same ``n``-token context; whether it was prefilled (else filled)."""
    from transformers import DynamicCache

    max_pos = max(16384, n + args.total_steps + 16)
    prefilled = n <= args.prefill_up_to
    prompt = torch.randint(3, 4096, (1, n), generator=torch.Generator().manual_seed(args.seed + n))
    rows = None if prefilled else random_rows(args.layers, n, args.seed + n)
    out = {}
    for name in names:
        t0 = time.perf_counter()
        if name == "unmodified":
            model = build(args.layers, args.seed, max_pos)
            cache = DynamicCache(config=model.config)
        else:
            model = library_model(name, args.layers, args.seed, max_pos, args.block_size)
            session = model._kvoffload_session
            session.reserve(1, n + args.total_steps + 1)
            cache = session.new_cache()
        if prefilled:
            first = prefill(model, cache, prompt, args.chunk)
        else:
            if name == "unmodified":
                fill_unmodified(cache, rows)
            else:
                fill_library(model, cache, rows, n)
            first = int(prompt[0, -1])
        CLOCK.hook(model)
        out[name] = Variant(name, model, cache, tokens=[first], fill_s=time.perf_counter() - t0)
        how = "prefill" if prefilled else "fill"
        print(f"  {name}: {how} of {n} tokens in {out[name].fill_s:.1f} s", flush=True)
    return out, prefilled


# ------------------------------------------------------------------------------------------- run
def profile_steps(variants: dict[str, Variant], steps: int, top: int) -> dict[str, list[dict[str, Any]]]:
    """Per library variant, the ops of ``steps`` decode steps by self CPU time (ms per step); the
    variants' steps alternate, each profiled on its own."""
    from torch.profiler import ProfilerActivity, profile

    acc: dict[str, dict[str, list[float]]] = {name: {} for name in LIBRARY}
    for i in range(steps):
        for name in LIBRARY if i % 2 == 0 else LIBRARY[::-1]:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                variants[name].step(record=False)
            for e in prof.key_averages():
                a = acc[name].setdefault(e.key, [0.0, 0.0, 0.0])
                a[0] += e.count
                a[1] += e.self_cpu_time_total
                a[2] += e.cpu_time_total
    out = {}
    for name, ops in acc.items():
        rows = [
            {"op": op, "calls_per_step": c / steps, "self_ms": s / 1e3 / steps, "total_ms": t / 1e3 / steps}
            for op, (c, s, t) in ops.items()
        ]
        rows.sort(key=lambda r: -r["self_ms"])
        out[name] = rows[:top]
    return out


def overhead(off: list[float], res: list[float]) -> float:
    return statistics.median(off) / statistics.median(res) - 1.0


def paired_overhead(off: list[float], res: list[float], rounds: int) -> float:
    """Median over rounds of (the round's median offloaded / its median resident) - 1."""
    per = len(off) // rounds
    ratios = [
        statistics.median(off[i * per : (i + 1) * per]) / statistics.median(res[i * per : (i + 1) * per])
        for i in range(rounds)
    ]
    return statistics.median(ratios) - 1.0


def unmodified_steps_in(r: int, args) -> int:
    """Timed steps of the unmodified model in round ``r`` (``--unmodified-steps`` spread evenly)."""
    u, n = args.unmodified_steps, args.rounds
    return (r + 1) * u // n - r * u // n


def run_length(n: int, args) -> tuple[dict[str, Any], dict[str, Any] | None]:
    print(f"prompt {n}:", flush=True)
    variants, prefilled = make_variants(n, args)
    off_model = variants["offloaded"].model
    for v in variants.values():
        for _ in range(args.warmup if v.library else 1):
            v.step(record=False)
    before = torch_kvoffload.stats(off_model)
    order = list(VARIANTS)
    for r in range(args.rounds):
        for name in order[r % 3 :] + order[: r % 3]:
            v = variants[name]
            for _ in range(unmodified_steps_in(r, args) if name == "unmodified" else args.steps):
                v.step(record=True)
    after = torch_kvoffload.stats(off_model)
    prof = None
    if args.profile:
        prof = profile_steps(variants, args.profile_steps, 60)
    common = min(len(v.tokens) for v in variants.values())
    toks = {name: v.tokens[:common] for name, v in variants.items()}
    res, off, un = variants["resident"], variants["offloaded"], variants["unmodified"]
    out: dict[str, Any] = {
        "prompt_len": n,
        "layers": args.layers,
        "context": "prefilled" if prefilled else "filled directly (random rows)",
        "timed_steps": {name: len(v.step_s) for name, v in variants.items()},
        "tokens_compared": common,
        "tokens_equal_resident_offloaded": toks["resident"] == toks["offloaded"],
        "tokens_equal_unmodified": toks["unmodified"] == toks["resident"] == toks["offloaded"],
    }
    for name, v in variants.items():
        q = quantiles(v.step_s)
        out[name] = {
            "decode_tok_s": 1e3 / q["p50_ms"],
            "step": q,
            "attn_module": quantiles(v.attn_s),
            "fill_s": v.fill_s,
            **({"cache_ops": quantiles(v.ops_s), "cache_write": quantiles(v.write_s)} if v.library else {}),
        }
    out["overhead_step"] = overhead(off.step_s, res.step_s)
    out["overhead_attn_module"] = overhead(off.attn_s, res.attn_s)
    out["overhead_cache_ops"] = overhead(off.ops_s, res.ops_s)
    for key, o, r in (("step", off.step_s, res.step_s), ("attn_module", off.attn_s, res.attn_s),
                      ("cache_ops", off.ops_s, res.ops_s), ("cache_write", off.write_s, res.write_s)):  # fmt: skip
        out[f"overhead_{key}_ms"] = 1e3 * (statistics.median(o) - statistics.median(r))
    out["overhead_step_paired"] = paired_overhead(off.step_s, res.step_s, args.rounds)
    out["overhead_attn_module_paired"] = paired_overhead(off.attn_s, res.attn_s, args.rounds)
    out["overhead_cache_ops_paired"] = paired_overhead(off.ops_s, res.ops_s, args.rounds)
    out["speedup_resident_vs_unmodified"] = (
        out["resident"]["decode_tok_s"] / out["unmodified"]["decode_tok_s"]
    )
    out["h2d_bytes_per_step_offloaded"] = (after["bytes_h2d"] - before["bytes_h2d"]) / len(off.step_s)
    lookups = after["hits"] + after["misses"] - before["hits"] - before["misses"]
    out["hit_rate_offloaded"] = (after["hits"] - before["hits"]) / max(1, lookups)
    kv = {
        "tokens": n,
        "unmodified_measured": dense_cache_bytes(un.cache),
        "unmodified_tokens": n + len(un.tokens) - 1,
        "resident": torch_kvoffload.stats(res.model)["device_kv_bytes"],
        "offloaded": torch_kvoffload.stats(off.model)["device_kv_bytes"],
        "unmodified_accounting_at_n": args.layers * n * (KV_LORA + ROPE + INDEX_DIM) * 4,
    }
    kv["unmodified"] = kv["unmodified_measured"]
    kv["unmodified_source"] = "measured (DynamicCache tensors)"
    out["device_kv"] = kv
    for v in variants.values():
        if v.library:
            v.model._kvoffload_session.close()
    return out, prof


def kv_only(n: int, args) -> dict[str, Any]:
    """Device KV of the library variants at ``n`` tokens (filled, one decode step) vs the accounting of
    the unmodified cache (the unmodified model is not run)."""
    print(f"device KV at {n} (library variants only):", flush=True)
    saved = args.prefill_up_to
    args.prefill_up_to = 0
    try:
        variants, _ = make_variants(n, args, names=LIBRARY)
    finally:
        args.prefill_up_to = saved
    out = {"tokens": n}
    for name, v in variants.items():
        v.step(record=False)
        st = torch_kvoffload.stats(v.model)
        out[name] = st["device_kv_bytes"]
        out["unmodified"] = st["dense_kv_bytes"]
        v.model._kvoffload_session.close()
    out["unmodified_source"] = "accounting (layers x tokens x (512 + 64 + 128) x 4 B)"
    return out


# ---------------------------------------------------------------------------------------- output
def print_tables(results: list[dict[str, Any]], kv_rows: list[dict[str, Any]], profiles) -> None:
    rows = []
    for r in results:
        rows.append(
            [r["prompt_len"], "prefill" if r["context"] == "prefilled" else "fill",
             *[r[v]["decode_tok_s"] for v in VARIANTS],
             *[f"{r[v]['step']['p10_ms']:.1f}/{r[v]['step']['p50_ms']:.1f}/{r[v]['step']['p90_ms']:.1f}"
               for v in LIBRARY],
             *[f"{100 * r[k]:+.1f}% ({100 * r[k + '_paired']:+.1f}%)"
               for k in ("overhead_step", "overhead_attn_module", "overhead_cache_ops")],
             r["hit_rate_offloaded"],
             f"{r['tokens_equal_resident_offloaded']}/{r['tokens_equal_unmodified']} ({r['tokens_compared']})"]
        )  # fmt: skip
    headers = ["prompt", "context", "tok/s unmod", "tok/s resident", "tok/s offload",
               "resident ms p10/50/90", "offload ms p10/50/90", "ovh step (paired)",
               "ovh attn module (paired)", "ovh cache ops (paired)", "hit rate", "tokens eq res=off / all (n)"]  # fmt: skip
    print(format_table(headers, rows))
    print()
    parts = [
        [r["prompt_len"], r["unmodified"]["attn_module"]["p50_ms"],
         *[r[v][k]["p50_ms"] for k in ("attn_module", "cache_ops", "cache_write") for v in LIBRARY],
         *[r[f"overhead_{k}_ms"] for k in ("step", "cache_ops", "cache_write")], r["h2d_bytes_per_step_offloaded"]]
        for r in results
    ]  # fmt: skip
    print(format_table(["prompt", "attn module unmod", "attn module res", "attn module off", "cache ops res",
                        "cache ops off", "write res", "write off", "off-res step", "off-res cache ops",
                        "off-res write", "H2D B/step off"], parts))  # fmt: skip
    print("(ms per decode step, median; all layers)\n")
    kvt = [
        [k["tokens"], k["unmodified"], k["resident"], k["offloaded"], k["resident"] / k["unmodified"],
         k["offloaded"] / k["unmodified"], k["unmodified_source"]]
        for k in kv_rows
    ]  # fmt: skip
    print(format_table(["tokens", "KV B unmod", "KV B resident", "KV B offload", "resident/unmod",
                        "offload/unmod", "unmodified bytes"], kvt))  # fmt: skip
    for n, prof in profiles.items():
        by = {v: {row["op"]: row for row in prof[v]} for v in LIBRARY}
        diff = []
        for op in set(by["resident"]) | set(by["offloaded"]):
            res, off = by["resident"].get(op, {}), by["offloaded"].get(op, {})
            rs, os_ = res.get("self_ms", 0.0), off.get("self_ms", 0.0)
            diff.append([op, rs, os_, os_ - rs, res.get("total_ms", 0.0), off.get("total_ms", 0.0),
                         res.get("calls_per_step", 0.0), off.get("calls_per_step", 0.0)])  # fmt: skip
        diff.sort(key=lambda d: -abs(d[3]))
        print(f"\nprofile at {n}: ms per decode step (torch.profiler, CPU), largest self-time differences")
        headers = [
            "op",
            "self res",
            "self off",
            "off - res",
            "total res",
            "total off",
            "calls res",
            "calls off",
        ]
        print(format_table(headers, diff[:15]))


def plot(results: list[dict[str, Any]], kv_rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    colour = VARIANT_COLOURS

    def tokens_axis(a, ticks: list[int]) -> None:
        a.set_xscale("log", base=2)
        a.set_xticks(ticks, [f"{t // 1024}K" if t >= 1024 else str(t) for t in ticks])
        a.minorticks_off()

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    xs = [r["prompt_len"] for r in results]
    for v in VARIANTS:
        med = [r[v]["decode_tok_s"] for r in results]
        lo = [m - 1e3 / r[v]["step"]["p90_ms"] for m, r in zip(med, results, strict=True)]
        hi = [1e3 / r[v]["step"]["p10_ms"] - m for m, r in zip(med, results, strict=True)]
        ax[0].errorbar(xs, med, yerr=[lo, hi], fmt="o-", capsize=3, label=v, color=colour[v])
    ax[0].set(xlabel="prompt tokens", ylabel="decode tokens/s (median, p10-p90)", yscale="log")
    tokens_axis(ax[0], xs)
    ax[0].legend()
    for key, label, c in (("overhead_step", "whole step", "black"), ("overhead_attn_module", "attention module",
                          "tab:purple"), ("overhead_cache_ops", "cache ops", "tab:red")):  # fmt: skip
        ax[1].plot(xs, [100 * r[key] for r in results], "o-", label=label, color=c)
    ax[1].axhline(5, ls="--", c="grey", lw=0.8)
    ax[1].axhline(10, ls=":", c="grey", lw=0.8)
    ax[1].set(xlabel="prompt tokens", ylabel="offloaded / resident - 1 (%, medians)",
              title="offload overhead (targets: step 5 %, attention 10 %)")  # fmt: skip
    tokens_axis(ax[1], xs)
    ax[1].legend()
    kx = [k["tokens"] for k in kv_rows]
    for v in LIBRARY:
        ax[2].plot(kx, [k[v] / k["unmodified"] for k in kv_rows], "o-", label=v, color=colour[v])
    ax[2].set(xlabel="tokens", ylabel="device KV / unmodified cache", ylim=(0, 1.1))
    tokens_axis(ax[2], kx)
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 65536])
    p.add_argument(
        "--kv-lengths",
        type=int,
        nargs="*",
        default=[32768, 65536, 131072],
        help="lengths whose device KV is reported (measured where a timed run had that length)",
    )
    p.add_argument(
        "--prefill-up-to",
        type=int,
        default=8192,
        help="prompts up to this length are prefilled through the model; longer ones filled directly",
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per variant first")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=5, help="decode steps per round of each library variant")
    p.add_argument(
        "--unmodified-steps",
        type=int,
        default=6,
        help="timed decode steps of the unmodified model, spread over the rounds",
    )
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--profile", action="store_true", help="profile decode steps of both library variants")
    p.add_argument("--profile-steps", type=int, default=6)
    p.add_argument("--smoke", action="store_true", help="a small run checking the script (< 2 minutes)")
    p.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="where the JSON and PNG go (default benchmarks/results/, a temporary one with --smoke)",
    )
    args = p.parse_args()  # fmt: skip
    if args.smoke:
        args.lengths, args.kv_lengths, args.prefill_up_to, args.layers = [1024, 4096], [8192], 1024, 1
        args.rounds, args.steps, args.warmup, args.profile_steps, args.unmodified_steps = 2, 2, 1, 1, 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.total_steps = args.warmup + args.rounds * args.steps + (args.profile_steps if args.profile else 0)
    t0 = time.perf_counter()
    results, profiles, kv_rows = [], {}, []
    with timed_cache_ops():
        for n in args.lengths:
            res, prof = run_length(n, args)
            results.append(res)
            if prof is not None:
                profiles[n] = prof
        for n in args.kv_lengths:
            timed = next((r["device_kv"] for r in results if r["prompt_len"] == n), None)
            kv_rows.append(timed if timed is not None else kv_only(n, args))
    print_tables(results, kv_rows, profiles)
    payload = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "wall_s": time.perf_counter() - t0, "results": results,
               "device_kv": kv_rows, "profile": {str(n): p for n, p in profiles.items()}}  # fmt: skip
    out_dir = args.output_dir
    if out_dir is None:  # a smoke run leaves the committed results alone
        out_dir = Path(tempfile.mkdtemp(prefix="hf_generate_bench_smoke_")) if args.smoke else RESULTS_DIR
    if out_dir.resolve() == RESULTS_DIR.resolve():
        path = write_json("hf_generate_bench", payload)
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "hf_generate_bench.json"
        path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    print(f"wrote {path} ({payload['wall_s']:.0f} s)")
    plot(results, kv_rows, out_dir / "hf_generate_bench.png")


if __name__ == "__main__":
    main()

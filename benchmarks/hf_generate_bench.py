"""Decode throughput of a random DeepseekV32 with production per-layer widths: offloaded vs unmodified.

The model: hidden 2048, 16 heads of 128 + 64 (query / key) and 128 (value), kv_lora_rank 512, rope 64,
q_lora_rank 1536, lightning indexer 64 heads x 128, top-k 2048, few layers (``--layers``), fp32, sdpa.
For each prompt length the prompt is prefilled in chunks (``--chunk`` tokens per forward, so the indexer's
``[S, H, T]`` scores fit in memory), then ``--steps`` greedy decode steps run; the same is done with the
unmodified model (its ``DynamicCache``). Reported per length: decode tokens/s of both, device KV bytes of
both (ours from ``torch_kvoffload.stats``, the unmodified model's from its cache tensors), bytes moved
host->device per decode step vs a full-layer reload per step (what a whole-layer offloaded cache moves),
and whether the generated tokens are equal.

Writes ``benchmarks/results/hf_generate_bench.json`` and ``hf_generate_bench.png``.

    python benchmarks/hf_generate_bench.py                      # 2K and 8K, 2 layers
    python benchmarks/hf_generate_bench.py --lengths 1024 --steps 4   # smoke run
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import RESULTS_DIR, format_table, write_json

import torch_kvoffload


def build(layers: int, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, DeepseekV32Config

    cfg = DeepseekV32Config(
        vocab_size=4096, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=layers,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        index_topk=2048, index_head_dim=128, index_n_heads=64, max_position_embeddings=16384,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def generate(model, prompt: torch.Tensor, cache, chunk: int, steps: int) -> tuple[list[int], list[float]]:
    """Chunked prefill then greedy decode; the tokens and each decode step's seconds."""
    with torch.no_grad():
        logits = None
        for start in range(0, prompt.shape[1], chunk):
            logits = model(input_ids=prompt[:, start : start + chunk], cache=cache, use_cache=True).logits
        tokens, times = [int(logits[0, -1].argmax())], []
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits
            times.append(time.perf_counter() - t0)
            tokens.append(int(logits[0, -1].argmax()))
    return tokens, times


def dense_cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values, getattr(layer, "indexer_keys", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from transformers import DynamicCache

    results, rows = [], []
    for n in args.lengths:
        prompt = torch.randint(3, 4096, (1, n), generator=torch.Generator().manual_seed(args.seed + n))
        ref = build(args.layers, args.seed)
        cache = DynamicCache(config=ref.config)
        t0 = time.perf_counter()
        want, ref_times = generate(ref, prompt, cache, args.chunk, args.steps)
        ref_prefill = time.perf_counter() - t0 - sum(ref_times)
        ref_bytes = dense_cache_bytes(cache)
        del ref, cache
        model = torch_kvoffload.offload(
            build(args.layers, args.seed), {"layerwise": {}, "sparse": {}, "block_size": args.block_size}
        )
        session = model._kvoffload_session
        session.plan_generation(1, n + args.steps + 1)
        ours_cache = session.new_cache()
        t0 = time.perf_counter()
        # decode H2D: measured from the stats around the decode steps
        with torch.no_grad():
            for start in range(0, n, args.chunk):
                logits = model(input_ids=prompt[:, start : start + args.chunk], cache=ours_cache).logits
        prefill = time.perf_counter() - t0
        before = torch_kvoffload.stats(model)
        got, times = [int(logits[0, -1].argmax())], []
        with torch.no_grad():
            for _ in range(args.steps):
                t1 = time.perf_counter()
                logits = model(input_ids=torch.tensor([[got[-1]]]), cache=ours_cache).logits
                times.append(time.perf_counter() - t1)
                got.append(int(logits[0, -1].argmax()))
        after = torch_kvoffload.stats(model)
        steady = times[1:] or times
        ref_steady = ref_times[1:] or ref_times
        row_bytes = (512 + 64 + 128) * 4
        res = {
            "prompt_len": n,
            "layers": args.layers,
            "decode_tok_s_ours": len(steady) / sum(steady),
            "decode_tok_s_unmodified": len(ref_steady) / sum(ref_steady),
            "prefill_s_ours": prefill,
            "prefill_s_unmodified": ref_prefill,
            "device_kv_bytes_ours": after["device_kv_bytes"],
            "device_kv_bytes_unmodified": ref_bytes,
            "h2d_bytes_per_step_ours": (after["bytes_h2d"] - before["bytes_h2d"]) / args.steps,
            "h2d_bytes_per_step_full_reload": args.layers * (n + args.steps // 2) * row_bytes,
            "hit_rate": (after["hits"] - before["hits"])
            / max(1, after["hits"] + after["misses"] - before["hits"] - before["misses"]),
            "tokens_equal": got == want,
        }
        res["speedup"] = res["decode_tok_s_ours"] / res["decode_tok_s_unmodified"]
        res["device_kv_ratio"] = res["device_kv_bytes_ours"] / res["device_kv_bytes_unmodified"]
        results.append(res)
        rows.append([n, res["decode_tok_s_unmodified"], res["decode_tok_s_ours"], res["speedup"],
                     res["device_kv_bytes_unmodified"], res["device_kv_bytes_ours"], res["device_kv_ratio"],
                     int(res["h2d_bytes_per_step_ours"]), res["h2d_bytes_per_step_full_reload"], res["hit_rate"],
                     res["tokens_equal"]])  # fmt: skip
        session.close()
        print(f"prompt {n}: done", flush=True)
    headers = ["prompt", "tok/s HF", "tok/s ours", "speedup", "KV B HF", "KV B ours", "KV ratio",
               "H2D B/step ours", "H2D B/step reload", "hit rate", "tokens equal"]  # fmt: skip
    print(format_table(headers, rows))
    path = write_json("hf_generate_bench", {"config": vars(args), "results": results})
    print(f"wrote {path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["prompt_len"] for r in results]
    ax[0].plot(xs, [r["decode_tok_s_unmodified"] for r in results], "o-", label="unmodified")
    ax[0].plot(xs, [r["decode_tok_s_ours"] for r in results], "o-", label="layerwise + sparse")
    ax[0].set(xlabel="prompt tokens", ylabel="decode tokens/s", xscale="log", yscale="log")
    ax[0].legend()
    ax[1].plot(xs, [r["h2d_bytes_per_step_full_reload"] for r in results], "o-", label="full-layer reload")
    ax[1].plot(xs, [r["h2d_bytes_per_step_ours"] for r in results], "o-", label="ours (misses)")
    ax[1].set(xlabel="prompt tokens", ylabel="H2D bytes per decode step", xscale="log", yscale="log")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "hf_generate_bench.png", dpi=100)
    print(f"wrote {RESULTS_DIR / 'hf_generate_bench.png'}")


if __name__ == "__main__":
    main()

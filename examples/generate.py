"""Generate with a random Hugging Face DeepSeek model, with and without KV offload, and compare.

    python examples/generate.py --model deepseek_v32 --mode both --prompt-len 256 --new-tokens 32

Builds a random-initialised model (no download) of the size given by the flags, generates greedily with
the unmodified model, then with ``torch_kvoffload.offload`` (``--eager``, the default) or
``torch_kvoffload.compile`` (``--compile``) and prints a table: decode tokens/s, device KV bytes vs the
unmodified model's cache, bytes moved each way, the sparse hit rate, and whether the tokens are equal.
Then (``--num-beams``, default 3) a beam search on both models: the offloaded model's second sequence, its
beams forked requests sharing host-pool blocks.

Modes: ``none`` (unmodified model only), ``layerwise``, ``sparse`` (DeepseekV32 only), ``both``,
``kvpp``: ``--ranks`` processes (default 2, spawned, gloo on 127.0.0.1) each run the same model replica
with KVPP (each rank stores only the layers it owns; the owner broadcasts a layer just before it runs)
and the table gets a row per rank with its broadcasts, bytes broadcast and the KV bytes it stores.

    python examples/generate.py --model deepseek_v3 --mode kvpp
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

import torch_kvoffload

MODES = ("none", "layerwise", "sparse", "both", "kvpp")


def build(args: argparse.Namespace) -> torch.nn.Module:
    """A seeded random model of the requested family and size."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV32Config

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=args.kv_lora_rank,
        q_lora_rank=args.q_lora_rank,
        qk_rope_head_dim=args.rope_dim,
        qk_nope_head_dim=args.nope_dim,
        v_head_dim=args.nope_dim,
        max_position_embeddings=max(4096, args.prompt_len + args.new_tokens),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if args.model == "deepseek_v3":
        cfg = DeepseekV3Config(**common)
    else:
        cfg = DeepseekV32Config(
            **common,
            index_topk=args.index_topk,
            index_head_dim=args.index_head_dim,
            index_n_heads=args.index_heads,
        )
    torch.manual_seed(args.seed)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype).eval()


def prompts(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """``--batch`` random prompts, the i-th ``i * 7`` tokens shorter than ``--prompt-len``, left padded."""
    g = torch.Generator().manual_seed(args.seed + 1)
    lengths = [max(1, args.prompt_len - 7 * i) for i in range(args.batch)]
    ids = torch.zeros(args.batch, args.prompt_len, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, args.prompt_len - n :] = torch.randint(3, args.vocab, (n,), generator=g)
        mask[b, args.prompt_len - n :] = 1
    return ids, mask


class _Progress:
    """A logits processor that only advances a tqdm bar (one step per generated token)."""

    def __init__(self, total: int, desc: str, disable: bool = False) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="tok", leave=False, disable=disable)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.bar.update(1)
        return scores


def run(
    model: torch.nn.Module, ids, mask, args, desc: str, quiet: bool = False
) -> tuple[torch.Tensor, float]:
    """Greedy tokens and decode tokens/s (prefill excluded: timed from the second step on)."""
    from transformers import LogitsProcessorList

    progress = _Progress(args.new_tokens, desc, disable=quiet)
    stamps: list[float] = []

    def stamp(input_ids, scores):
        stamps.append(time.perf_counter())
        return scores

    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=args.new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([progress, stamp]),
        )
    progress.bar.close()
    steps = len(stamps) - 1
    rate = steps * ids.shape[0] / (stamps[-1] - stamps[0]) if steps > 0 else float("nan")
    return out, rate


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def _kvpp_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """One KVPP rank: the unmodified model, then the same replica with KVPP; rank 0 prints the table."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        quiet = rank != 0
        ids, mask = prompts(args)
        want, base_rate = run(build(args), ids, mask, args, "unmodified", quiet=quiet)
        model = build(args)
        cfg = {"kvpp": {}, "block_size": args.block_size}
        model = torch_kvoffload.compile(model, cfg) if args.compile else torch_kvoffload.offload(model, cfg)
        got, rate = run(model, ids, mask, args, "kvpp", quiet=quiet)
        s = torch_kvoffload.stats(model)
        mine = (rank, rate, s, bool(torch.equal(got, want)))
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            kind = "compile" if args.compile else "eager"
            rows = [("unmodified", f"{base_rate:.1f}", "-", "-", "-", "-", "-", "-")]
            for r, rate_r, st, equal in everyone:
                rows.append(
                    (
                        f"kvpp rank {r} ({kind})",
                        f"{rate_r:.1f}",
                        str(int(st["kvpp_owned_layers"])),
                        f"{int(st['kvpp_persistent_bytes']):,}",
                        f"{int(st['kvpp_scratch_bytes']):,}",
                        f"{int(st['device_kv_bytes']):,} / {int(st['dense_kv_bytes']):,}",
                        f"{int(st['broadcasts'])} / {int(st['bytes_broadcast']):,}",
                        str(equal),
                    )
                )
            header = (
                "run",
                "decode tok/s",
                "owned layers",
                "owned KV B",
                "scratch KV B",
                "device KV B (ours / dense)",
                "broadcasts / bytes",
                "tokens equal",
            )
            _table(header, rows)
        from torch_kvoffload.integrations.hf import session_of

        session_of(model).close()
    finally:
        dist.destroy_process_group()


def _run_kvpp(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    from torch_kvoffload._utils import free_port

    if args.ranks < 2:
        print("--mode kvpp needs --ranks >= 2")
        return 2
    mp.start_processes(
        _kvpp_rank, args=(args.ranks, free_port(), args), nprocs=args.ranks, join=True, start_method="spawn"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("deepseek_v3", "deepseek_v32"), default="deepseek_v32")
    p.add_argument("--mode", choices=MODES, default="both")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-lora-rank", type=int, default=64)
    p.add_argument("--q-lora-rank", type=int, default=96)
    p.add_argument("--rope-dim", type=int, default=16)
    p.add_argument("--nope-dim", type=int, default=32)
    p.add_argument("--index-topk", type=int, default=16)
    p.add_argument("--index-head-dim", type=int, default=32)
    p.add_argument("--index-heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=2, help="--mode kvpp: processes in the KVPP group")
    p.add_argument("--num-beams", type=int, default=3, help="then a beam search on the same models (1: none)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--compile", action="store_true", help="torch_kvoffload.compile (Dynamo + passes)")
    g.add_argument("--eager", action="store_true", help="torch_kvoffload.offload (default)")
    args = p.parse_args(argv)

    if args.mode == "kvpp":
        return _run_kvpp(args)
    if args.mode in ("sparse", "both") and args.model != "deepseek_v32":
        print(f"--mode {args.mode} needs a model with a lightning indexer (--model deepseek_v32)")
        return 2
    ids, mask = prompts(args)
    want, base_rate = run(build(args), ids, mask, args, "unmodified")
    rows = [("unmodified", f"{base_rate:.1f}", "-", "-", "-", "-", "-")]
    if args.mode != "none":
        cfg: dict = {"block_size": args.block_size}
        if args.mode in ("layerwise", "both"):
            cfg["layerwise"] = {}
        if args.mode in ("sparse", "both"):
            cfg["sparse"] = {}
        model = build(args)
        if args.compile:
            if not hasattr(torch_kvoffload, "compile"):
                print("--compile: torch_kvoffload.compile is unavailable in this build; use --eager")
                return 2
            model = torch_kvoffload.compile(model, cfg)
        else:
            model = torch_kvoffload.offload(model, cfg)
        got, rate = run(model, ids, mask, args, args.mode)
        s = torch_kvoffload.stats(model)
        lookups = s["hits"] + s["misses"]
        hit = f"{s['hits'] / lookups:.1%}" if lookups else "-"
        rows.append(
            (
                f"{args.mode} ({'compile' if args.compile else 'eager'})",
                f"{rate:.1f}",
                f"{s['device_kv_bytes']:,} / {s['dense_kv_bytes']:,}",
                f"{s['bytes_h2d']:,}",
                f"{s['bytes_d2h']:,}",
                hit,
                str(bool(torch.equal(got, want))),
            )
        )
    header = (
        "run",
        "decode tok/s",
        "device KV B (ours / dense)",
        "bytes H2D",
        "bytes D2H",
        "hit rate",
        "tokens equal",
    )
    _table(header, rows)
    if args.num_beams > 1 and args.mode != "none":
        kw = dict(
            attention_mask=mask, max_new_tokens=args.new_tokens, num_beams=args.num_beams, do_sample=False
        )
        with torch.no_grad():
            beams_want = build(args).generate(input_ids=ids, **kw)
            beams_got = model.generate(input_ids=ids, **kw)  # the offloaded model's next sequence
        s = torch_kvoffload.stats(model)
        print(
            f"beam search (num_beams={args.num_beams}) on the same offloaded model: tokens equal "
            f"{bool(torch.equal(beams_got, beams_want))}; host-pool blocks shared by forked beams "
            f"{s['fork_shared_blocks']}, copied on write {s['cow_copies']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

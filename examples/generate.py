"""Generate with a random Hugging Face DeepSeek model, with and without KV offload, and compare.

    python examples/generate.py --model deepseek_v32 --mode both --prompt-len 256 --new-tokens 32

Builds a random-initialised model (no download) of the size given by the flags, generates greedily with
the unmodified model, then with ``torch_kvoffload.offload`` (``--eager``, the default) or
``torch_kvoffload.compile`` (``--compile``) and prints a table: decode tokens/s, device KV bytes vs the
unmodified model's cache, bytes moved each way, the sparse hit rate, and whether the tokens are equal.
Then (``--num-beams``, default 3; one process only) a beam search on both models: the offloaded model's
second sequence, its beams forked requests sharing host-pool blocks.

Modes: ``none`` (unmodified model only), ``layerwise``, ``sparse`` (DeepseekV32 only), ``both``, ``kvpp``
(each rank stores only the layers it owns; the owner broadcasts a layer just before it runs), ``auto``
(DeepseekV32: each request resident while it fits in ``--device-kv-budget`` bytes, else spilled to the host
pool; one process).

Tensor parallelism (``--tp N``, always on with ``--mode kvpp``): rank 0 saves the random model to a
temporary directory, every rank loads it with transformers' tensor parallelism (``tp_plan="auto"``: V3.2
shards the attention heads and the MLPs, V3 the MLPs), offloads it with ``--mode`` (the KVPP group is the
TP group) and generates; each rank's tokens are compared with the single-process unmodified model and the
table gets a row per rank: its attention heads, the KV layers it stores, device KV bytes, bytes moved,
broadcasts and whether the tokens are equal. Under ``torchrun`` each process is one rank; without it the
example spawns ``--tp`` ranks itself (gloo on 127.0.0.1, default 2 for ``--mode kvpp``):

    torchrun --standalone --nproc-per-node 2 examples/generate.py --tp 2 --model deepseek_v32 --mode kvpp
    python examples/generate.py --model deepseek_v3 --mode kvpp
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time

import torch

import torch_kvoffload

MODES = ("none", "layerwise", "sparse", "both", "kvpp", "auto")


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


def _offload_config(args: argparse.Namespace) -> dict:
    """The ``OffloadConfig`` (as a dict) of ``--mode`` and ``--block-size``."""
    cfg: dict = {"block_size": args.block_size}
    if args.mode == "kvpp":
        cfg["kvpp"] = {}
    if args.mode in ("layerwise", "both"):
        cfg["layerwise"] = {}
    if args.mode in ("sparse", "both"):
        cfg["sparse"] = {}
    if args.mode == "auto":  # resident while the KV fits in the budget, spilled to the host pool when not
        cfg["sparse"] = {"offload": "auto"}
        if args.device_kv_budget is not None:
            cfg["serving"] = {"device_kv_budget": args.device_kv_budget}
    return cfg


def _load_tp(directory: str, args: argparse.Namespace) -> torch.nn.Module:
    """The model saved in ``directory`` loaded with transformers' tensor parallelism on this rank."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(
        directory,
        distributed_config=DistributedConfig(tp_plan="auto"),  # from_pretrained(..., tp_plan="auto") before
        dtype=dtype,
        attn_implementation="sdpa",
    )
    return model.eval()


def _tp_rank(args: argparse.Namespace) -> bool:
    """One rank of a tensor-parallel run in an initialised gloo group: the single-process unmodified model
    (built here), then the saved model loaded with ``tp_plan="auto"``, offloaded with ``--mode``; rank 0
    prints a row per rank. Returns whether every rank's tokens equal the unmodified model's."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    quiet = rank != 0
    ids, mask = prompts(args)
    reference = build(args)  # the same seeded weights on every rank
    directory = [tempfile.mkdtemp(prefix="kvoffload_tp_") if rank == 0 else None]
    if rank == 0:
        reference.save_pretrained(directory[0])
    dist.broadcast_object_list(directory, src=0)  # the ranks share one host (torchrun --nproc-per-node)
    try:
        want, base_rate = run(reference, ids, mask, args, "unmodified", quiet=quiet)
        del reference
        model = _load_tp(directory[0], args)
    finally:
        dist.barrier()  # every rank has read the directory
        if rank == 0:
            shutil.rmtree(directory[0], ignore_errors=True)
    kind = "compile" if args.compile else "eager"
    if args.mode != "none":
        cfg = _offload_config(args)
        model = torch_kvoffload.compile(model, cfg) if args.compile else torch_kvoffload.offload(model, cfg)
    got, rate = run(model, ids, mask, args, f"{args.mode} (TP {world})", quiet=quiet)
    row = [f"{args.mode} rank {rank} ({kind})" if args.mode != "none" else f"TP rank {rank}", f"{rate:.1f}"]
    if args.mode != "none":
        from torch_kvoffload.integrations.hf import session_of

        session = session_of(model)
        spec, s = session.spec, torch_kvoffload.stats(model)
        lookups = s["hits"] + s["misses"]
        owned = int(s["kvpp_owned_layers"]) if session.kvpp_on else spec.num_layers
        row += [
            f"{spec.num_heads} / {spec.total_heads}",
            f"{owned} / {spec.num_layers}",
            f"{int(s['device_kv_bytes']):,} / {int(s['dense_kv_bytes']):,}",
            f"{int(s['bytes_h2d']):,} / {int(s['bytes_d2h']):,}",
            f"{s['hits'] / lookups:.1%}" if lookups else "-",
            f"{int(s['broadcasts'])} / {int(s.get('bytes_broadcast', 0)):,}",
        ]
    row.append(str(bool(torch.equal(got, want))))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, tuple(row))
    if rank == 0:
        header = (
            "run",
            "decode tok/s",
            "heads (rank / model)",
            "KV layers stored",
            "device KV B (ours / dense)",
            "bytes H2D / D2H",
            "hit rate",
            "broadcasts / bytes",
            "tokens equal",
        )
        if args.mode == "none":
            header = header[:2] + header[-1:]
        base = ("unmodified (1 process)", f"{base_rate:.1f}") + ("-",) * (len(header) - 2)
        _table(header, [base, *everyone])
    if args.mode != "none":
        from torch_kvoffload.integrations.hf import session_of

        session_of(model).close()
    equal = all(r[-1] == "True" for r in everyone)
    if rank == 0 and not equal:
        print("the tokens of some rank differ from the unmodified model's")
    return equal


def _spawned_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """A rank spawned by :func:`_run_tp`: the environment ``torchrun`` would give it, then :func:`_tp_rank`."""
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        if not _tp_rank(args):
            sys.exit(1)
    finally:
        dist.destroy_process_group()


def _run_tp(args: argparse.Namespace) -> int:
    """``--tp N`` under ``torchrun`` (this process is one rank), else spawn ``N`` ranks on 127.0.0.1."""
    import torch.distributed as dist

    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if launched else args.tp
    if args.tp is not None and args.tp != world:
        print(f"--tp {args.tp} but torchrun started {world} processes (--nproc-per-node)")
        return 2
    if world < 2:
        print("tensor parallelism needs at least 2 ranks (--tp N, N >= 2, or torchrun --nproc-per-node N)")
        return 2
    if not launched:
        import torch.multiprocessing as mp

        from torch_kvoffload._utils import free_port

        try:
            mp.start_processes(
                _spawned_rank, args=(world, free_port(), args), nprocs=world, join=True, start_method="spawn"
            )
        except mp.ProcessExitedException as exc:  # a rank's tokens differ (its error was printed)
            print(exc)
            return 1
        return 0
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        equal = _tp_rank(args)
    finally:
        dist.destroy_process_group()
    return 0 if equal else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("deepseek_v3", "deepseek_v32"), default="deepseek_v32")
    p.add_argument("--mode", choices=MODES, default="both")
    p.add_argument(
        "--device-kv-budget",
        type=int,
        default=None,
        help="--mode auto: device KV bytes (default: what is free)",
    )
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
    p.add_argument(
        "--tp",
        "--ranks",
        type=int,
        default=None,
        help="tensor-parallel ranks: the model is loaded with tp_plan='auto' on each (under torchrun: its "
        "--nproc-per-node; otherwise spawned). --mode kvpp always runs tensor-parallel (default 2 ranks)",
    )
    p.add_argument("--num-beams", type=int, default=3, help="then a beam search on the same models (1: none)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--compile", action="store_true", help="torch_kvoffload.compile (Dynamo + passes)")
    g.add_argument("--eager", action="store_true", help="torch_kvoffload.offload (default)")
    args = p.parse_args(argv)

    if args.mode in ("sparse", "both") and args.model != "deepseek_v32":
        print(f"--mode {args.mode} needs a model with a lightning indexer (--model deepseek_v32)")
        return 2
    if args.compile and not hasattr(torch_kvoffload, "compile"):
        print("--compile: torch_kvoffload.compile is unavailable in this build; use --eager")
        return 2
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun --nproc-per-node N
    if args.tp is not None or args.mode == "kvpp" or launched:
        if args.tp is None and not launched:
            args.tp = 2
        return _run_tp(args)
    ids, mask = prompts(args)
    want, base_rate = run(build(args), ids, mask, args, "unmodified")
    rows = [("unmodified", f"{base_rate:.1f}", "-", "-", "-", "-", "-")]
    if args.mode != "none":
        cfg = _offload_config(args)
        model = build(args)
        model = torch_kvoffload.compile(model, cfg) if args.compile else torch_kvoffload.offload(model, cfg)
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

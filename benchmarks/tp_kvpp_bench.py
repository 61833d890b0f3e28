"""KVPP on tensor-parallel Hugging Face models (``tp_plan="auto"``): per-rank KV, capacity, forward time.

Every rank of a gloo group on 127.0.0.1 loads the same saved tiny DeepseekV32 with transformers' tensor
parallelism (the attention heads and the MLP are sharded; the MLA latent KV, one head, is replicated) and
offloads it. "TP alone" is the library's resident sparse mode (``{"sparse": {"offload": False}}``): the
whole latent KV and indexer keys of every layer on each rank, attention over the indexer's top-k, the same
attention KVPP runs. "TP + KVPP" is ``{"kvpp": {}}``: each rank keeps its owned layers and two scratch
buffers; the owner broadcasts a layer's blocks one layer ahead.

1. Memory. Per-rank device KV bytes (``stats()["device_kv_bytes"]``, ``kvpp_persistent_bytes``,
   ``kvpp_scratch_bytes``) of both modes for the same reservation (``--cap-batch`` requests of ``--context``
   tokens), measured at 2 and 4 ranks (``--cap-layers`` layers, production KV widths: latent 512 + rope 64,
   indexer key 128, fp32); 8 ranks by accounting (``KVPPPlan.allocation_bytes``: this machine has 2 cores).
   Capacity gain = KV blocks per byte budget with KVPP / without = (TP-alone bytes per block) / (KVPP bytes
   per block), beside the formula of docs/kvpp.md (``L / (max owned + 2)``, scratch padding excluded), and
   the DeepSeek-V3-like table (61 layers + 1 MTP, bf16, 40 GiB) by accounting.
2. Time, 2 ranks, one model loaded twice per rank (KVPP and TP alone side by side in the same processes):
   both sessions hold a ``--context``-token request, prefilled in ``--chunk``-token forwards. Then, round
   robin, median of ``--repeats`` / ``--decode-repeats``: a decode step (``--decode-batch`` = 1 request,
   1 token, context ``--context``) and a prefill chunk (``--chunk`` tokens whose history makes the context
   ``--context``; rolled back with ``cache.crop`` after each). Per KVPP forward: the time the compute
   thread waited in ``kvpp_wait_layer`` (the scheduler's ``wait_seconds``; of it, layer 0's, from a wrapper
   around the scheduler's ``wait_layer``), the time the broadcasts took on the transfer thread (a wrapper
   around ``BroadcastTransport._broadcast``), ``begin_forward`` (the ranks' agreement exchange), the extra
   process CPU time against TP alone and, right after, the same broadcasts back to back with no compute
   (serial). **Hidden share = 1 − waited / serial**: the part of the broadcasts' own cost that the forward
   did not wait for. ``--dtype bfloat16`` times the model in bf16 (half the broadcast bytes).

Prints tables; writes ``benchmarks/results/tp_kvpp_bench{--tag}.{json,md,png}`` (``--quick``: 2K context,
``_quick`` suffix). The default run takes ~8 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import RESULTS_DIR, format_table, launch_gloo, pyplot, write_json

from torch_kvoffload.kvpp import KVPPPlan, assign_owners

GIB = 1024**3
MIB = 1024**2
KV_LORA, ROPE, INDEX_DIM = 512, 64, 128  # DeepSeek-V3 / V3.2 latent, rope and indexer key widths
VOCAB = 4096
BLOCK = 128


# ------------------------------------------------------------------------------------------ the model
def save_model(
    directory: str, layers: int, hidden: int, intermediate: int, top_k: int, positions: int
) -> str:
    """A seeded random DeepseekV32 (dense MLP in every layer, 8 attention heads) saved to ``directory``."""
    from transformers import AutoModelForCausalLM, DeepseekV32Config

    cfg = DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, moe_intermediate_size=256,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=layers,
        kv_lora_rank=KV_LORA, q_lora_rank=512, qk_rope_head_dim=ROPE, qk_nope_head_dim=128, v_head_dim=128,
        index_topk=top_k, index_head_dim=INDEX_DIM, index_n_heads=16, max_position_embeddings=positions,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval().save_pretrained(directory)
    return directory


def load_offloaded(directory: str, mode: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The saved model loaded with ``tp_plan="auto"`` in ``dtype`` on this rank and offloaded in ``mode``."""
    import transformers
    from transformers import AutoModelForCausalLM

    import torch_kvoffload

    transformers.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto", dtype=dtype).eval()
    assert model._tp_size == dist.get_world_size(), f"loaded with tp_size {model._tp_size}"
    cfg = {"kvpp": {}} if mode == "kvpp" else {"sparse": {"offload": False}}
    return torch_kvoffload.offload(model, {**cfg, "block_size": BLOCK})


def forward(model, ids: torch.Tensor, cache, past: int):
    with torch.no_grad():
        out = model(
            input_ids=ids,
            past_key_values=cache,
            use_cache=True,
            attention_mask=torch.ones(ids.shape[0], past + ids.shape[1], dtype=torch.long),
        )
    return out.past_key_values


# -------------------------------------------------------------------------------------------- launcher
def launch(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (``_common.launch_gloo``)."""
    launch_gloo(fn, world, *args, timeout_s=600)


# ---------------------------------------------------------------------------------------------- memory
def _memory_worker(rank: int, world: int, directory: str, batch: int, context: int, out: str) -> None:
    """Both modes on this rank, the same reservation; one prefill and one decode forward each."""
    import torch_kvoffload
    from torch_kvoffload.integrations.hf import session_of

    result: dict[str, Any] = {}
    ids = torch.randint(3, VOCAB, (batch, 17), generator=torch.Generator().manual_seed(0))
    for mode in ("tp", "kvpp"):
        model = load_offloaded(directory, mode)
        session = session_of(model)
        session.reserve(batch, context)
        cache = forward(model, ids[:, :16], None, 0)
        forward(model, ids[:, 16:], cache, 16)  # with history: KVPP broadcasts
        stats = torch_kvoffload.stats(model)
        result[mode] = {
            k: stats.get(k, 0)
            for k in ("device_kv_bytes", "kvpp_persistent_bytes", "kvpp_scratch_bytes", "kvpp_owned_layers")
        }
        result[mode]["bytes_broadcast"] = stats.get("bytes_broadcast", 0)
        result[mode]["num_blocks"] = session.blocks_per_request * batch
        session.close()
        del model
    torch.save(result, out.format(rank=rank))


def memory_measured(world: int, directory: str, layers: int, batch: int, context: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank{rank}.pt")
        launch(_memory_worker, world, directory, batch, context, out)
        ranks = [torch.load(out.format(rank=r), weights_only=False) for r in range(world)]
    blocks = ranks[0]["tp"]["num_blocks"]
    tp_bytes = max(r["tp"]["device_kv_bytes"] for r in ranks)
    kvpp_bytes = max(r["kvpp"]["device_kv_bytes"] for r in ranks)
    owned = max(r["kvpp"]["kvpp_owned_layers"] for r in ranks)
    return {
        "ranks": world,
        "source": "measured",
        "layers": layers,
        "num_blocks": blocks,
        "per_rank": ranks,
        "tp_bytes": tp_bytes,
        "kvpp_bytes": kvpp_bytes,
        "max_owned": owned,
        "gain_measured": tp_bytes / kvpp_bytes,
        "gain_formula": layers / (owned + 2),
    }


def kvpp_accounting(
    ranks: int, layers: int, bundle_bpb: int, num_blocks: int, mtp: int = 0
) -> dict[str, int]:
    """Bytes the fullest rank allocates for ``num_blocks`` blocks (``KVPPPlan.allocation_bytes``)."""
    owners = assign_owners(range(layers), ranks)
    bpb = dict.fromkeys(range(layers), bundle_bpb)
    worst = max(
        (KVPPPlan(bpb, owners, r, mtp * bundle_bpb) for r in range(ranks)),
        key=lambda p: p.allocation_bytes(num_blocks),
    )
    return {
        "max_owned": len(worst.owned),
        "kvpp_bytes": worst.allocation_bytes(num_blocks),
        "scratch_bytes": 2 * worst.scratch_buffer_bytes(num_blocks),
    }


def memory_accounting(ranks: int, layers: int, bundle_bpb: int, num_blocks: int) -> dict[str, Any]:
    """The tiny model at ``ranks`` ranks by accounting (same blocks as the measured runs)."""
    acc = kvpp_accounting(ranks, layers, bundle_bpb, num_blocks)
    tp_bytes = layers * bundle_bpb * num_blocks
    return {
        "ranks": ranks,
        "source": "accounting",
        "layers": layers,
        "num_blocks": num_blocks,
        "tp_bytes": tp_bytes,
        "kvpp_bytes": acc["kvpp_bytes"],
        "max_owned": acc["max_owned"],
        "gain_measured": tp_bytes / acc["kvpp_bytes"],
        "gain_formula": layers / (acc["max_owned"] + 2),
    }


def v3_capacity(ranks: int, available: int, layers: int = 61, mtp: int = 1) -> dict[str, Any]:
    """DeepSeek-V3-like (bf16, 128-token blocks, indexer key) in ``available`` bytes per rank: blocks that
    fit with TP alone (every layer on every rank) and with KVPP; per-rank bytes for TP alone's block count."""
    bundle = BLOCK * (KV_LORA + ROPE + INDEX_DIM) * 2
    owners = assign_owners(range(layers), ranks)
    plan = KVPPPlan(dict.fromkeys(range(layers), bundle), owners, 0, mtp * bundle)
    blocks_tp = available // ((layers + mtp) * bundle)
    blocks_kvpp = plan.group_num_blocks(available, ranks)
    acc = kvpp_accounting(ranks, layers, bundle, blocks_tp, mtp)
    return {
        "ranks": ranks,
        "bundle_bytes_per_block": bundle,
        "max_owned": acc["max_owned"],
        "blocks_tp": blocks_tp,
        "blocks_kvpp": blocks_kvpp,
        "gain": blocks_kvpp / blocks_tp,
        "gain_formula": (layers + mtp) / (acc["max_owned"] + mtp + 2),
        "tp_bytes_at_blocks_tp": (layers + mtp) * bundle * blocks_tp,
        "kvpp_bytes_at_blocks_tp": acc["kvpp_bytes"],
    }


# ------------------------------------------------------------------------------------------------ time
class BroadcastClock:
    """Times each layer broadcast on the KVPP transfer thread (wraps ``BroadcastTransport._broadcast``)."""

    def __init__(self, transport) -> None:
        self.seconds: list[float] = []
        inner = transport._broadcast

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - t0)

        transport._broadcast = timed

    def mark(self) -> int:
        return len(self.seconds)

    def since(self, mark: int) -> float:
        return sum(self.seconds[mark:])


def _time_worker(rank: int, world: int, directory: str, args: dict, out: str) -> None:
    from torch_kvoffload.integrations.hf import session_of

    ctx, chunk, batch, reps = args["context"], args["chunk"], args["decode_batch"], args["repeats"]
    decode_reps = args["decode_repeats"]
    dtype = getattr(torch, args["dtype"])
    models = {mode: load_offloaded(directory, mode, dtype) for mode in ("tp", "kvpp")}
    sessions = {mode: session_of(m) for mode, m in models.items()}
    rt = sessions["kvpp"].kvpp_offload
    ids = torch.randint(3, VOCAB, (batch, ctx + decode_reps + 1), generator=torch.Generator().manual_seed(1))
    caches: dict[str, Any] = {}
    prefill = {mode: 0.0 for mode in models}
    history = ctx - chunk  # the measured chunk makes the context ``ctx``
    for mode, model in models.items():
        sessions[mode].reserve(batch, ctx + decode_reps + 1)
        dist.barrier()
        t0 = time.perf_counter()
        cache = None
        for start in range(0, history, chunk):
            cache = forward(model, ids[:, start : start + chunk], cache, start)
        prefill[mode] = time.perf_counter() - t0
        caches[mode] = cache
        if rank == 0:
            print(f"  {mode}: {history} tokens prefilled in {prefill[mode]:.1f} s", flush=True)
    rt = sessions["kvpp"].kvpp_offload
    clock = BroadcastClock(rt.scheduler.transport)
    sched = rt.scheduler
    layer_waits: list[tuple[int, float]] = []  # (layer, seconds waited) of every kvpp_wait_layer call
    inner_wait = sched.wait_layer

    def wait_layer(layer: int, bundle=None) -> None:  # the op reaches the scheduler object: wrap its method
        w0 = sched.counters.get("wait_seconds")
        inner_wait(layer, bundle)
        layer_waits.append((layer, sched.counters.get("wait_seconds") - w0))

    sched.wait_layer = wait_layer
    begin_seconds: list[float] = []  # begin_forward: the ranks' agreement exchange, then layer 0's start
    inner_begin = sched.begin_forward

    def begin_forward(*a, **kw) -> None:
        t0 = time.perf_counter()
        inner_begin(*a, **kw)
        begin_seconds.append(time.perf_counter() - t0)

    sched.begin_forward = begin_forward

    def serial(old: int) -> float:
        """The broadcasts of a forward over ``old`` tokens of history, back to back, no compute."""
        n = -(-old // BLOCK)
        per = sessions["kvpp"].blocks_per_request
        tables = [list(range(r * per, r * per + n)) for r in range(batch)]
        dist.barrier()
        t0 = time.perf_counter()
        sched.begin_forward(True, tables)
        for layer in rt.plan.target_layers:
            sched.wait_layer(layer)
        sched.end_forward()
        return time.perf_counter() - t0

    def timed(mode: str, tokens: torch.Tensor, past: int, crop: bool) -> dict[str, float]:
        waited0, mark, wmark = rt.counters.get("wait_seconds"), clock.mark(), len(layer_waits)
        bmark = len(begin_seconds)
        bytes0 = rt.counters.get("bytes_broadcast")
        dist.barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        cache = forward(models[mode], tokens, caches[mode], past)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if crop:
            cache.crop(-tokens.shape[1])  # transformers' convention: minus the count
        row = {"seconds": seconds, "cpu_seconds": cpu}
        if mode == "kvpp":
            row.update(
                waited=rt.counters.get("wait_seconds") - waited0,
                in_forward=clock.since(mark),
                bytes=rt.counters.get("bytes_broadcast") - bytes0,
                begin=sum(begin_seconds[bmark:]),
                layer0_waited=sum(w for layer, w in layer_waits[wmark:] if layer == rt.plan.target_layers[0]),
            )
        return row

    rows: dict[str, list[dict[str, float]]] = {"chunk": [], "decode": []}
    for rep in range(reps + 1):  # the first round is a warm-up
        order = ("tp", "kvpp") if rep % 2 == 0 else ("kvpp", "tp")
        got: dict[str, dict[str, float]] = {}
        for mode in order:
            got[f"chunk_{mode}"] = timed(mode, ids[:, history:ctx], history, crop=True)
        got["chunk_serial"] = {"seconds": serial(history)}
        if rank == 0:
            print(
                f"  chunk round {rep}: " + ", ".join(f"{k} {v['seconds']:.2f} s" for k, v in got.items()),
                flush=True,
            )
        if rep > 0:
            rows["chunk"].append(got)
    for mode in models:  # the measured chunk once more, kept: the decode steps run at context ``ctx``
        caches[mode] = forward(models[mode], ids[:, history:ctx], caches[mode], history)
    for rep in range(decode_reps + 1):
        order = ("tp", "kvpp") if rep % 2 == 0 else ("kvpp", "tp")
        got = {}
        past = ctx + rep
        for mode in order:
            got[f"decode_{mode}"] = timed(mode, ids[:, past : past + 1], past, crop=False)
        got["decode_serial"] = {"seconds": serial(past)}
        if rep > 0:
            rows["decode"].append(got)
    result = {"rank": rank, "rows": rows, "prefill_seconds": prefill, "layers": len(rt.plan.target_layers)}
    for s in sessions.values():
        s.close()
    torch.save(result, out.format(rank=rank))


def summarize_time(ranks: list[dict], layers: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("chunk", "decode"):
        per_rank = []
        for res in ranks:
            rows = res["rows"][kind]
            med = {
                "tp_seconds": statistics.median(r[f"{kind}_tp"]["seconds"] for r in rows),
                "kvpp_seconds": statistics.median(r[f"{kind}_kvpp"]["seconds"] for r in rows),
                "tp_cpu_seconds": statistics.median(r[f"{kind}_tp"]["cpu_seconds"] for r in rows),
                "kvpp_cpu_seconds": statistics.median(r[f"{kind}_kvpp"]["cpu_seconds"] for r in rows),
                "waited_seconds": statistics.median(r[f"{kind}_kvpp"]["waited"] for r in rows),
                "layer0_waited_seconds": statistics.median(r[f"{kind}_kvpp"]["layer0_waited"] for r in rows),
                "begin_forward_seconds": statistics.median(r[f"{kind}_kvpp"]["begin"] for r in rows),
                "in_forward_broadcast_seconds": statistics.median(
                    r[f"{kind}_kvpp"]["in_forward"] for r in rows
                ),
                "serial_broadcast_seconds": statistics.median(r[f"{kind}_serial"]["seconds"] for r in rows),
                "bytes_broadcast": statistics.median(r[f"{kind}_kvpp"]["bytes"] for r in rows),
            }
            med["hidden_share"] = 1 - med["waited_seconds"] / med["serial_broadcast_seconds"]
            med["kvpp_over_tp"] = med["kvpp_seconds"] / med["tp_seconds"]
            med["repeats"] = len(rows)
            per_rank.append({"rank": res["rank"], **med})
        out[kind] = per_rank
    out["layers"] = layers
    return out


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=8192, help="tokens of context of the timed forwards")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--decode-batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed prefill chunks per mode")
    parser.add_argument("--decode-repeats", type=int, default=9, help="timed decode steps per mode")
    parser.add_argument("--layers", type=int, default=8, help="layers of the timed model")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=2048, help="index_topk (DeepSeek-V3.2: 2048)")
    parser.add_argument("--cap-layers", type=int, default=16, help="layers of the memory model")
    parser.add_argument("--cap-batch", type=int, default=4, help="requests reserved in the memory runs")
    parser.add_argument(
        "--available-gib", type=float, default=40.0, help="KV memory per rank (V3-like table)"
    )
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="timed model")
    parser.add_argument("--skip-memory", action="store_true", help="only the timed forwards")
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument("--quick", action="store_true", help="2K context, 512-token chunks, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.context, args.chunk, args.repeats, args.decode_repeats = 2048, 512, 2, 4
    t_start = time.perf_counter()
    results: dict[str, Any] = {"config": vars(args)}

    results["v3_capacity"] = [v3_capacity(t, int(args.available_gib * GIB)) for t in (2, 4, 8)]
    with tempfile.TemporaryDirectory() as tmp:
        cap_dir = save_model(
            os.path.join(tmp, "cap"), args.cap_layers, 256, 512, args.top_k, args.context + 64
        )
        if not args.skip_memory:
            memory = [
                memory_measured(w, cap_dir, args.cap_layers, args.cap_batch, args.context) for w in (2, 4)
            ]
            bundle_bpb = BLOCK * (KV_LORA + ROPE + INDEX_DIM) * 4
            memory.append(memory_accounting(8, args.cap_layers, bundle_bpb, memory[0]["num_blocks"]))
            results["memory"] = memory

        time_dir = save_model(
            os.path.join(tmp, "time"),
            args.layers,
            args.hidden,
            args.intermediate,
            args.top_k,
            args.context + 64,
        )
        with tempfile.TemporaryDirectory() as out_dir:
            out = os.path.join(out_dir, "rank{rank}.pt")
            t0 = time.perf_counter()
            launch(_time_worker, 2, time_dir, vars(args), out)
            ranks = [torch.load(out.format(rank=r), weights_only=False) for r in range(2)]
        results["time"] = summarize_time(ranks, args.layers)
        results["time"]["prefill_seconds"] = [r["prefill_seconds"] for r in ranks]
        results["time"]["wall_seconds"] = time.perf_counter() - t0
    results["wall_seconds"] = time.perf_counter() - t_start

    text = report(results, args)
    print(text)
    name = ("tp_kvpp_bench_quick" if args.quick else "tp_kvpp_bench") + args.tag
    path = write_json(name, results)
    (RESULTS_DIR / f"{name}.md").write_text(text + "\n")
    plot(results, RESULTS_DIR / f"{name}.png")
    print(f"\nwrote {path}")


def report(results: dict[str, Any], args) -> str:
    lines = [
        f"DeepSeek-V3-like (61 layers + 1 MTP, bf16, {BLOCK}-token blocks, latent {KV_LORA} + rope {ROPE} + "
        f"indexer key {INDEX_DIM}), {args.available_gib} GiB of KV per rank, by accounting:",
        "",
        format_table(
            [
                "ranks",
                "owned",
                "blocks TP",
                "blocks TP+KVPP",
                "gain",
                "formula",
                "GiB/rank TP",
                "GiB/rank KVPP",
            ],
            [
                [
                    c["ranks"],
                    c["max_owned"],
                    c["blocks_tp"],
                    c["blocks_kvpp"],
                    c["gain"],
                    c["gain_formula"],
                    c["tp_bytes_at_blocks_tp"] / GIB,
                    c["kvpp_bytes_at_blocks_tp"] / GIB,
                ]
                for c in results["v3_capacity"]
            ],
        ),
        "",
    ]
    if "memory" in results:
        lines += [
            f"Tiny DeepseekV32 loaded with tp_plan='auto' ({args.cap_layers} layers, fp32, "
            f"{args.cap_batch} x "
            f"{args.context} tokens reserved): per-rank device KV, the fullest rank",
            "",
            format_table(
                ["ranks", "source", "owned", "blocks", "MiB TP alone", "MiB TP+KVPP", "gain", "formula"],
                [
                    [
                        m["ranks"], m["source"], m["max_owned"], m["num_blocks"], m["tp_bytes"] / MIB,
                        m["kvpp_bytes"] / MIB, m["gain_measured"], m["gain_formula"],
                    ]
                    for m in results["memory"]
                ],
            ),
            "",
        ]  # fmt: skip
    t = results["time"]
    lines.append(
        f"Forward time, 2 ranks, {t['layers']} layers (hidden {args.hidden}, {args.dtype}, "
        "1 thread per rank), "
        f"context {args.context}, median of {args.repeats} chunks / {args.decode_repeats} decode steps "
        "(TP alone = resident sparse, same TP model):"
    )
    lines.append("")
    rows = []
    for kind, label in (("chunk", f"prefill chunk {args.chunk}"), ("decode", f"decode x{args.decode_batch}")):
        for r in t[kind]:
            rows.append(
                [
                    label, r["rank"], r["tp_seconds"] * 1e3, r["kvpp_seconds"] * 1e3, r["kvpp_over_tp"],
                    (r["kvpp_cpu_seconds"] - r["tp_cpu_seconds"]) * 1e3,
                    r["bytes_broadcast"] / MIB, r["serial_broadcast_seconds"] * 1e3,
                    r["in_forward_broadcast_seconds"] * 1e3, r["waited_seconds"] * 1e3,
                    r["layer0_waited_seconds"] * 1e3, r["begin_forward_seconds"] * 1e3, r["hidden_share"],
                ]
            )  # fmt: skip
    lines.append(
        format_table(
            [
                "forward",
                "rank",
                "TP ms",
                "KVPP ms",
                "KVPP/TP",
                "+CPU ms",
                "MiB bcast",
                "serial ms",
                "in-fwd ms",
                "waited ms",
                "layer 0",
                "begin ms",
                "hidden",
            ],
            rows,
        )
    )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    if "memory" not in results:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    mem = results["memory"]
    x = range(len(mem))
    ax1.bar([i - 0.2 for i in x], [m["tp_bytes"] / MIB for m in mem], 0.4, label="TP alone (KV replicated)")
    ax1.bar([i + 0.2 for i in x], [m["kvpp_bytes"] / MIB for m in mem], 0.4, label="TP + KVPP")
    ax1.set_xticks(list(x), [f"{m['ranks']} ranks\n({m['source']})" for m in mem])
    ax1.set_ylabel("device KV per rank (MiB)")
    ax1.set_title(f"Per-rank KV, {mem[0]['layers']}-layer tiny V3.2")
    ax1.legend()
    t = results["time"]
    kinds = ("chunk", "decode")
    r0 = {k: t[k][0] for k in kinds}
    ax2.bar([i - 0.2 for i in range(2)], [r0[k]["tp_seconds"] * 1e3 for k in kinds], 0.4, label="TP alone")
    ax2.bar([i + 0.2 for i in range(2)], [r0[k]["kvpp_seconds"] * 1e3 for k in kinds], 0.4, label="TP + KVPP")
    ax2.set_xticks([0, 1], [f"{k}\nhidden {r0[k]['hidden_share']:.0%}" for k in kinds])
    ax2.set_yscale("log")
    ax2.set_ylabel("forward ms (rank 0, median)")
    ax2.set_title(f"2 ranks, context {results['config']['context']}")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

"""P/D transfer benchmark: per-transport throughput of a 32K-token DeepSeek-like layer set against a local
copy of the same bytes, how much of the transfer prefill compute hides, and the time from a peer's death
to the error.

Layer set: DeepSeek-V3.2 rows, 32768 tokens in 128-token blocks, ``--layers`` layers, in each ``--formats``
format: ``bf16`` (``kv_lora_rank`` 512 + ``rope`` 64 bf16 main KV and a 128-dim bf16 indexer key: 1,408 bytes a
token), ``int8-indexer`` (the same main KV, the 128-dim int8 indexer key + fp32 scale: 1,284) and ``fp8``
(DeepSeek's 656-byte FP8 latent rows and 132-byte FP8 indexer rows: 788). A prefill process publishes each layer
(LAYER_READY) and waits for decode's READ_DONE; decode (another process) validates and pulls the layer into
its host pool and indexer. Throughput = layer bytes / (LAYER_READY -> READ_DONE); the local copy is one
process copying the same bytes (each component contiguously, ``Tensor.copy_``). "hidden" = 1 - (forward
time with P/D - without) / (layers x transfer time), medians of interleaved forwards with a matmul per layer.

    python benchmarks/pd_bench.py [--layers 4] [--tokens 32768] [--transports shm,mooncake]
                                  [--formats bf16,int8-indexer,fp8]

Prints a table and writes ``benchmarks/results/pd_bench.{json,png}`` (bytes per request of each run).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, format_table, pyplot, write_json

BS, R, P, D = 128, 512, 64, 128
#: per format: the main KV components and the indexer components, ``(row shape, dtype)`` each; the decode
#: host pool of the FP8 rows keeps them as its ``kv_c`` with an empty ``k_pe`` (rope_dim 0)
FORMATS = {
    "bf16": ([((R,), torch.bfloat16), ((P,), torch.bfloat16)], [((D,), torch.bfloat16)]),
    "int8-indexer": ([((R,), torch.bfloat16), ((P,), torch.bfloat16)], [((D,), torch.int8), ((1,), torch.float32)]),
    "fp8": ([((R + 4 * (R // 128) + 2 * P,), torch.uint8)], [((D + 4 * (D // 128),), torch.uint8)]),
}  # fmt: skip


def _compat(layers: int, fmt: str):
    from torch_kvoffload.pd import make_compatibility

    main, idx = FORMATS[fmt]
    return make_compatibility(
        model_fingerprint="deepseek-like", num_layers=layers, block_size=BS,
        main=[torch.empty(1, BS, *r, dtype=d) for r, d in main], indexer=[torch.empty(1, BS, *r, dtype=d) for r, d in idx],
    )  # fmt: skip


def _row_bytes(fmt: str) -> int:
    """Bytes a token moves in ``fmt`` (main KV and indexer key)."""
    main, idx = FORMATS[fmt]
    return sum(torch.Size(r).numel() * torch.empty((), dtype=d).element_size() for r, d in main + idx)


def _cfg(role: str, a: dict):
    from torch_kvoffload.pd import PDConfig

    return PDConfig(
        role=role, transport=a["transport"], kv_port=a["port"], rendezvous=a["rdv"], layer_ack_timeout_s=60
    )


def decode_proc(a: dict, tickets_q, result_q, stop) -> None:
    from torch_kvoffload.pd import DecodeReceiver, TransferTicket
    from torch_kvoffload.pd.messages import ReadDone
    from torch_kvoffload.sparse import HostKVPool

    layers, nb = a["layers"], a["tokens"] // BS
    main, idx = FORMATS[a["fmt"]]
    if len(main) == 1:  # FP8 rows: one component of bytes
        pool = HostKVPool.create(layers, nb, BS, main[0][0][0], 0, torch.uint8)
    else:
        pool = HostKVPool.create(layers, nb, BS, R, P, torch.bfloat16)
    for layer in range(layers):
        pool.kv_c(layer).zero_()
        pool.k_pe(layer).zero_()
    indexer = [tuple(torch.zeros(nb, BS, *r, dtype=d) for r, d in idx) for _ in range(layers)]

    class Receiver(DecodeReceiver):
        def _reply(self, peer, msg):
            if a.get("die_at") is not None and isinstance(msg, ReadDone) and msg.layer == a["die_at"]:
                Path(a["kill_file"]).write_text(repr(time.time()))
                os._exit(3)
            super()._reply(peer, msg)

    recv = Receiver(_cfg("decode", a), pool=pool, compat=_compat(layers, a["fmt"]), indexer=indexer)
    rounds = []
    main = pool.allocate(0, a["tokens"])
    for rid in range(a["rounds"]):  # rounds run one after the other: they may share the destinations
        part = recv.expect(rid, a["tokens"], main, list(range(nb)))
        rounds.append(TransferTicket.combine(rid, a["tokens"], 0, main, [part]).to_dict())
    tickets_q.put(rounds)
    for rid in range(a["rounds"]):
        try:
            recv.wait_request(rid, timeout=300)
        except Exception as exc:
            result_q.put({"error": str(exc)})
            return
    result_q.put({"counters": recv.counters.snapshot()})
    stop.wait(120)
    recv.close()
    pool.close()


def prefill_proc(a: dict, tickets_q, result_q) -> None:
    from torch_kvoffload.layerwise import (
        LayerCacheSpec,
        TensorSpec,
        plan_layer_buffers,
    )
    from torch_kvoffload.pd import (
        make_transport,
    )

    layers, nb = a["layers"], a["tokens"] // BS
    main, idx = FORMATS[a["fmt"]]
    specs = [LayerCacheSpec(tuple(TensorSpec((nb, BS, *r), d) for r, d in main),
                            tuple(TensorSpec((nb, BS, *r), d) for r, d in idx)) for _ in range(layers)]  # fmt: skip
    plan = plan_layer_buffers(specs, 2, ())
    transport = make_transport(_cfg("prefill", a), rank_name="p0")
    try:
        _prefill(a, tickets_q, result_q, layers, nb, plan, transport)
    finally:
        transport.close()


def _prefill(a: dict, tickets_q, result_q, layers: int, nb: int, plan, transport) -> None:
    from torch_kvoffload.layerwise import LayerwiseOffloadRuntime
    from torch_kvoffload.pd import PrefillMultiConnector, PrefillSender, TransferTicket, export_layer_buffers
    from torch_kvoffload.store.local import LocalKVStore

    buffers = export_layer_buffers(plan, transport)
    for group in [*buffers.main, *buffers.indexer]:
        for t in group or ():
            t.copy_(torch.randint(-100, 100, t.shape, dtype=torch.int8).view(t.dtype)
                    if t.dtype in (torch.int8, torch.uint8) else torch.randn(t.shape).to(t.dtype))  # fmt: skip
    sender = PrefillSender(
        _cfg("prefill", a), p_rank=0, buffers=buffers, transport=transport, compat=_compat(layers, a["fmt"])
    )
    tickets = [TransferTicket.from_dict(d) for d in tickets_q.get(timeout=120)]
    table = [list(range(nb))]
    out: dict = {}
    try:
        # 1. transfer alone (publish a layer, wait for its READ_DONE), each interleaved with a local copy of
        #    the same bytes in this process, so both see the same machine load
        k = a["transfer_rounds"]
        local_dst = [torch.empty_like(t) for t in buffers.layer_caches(0)]
        per_layer, local = [], []
        for t in tickets[:k]:
            sender.begin_forward([t], table)
            for layer in range(layers):
                start = time.perf_counter()
                for src, dst in zip(buffers.layer_caches(layer), local_dst, strict=True):
                    dst.copy_(src)
                local.append(time.perf_counter() - start)
                start = time.perf_counter()
                sender.provider(plan.slot_of[layer], layer).wait(120)
                per_layer.append(time.perf_counter() - start)
            sender.end_forward()
            sender.wait_request(t.request_id, timeout=120)
        out["transfer_seconds"] = per_layer
        out["local_copy_seconds"] = local
        # 2. overlapped with compute: the layerwise runtime with a matmul per layer, with and without P/D
        if a["rounds"] > k:
            x = torch.randn(a["mm"], a["mm"])
            rt = LayerwiseOffloadRuntime(plan, buffers, LocalKVStore(1 << 20), model_id="bench")

            def forward(conn, tickets_) -> float:
                start = time.perf_counter()
                if tickets_ is None:
                    conn.begin_forward([[1]], table)
                else:
                    conn.begin_forward([[1]], table, tickets_)
                for layer in range(layers):
                    conn.wait_layer(layer)
                    for _ in range(a["mm_reps"]):
                        x @ x
                    conn.save_layer(layer)
                conn.end_forward()
                return time.perf_counter() - start

            conn = PrefillMultiConnector([rt, sender])
            alone, overlapped = [], []
            for t in tickets[k:]:  # interleaved pairs: machine noise hits both alike
                alone.append(forward(rt, None))
                overlapped.append(forward(conn, [t]))
                sender.wait_request(t.request_id, timeout=120)
            out["compute_only_seconds"] = statistics.median(alone)
            out["with_transfer_seconds"] = statistics.median(overlapped)
            rt.close()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["error_at"] = time.time()
    finally:
        result_q.put(out)
        sender.close()


def run(a: dict, ctx) -> tuple[dict, dict]:
    tickets_q, pre_q, dec_q, stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    dec = ctx.Process(target=decode_proc, args=(a, tickets_q, dec_q, stop), daemon=True)
    pre = ctx.Process(target=prefill_proc, args=(a, tickets_q, pre_q), daemon=True)
    dec.start()
    pre.start()
    try:
        pre_out = pre_q.get(timeout=600)
        try:
            dec_out = dec_q.get(timeout=5)
        except Exception:
            dec_out = {"exitcode": dec.exitcode}
    finally:
        stop.set()
        for p in (pre, dec):
            p.join(10)
            if p.is_alive():
                p.kill()
    return pre_out, dec_out


def main() -> None:
    from torch_kvoffload._utils import free_port

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--transports", default="shm,mooncake")
    ap.add_argument("--formats", default="bf16,int8-indexer,fp8", help=f"of {', '.join(FORMATS)}")
    ap.add_argument("--mm", type=int, default=768, help="matmul size of the per-layer compute")
    ap.add_argument("--mm-reps", type=int, default=8)
    args = ap.parse_args()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch_kvoffload.pd", "torch_kvoffload.layerwise", "torch_kvoffload.sparse"]
    )
    formats = args.formats.split(",")
    rows = []
    results: dict = {"layers": args.layers, "tokens": args.tokens, "runs": {}}
    for fmt in formats:
        layer_bytes = args.tokens * _row_bytes(fmt)
        for name in args.transports.split(","):
            with tempfile.TemporaryDirectory() as rdv:
                a = dict(transport=name, port=free_port(), rdv=rdv, layers=args.layers, tokens=args.tokens,
                         rounds=6, transfer_rounds=3, mm=args.mm, mm_reps=args.mm_reps, fmt=fmt)  # fmt: skip
                pre, dec = run(a, ctx)
            if "error" in pre:
                print(f"{fmt} / {name}: {pre['error']}", file=sys.stderr)
                continue
            per = statistics.median(pre["transfer_seconds"])
            local = statistics.median(pre["local_copy_seconds"])
            overhead = pre["with_transfer_seconds"] - pre["compute_only_seconds"]
            hidden = min(1.0, max(0.0, 1.0 - overhead / (per * args.layers)))
            counters = dec.get("counters", {})
            # bytes the decode receiver counted per request (every round moves one request of `tokens`)
            per_request = counters.get("bytes_received", 0) / max(counters.get("requests_done", 0), 1)
            results["runs"][f"{fmt}/{name}"] = {
                **pre, "format": fmt, "transport": name, "layer_bytes": layer_bytes, "row_bytes": _row_bytes(fmt),
                "bytes_per_request": per_request, "median_transfer_seconds_per_layer": per,
                "hidden_fraction": hidden, "median_local_copy_seconds_per_layer": local, "vs_local": local / per,
                "decode": dec,
            }  # fmt: skip
            rows.append([fmt, name, _row_bytes(fmt), f"{per_request / 2**20:.1f}", local * 1e3, per * 1e3,
                         layer_bytes / per / 1e9, local / per,
                         f"{pre['compute_only_seconds'] * 1e3:.0f} / {pre['with_transfer_seconds'] * 1e3:.0f}",
                         f"{hidden:.2f}"])  # fmt: skip
    base = next((r for r in results["runs"].values() if r["format"] == "bf16"), None)
    for r in results["runs"].values():
        if base is not None and base["bytes_per_request"]:
            r["bytes_vs_bf16"] = r["bytes_per_request"] / base["bytes_per_request"]
    # time from a peer's death to the error (default heartbeats), shm
    with tempfile.TemporaryDirectory() as rdv:
        kill_file = os.path.join(rdv, "killed_at")
        a = dict(transport="shm", port=free_port(), rdv=rdv, layers=args.layers, tokens=args.tokens // 8, rounds=1,
                 transfer_rounds=1, die_at=1, kill_file=kill_file, mm=args.mm, mm_reps=args.mm_reps,
                 fmt=formats[0])  # fmt: skip
        pre, _ = run(a, ctx)
        death = pre.get("error_at", float("nan")) - float(Path(kill_file).read_text())
    results["death_to_error_seconds"] = death
    results["death_error"] = pre.get("error", "")
    print(
        format_table(
            [
                "format",
                "transport",
                "B/token",
                "MiB/request",
                "local copy ms",
                "transfer ms",
                "GB/s",
                "vs local",
                "compute ms: alone / +P/D",
                "hidden",
            ],
            rows,
        )
    )
    print(f"decode killed -> prefill error: {death:.2f} s ({pre.get('error', 'no error!')[:160]})")
    path = write_json("pd_bench", results)
    print(f"wrote {path}")
    plt = pyplot()
    if plt is not None and results["runs"]:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        runs = list(results["runs"].items())
        ax.bar([k for k, _ in runs], [r["bytes_per_request"] / 2**20 for _, r in runs], color="tab:blue")
        ax.set_ylabel("MiB per request (decode receiver)")
        ax.set_title(f"P/D bytes per request, {args.tokens} tokens x {args.layers} layers")
        for i, (_, r) in enumerate(runs):
            ax.text(i, r["bytes_per_request"] / 2**20, f"{r['median_transfer_seconds_per_layer'] * 1e3:.0f} ms/layer",
                    ha="center", va="bottom", fontsize=8)  # fmt: skip
        fig.autofmt_xdate()
        fig.tight_layout()
        fig.savefig(RESULTS_DIR / "pd_bench.png", dpi=120)


if __name__ == "__main__":
    main()

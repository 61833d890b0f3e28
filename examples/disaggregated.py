"""Disaggregated prefill -> decode on one host: two processes, the KV of every layer moving as it is written.

The prefill process runs a layerwise-offload forward (shared layer buffers exported through the chosen
transport, host save to a store) and publishes each layer; the decode process pulls it into its host KV
pool (main KV) and its indexer cache, then greedily decodes a few tokens with a small fixed readout over
that KV (latent attention of a fixed query per layer, then a projection to a vocabulary). The same
readout over the KV prefill computed (the colocated run) must give the same tokens.

    python examples/disaggregated.py [--transport shm|mooncake] [--tokens 2048] [--layers 8]
                                     [--fault none|kill-decode|drop-ack|bad-metadata]

With a fault the run ends with the error each side reports, in bounded time: ``kill-decode`` (decode
exits after layer 2; prefill's heartbeat detects it), ``drop-ack`` (decode never acknowledges layer 2;
prefill's per-layer deadline fires), ``bad-metadata`` (prefill announces wrong block sizes for layer 2;
decode refuses the layer with READ_FAILED and invalidates the request).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import tempfile
import time

import torch

BS, R, P, D = 64, 128, 32, 64  # block size, kv_lora_rank, rope dim, indexer dim
VOCAB = 100
MAIN = [((R,), torch.bfloat16), ((P,), torch.bfloat16)]
IDX = [((D,), torch.int8), ((1,), torch.float32)]
RID = 1


def layer_kv(layer: int, comp: int, nb: int) -> torch.Tensor:
    """What prefill 'computes' for ``layer`` (deterministic, so the colocated run can recompute it)."""
    row, dtype = (MAIN + IDX)[comp]
    g = torch.Generator().manual_seed(7919 * layer + comp)
    if dtype.is_floating_point:
        return torch.randn(nb, BS, *row, generator=g).to(dtype)
    return torch.randint(-128, 128, (nb, BS, *row), generator=g, dtype=torch.int8)


def readout(kv: list[tuple[torch.Tensor, torch.Tensor]], tokens: int, steps: int = 4) -> list[int]:
    """Greedy tokens of a fixed latent-attention readout over per-layer ``(kv_c, k_pe)`` rows."""
    g = torch.Generator().manual_seed(0)
    w_q = torch.randn(VOCAB, R + P, generator=g)
    w_out = torch.randn(R, VOCAB, generator=g) / R**0.5
    out, tok = [], 0
    for _ in range(steps):
        h = torch.zeros(R)
        q = w_q[tok]
        for kv_c, k_pe in kv:
            c, pe = kv_c.reshape(-1, R)[:tokens].float(), k_pe.reshape(-1, P)[:tokens].float()
            p = torch.softmax((c @ q[:R] + pe @ q[R:]) / (R + P) ** 0.5, dim=0)
            h = h + p @ c
        tok = int((h @ w_out).argmax())
        out.append(tok)
    return out


def _compat(layers: int):
    from torch_kvoffload.pd import make_compatibility

    return make_compatibility(
        model_fingerprint="example", num_layers=layers, block_size=BS,
        main=[torch.empty(1, BS, *r, dtype=d) for r, d in MAIN], indexer=[torch.empty(1, BS, *r, dtype=d) for r, d in IDX],
    )  # fmt: skip


def _config(role: str, a: dict):
    from torch_kvoffload.pd import PDConfig

    return PDConfig(role=role, transport=a["transport"], kv_port=a["port"], rendezvous=a["rdv"],
                    layer_ack_timeout_s=2.0)  # fmt: skip


def decode(a: dict, tickets_q, result_q, stop) -> None:
    from torch_kvoffload.pd import DecodeReceiver, PDTransferError, TransferTicket
    from torch_kvoffload.pd.messages import ReadDone
    from torch_kvoffload.sparse import HostKVPool

    layers, nb = a["layers"], -(-a["tokens"] // BS)
    pool = HostKVPool.create(layers, nb, BS, R, P, torch.bfloat16)
    indexer = [tuple(torch.zeros(nb, BS, *r, dtype=d) for r, d in IDX) for _ in range(layers)]

    class Receiver(DecodeReceiver):
        def _reply(self, peer, msg):
            if isinstance(msg, ReadDone) and msg.layer == 2:
                if a["fault"] == "kill-decode":
                    print(f"[decode] exiting after reading layer 2 (at {time.strftime('%X')})", flush=True)
                    os._exit(1)
                if a["fault"] == "drop-ack":
                    return
            super()._reply(peer, msg)

    recv = Receiver(_config("decode", a), pool=pool, compat=_compat(layers), indexer=indexer)
    main = pool.allocate(RID, a["tokens"])
    part = recv.expect(RID, a["tokens"], main, list(range(nb)))
    tickets_q.put(TransferTicket.combine(RID, a["tokens"], 0, main, [part]).to_dict())
    try:
        recv.wait_request(RID, timeout=60)
        kv = [(pool.kv_c(layer)[main], pool.k_pe(layer)[main]) for layer in range(layers)]
        result_q.put({"tokens": readout(kv, a["tokens"]), "counters": recv.counters.snapshot()})
    except PDTransferError as exc:
        result_q.put({"error": str(exc), "state": recv.state(RID)})
    stop.wait(30)
    recv.close()
    pool.close()


def prefill(a: dict, tickets_q, result_q) -> None:
    from torch_kvoffload.layerwise import (
        LayerCacheSpec,
        LayerwiseOffloadRuntime,
        TensorSpec,
        plan_layer_buffers,
    )
    from torch_kvoffload.pd import (
        PrefillMultiConnector,
        PrefillSender,
        TransferTicket,
        export_layer_buffers,
        make_transport,
    )
    from torch_kvoffload.store.local import LocalKVStore

    layers, nb = a["layers"], -(-a["tokens"] // BS)
    specs = [LayerCacheSpec(tuple(TensorSpec((nb, BS, *r), d) for r, d in MAIN),
                            tuple(TensorSpec((nb, BS, *r), d) for r, d in IDX)) for _ in range(layers)]  # fmt: skip
    plan = plan_layer_buffers(specs, 2, (0,))  # layer 0 own buffer, the others rotate through 2
    cfg = _config("prefill", a)
    transport = make_transport(cfg, rank_name="p0")
    buffers = export_layer_buffers(plan, transport)
    rt = LayerwiseOffloadRuntime(plan, buffers, LocalKVStore(1 << 28), model_id="example")

    class Sender(PrefillSender):
        def _layer_ready(self, msg):
            if a["fault"] == "bad-metadata" and msg.layer == 2:
                return dataclasses.replace(
                    msg, main_block_bytes=[msg.main_block_bytes[0] // 2, *msg.main_block_bytes[1:]]
                )
            return msg

    sender = Sender(cfg, p_rank=0, buffers=buffers, transport=transport, compat=_compat(layers))
    conn = PrefillMultiConnector([rt, sender])
    ticket = TransferTicket.from_dict(tickets_q.get(timeout=60))
    table = list(range(nb))
    out: dict = {}
    start = time.perf_counter()
    try:
        conn.begin_forward([list(range(a["tokens"]))], [table], [ticket])
        for layer in range(layers):
            conn.wait(layer)
            for c, buf in enumerate(conn.layer_caches(layer)):
                buf[table] = layer_kv(layer, c, nb)
            conn.save(layer)
        conn.end_forward()
        sender.wait_request(RID, timeout=30)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.perf_counter() - start
    out["layers"] = sorted(sender.layer_log, key=lambda e: e["layer"])
    result_q.put(out)
    sender.close()
    rt.close()
    transport.close()


def main() -> None:
    from torch_kvoffload._utils import free_port

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", default="shm", choices=["shm", "mooncake"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--fault", default="none", choices=["none", "kill-decode", "drop-ack", "bad-metadata"])
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as rdv:
        a = dict(transport=args.transport, port=free_port(), rdv=rdv, tokens=args.tokens, layers=args.layers,
                 fault=args.fault)  # fmt: skip
        tickets_q, pre_q, dec_q, stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
        dec = ctx.Process(target=decode, args=(a, tickets_q, dec_q, stop), daemon=True)
        pre = ctx.Process(target=prefill, args=(a, tickets_q, pre_q), daemon=True)
        dec.start()
        pre.start()
        p_out = pre_q.get(timeout=120)
        try:
            d_out = dec_q.get(timeout=10)
        except Exception:
            d_out = {"error": f"decode process exited (code {dec.exitcode})"}
        stop.set()
        for proc in (pre, dec):
            proc.join(10)
    print(
        f"prefill -> decode over {args.transport}, {args.tokens} tokens, {args.layers} layers, fault={args.fault}"
    )
    for e in p_out["layers"]:
        print(f"  layer {e['layer']}: {e['bytes'] / 2**20:6.2f} MiB in {e['seconds'] * 1e3:7.2f} ms "
              f"({e['bytes'] / max(e['seconds'], 1e-9) / 1e9:5.2f} GB/s, LAYER_READY -> READ_DONE)")  # fmt: skip
    print(f"prefill forward + transfer: {p_out['seconds']:.2f} s")
    if "error" in p_out:
        print(f"prefill error: {p_out['error']}")
    if "error" in d_out:
        print(f"decode error: {d_out['error']}")
        return
    nb = -(-args.tokens // BS)
    colocated = readout(
        [(layer_kv(layer, 0, nb), layer_kv(layer, 1, nb)) for layer in range(args.layers)], args.tokens
    )
    print(f"decode tokens    : {d_out['tokens']}")
    print(f"colocated tokens : {colocated}")
    print(f"equal: {d_out['tokens'] == colocated}")


if __name__ == "__main__":
    main()

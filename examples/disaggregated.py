"""Disaggregated prefill -> decode on one host: two processes, the KV of every layer moving as it is written.

With ``transformers`` installed the two processes serve a tiny random DeepseekV32 (DSA) model through the
Hugging Face path: prefill runs the prompt with layerwise offload (``OffloadConfig(layerwise=...,
pd=PDConfig(role="prefill"))``; its shared layer buffers are exported through the transport) and publishes
each layer as it is written; decode (``OffloadConfig(sparse=..., pd=PDConfig(role="decode"))``) pulls it
into its sparse host KV pool (main KV) and indexer cache, then continues greedy generation from prefill's
first token with sparse decode offload. The tokens must equal a colocated ``generate`` of the unmodified
model. Without ``transformers`` (or with ``--synthetic``) prefill writes deterministic KV into the layer
buffers and decode runs a small fixed readout over what it received (latent attention of a fixed query
per layer, then a projection to a vocabulary), compared with the same readout over the KV prefill wrote.

    python examples/disaggregated.py [--transport shm|mooncake] [--tokens 512] [--layers 8] [--synthetic]
                                     [--fault none|kill-decode|drop-ack|bad-metadata]

With a fault the run ends with the error each side reports, in bounded time: ``kill-decode`` (decode
exits after layer 2; prefill's heartbeat detects it), ``drop-ack`` (decode never acknowledges layer 2;
prefill's per-layer deadline fires), ``bad-metadata`` (prefill announces wrong block sizes for layer 2;
decode refuses the layer with READ_FAILED and invalidates the request). The parent notices a child that
exits without a result at once (:func:`child_result`). Exit status: 0, or 1 when a run without a fault
reports an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import multiprocessing as mp
import os
import queue
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


NEW_TOKENS = 8


def tiny_model(layers: int, seed: int = 0):
    """A seeded random DeepseekV32 causal LM (fp32, CPU): the same weights in every process."""
    from transformers import AutoModelForCausalLM, DeepseekV32Config

    cfg = DeepseekV32Config(
        vocab_size=1000, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=4096, index_topk=32, index_head_dim=32, index_n_heads=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def prompt(tokens: int) -> torch.Tensor:
    return torch.randint(3, 1000, (1, tokens), generator=torch.Generator().manual_seed(1))


def _hf_pd(role: str, a: dict) -> dict:
    return dict(
        role=role, transport=a["transport"], kv_port=a["port"], rendezvous=a["rdv"], layer_ack_timeout_s=2.0
    )


def hf_decode(a: dict, tickets_q, result_q, stop) -> None:
    import torch_kvoffload
    from torch_kvoffload import OffloadConfig
    from torch_kvoffload.integrations.hf.pd import decode_role
    from torch_kvoffload.pd import PDTransferError
    from torch_kvoffload.pd.messages import ReadDone

    model = torch_kvoffload.offload(
        tiny_model(a["layers"]), OffloadConfig(sparse={}, block_size=BS, pd=_hf_pd("decode", a))
    )
    role = decode_role(model)
    ids = prompt(a["tokens"])
    role.reserve(1, a["tokens"] + NEW_TOKENS)
    reply = role.receiver._reply

    def faulty_reply(peer, msg):
        if isinstance(msg, ReadDone) and msg.layer == 2:
            if a["fault"] == "kill-decode":
                print(f"[decode] exiting after reading layer 2 (at {time.strftime('%X')})", flush=True)
                os._exit(1)
            if a["fault"] == "drop-ack":
                return
        reply(peer, msg)

    role.receiver._reply = faulty_reply
    tickets = role.expect(ids, max_tokens=a["tokens"] + NEW_TOKENS)
    tickets_q.put([t.to_dict() for t in tickets])
    try:
        cache = role.wait(timeout=60)
        first = a["first_q"].get(timeout=60)  # prefill's first token, handed over with the request
        if first is None:
            raise PDTransferError("prefill failed after decode received the KV; nothing to continue")
        full = torch.cat([ids, first.view(1, 1)], dim=1)
        out = model.generate(input_ids=full, cache=cache, max_new_tokens=NEW_TOKENS - 1, do_sample=False)
        result_q.put(
            {"tokens": out[0, a["tokens"] :].tolist(), "counters": role.receiver.counters.snapshot()}
        )
    except PDTransferError as exc:
        result_q.put({"error": str(exc), "state": role.receiver.state(tickets[0].request_id)})
    stop.wait(30)
    torch_kvoffload.integrations.hf.install.detach(model)


def hf_prefill(a: dict, tickets_q, result_q) -> None:
    import torch_kvoffload
    from torch_kvoffload import OffloadConfig
    from torch_kvoffload.integrations.hf import session_of
    from torch_kvoffload.integrations.hf.pd import prefill_role
    from torch_kvoffload.pd import TransferTicket

    cfg = OffloadConfig(layerwise={"num_shared_buffers": 2}, block_size=BS, pd=_hf_pd("prefill", a))
    model = torch_kvoffload.offload(tiny_model(a["layers"]), cfg)
    role = prefill_role(model)
    ids = prompt(a["tokens"])
    session_of(model).reserve(
        1, a["tokens"] + 1
    )  # what generate(max_new_tokens=1) needs: buffers + sender now
    ready = role.sender._layer_ready
    if a["fault"] == "bad-metadata":
        role.sender._layer_ready = lambda msg: (
            dataclasses.replace(msg, main_block_bytes=[msg.main_block_bytes[0] // 2, *msg.main_block_bytes[1:]])
            if msg.layer == 2 else ready(msg)
        )  # fmt: skip
    role.submit([TransferTicket.from_dict(d) for d in tickets_q.get(timeout=60)])
    out: dict = {}
    start = time.perf_counter()
    try:
        first = model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)[0, -1]
        role.wait(timeout=30)
        a["first_q"].put(first)
        out["first"] = int(first)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        a["first_q"].put(None)
    out["seconds"] = time.perf_counter() - start
    out["layers"] = sorted(role.sender.layer_log, key=lambda e: e["layer"]) if role.sender else []
    result_q.put(out)
    torch_kvoffload.integrations.hf.install.detach(model)


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
            conn.wait_layer(layer)
            for c, buf in enumerate(conn.layer_caches(layer)):
                buf[table] = layer_kv(layer, c, nb)
            conn.save_layer(layer)
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


#: How long the parent waits for each child's result while the child is alive. A child that exits without
#: one (the ``kill-decode`` fault's decode, a crash) is reported within two polls (:data:`POLL_S`) of its
#: exit.
RESULT_TIMEOUT_S = 120.0
POLL_S = 0.2


def child_result(q, proc, name: str, timeout: float) -> dict:
    """The dict ``proc`` puts on ``q``; an ``{"error": ...}`` dict as soon as ``proc`` has exited without
    one, or after ``timeout`` seconds while it still runs."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            pass
        if proc.exitcode is not None:
            try:  # a result put just before a clean exit is already in the pipe
                return q.get(timeout=POLL_S)
            except queue.Empty:
                return {"error": f"the {name} process exited with code {proc.exitcode} without a result"}
        if time.monotonic() >= deadline:
            return {"error": f"no result from the {name} process within {timeout:.0f} s (still running)"}


def main() -> int:
    from torch_kvoffload._utils import free_port

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", default="shm", choices=["shm", "mooncake"])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--fault", default="none", choices=["none", "kill-decode", "drop-ack", "bad-metadata"])
    ap.add_argument("--synthetic", action="store_true", help="fixed readout instead of the tiny HF model")
    args = ap.parse_args()
    hf = not args.synthetic and importlib.util.find_spec("transformers") is not None
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as rdv:
        a = dict(transport=args.transport, port=free_port(), rdv=rdv, tokens=args.tokens, layers=args.layers,
                 fault=args.fault, first_q=ctx.Queue())  # fmt: skip
        tickets_q, pre_q, dec_q, stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
        dec = ctx.Process(target=hf_decode if hf else decode, args=(a, tickets_q, dec_q, stop), daemon=True)
        pre = ctx.Process(target=hf_prefill if hf else prefill, args=(a, tickets_q, pre_q), daemon=True)
        dec.start()
        pre.start()
        p_out = child_result(pre_q, pre, "prefill", RESULT_TIMEOUT_S)
        # decode still generates its tokens after prefill is done: slow on a loaded machine
        d_out = child_result(dec_q, dec, "decode", RESULT_TIMEOUT_S)
        stop.set()
        for proc in (pre, dec):
            proc.join(10)
    what = "tiny DeepseekV32" if hf else "synthetic KV"
    print(
        f"prefill -> decode over {args.transport} ({what}), {args.tokens} tokens, {args.layers} layers, "
        f"fault={args.fault}"
    )
    for e in p_out.get("layers", []):
        print(f"  layer {e['layer']}: {e['bytes'] / 2**20:6.2f} MiB in {e['seconds'] * 1e3:7.2f} ms "
              f"({e['bytes'] / max(e['seconds'], 1e-9) / 1e9:5.2f} GB/s, LAYER_READY -> READ_DONE)")  # fmt: skip
    if "seconds" in p_out:
        print(f"prefill forward + transfer: {p_out['seconds']:.2f} s")
    if "error" in p_out:
        print(f"prefill error: {p_out['error']}")
    if "error" in d_out:
        print(f"decode error: {d_out['error']}")
    if "error" in p_out or "error" in d_out:
        # with a fault the errors are the demonstration; without one they are a failure
        return 0 if args.fault != "none" else 1
    if hf:
        ref = tiny_model(args.layers)
        ids = prompt(args.tokens)
        colocated = ref.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, args.tokens :]
        colocated = colocated.tolist()
    else:
        nb = -(-args.tokens // BS)
        colocated = readout(
            [(layer_kv(layer, 0, nb), layer_kv(layer, 1, nb)) for layer in range(args.layers)], args.tokens
        )
    print(f"decode tokens    : {d_out['tokens']}")
    print(f"colocated tokens : {colocated}")
    print(f"equal: {d_out['tokens'] == colocated}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

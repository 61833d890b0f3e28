"""Test helpers for P/D transfer: a tiny DeepSeek-like cache layout, deterministic per-block KV, and the
prefill / decode process bodies the multi-process tests spawn (with fault injection).

The KV prefill "computes" is a pure function of (request, layer, component) (:func:`block_data`), so the
decode process checks its host pool and indexer against an expectation computed independently of the
transfer code.
"""

from __future__ import annotations

import glob
import math
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from typing import Any

import torch

L, BS, NB = 6, 4, 24  # layers, block size, prefill device blocks
R, P, D = 32, 8, 16  # kv_lora_rank, rope_dim, index_dim
POOL_BLOCKS, IDX_BLOCKS = 40, 40
KV_DTYPE = torch.bfloat16
REQUESTS = [(7, 21), (11, 9), (12, 2)]  # (request id, prompt tokens): 6, 3 and 1 blocks

MAIN_ROWS = [((R,), KV_DTYPE), ((P,), KV_DTYPE)]
IDX_ROWS = [((D,), torch.int8), ((1,), torch.float32)]  # int8 indexer key + its fp32 scale


def nblocks(tokens: int) -> int:
    return math.ceil(tokens / BS)


def block_data(rid: int, layer: int, comp: int, n: int) -> torch.Tensor:
    """``[n, BS, *row]`` KV of component ``comp`` (0, 1 main; 2, 3 indexer) of ``layer`` of request ``rid``."""
    row, dtype = (MAIN_ROWS + IDX_ROWS)[comp]
    g = torch.Generator().manual_seed(rid * 1_000_003 + layer * 1009 + comp)
    if dtype.is_floating_point:
        return torch.randn(n, BS, *row, generator=g).to(dtype)
    return torch.randint(-128, 128, (n, BS, *row), generator=g, dtype=torch.int8)


def specs(indexer_layers=None):
    from torch_kvoffload.layerwise import LayerCacheSpec, TensorSpec

    main = tuple(TensorSpec((NB, BS, *r), d) for r, d in MAIN_ROWS)
    idx = tuple(TensorSpec((NB, BS, *r), d) for r, d in IDX_ROWS)
    return [
        LayerCacheSpec(main, idx if indexer_layers is None or i in indexer_layers else None) for i in range(L)
    ]


def compat(fingerprint: str = "tiny-dsa"):
    from torch_kvoffload.pd import make_compatibility

    main = [torch.empty(1, BS, *r, dtype=d) for r, d in MAIN_ROWS]
    idx = [torch.empty(1, BS, *r, dtype=d) for r, d in IDX_ROWS]
    return make_compatibility(
        model_fingerprint=fingerprint, num_layers=L, block_size=BS, main=main, indexer=idx
    )


#: The heartbeat settings of the tests that time a dead peer's detection: dead after 4 missed 0.25 s beats.
DEAD_PEER = dict(heartbeat_interval_s=0.25, heartbeat_misses=4)


def config(role: str, **kw: Any):
    from torch_kvoffload.pd import PDConfig

    # A 3 s dead-peer window: wide enough that a test whose two sides share one process (and its GIL) on
    # a loaded machine never sees a live peer as dead; the tests about dead peers pass DEAD_PEER.
    base = dict(
        heartbeat_interval_s=0.25, heartbeat_misses=12, layer_ack_timeout_s=5.0, handshake_timeout_s=20.0
    )
    base.update(kw)
    return PDConfig(role=role, **base)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (bit-for-bit comparison, NaN-safe)."""
    return t.detach().cpu().contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------------------- prefill
def _fault_sender_cls(fault: str | None):
    from torch_kvoffload.pd import PrefillSender

    if not fault:
        return PrefillSender
    kind, _, arg = fault.partition(":")
    layer = int(arg) if arg else 2

    class FaultySender(PrefillSender):
        def _layer_ready(self, msg):
            if kind == "bad-metadata" and msg.layer == layer:
                import dataclasses

                return dataclasses.replace(
                    msg, main_block_bytes=[msg.main_block_bytes[0] + 2, *msg.main_block_bytes[1:]]
                )
            return msg

        def provider(self, slot, layer_):
            ev = super().provider(slot, layer_)
            if kind == "die-after" and layer_ == layer:
                time.sleep(0.1)  # let the batch leave
                os._exit(3)
            return ev

    return FaultySender


def make_prefill_rank(
    cfg,
    p_rank: int,
    rdv_dir: str,
    cls=None,
    *,
    shared: int = 2,
    independent=(0,),
    store=None,
    indexer_layers=None,
    sender_first=False,
):
    """``(connector, sender, runtime, transport)`` of one prefill rank: a layerwise runtime over buffers
    exported by the configured transport, and its sender."""
    from torch_kvoffload.layerwise import LayerwiseOffloadRuntime, plan_layer_buffers
    from torch_kvoffload.pd import (
        FileRendezvous,
        PrefillMultiConnector,
        PrefillSender,
        export_layer_buffers,
        make_transport,
    )
    from torch_kvoffload.store.local import LocalKVStore

    transport = make_transport(cfg, rank_name=f"p{p_rank}")
    plan = plan_layer_buffers(specs(indexer_layers), shared, independent)
    buffers = export_layer_buffers(plan, transport)
    rt = LayerwiseOffloadRuntime(
        plan, buffers, store if store is not None else LocalKVStore(1 << 24), model_id="tiny-dsa"
    )
    sender = (cls or PrefillSender)(
        cfg,
        p_rank=p_rank,
        buffers=buffers,
        transport=transport,
        compat=compat(),
        rendezvous=FileRendezvous(rdv_dir),
    )
    return PrefillMultiConnector([sender, rt] if sender_first else [rt, sender]), sender, rt, transport


def prefill_tables(p_rank: int, tickets) -> tuple[list[list[int]], list[list[int]]]:
    """Prefill block tables (a rank-specific permutation: any blocks work) and token ids of ``tickets``."""
    perm = torch.randperm(NB, generator=torch.Generator().manual_seed(100 + p_rank)).tolist()
    tables, pos = [], 0
    for t in tickets:
        n = len(t.main_blocks)
        tables.append(perm[pos : pos + n])
        pos += n
    tokens = [
        list(range(1000 * p_rank + t.request_id, 1000 * p_rank + t.request_id + t.num_tokens))
        for t in tickets
    ]
    return tables, tokens


def write_layer(conn, layer: int, tickets, tables) -> None:
    """Compute ``layer``: write every request's KV (:func:`block_data`) into the layer's buffers."""
    caches = conn.layer_caches(layer)
    for t, table in zip(tickets, tables, strict=True):
        for c, buf in enumerate(caches):
            buf[table] = block_data(t.request_id, layer, c, len(table))


def run_prefill(conn, tickets, *, on_layer=None) -> list[list[int]]:
    """One prefill forward of prefill rank 0 over ``tickets``: every layer waited for, written
    (:func:`write_layer`; ``on_layer(layer)`` first) and saved; returns the block tables."""
    tables, tokens = prefill_tables(0, tickets)
    conn.begin_forward(tokens, tables, tickets)
    try:
        for layer in range(L):
            conn.wait_layer(layer)
            if on_layer is not None:
                on_layer(layer)
            write_layer(conn, layer, tickets, tables)
            conn.save_layer(layer)
    finally:
        conn.end_forward()
    return tables


def prefill_rank(
    cfg, p_rank: int, tickets, rdv_dir: str, fault: str | None, layer_sleep: float, out: dict, wait_s: float
) -> None:
    """One prefill TP rank: layerwise runtime over exported buffers + sender; writes every layer's KV and
    waits up to ``wait_s`` (:func:`verdict_s`) for every request's verdict."""

    t0 = time.time()
    try:
        conn, sender, rt, transport = make_prefill_rank(cfg, p_rank, rdv_dir, _fault_sender_cls(fault))
        tables, tokens = prefill_tables(p_rank, tickets)
        try:
            conn.begin_forward(tokens, tables, tickets)
            for layer in range(L):
                conn.wait_layer(layer)
                write_layer(conn, layer, tickets, tables)
                time.sleep(layer_sleep)
                conn.save_layer(layer)
            conn.end_forward()
            end = time.monotonic() + wait_s
            for t in tickets:
                sender.wait_request(t.request_id, timeout=max(0.0, end - time.monotonic()))
            out[p_rank] = {"ok": True, "seconds": time.time() - t0, "counters": sender.counters.snapshot()}
        finally:
            sender.close()
            rt.close()
            transport.close()
    except BaseException as exc:
        out[p_rank] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__,
                       "at": time.time(), "trace": traceback.format_exc()[-3000:]}  # fmt: skip


def prefill_main(
    cfg_kw: dict, rdv_dir: str, tickets_q, result_q, fault: str | None, layer_sleep: float, wait_s: float,
    deadline_s: float,
) -> None:  # fmt: skip
    """Process body: every prefill TP rank on its own thread; ``wait_s`` for the library's verdict
    (:func:`verdict_s`), ``deadline_s`` for the whole pair (:func:`pair_deadline_s`)."""
    from torch_kvoffload.pd import TransferTicket

    end = time.monotonic() + deadline_s
    cfg = config("prefill", **cfg_kw)
    tickets = [TransferTicket.from_dict(d) for d in tickets_q.get(timeout=deadline_s)]
    out: dict = {}
    threads = [threading.Thread(target=prefill_rank,
                                args=(cfg, r, tickets, rdv_dir, fault, layer_sleep, out, wait_s))
               for r in range(cfg.prefill_tp_size)]  # fmt: skip
    for th in threads:
        th.start()
    for th in threads:
        th.join(max(0.0, end - time.monotonic()))
    result_q.put({"side": "prefill", "ranks": out})


# -------------------------------------------------------------------------------------------- decode
def _fault_receiver_cls(fault: str | None, kill_file: str):
    from torch_kvoffload.pd import DecodeReceiver
    from torch_kvoffload.pd.messages import ReadDone

    if not fault:
        return DecodeReceiver
    kind, _, arg = fault.partition(":")
    layer = int(arg) if arg else 2

    class FaultyReceiver(DecodeReceiver):
        def _reply(self, peer, msg):
            if kind == "drop-ack" and isinstance(msg, ReadDone) and msg.layer == layer:
                return
            super()._reply(peer, msg)

        def _handle_layer(self, identity, msg):
            if kind == "die-at" and msg.layer == layer:
                with open(kill_file, "w") as f:
                    f.write(str(time.time()))
                os._exit(3)
            super()._handle_layer(identity, msg)

    return FaultyReceiver


def make_decode(
    cfg, rdv_dir: str, cls=None, fingerprint: str = "tiny-dsa", indexer_layers=None, dp_rank: int = 0
):
    """``(pool, indexers, receivers)``: one host pool shared by every decode TP rank of DP rank ``dp_rank``
    and a rank-local indexer (int8 key + fp32 scale on the compute device) per rank."""
    from torch_kvoffload.device import default_device
    from torch_kvoffload.pd import DecodeReceiver, FileRendezvous
    from torch_kvoffload.sparse import HostKVPool

    pool = HostKVPool.create(L, POOL_BLOCKS, BS, R, P, KV_DTYPE)
    dev = default_device()
    indexers = [
        [
            tuple(torch.zeros(IDX_BLOCKS, BS, *r, dtype=d, device=dev) for r, d in IDX_ROWS)
            if indexer_layers is None or i in indexer_layers
            else None
            for i in range(L)
        ]
        for _ in range(cfg.decode_tp_size)
    ]
    pool.kv_c(0).zero_()
    pool.k_pe(0).zero_()
    recvs = [(cls or DecodeReceiver)(cfg, pool=pool, compat=compat(fingerprint), dp_rank=dp_rank, tp_rank=t,
                                     indexer=indexers[t], rendezvous=FileRendezvous(rdv_dir))
             for t in range(cfg.decode_tp_size)]  # fmt: skip
    return pool, indexers, recvs


def make_tickets(pool, recvs, requests, dp_rank: int = 0):
    """Allocate each request's pool blocks and every rank's indexer blocks (of decode DP rank ``dp_rank``);
    the combined tickets."""
    from torch_kvoffload.pd import TransferTicket

    tickets = []
    for rid, ntok in requests:
        main = pool.allocate(rid, ntok)
        parts = []
        for t, rv in enumerate(recvs):
            idx = [
                IDX_BLOCKS - 1 - (7 * t + 3 * len(tickets) + 11 * j) % IDX_BLOCKS for j in range(len(main))
            ]
            parts.append(rv.expect(rid, ntok, main, idx))
        tickets.append(TransferTicket.combine(rid, ntok, dp_rank, main, parts))
    return tickets


def decode_main(
    cfg_kw: dict, rdv_dir: str, tickets_q, result_q, stop, fault: str | None, fingerprint: str, wait_s: float,
    kill_file: str, deadline_s: float,
) -> None:  # fmt: skip
    """Process body: every decode TP rank of DP rank 0 (one shared host pool, rank-local indexers); waits
    up to ``wait_s`` in all for the requests' verdicts (:func:`verdict_s`), then up to ``deadline_s``
    (:func:`pair_deadline_s`) for ``stop``."""
    from torch_kvoffload.pd import all_ranks_ready

    try:
        cfg = config("decode", **cfg_kw)
        pool, indexers, recvs = make_decode(cfg, rdv_dir, _fault_receiver_cls(fault, kill_file), fingerprint)
        tickets = make_tickets(pool, recvs, REQUESTS)
        tickets_q.put([t.to_dict() for t in tickets])
        states, errors, mismatches = {}, {}, []
        end = time.monotonic() + wait_s
        for t in tickets:
            for rank, rv in enumerate(recvs):
                try:
                    rv.wait_request(t.request_id, timeout=max(0.0, end - time.monotonic()))
                except Exception as exc:
                    errors[(t.request_id, rank)] = f"{type(exc).__name__}: {exc}"
            st = [rv.state(t.request_id) for rv in recvs]
            states[t.request_id] = st
            try:
                ready = all_ranks_ready(st)
            except Exception:
                ready = False
            if not ready:
                continue
            n = len(t.main_blocks)
            main_idx = torch.tensor(t.main_blocks)
            for layer in range(L):
                for c, view in ((0, pool.kv_c(layer)), (1, pool.k_pe(layer))):
                    if not torch.equal(bits(view[main_idx]), bits(block_data(t.request_id, layer, c, n))):
                        mismatches.append(("main", t.request_id, layer, c))
                for rank in range(cfg.decode_tp_size):
                    ib = torch.tensor(t.parts[rank].indexer_blocks)
                    for c, buf in enumerate(indexers[rank][layer]):
                        want = block_data(t.request_id, layer, 2 + c, n)
                        if not torch.equal(bits(buf[ib.to(buf.device)]), bits(want)):
                            mismatches.append(("indexer", t.request_id, layer, rank, c))
        # what a failed request left readable: its destinations must be zero
        leftovers = []
        for t in tickets:
            if all(s == "failed" for s in states[t.request_id]):
                main_idx = torch.tensor(t.main_blocks)
                for layer in range(L):
                    if pool.kv_c(layer)[main_idx].abs().sum() != 0:
                        time.sleep(0.5)  # zeroing runs on the read thread: give it a moment
                        if pool.kv_c(layer)[main_idx].abs().sum() != 0:
                            leftovers.append((t.request_id, layer))
        result = {"side": "decode", "states": states, "errors": {f"{k[0]}:{k[1]}": v for k, v in errors.items()},
                  "mismatches": mismatches, "leftovers": leftovers,
                  "handshake_errors": [e for rv in recvs for e in rv.handshake_errors],
                  "counters": [rv.counters.snapshot() for rv in recvs], "at": time.time()}  # fmt: skip
        result_q.put(result)
        stop.wait(deadline_s)
        for rv in recvs:
            rv.close()
        pool.close()
    except BaseException as exc:
        result_q.put(
            {
                "side": "decode",
                "fatal": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc()[-3000:],
            }
        )


# ------------------------------------------------------------------------------------- orchestration
PRELOAD = ("torch", "torch_kvoffload.layerwise", "torch_kvoffload.pd", "torch_kvoffload.sparse",
            "torch_kvoffload.store.local", "support.pd_helpers")  # fmt: skip


def mp_context():
    """A forkserver context whose server imported torch and the package once: every child forks from it
    in milliseconds instead of importing for seconds (spawn), and no child inherits a parent's threads."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


# ----------------------------------------------------------------------------------------- deadlines
# Every wall-clock bound of the multi-process tests is one of these: what the configuration lets the library
# take before it must report (success or a timeout error), plus the work itself — measured on this machine
# as it is loaded now, never guessed.
_MEASURED: dict[tuple[str, ...], float] = {}
#: How many measured cold starts a process start or wind-down may take (the load can rise after the
#: measurement).
PROCESS_FACTOR = 3.0


def _import_all(modules: tuple[str, ...]) -> None:
    import importlib

    for name in modules:
        importlib.import_module(name)


def process_s(modules: tuple[str, ...] = PRELOAD) -> float:
    """Seconds a test process may take to start (or wind down) on this machine as loaded now:
    ``PROCESS_FACTOR`` times a cold start — a spawned interpreter importing ``modules``, what the
    forkserver (or a spawned test body) does before any P/D code runs — measured once per module set.
    The one part of a multi-process test no configuration bounds."""
    if modules not in _MEASURED:
        t0 = time.monotonic()
        proc = mp.get_context("spawn").Process(target=_import_all, args=(modules,), daemon=True)
        proc.start()
        proc.join()  # it imports and returns: no bound needed
        if proc.exitcode != 0:
            raise RuntimeError(f"process_s: importing {modules} in a fresh process failed ({proc.exitcode})")
        _MEASURED[modules] = time.monotonic() - t0
    return PROCESS_FACTOR * _MEASURED[modules]


def verdict_s(cfg, layers: int = L, layer_work_s: float = 0.0) -> float:
    """Seconds after both sides started within which the library reports every request of a transfer
    done or failed, from ``cfg`` (a :class:`PDConfig`): the handshake (``handshake_timeout_s``, rendezvous
    lookup included), then per layer its work (``layer_work_s``) and at most ``layer_ack_timeout_s`` for
    its acknowledgement (read retries happen inside it), and the dead-peer window (``dead_after_s``) for a
    peer that went silent."""
    return cfg.handshake_timeout_s + layers * (layer_work_s + cfg.layer_ack_timeout_s) + cfg.dead_after_s


def pair_deadline_s(cfg, layers: int = L, layer_work_s: float = 0.0) -> float:
    """Seconds a prefill + decode process pair may take from start to results: both processes' starts
    (:func:`process_s`) and the library's :func:`verdict_s`."""
    return 2 * process_s() + verdict_s(cfg, layers, layer_work_s)


def dead_peer_detect_s(cfg) -> float:
    """Worst-case seconds from a peer's death to its detection: silence for ``dead_after_s`` (measured
    from its last message, sent before it died) noticed at the next heartbeat tick (``heartbeat_interval_s``)."""
    return cfg.dead_after_s + cfg.heartbeat_interval_s


def run_pair(
    tmp_path, *, transport: str, p_tp: int, d_tp: int, prefill_fault: str | None = None,
    decode_fault: str | None = None, fingerprint: str = "tiny-dsa", layer_sleep: float = 0.0,
    decode_wait_s: float | None = None, **cfg_extra: Any,
) -> tuple[dict, dict]:  # fmt: skip
    """Spawn a decode and a prefill process on loopback; return their result dicts (``{}`` if none came).
    Both sides wait :func:`verdict_s` of the configuration for the library's verdicts (decode
    ``decode_wait_s`` if given), the pair :func:`pair_deadline_s` in all."""
    ctx = mp_context()
    rdv = str(tmp_path / "rendezvous")
    cfg_kw = dict(
        transport=transport,
        prefill_tp_size=p_tp,
        decode_tp_size=d_tp,
        kv_port=free_port_run(d_tp * cfg_extra.get("decode_dp_size", 1)),  # every decode endpoint
        **cfg_extra,
    )
    cfg = config("decode", **cfg_kw)
    wait_s = verdict_s(cfg, L, layer_sleep)
    timeout = pair_deadline_s(cfg, L, layer_sleep)
    decode_wait_s = wait_s if decode_wait_s is None else decode_wait_s
    tickets_q, pre_q, dec_q, stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    kill_file = str(tmp_path / "killed_at")
    dec = ctx.Process(
        target=decode_main,
        args=(
            cfg_kw,
            rdv,
            tickets_q,
            dec_q,
            stop,
            decode_fault,
            fingerprint,
            decode_wait_s,
            kill_file,
            timeout,
        ),
        daemon=True,
    )
    pre = ctx.Process(
        target=prefill_main,
        args=(cfg_kw, rdv, tickets_q, pre_q, prefill_fault, layer_sleep, wait_s, timeout),
        daemon=True,
    )
    dec.start()
    pre.start()
    deadline = time.monotonic() + timeout
    results: dict[str, dict] = {}
    procs = {"decode": (dec_q, dec), "prefill": (pre_q, pre)}
    try:
        while len(results) < 2 and time.monotonic() < deadline:
            for name, (q, proc) in procs.items():
                if name in results:
                    continue
                try:
                    results[name] = q.get(timeout=0.05)
                except queue.Empty:
                    if not proc.is_alive():
                        # a process flushes its queue before it exits: the result is there now or never
                        try:
                            results[name] = q.get_nowait()
                        except queue.Empty:
                            results[name] = {"exitcode": proc.exitcode}
    finally:
        stop.set()
        for proc in (pre, dec):
            proc.join(process_s())
            if proc.is_alive():
                proc.kill()
                proc.join(process_s())
        for path in glob.glob(f"/dev/shm/kvoffload-pd-{pre.pid}-*"):  # a killed prefill leaves its exports
            os.unlink(path)
    return results.get("prefill", {}), results.get("decode", {})


# ------------------------------------------------------------------------- transport test processes
def export_region_main(transport: str, nbytes: int, seed: int, out_q, stop, deadline_s: float) -> None:
    """Process body: export one ``uint8`` region of random bytes and describe it; wait for ``stop`` (at
    most ``deadline_s``, the test's :func:`process_s` bound)."""
    from torch_kvoffload.pd import ShmTransport
    from torch_kvoffload.pd.transports.mooncake import MooncakeTransport

    tr = ShmTransport() if transport == "shm" else MooncakeTransport()
    region = tr.allocate("r", (nbytes,), torch.uint8)
    region.copy_(
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    )
    out_q.put(tr.describe())
    stop.wait(deadline_s)
    tr.close()


# ------------------------------------------------------------------ memfabric_hybrid recording fake
class FakeMemFabric:
    """A recording FAKE of ``memfabric_hybrid`` 1.3.0's ``TransferEngine`` (no Ascend here): engines of
    one process find each other by ``unique_id`` and copy registered host memory with ``ctypes.memmove``;
    every call is appended to ``calls``. Only for unit tests of the adapter."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.engines: dict[str, Any] = {}
        self.fail_reads = False
        fake = self

        class TransferEngine:
            def __init__(self) -> None:
                self.unique_id = ""
                self.regions: list[tuple[int, int]] = []

            def initialize(self, store_url: str, unique_id: str, role: str, device_id: int) -> int:
                fake.calls.append(("initialize", store_url, unique_id, role, device_id))
                self.unique_id = unique_id
                fake.engines[unique_id] = self
                return 0

            def register_memory(self, addr: int, size: int) -> int:
                fake.calls.append(("register_memory", addr, size))
                self.regions.append((addr, size))
                return 0

            def unregister_memory(self, addr: int) -> int:
                fake.calls.append(("unregister_memory", addr))
                return 0

            def _inside(self, addr: int, n: int) -> bool:
                return any(a <= addr and addr + n <= a + s for a, s in self.regions)

            def batch_transfer_sync_read(self, dest: str, buffers, peer_buffer_addresses, lengths) -> int:
                import ctypes

                fake.calls.append(
                    (
                        "batch_transfer_sync_read",
                        dest,
                        list(buffers),
                        list(peer_buffer_addresses),
                        list(lengths),
                    )
                )
                peer = fake.engines.get(dest)
                if fake.fail_reads or peer is None:
                    return -1
                for local, remote, n in zip(buffers, peer_buffer_addresses, lengths, strict=True):
                    if not (self._inside(local, n) and peer._inside(remote, n)):
                        return -2
                    ctypes.memmove(local, remote, n)
                return 0

            def destroy(self) -> None:
                fake.calls.append(("destroy", self.unique_id))

        self.TransferEngine = TransferEngine


# ------------------------------------------------------------- Hugging Face models, tensor parallel sides
#: What a rank process of the Hugging Face TP tests imports before its body runs (the forkserver preloads
#: it once; :func:`process_s` measures a cold start of it).
HF_PRELOAD = (*PRELOAD, "transformers", "transformers.models.deepseek_v32.modeling_deepseek_v32",
              "transformers.models.deepseek_v3.modeling_deepseek_v3", "support.hf_models", "support.tp_helpers")  # fmt: skip


def hf_context():
    """A forkserver context preloading :data:`HF_PRELOAD` (when this test session starts the server)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(HF_PRELOAD))
    return ctx


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive TCP ports on ``host`` that were all free when asked (a decode TP
    side listens on ``kv_port + tp_rank``)."""
    import socket

    from torch_kvoffload._utils import free_port

    while True:
        base = free_port(host)
        if base + count > 65536:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def _gloo_rank(rank: int, world: int, port: int, timeout_s: float, fn, args: tuple) -> None:
    import torch.distributed as dist

    from support.gloo import init_gloo

    torch.set_num_threads(1)
    init_gloo(rank, world, port, timeout_s)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def start_gloo_group(ctx, fn, world: int, *args: Any, timeout_s: float) -> tuple[list, Any]:
    """Start ``world`` processes of ``ctx`` running ``fn(rank, world, *args)`` in their own gloo group on
    127.0.0.1 (the default process group of each: what ``tp_plan="auto"`` shards over); collectives time out
    after ``timeout_s``. Returns the processes (daemons, not joined) and the group's rendezvous store, which
    the caller keeps until they are done (:mod:`support.gloo`)."""
    from support.gloo import master_store

    store = master_store(timeout_s)
    procs = [
        ctx.Process(target=_gloo_rank, args=(r, world, store.port, timeout_s, fn, args), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs, store


def load_hf_side(directory: str, rank: int, world: int) -> torch.nn.Module:
    """The model saved in ``directory`` for one rank of a side of ``world`` TP ranks (``tp_plan="auto"``
    when ``world > 1``, else a plain load)."""
    if world > 1:
        from support.tp_helpers import load_tp

        return load_tp(directory, rank, world)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).eval()


def _refusal(model: torch.nn.Module, cfg: dict) -> str | None:
    """The ``ValueError`` offloading ``model`` with ``cfg`` raises (``None`` if it does not); the model is
    left as it was."""
    import torch_kvoffload

    try:
        torch_kvoffload.offload(model, cfg)
    except ValueError as exc:
        return str(exc)
    torch_kvoffload.integrations.hf.install.detach(model)
    return None


def hf_prefill_rank(rank: int, world: int, case: dict, tickets_q, first_q, out_q) -> None:
    """Prefill TP rank body: load, offload with layerwise + P/D prefill, take decode's tickets, run the
    prompt's forward (``generate`` of one token, publishing every layer), wait for decode's reads; rank 0
    hands the first token to every decode rank. First, with ``prefill_tp_size`` other than the model's TP
    size, the offload's refusal (``"refused"``)."""
    import torch_kvoffload
    from torch_kvoffload.integrations.hf.pd import prefill_role
    from torch_kvoffload.pd import TransferTicket

    try:
        model = load_hf_side(case["dir"], rank, world)
        pd = {**case["pd"], "role": "prefill"}
        cfg = {"layerwise": {"num_shared_buffers": 1}, "block_size": case["block_size"], "pd": pd}
        d_tp = pd["decode_tp_size"]  # a prefill size of d_tp is a valid P/D config, not this model's size
        refused = _refusal(model, {**cfg, "pd": {**pd, "prefill_tp_size": d_tp}}) if d_tp != world else None
        model = torch_kvoffload.offload(model, cfg)
        role = prefill_role(model)
        role.submit([TransferTicket.from_dict(d) for d in tickets_q.get(timeout=case["deadline_s"])])
        ids, mask = case["ids"], case["mask"]
        first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)[:, -1]
        role.wait(timeout=case["verdict_s"])
        if rank == 0:
            for _ in range(
                pd["decode_tp_size"]
            ):  # plain ints: a queued tensor lives only as long as its sender
                first_q.put(first.tolist())
        out_q.put(("prefill", rank, {"sender": role.sender.counters.snapshot(), "p_rank": role.sender.p_rank,
                                     "layers": len(role.sender.layer_log), "refused": refused}))  # fmt: skip
    except BaseException:
        out_q.put(("prefill", rank, {"error": traceback.format_exc()}))


def hf_decode_rank(rank: int, world: int, case: dict, tickets_q, first_q, out_q) -> None:
    """Decode TP rank body: load, offload with sparse decode offload + P/D decode, expect the prompt (rank 0
    hands the tickets to every prefill rank), wait until every rank received its share, continue
    ``generate`` from prefill's first token. First, on a TP side, the offload's refusal of
    ``decode_tp_size=1`` (``"refused"``)."""
    import torch_kvoffload
    from torch_kvoffload.integrations.hf.pd import decode_role

    try:
        model = load_hf_side(case["dir"], rank, world)
        pd = {**case["pd"], "role": "decode"}
        cfg = {"sparse": case.get("decode_sparse", {}), "block_size": case["block_size"], "pd": pd}
        refused = _refusal(model, {**cfg, "pd": {**pd, "decode_tp_size": 1}}) if world > 1 else None
        model = torch_kvoffload.offload(model, cfg)
        role = decode_role(model)
        ids, mask = case["ids"], case["mask"]
        S = ids.shape[1]
        tickets = [t.to_dict() for t in role.expect(ids, mask, max_tokens=S + case["new"])]
        if rank == 0:
            for _ in range(pd["prefill_tp_size"]):
                tickets_q.put(tickets)
        first = torch.tensor(first_q.get(timeout=case["deadline_s"]), dtype=ids.dtype)
        cache = role.wait(timeout=case["verdict_s"])
        recv = role.receiver.counters.snapshot()
        full = torch.cat([ids, first[:, None]], dim=1)
        full_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model.generate(input_ids=full, attention_mask=full_mask, cache=cache,
                             max_new_tokens=case["new"] - 1, do_sample=False)  # fmt: skip
        out_q.put(("decode", rank, {"tokens": out[:, S:].tolist(), "receiver": recv, "tickets": tickets,
                                    "tp_rank": role.receiver.tp_rank, "stats": torch_kvoffload.stats(model),
                                    "refused": refused}))  # fmt: skip
    except BaseException:
        out_q.put(("decode", rank, {"error": traceback.format_exc()}))


def run_hf_sides(case: dict, p_tp: int, d_tp: int, deadline_s: float) -> dict[tuple[str, int], dict]:
    """Start a prefill side of ``p_tp`` ranks and a decode side of ``d_tp`` ranks (two gloo groups) on
    ``case``; return each rank's result by ``(side, rank)`` — what came within ``deadline_s`` (a rank that
    failed reports its traceback as ``"error"``; the first error ends the wait)."""
    ctx = hf_context()
    tickets_q, first_q, out_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = []
    results: dict[tuple[str, int], dict] = {}
    deadline = time.monotonic() + deadline_s
    try:
        args = (case, tickets_q, first_q, out_q)
        stores = []
        for fn, world in ((hf_decode_rank, d_tp), (hf_prefill_rank, p_tp)):
            started, store = start_gloo_group(ctx, fn, world, *args, timeout_s=deadline_s)
            procs += started
            stores.append(store)
        while len(results) < p_tp + d_tp:
            try:
                side, rank, out = out_q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            results[(side, rank)] = out
            if "error" in out:
                break
    finally:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()) if len(results) == p_tp + d_tp else 0)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(process_s(HF_PRELOAD))
        for p in procs:  # a killed rank leaves its exports (prefill) or its shared host pool (decode)
            for path in glob.glob(f"/dev/shm/kvoffload-pd-{p.pid}-*") + glob.glob(
                f"/dev/shm/kvoffload-pool-{p.pid}-*"
            ):
                os.unlink(path)
    return results


#: the timeout DecodeRole.wait is given over stub receivers: they never wait (a failure is raised at once),
#: the value only reaches the error messages
STUB_WAIT_S = 1.0


class _StubReceiver:
    """A decode rank's receiver whose requests end as told: ``fail`` is raised by ``wait_request``,
    ``state`` reports ``state``."""

    def __init__(self, fail: BaseException | None, state: str = "done") -> None:
        self.fail, self._state = fail, state

    def wait_request(self, request_id: int, timeout: float | None = None) -> None:
        if self.fail is not None:
            raise self.fail

    def state(self, request_id: int) -> str:
        return self._state

    def release(self, request_id: int) -> None:
        pass

    def close(self) -> None:
        pass


#: What rank 1 of :func:`wait_agreement_rank`'s decode side meets, by case (rank 0's transfers succeed).
WAIT_FAULTS = {
    "none": (None, "done"),
    "failed": ("PDTransferError", "done"),
    "timeout": ("TimeoutError", "done"),
    "failed-state": (None, "failed"),
}


def wait_agreement_rank(rank: int, world: int, out_q) -> None:
    """Decode TP rank body: :meth:`DecodeRole.wait` over this gloo group (the decode TP group) with stub
    receivers — rank 1 meets each :data:`WAIT_FAULTS` case in turn, the others succeed; reports per case
    ``(case, rank, outcome)``, the outcome ``"ok"`` or ``"<ErrorType>: <message>"``."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from torch_kvoffload.integrations.hf.pd import DecodeRole
    from torch_kvoffload.kv.spec import TensorParallel
    from torch_kvoffload.pd import PDConfig, PDTransferError

    tp = TensorParallel(world, rank, tuple(range(world)), group=dist.group.WORLD)
    session = SimpleNamespace(config=SimpleNamespace(sparse=SimpleNamespace(indexer_dtype="float")),
                              spec=SimpleNamespace(tp=tp))  # fmt: skip
    role = DecodeRole(session, PDConfig(role="decode", prefill_tp_size=world, decode_tp_size=world))
    errors = {"PDTransferError": PDTransferError, "TimeoutError": TimeoutError}
    for case, (error, state) in WAIT_FAULTS.items():
        fail = errors[error](f"rank {rank} lost request 7 ({case})") if error and rank == 1 else None
        role.receiver = _StubReceiver(fail, state if rank == 1 else "done")
        role._requests, role.cache = [7, 8], f"cache of {case}"
        try:
            outcome = "ok" if role.wait(timeout=STUB_WAIT_S) == role.cache else "wrong cache"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        out_q.put((case, rank, outcome))

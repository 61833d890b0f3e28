"""Prefill / decode behaviour in one process (threads): the multi-connector's ordering, the buffer reuse
gate (one and two decode DP ranks), request vs buffer completion, sends after the layer's writes, the
handshake timeout, stale destinations, argument validation, the sender's completion bookkeeping."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import support.pd_helpers as h
import torch

from torch_kvoffload._utils import free_port
from torch_kvoffload.pd import (
    DecodeReceiver,
    FileRendezvous,
    HandshakeError,
    PDTransferError,
    PrefillMultiConnector,
    PrefillSender,
    ReadFailedError,
    ShmTransport,
    TransferTicket,
    TransportError,
    all_ranks_ready,
)
from torch_kvoffload.pd.messages import LayerReady
from torch_kvoffload.pd.prefill_state import LayerAnswers, RequestTrackers
from torch_kvoffload.pd.rendezvous import decode_key
from torch_kvoffload.store.local import LocalKVStore
from torch_kvoffload.transfer import TransferError, TransferStream

#: How long a request's verdict may take with the test configuration (:func:`pd_helpers.verdict_s`), the
#: slowest injected read (0.5 s) counted as every layer's work.
VERDICT_S = h.verdict_s(h.config("decode"), layer_work_s=0.5)


class RecordingStore(LocalKVStore):
    def __init__(self, *a, log, **kw) -> None:
        super().__init__(*a, **kw)
        self.log = log

    def batch_put_blocks(self, keys, layout, blocks) -> None:
        self.log.append(("save", keys[0]))
        super().batch_put_blocks(keys, layout, blocks)


def _slow_receiver(slow_layers: dict[int, float], done_at: dict):
    """A receiver whose bulk read of the given layers takes longer (while it holds the request locks)."""

    class Slow(DecodeReceiver):
        def _read(self, peer, ops, layer):
            time.sleep(slow_layers.get(layer, 0.0))
            out = super()._read(peer, ops, layer)
            done_at.setdefault(layer, time.monotonic())
            return out

    return Slow


@pytest.fixture
def setup(tmp_path):
    """A decode rank and a prefill rank in this process, factory-style."""
    made = []

    def make(
        *,
        decode_cls=None,
        sender_cls=None,
        shared=2,
        independent=(0,),
        store=None,
        requests=h.REQUESTS,
        sender_first=False,
        **kw,
    ):
        cfg_kw = dict(transport="shm", prefill_tp_size=1, decode_tp_size=1, kv_port=free_port(), **kw)
        rdv = str(tmp_path / "rdv")
        pool, indexers, recvs = h.make_decode(h.config("decode", **cfg_kw), rdv, decode_cls)
        conn, sender, rt, tr = h.make_prefill_rank(
            h.config("prefill", **cfg_kw),
            0,
            rdv,
            sender_cls,
            shared=shared,
            independent=independent,
            store=store,
            sender_first=sender_first,
        )
        made.append((recvs, sender, rt, tr, pool))
        tickets = h.make_tickets(pool, recvs, requests)
        return SimpleNamespace(
            conn=conn, sender=sender, rt=rt, recv=recvs[0], pool=pool, idx=indexers[0], tickets=tickets
        )

    yield make
    for recvs, sender, rt, tr, pool in made:
        sender.close()
        rt.close()
        tr.close()
        for r in recvs:
            r.close()
        pool.close()


@pytest.mark.parametrize("sender_first", [False, True])
def test_provider_is_called_before_the_host_save_whatever_the_order(setup, sender_first: bool) -> None:
    log: list = []

    class LoggingSender(PrefillSender):
        def provider(self, slot, layer):
            log.append(("provider", layer))
            return super().provider(slot, layer)

    s = setup(sender_cls=LoggingSender, store=RecordingStore(1 << 24, log=log), sender_first=sender_first)
    conn, sender, rt, tickets = s.conn, s.sender, s.rt, s.tickets
    assert conn.order[0] is sender and conn.order[-1] is rt
    h.run_prefill(conn, tickets)
    for t in tickets:
        conn.wait_request(t.request_id, timeout=VERDICT_S)
    kinds = [k for k, _ in log]
    # per layer: the provider, then the save (only full blocks are saved)
    provider_layers = [x for k, x in log if k == "provider"]
    assert provider_layers == list(range(h.L))
    for layer in range(h.L):
        p = log.index(("provider", layer))
        saves = [i for i, (k, key) in enumerate(log) if k == "save" and f"/{layer}/" in key]
        assert saves and min(saves) > p
    assert kinds[0] == "provider"


def test_multi_connector_rejects_bad_compositions(setup) -> None:
    s = setup()
    sender = s.sender
    rt = s.rt
    with pytest.raises(ValueError, match="one LayerwiseOffloadRuntime and at least one PrefillSender"):
        PrefillMultiConnector([rt])
    with pytest.raises(ValueError, match="2 runtime"):
        PrefillMultiConnector([rt, rt, sender])
    with pytest.raises(ValueError, match="str"):
        PrefillMultiConnector([rt, sender, "store"])


def test_buffer_reuse_waits_for_the_decode_read(setup) -> None:
    done_at: dict = {}
    # one shared buffer, no independent layer: layer L+1 reuses layer L's physical buffer
    s = setup(decode_cls=_slow_receiver({1: 0.4}, done_at), shared=1, independent=())
    conn = s.conn
    recv = s.recv
    tickets = s.tickets
    entered: dict = {}
    h.run_prefill(conn, tickets, on_layer=lambda layer: entered.setdefault(layer, time.monotonic()))
    assert entered[2] >= done_at[1]  # layer 2 entered its buffer only after decode read layer 1
    for t in tickets:
        recv.wait_request(t.request_id, timeout=VERDICT_S)
        assert recv.state(t.request_id) == "done"


def test_request_completion_is_tracked_apart_from_buffer_completion(setup) -> None:
    done_at: dict = {}
    s = setup(decode_cls=_slow_receiver({h.L - 1: 0.5}, done_at))
    conn = s.conn
    sender = s.sender
    recv = s.recv
    pool = s.pool
    idx = s.idx
    tickets = s.tickets
    h.run_prefill(conn, tickets)  # end_forward does not wait for the remote reads
    rid = tickets[0].request_id
    assert sender.request_state(rid) == "pending" and recv.state(rid) == "pending"
    sender.wait_request(rid, timeout=VERDICT_S)
    recv.wait_request(rid, timeout=VERDICT_S)
    assert sender.request_state(rid) == "done"
    assert all_ranks_ready([recv.state(rid)])
    # bit for bit, against the independently generated KV
    t = tickets[0]
    for layer in range(h.L):
        want = h.block_data(rid, layer, 0, len(t.main_blocks))
        assert torch.equal(h.bits(pool.kv_c(layer)[list(t.main_blocks)]), h.bits(want))
        ib = list(t.parts[0].indexer_blocks)
        assert torch.equal(h.bits(idx[layer][1][ib]), h.bits(h.block_data(rid, layer, 3, len(ib))))


def test_no_handshake_reply_times_out(tmp_path) -> None:
    import zmq

    port = free_port()
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts the connection, never answers
    silent.bind(f"tcp://127.0.0.1:{port}")
    try:
        rdv = FileRendezvous(str(tmp_path / "rdv"))
        rdv.publish(decode_key(port, 0, 0), {"endpoint": f"tcp://127.0.0.1:{port}"})
        cfg = h.config("prefill", transport="shm", kv_port=port, handshake_timeout_s=1.0)
        _conn, sender, rt, tr = h.make_prefill_rank(cfg, 0, str(tmp_path / "rdv"))
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match=r"no HELLO_ACK .* within 1\.0 s"):
            sender.connect(0)
        elapsed = time.monotonic() - t0
        assert 0.9 * cfg.handshake_timeout_s <= elapsed < 3 * cfg.handshake_timeout_s
        sender.close()
        rt.close()
        tr.close()
    finally:
        silent.close(0)
        ctx.term()


def test_never_advertised_decode_is_a_handshake_error(tmp_path) -> None:
    cfg = h.config("prefill", transport="shm", kv_port=free_port(), handshake_timeout_s=0.3)
    _conn, sender, rt, tr = h.make_prefill_rank(cfg, 0, str(tmp_path / "rdv"))
    with pytest.raises(HandshakeError, match="never advertised"):
        sender.connect(0)
    rt.close()
    tr.close()


def test_stale_generation_never_lands_in_a_reused_destination(setup) -> None:
    s = setup(requests=[(5, 8)])
    conn = s.conn
    sender = s.sender
    recv = s.recv
    pool = s.pool
    tickets = s.tickets
    old = tickets[0]
    recv.release(5)  # the destination is handed out again, to a new request
    pool.free(5)
    new = h.make_tickets(pool, [recv], [(9, 8)])[0]
    assert new.main_blocks == old.main_blocks  # the same pool blocks
    with pytest.raises(TransferError, match=r"generation .* not expected"):
        h.run_prefill(conn, [old])
        sender.wait_request(5, timeout=VERDICT_S)
    assert int(pool.kv_c(0)[list(new.main_blocks)].abs().sum()) == 0
    assert recv.state(9) == "pending"


def test_release_waits_for_a_read_in_flight(setup) -> None:
    done_at: dict = {}
    s = setup(decode_cls=_slow_receiver({0: 0.5}, done_at), requests=[(5, 8)])
    conn = s.conn
    sender = s.sender
    recv = s.recv
    tickets = s.tickets
    raised: list = []

    def run() -> None:
        try:
            h.run_prefill(conn, tickets)
        except TransferError as exc:  # later layers of a released request are refused
            raised.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    time.sleep(0.3)  # layer 0 is being read now
    t0 = time.monotonic()
    recv.release(5)
    released = time.monotonic()
    assert done_at.get(0) is not None and done_at[0] <= released  # the read finished before release returned
    assert released - t0 > 0.05
    th.join(VERDICT_S)
    assert raised and "not expected" in str(raised[0])
    with pytest.raises(PDTransferError):
        sender.wait_request(5, timeout=VERDICT_S)


def test_argument_validation_before_anything_moves(setup) -> None:
    s = setup(requests=[(5, 8)])
    sender = s.sender
    recv = s.recv
    pool = s.pool
    tickets = s.tickets
    with pytest.raises(ValueError, match="need 2 main blocks"):
        recv.expect(6, 8, [0])
    with pytest.raises(ValueError, match="already expected"):
        recv.expect(5, 8, list(tickets[0].main_blocks), list(tickets[0].parts[0].indexer_blocks))
    with pytest.raises(ValueError, match="indexer blocks"):
        recv.expect(6, 8, [30, 31], [1])
    with pytest.raises(ValueError, match="prefill blocks"):
        sender.begin_forward(tickets, [[0]])
    bad = TransferTicket(5, 8, 0, tickets[0].main_blocks, ())
    with pytest.raises(ValueError, match="parts"):
        sender.begin_forward([bad], [[0, 1]])
    with pytest.raises(ValueError, match="role='decode'"):
        DecodeReceiver(h.config("prefill"), pool=pool, compat=h.compat())
    with pytest.raises(ValueError, match="does not describe the destinations"):
        DecodeReceiver(h.config("decode", kv_port=free_port()), pool=pool, compat=h.compat(), indexer=None)


class FlakyShm(ShmTransport):
    """An shm transport whose first ``failures`` reads fail."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures, self.reads = failures, 0

    def _read(self, peer, ops) -> None:
        self.reads += 1
        if self.reads <= self.failures:
            raise TransportError(f"injected read failure {self.reads}")
        super()._read(peer, ops)


@pytest.mark.parametrize(("failures", "retries", "ok"), [(2, 2, True), (3, 2, False), (1, 0, False)])
def test_bounded_read_retries(tmp_path, failures: int, retries: int, ok: bool) -> None:
    from torch_kvoffload.sparse import HostKVPool

    port = free_port()
    rdv = str(tmp_path / "rdv")
    pool = HostKVPool.create(h.L, h.POOL_BLOCKS, h.BS, h.R, h.P, h.KV_DTYPE)
    idx = [tuple(torch.zeros(h.IDX_BLOCKS, h.BS, *r, dtype=d) for r, d in h.IDX_ROWS) for _ in range(h.L)]
    flaky = FlakyShm(failures)
    dcfg = h.config("decode", kv_port=port, read_retries=retries)
    recv = DecodeReceiver(
        dcfg, pool=pool, compat=h.compat(), indexer=idx, transport=flaky, rendezvous=FileRendezvous(rdv)
    )
    conn, sender, rt, tr = h.make_prefill_rank(
        h.config("prefill", kv_port=port, read_retries=retries), 0, rdv
    )
    try:
        tickets = h.make_tickets(pool, [recv], [(5, 8)])
        if ok:
            h.run_prefill(conn, tickets)
            sender.wait_request(5, timeout=VERDICT_S)
            recv.wait_request(5, timeout=VERDICT_S)
            assert recv.counters.get("read_retries") == failures
        else:
            with pytest.raises(
                TransferError, match=r"read failed after \d+ retries: .*injected read failure"
            ):
                h.run_prefill(conn, tickets)
                sender.wait_request(5, timeout=VERDICT_S)
            assert recv.state(5) == "failed"
            assert flaky.reads >= retries + 1
    finally:
        sender.close()
        rt.close()
        tr.close()
        recv.close()
        flaky.close()
        pool.close()


def test_port_in_use_is_a_clear_error_and_leaks_nothing(tmp_path) -> None:
    import zmq

    port = free_port()
    ctx = zmq.Context()
    busy = ctx.socket(zmq.ROUTER)
    busy.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(OSError, match=f"cannot bind tcp://127.0.0.1:{port}"):
            h.make_decode(h.config("decode", kv_port=port), str(tmp_path / "rdv"))
    finally:
        busy.close(0)
        ctx.term()


def _mooncake_missing() -> str | None:
    try:
        import mooncake.engine  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mooncake TransferEngine not usable: {exc}"
    return None


@pytest.mark.skipif(_mooncake_missing() is not None, reason=_mooncake_missing() or "")
def test_registered_existing_buffers_transfer_over_mooncake(tmp_path) -> None:
    from torch_kvoffload.layerwise import LayerwiseOffloadRuntime, allocate_layer_buffers, plan_layer_buffers
    from torch_kvoffload.pd import make_transport, register_layer_buffers

    port = free_port()
    rdv = str(tmp_path / "rdv")
    pcfg = h.config("prefill", transport="mooncake", kv_port=port)
    pool, indexers, recvs = h.make_decode(h.config("decode", transport="mooncake", kv_port=port), rdv)
    plan = plan_layer_buffers(h.specs(), 2, (0,))
    buffers = allocate_layer_buffers(plan, "cpu")  # a session's own buffers: registered, not reallocated
    transport = make_transport(pcfg, rank_name="p0")
    assert register_layer_buffers(buffers, transport) is buffers
    rt = LayerwiseOffloadRuntime(plan, buffers, LocalKVStore(1 << 24), model_id="tiny-dsa")
    sender = PrefillSender(pcfg, p_rank=0, buffers=buffers, transport=transport, compat=h.compat(),
                           rendezvous=FileRendezvous(rdv))  # fmt: skip
    try:
        tickets = h.make_tickets(pool, recvs, h.REQUESTS)
        h.run_prefill(PrefillMultiConnector([sender, rt]), tickets)
        for t in tickets:
            sender.wait_request(t.request_id, timeout=VERDICT_S)
            recvs[0].wait_request(t.request_id, timeout=VERDICT_S)
            for layer in range(h.L):
                want = h.block_data(t.request_id, layer, 1, len(t.main_blocks))
                assert torch.equal(h.bits(pool.k_pe(layer)[list(t.main_blocks)]), h.bits(want))
                ib = list(t.parts[0].indexer_blocks)
                got = indexers[0][layer][0][torch.tensor(ib).to(indexers[0][layer][0].device)]
                assert torch.equal(h.bits(got), h.bits(h.block_data(t.request_id, layer, 2, len(ib))))
        with pytest.raises(ValueError, match="export_layer_buffers"):
            register_layer_buffers(buffers, ShmTransport())
    finally:
        sender.close()
        rt.close()
        transport.close()
        recvs[0].close()
        pool.close()


@pytest.mark.parametrize(
    ("p_layers", "d_layers", "ok"), [((1, 3, 5), (1, 3, 5), True), (None, (1, 3, 5), False)]
)
def test_layers_without_indexer(tmp_path, p_layers, d_layers, ok: bool) -> None:
    """Only some layers carry an indexer; a side that has one where the other has none fails that layer."""
    port = free_port()
    rdv = str(tmp_path / "rdv")
    pool, indexers, recvs = h.make_decode(h.config("decode", kv_port=port), rdv, indexer_layers=d_layers)
    conn, sender, rt, tr = h.make_prefill_rank(
        h.config("prefill", kv_port=port), 0, rdv, indexer_layers=p_layers
    )
    try:
        tickets = h.make_tickets(pool, recvs, [(5, 8), (6, 3)])
        if not ok:
            with pytest.raises(
                TransferError, match=r"indexer metadata: block bytes .* the destination has no indexer"
            ):
                h.run_prefill(conn, tickets)
                sender.wait_request(5, timeout=VERDICT_S)
            assert recvs[0].state(5) == "failed"
            return
        h.run_prefill(conn, tickets)
        for t in tickets:
            recvs[0].wait_request(t.request_id, timeout=VERDICT_S)
            n = len(t.main_blocks)
            for layer in range(h.L):
                got = pool.kv_c(layer)[list(t.main_blocks)]
                assert torch.equal(h.bits(got), h.bits(h.block_data(t.request_id, layer, 0, n)))
                if layer in d_layers:
                    ib = torch.tensor(t.parts[0].indexer_blocks)
                    for c, buf in enumerate(indexers[0][layer]):
                        want = h.block_data(t.request_id, layer, 2 + c, n)
                        assert torch.equal(h.bits(buf[ib.to(buf.device)]), h.bits(want))
                else:
                    assert indexers[0][layer] is None
    finally:
        sender.close()
        rt.close()
        tr.close()
        recvs[0].close()
        pool.close()


# ------------------------------------------------------------------------------- two decode DP ranks
@pytest.fixture
def two_dp(tmp_path):
    """One prefill rank (one shared layer buffer: layer L+1 reuses layer L's) sending request 5 to decode
    DP rank 0 and request 6 to DP rank 1, each DP rank with its own host pool; factory-style."""
    made = []

    def make(*, decode_cls=(None, None)):
        cfg_kw = dict(
            transport="shm", prefill_tp_size=1, decode_tp_size=1, decode_dp_size=2, kv_port=h.free_port_run(2)
        )
        rdv = str(tmp_path / "rdv")
        ranks = [
            h.make_decode(h.config("decode", **cfg_kw), rdv, cls, dp_rank=dp)
            for dp, cls in enumerate(decode_cls)
        ]
        conn, sender, rt, tr = h.make_prefill_rank(
            h.config("prefill", **cfg_kw), 0, rdv, shared=1, independent=()
        )
        made.append((ranks, sender, rt, tr))
        tickets = [
            t
            for dp, (pool, _idx, recvs) in enumerate(ranks)
            for t in h.make_tickets(pool, recvs, [(5 + dp, 8 + 5 * dp)], dp_rank=dp)
        ]
        return SimpleNamespace(conn=conn, sender=sender, ranks=ranks, tickets=tickets)

    yield make
    for ranks, sender, rt, tr in made:
        sender.close()
        rt.close()
        tr.close()
        for pool, _idx, recvs in ranks:
            for r in recvs:
                r.close()
            pool.close()


def test_a_layer_sent_to_two_decode_dp_ranks_waits_for_both_reads(two_dp) -> None:
    done_at: dict = {}
    s = two_dp(decode_cls=(None, _slow_receiver({1: 0.4}, done_at)))
    entered: dict = {}
    h.run_prefill(s.conn, s.tickets, on_layer=lambda layer: entered.setdefault(layer, time.monotonic()))
    assert entered[2] >= done_at[1]  # layer 2 entered the buffer only after the slow DP rank read layer 1
    for t, (pool, idx, recvs) in zip(s.tickets, s.ranks, strict=True):
        recvs[0].wait_request(t.request_id, timeout=VERDICT_S)
        s.sender.wait_request(t.request_id, timeout=VERDICT_S)
        assert recvs[0].state(t.request_id) == "done" and s.sender.request_state(t.request_id) == "done"
        ib = list(t.parts[0].indexer_blocks)
        for layer in range(h.L):
            want = h.block_data(t.request_id, layer, 0, len(t.main_blocks))
            assert torch.equal(h.bits(pool.kv_c(layer)[list(t.main_blocks)]), h.bits(want))
            assert torch.equal(
                h.bits(idx[0][layer][1][ib]), h.bits(h.block_data(t.request_id, layer, 3, len(ib)))
            )


def test_a_layer_fails_at_the_first_decode_dp_rank_that_fails_it(two_dp) -> None:
    """DP rank 1 fails layer 0 while DP rank 0 is still reading it: the layer's event fails at once."""

    class Failing(DecodeReceiver):
        def _read(self, peer, ops, layer):
            raise TransportError("injected read failure")

    slow_s = 3.0
    s = two_dp(decode_cls=(_slow_receiver({0: slow_s}, {}), Failing))
    tables, _ = h.prefill_tables(0, s.tickets)
    s.sender.begin_forward(s.tickets, tables)
    try:
        t0 = time.monotonic()
        event = s.sender.provider(s.sender.buffers.plan.slot_of[0], 0)
        with pytest.raises(TransferError, match="injected read failure"):
            event.wait(timeout=slow_s / 2)  # a TimeoutError if it waited for DP rank 0's read
        assert time.monotonic() - t0 < slow_s
        assert isinstance(event.error, ReadFailedError)
        assert s.sender.request_state(6) == "failed" and s.sender.request_state(5) == "pending"
    finally:
        s.sender.end_forward()


def test_layer_ready_leaves_only_after_the_layers_writes(setup, monkeypatch) -> None:
    """On an accelerator a layer's writes may still run when it is published: its LAYER_READY waits for
    them (here: compute events that complete when the test says so, the later layer's first)."""
    import torch_kvoffload.pd.prefill as prefill_module

    arrived: list[int] = []

    class Recording(DecodeReceiver):
        def _on_message(self, peer, msg):
            if isinstance(msg, LayerReady):
                arrived.append(msg.layer)
            super()._on_message(peer, msg)

    s = setup(decode_cls=Recording, requests=[(5, 8)])
    gates = [threading.Event(), threading.Event()]
    writers = [TransferStream(f"writes-{i}", device=torch.device("cpu")) for i in range(2)]
    writes = iter([w.submit(g.wait) for w, g in zip(writers, gates, strict=True)])
    monkeypatch.setattr(prefill_module, "record_compute_event", lambda: next(writes))
    tables, _ = h.prefill_tables(0, s.tickets)
    s.sender.begin_forward(s.tickets, tables)
    try:
        slot_of = s.sender.buffers.plan.slot_of
        events = [s.sender.provider(slot_of[layer], layer) for layer in range(2)]
        time.sleep(0.3)
        assert arrived == [] and not any(e.query() for e in events)
        gates[1].set()  # layer 1's writes finish first
        time.sleep(0.3)
        assert 0 not in arrived and not events[0].query()
        gates[0].set()
        for e in events:
            e.wait(VERDICT_S)
        assert sorted(arrived) == [0, 1]
    finally:
        for g in gates:
            g.set()
        for w in writers:
            w.close()
        s.sender.end_forward()


# ------------------------------------------------------------------------------------- bookkeeping
def test_layer_answers_complete_after_every_read_and_fail_at_the_first_failure() -> None:
    ok = LayerAnswers(2)
    ok.read()
    assert not ok.event.query()
    ok.read()
    assert ok.event.query() and ok.event.error is None
    first, second = ReadFailedError("first"), ReadFailedError("second")
    bad = LayerAnswers(3)
    bad.read()
    bad.failed(first)
    assert bad.event.query() and bad.event.error is first  # no waiting for the other peers
    bad.failed(second)
    bad.read()
    assert bad.event.error is first


def test_request_trackers_complete_fail_and_time_out() -> None:
    t = RequestTrackers("sender", num_layers=2)
    t.start([1, 2, 3])
    assert t.layer_read([1, 2], 0) == 0
    assert t.layer_read([1, 2], 1) == 2  # both complete with their last layer
    assert (t.state(1), t.state(3)) == ("done", "pending")
    t.wait_request(1, timeout=0)
    err = ReadFailedError("layer 0 of request 3")
    assert t.fail([1, 3], err) == 1  # a completed request stays done
    assert (t.state(1), t.state(3)) == ("done", "failed")
    with pytest.raises(PDTransferError, match="request 3 failed: layer 0 of request 3") as info:
        t.wait_request(3, timeout=0)
    assert info.value.__cause__ is err
    t.start([4])
    with pytest.raises(TimeoutError, match=r"request 4: layers \[0, 1\] not acknowledged after 0.05 s"):
        t.wait_request(4, timeout=0.05)
    t.forget(4)
    with pytest.raises(KeyError, match="unknown request 4"):
        t.state(4)

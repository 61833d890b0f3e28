"""Multi-process KVPP workers for the tests (run by ``kvpp_helpers.spawn_gloo``), with their reference.

The workload stands in for a model's attention over a paged cache with three components per layer
(``c_kv``, ``k_pe``, ``index_k``, fp32): per layer, new rows projected from the hidden state are written
at the forward's slots, then each request attends over its full history
``softmax(q·c_kvᵀ + q_pe·k_peᵀ + q_i·index_kᵀ)·c_kv``. The reference runs the same steps with one plain
cache per layer and no KVPP, so every KVPP run's outputs and final owner caches can be compared bit for
bit (one thread per process, the same kernels).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from support.kvpp_helpers import small_spec as spec
from torch_kvoffload.kvpp import KVPPConfig, build_kvpp_runtime, create_kvpp_group
from torch_kvoffload.ops.kvpp import kvpp_prefetch_layer, kvpp_wait_layer

BLOCK_SIZE = 4
DIMS = {"c_kv": 16, "k_pe": 8, "index_k": 8}
HIDDEN = 16
NUM_BLOCKS = 40
SENTINEL = 0xAB


@dataclass(frozen=True)
class Request:
    """One request of a step: its block table, tokens already cached and new tokens this step."""

    blocks: tuple[int, ...]
    cached: int
    new: int


# Step 0 is a first prefill (nothing cached anywhere); later steps mix decodes, a chunked-prefill
# continuation and a new request. Block ids are scattered over the pool (never the last block).
SCRIPT: tuple[tuple[Request, ...], ...] = (
    (Request((3, 4), 0, 7), Request((20,), 0, 2)),
    (Request((3, 4), 7, 1), Request((20,), 2, 1)),
    (Request((3, 4, 5), 8, 2), Request((20,), 3, 1), Request((11, 12, 13), 0, 9)),
    (Request((3, 4, 5), 10, 1), Request((11, 12, 13, 30), 9, 4)),
    (Request((20, 21), 4, 1), Request((11, 12, 13, 30), 13, 1)),
)


def has_history(step: tuple[Request, ...]) -> bool:
    return any(r.cached > 0 for r in step)


def _weights(layer: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + layer)
    out = {f"w_{name}": torch.randn(HIDDEN, dim, generator=g) / 4 for name, dim in DIMS.items()}
    out.update({f"q_{name}": torch.randn(HIDDEN, dim, generator=g) / 4 for name, dim in DIMS.items()})
    out["wo"] = torch.randn(DIMS["c_kv"], HIDDEN, generator=g) / 4
    return out


def initial_cache(layer: int) -> dict[str, torch.Tensor]:
    """What the cache of ``layer`` holds before the script (seeded; stands in for earlier forwards)."""
    g = torch.Generator().manual_seed(layer)
    return {name: torch.randn(NUM_BLOCKS, BLOCK_SIZE, dim, generator=g) for name, dim in DIMS.items()}


def step_input(step: int, tokens: int) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(7000 + step))


def layer_forward(
    layer: int,
    x: torch.Tensor,
    step: tuple[Request, ...],
    cache: dict[str, torch.Tensor],
    hook: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """One layer of the workload over ``cache`` (``{name: [NUM_BLOCKS, BLOCK_SIZE, dim]}``)."""
    w = _weights(layer)
    new = {name: x @ w[f"w_{name}"] for name in DIMS}
    q = {name: x @ w[f"q_{name}"] for name in DIMS}
    if hook is not None:
        hook(layer)  # after the projections, before the first KV read or write
    out = torch.zeros_like(x)
    row = 0
    for req in step:
        table = torch.tensor(req.blocks)
        pos = torch.arange(req.cached + req.new)
        slots = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        for name in DIMS:
            flat = cache[name].view(-1, DIMS[name])
            flat[slots[req.cached :]] = new[name][row : row + req.new]
        rows = {name: cache[name].view(-1, DIMS[name])[slots] for name in DIMS}
        s = sum(q[name][row : row + req.new] @ rows[name].T for name in DIMS)
        visible = pos[None, :] <= pos[req.cached :, None]
        p = s.masked_fill(~visible, float("-inf")).softmax(-1)
        out[row : row + req.new] = (p @ rows["c_kv"]) @ w["wo"]
        row += req.new
    return x + out


def _snapshot(into: dict, cache: dict[str, torch.Tensor]) -> Callable[[int], None]:
    def hook(layer: int) -> None:
        into[layer] = {k: v.clone() for k, v in cache.items()}

    return hook


def reference(layers: list[int]) -> tuple[list, list, dict]:
    """Without KVPP: the outputs per step; per step, each layer's cache as its wait sees it (before the
    layer's writes); and the caches after the script."""
    caches = {layer: initial_cache(layer) for layer in layers}
    outputs, seen = [], []
    for i, step in enumerate(SCRIPT):
        x = step_input(i, sum(r.new for r in step))
        before: dict[int, dict[str, torch.Tensor]] = {}
        for layer in layers:
            x = layer_forward(layer, x, step, caches[layer], _snapshot(before, caches[layer]))
        outputs.append(x)
        seen.append(before)
    return outputs, seen, caches


# ------------------------------------------------------------------------------------------- workers


def _stage_layers(num_layers: int, pp: int, stage: int) -> list[int]:
    base, rem = divmod(num_layers, pp)
    start = stage * base + min(stage, rem)
    return list(range(start, start + base + int(stage < rem)))


class _FailingTransport:
    """Wraps a transport: the broadcast of ``fail_layer`` fails on the transfer thread (on every rank, so
    no collective is left half-issued)."""

    def __init__(self, inner, fail_layer: int) -> None:
        self.inner, self.fail_layer = inner, fail_layer
        self.group, self.device = inner.group, inner.device
        self.submitted: list[int] = []

    def broadcast(self, layer, spans, owner, after=(), *, seconds=None):
        self.submitted.append(layer)
        if layer == self.fail_layer:

            def boom() -> None:
                raise RuntimeError(f"injected failure of layer {layer}")

            return self.inner.stream.submit(boom, after=after)
        return self.inner.broadcast(layer, spans, owner, after, seconds=seconds)

    def all_gather_object(self, obj):
        return self.inner.all_gather_object(obj)

    def exchange(self, values):
        return self.inner.exchange(values)

    def close(self) -> None:
        self.inner.close()


def _wait_and_check(rt, name: str, history: bool, want: dict, covered: set, problems: list, where: tuple):
    """The layer hook of a KVPP run: wait (and prefetch, as a graph pass places it), then check that a
    peer's scratch holds the owner's blocks inside the forward's runs and nothing written outside them."""

    def hook(layer: int) -> None:
        kvpp_wait_layer(name, layer, rt.caches(layer))
        if rt.plan.is_target(layer) and (nxt := rt.plan.next_target(layer)) is not None:
            kvpp_prefetch_layer(name, nxt, rt.caches(nxt))
        if rt.plan.is_persistent(layer) or not history:
            return
        inside = torch.tensor(sorted(covered))
        outside = torch.tensor([b for b in range(NUM_BLOCKS) if b not in covered], dtype=torch.int64)
        for n, v in rt.views(layer).items():
            if not torch.equal(v[inside], want[layer][n][inside]):
                problems.append((*where, layer, n, "differs from the owner's inside the runs"))
            if not bool((v.view(torch.uint8)[outside] == SENTINEL).all()):
                problems.append((*where, layer, n, "written outside the runs"))

    return hook


def kvpp_worker(rank: int, world: int, tp: int, pp: int, num_layers: int, out: str, extra: bool) -> None:
    """Serve :data:`SCRIPT` through a KVPP runtime twice — broadcasting the forward's block runs, then
    whole spans — checking scratch contents after every wait; save what the test compares."""
    from torch_kvoffload.kvpp import BroadcastTransport, KVPPScheduler
    from torch_kvoffload.transfer import TransferError

    assert spec().component_bytes_per_block() == [BLOCK_SIZE * d * 4 for d in DIMS.values()]

    group = create_kvpp_group(dp=1, pp=pp, pcp=1, tp=tp, device=torch.device("cpu"))
    layers = _stage_layers(num_layers, pp, group.pp_stage)
    last_stage = group.pp_stage == pp - 1
    drafts = [num_layers] if last_stage else []
    _, seen, _ = reference(layers + drafts)

    cfg = KVPPConfig(
        enable_kvpp=True,
        tp_size=tp,
        attention="sfa",
        speculative_method="mtp",
        num_speculative_tokens=1,
        wait_timeout_s=60,
    )
    name = f"kvpp-test-{rank}"
    rt = build_kvpp_runtime(
        cfg,
        group,
        dict.fromkeys(layers, spec()),
        num_blocks=NUM_BLOCKS,
        draft_bundles=dict.fromkeys(drafts, spec()),
        name=name,
    )
    sched = rt.scheduler
    all_layers = layers + drafts
    result: dict = {"rank": rank, "layers": layers, "drafts": drafts, "owned": rt.plan.owned}
    result["group_ranks"] = list(group.ranks)
    result["local_rank"] = group.local_rank
    result["persistent_bytes"] = rt.allocation.persistent_bytes
    result["scratch_bytes"] = rt.allocation.scratch_bytes

    for mode in ("runs", "whole"):
        for layer in all_layers:  # the owners' (and drafts') caches start from the seeded contents
            if rt.plan.is_persistent(layer):
                for n, v in rt.views(layer).items():
                    v.copy_(initial_cache(layer)[n])
        for buf in rt.allocation.scratch:
            buf.fill_(SENTINEL)
        outputs, per_forward, runs_seen, problems = [], [], [], []
        for i, step in enumerate(SCRIPT):
            tables = [list(r.blocks) for r in step] if mode == "runs" else None
            before = sched.counters.snapshot()
            sched.begin_forward(has_history(step), tables)
            runs_seen.append(sched.block_runs)
            x = step_input(i, sum(r.new for r in step))
            covered = {b for s, t in (sched.block_runs or [(0, NUM_BLOCKS)]) for b in range(s, t)}
            hook = _wait_and_check(rt, name, has_history(step), seen[i], covered, problems, (mode, i))
            for layer in all_layers:
                x = layer_forward(layer, x, step, rt.views(layer), hook)
                if not rt.plan.is_persistent(layer):
                    rt.allocation.bundle_span(layer).fill_(SENTINEL)  # scratch is transient
            sched.end_forward()
            after = sched.counters.snapshot()
            per_forward.append({k: after[k] - before[k] for k in after})
            outputs.append(x)
        result[mode] = {
            "outputs": outputs,
            "per_forward": per_forward,
            "runs": runs_seen,
            "problems": problems,
            "owned_caches": {
                layer: {n: v.clone() for n, v in rt.views(layer).items()} for layer in rt.plan.owned
            },
            "draft_caches": {layer: {n: v.clone() for n, v in rt.views(layer).items()} for layer in drafts},
        }

    if extra:
        # ranks that disagree on the block count refuse to run, naming what differs
        bad = build_kvpp_runtime(
            cfg, group, dict.fromkeys(layers, spec()), num_blocks=NUM_BLOCKS + group.local_rank
        )
        try:
            bad.scheduler.begin_forward(False)
            result["mismatch"] = ""
        except RuntimeError as exc:
            result["mismatch"] = str(exc)
        bad.close()
        # a broadcast that fails raises from the wait; nothing is submitted after it
        fail_layer = rt.plan.target_layers[2]
        transport = _FailingTransport(BroadcastTransport(group), fail_layer)
        failing = KVPPScheduler(rt.allocation, transport, wait_timeout=60.0)
        failing.begin_forward(True, [[1, 2]])
        raised_at, message = None, ""
        try:
            for layer in rt.plan.target_layers:
                failing.wait_layer(layer)
        except TransferError as exc:
            raised_at, message = layer, str(exc)
        submitted = list(transport.submitted)
        later = ""
        try:
            failing.wait_layer(rt.plan.target_layers[-1])
        except TransferError as exc:
            later = str(exc)
        failing.end_forward()
        failing.close()
        result["failure"] = {
            "fail_layer": fail_layer,
            "raised_at": raised_at,
            "message": message,
            "submitted": submitted,
            "submitted_after": list(transport.submitted),
            "later_error": later,
        }
    rt.close()
    torch.save(result, out.format(rank=rank))


# ------------------------------------------------------------------------------- agreement and errors

AGREEMENT_LAYERS = 3
GOOD_TABLES = [[3, 4], [20]]


def _attempt(call: Callable[[], None]) -> dict:
    """Run ``call``; report the exception it raised (type, message) and how long it took."""
    start = time.perf_counter()
    try:
        call()
    except BaseException as exc:
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - start}
    return {"type": None, "message": "", "seconds": time.perf_counter() - start}


def _good_forward(rt, name: str, tables: list[list[int]]) -> list[str]:
    """A forward with history over ``tables``: after each wait a peer's scratch holds the owner's blocks
    (the owner's cache is :func:`initial_cache`, the same on every rank). Returns what differed."""
    problems = []
    blocks = torch.tensor(sorted({b for t in tables for b in t}))
    rt.scheduler.begin_forward(True, tables)
    for layer in rt.plan.target_layers:
        kvpp_wait_layer(name, layer, rt.caches(layer))
        if not rt.plan.is_persistent(layer):
            for n, v in rt.views(layer).items():
                if not torch.equal(v[blocks], initial_cache(layer)[n][blocks]):
                    problems.append(f"layer {layer} {n}")
            rt.allocation.bundle_span(layer).fill_(SENTINEL)
    rt.scheduler.end_forward()
    return problems


def _agreement_runtime(group, rank: int, wait_timeout: float, tag: str):
    cfg = KVPPConfig(enable_kvpp=True, tp_size=group.size, attention="sfa", wait_timeout_s=wait_timeout)
    name = f"kvpp-{tag}-{rank}"
    rt = build_kvpp_runtime(
        cfg, group, dict.fromkeys(range(AGREEMENT_LAYERS), spec()), num_blocks=NUM_BLOCKS, name=name
    )
    for layer in rt.plan.owned:
        for n, v in rt.views(layer).items():
            v.copy_(initial_cache(layer)[n])
    return rt, name


def agreement_worker(rank: int, world: int, out: str, wait_timeout: float, short_timeout: float) -> None:
    """Forwards whose ranks disagree or fail, each followed by a good forward; then a peer that never
    joins a forward. Saves what each call raised and how long it took."""
    import torch.distributed as dist

    group = create_kvpp_group(dp=1, pp=1, pcp=1, tp=world, device=torch.device("cpu"))
    rt, name = _agreement_runtime(group, rank, wait_timeout, "agree")
    sched = rt.scheduler
    result: dict = {"rank": rank, "first": _good_forward(rt, name, GOOD_TABLES)}
    # different valid tables on the two ranks (each alone would be a fine forward)
    result["tables_differ"] = _attempt(lambda: sched.begin_forward(True, [[1 + rank, 30]]))
    result["after_tables_differ"] = _good_forward(rt, name, GOOD_TABLES)
    # the same tables, but only rank 0 has history (it would broadcast, rank 1 would not)
    result["history_differs"] = _attempt(lambda: sched.begin_forward(rank == 0, [[2]]))
    result["after_history_differs"] = _good_forward(rt, name, [[2], [7, 8]])
    # rank 1 raises on bad input (a block outside the pool); rank 0's input is fine
    bad = [[NUM_BLOCKS]] if rank == 1 else [[5]]
    result["bad_input"] = _attempt(lambda: sched.begin_forward(True, bad))
    result["after_bad_input"] = _good_forward(rt, name, GOOD_TABLES)
    result["counters"] = sched.counters.snapshot()
    rt.close()
    # a peer that does not schedule the forward at all: rank 0 gives up after the configured timeout
    rt, name = _agreement_runtime(group, rank, short_timeout, "absent")
    _good_forward(rt, name, GOOD_TABLES)
    if rank == 0:
        result["absent_peer"] = _attempt(lambda: rt.scheduler.begin_forward(True, GOOD_TABLES))
        result["after_absent_peer"] = _attempt(lambda: rt.scheduler.begin_forward(True, GOOD_TABLES))
    dist.barrier()  # rank 1 comes back only after rank 0 gave up
    if rank == 1:  # and joins with an error: the exchange rank 0 left behind completes, nothing is broadcast
        result["late_peer"] = _attempt(lambda: rt.scheduler.begin_forward(True, [[NUM_BLOCKS]]))
    rt.close()
    # a peer that fails in the middle of a forward (after the exchange): rank 1 stops after layer 0's
    # broadcast; rank 0's wait for a later layer fails after the configured timeout, and so does the
    # collective its transfer thread is in, so closing does not block either (on a fresh group)
    group = create_kvpp_group(dp=1, pp=1, pcp=1, tp=world, device=torch.device("cpu"))
    rt, name = _agreement_runtime(group, rank, short_timeout, "midway")
    _good_forward(rt, name, GOOD_TABLES)
    rt.scheduler.begin_forward(True, GOOD_TABLES)
    if rank == 0:
        result["peer_gone_midway"] = _attempt(
            lambda: [rt.scheduler.wait_layer(layer) for layer in rt.plan.target_layers]
        )
        # the wait itself may time out first (the broadcast stays pending) or see the transfer fail
        result["complete_after_peer_gone"] = _attempt(rt.scheduler.end_forward)
        result["after_peer_gone"] = _attempt(lambda: rt.scheduler.begin_forward(True, GOOD_TABLES))
    result["close_after_peer_gone"] = _attempt(rt.close)
    dist.barrier()  # rank 1 stays alive (its connections open) until rank 0 is done
    torch.save(result, out.format(rank=rank))

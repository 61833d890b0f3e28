"""A small MLA (+ lightning-indexer key) layer stack over a paged cache, for KVPP tests, demo and bench.

Every layer projects the normalised hidden state to absorbed-MLA queries (``q_nope`` in latent space,
``q_pe``), the latent ``c_kv``, the rotary key ``k_pe`` and an indexer key; then calls a hook (where KVPP
waits for the layer's broadcast: after the projections, before the first KV read or write), writes the new
rows into its paged cache ``{c_kv, k_pe, index_k}: [num_blocks, block_size, dim]``, and attends causally
over each request's full history: ``s = scale·(q_nope·c_kvᵀ + q_pe·k_peᵀ) + q_idx·index_kᵀ``,
``out = softmax(s)·c_kv``, projected back to the hidden size. Weights are seeded per layer, so every
process builds the same model. ``run_script`` serves a fixed sequence of prefill / chunked-prefill /
decode steps; ``kvpp_worker`` runs it under KVPP on one rank of a multi-process group.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from torch_kvoffload.kvpp.layout import BundleSpec

__all__ = ["DEFAULT_SCRIPT", "Batch", "ToyMLA", "ToyMLAConfig", "kvpp_worker", "plain_caches", "run_script"]

# Each step: (request id, new tokens). Step 0 is a first prefill (no history anywhere); later steps mix
# decodes, a new request's prefill and a chunked-prefill continuation.
DEFAULT_SCRIPT: tuple[tuple[tuple[int, int], ...], ...] = (
    ((0, 7), (1, 5)),
    ((0, 1), (1, 1)),
    ((0, 1), (1, 1), (2, 6)),
    ((2, 3),),
    ((0, 1), (1, 1), (2, 1)),
)


@dataclass(frozen=True)
class ToyMLAConfig:
    num_layers: int = 4
    num_draft_layers: int = 0
    hidden: int = 32
    heads: int = 2
    kv_lora_rank: int = 16
    rope_dim: int = 8
    index_dim: int = 8
    block_size: int = 4
    seed: int = 0

    def bundle(self) -> BundleSpec:
        return BundleSpec.mla(
            self.block_size, self.kv_lora_rank, self.rope_dim, torch.float32, self.index_dim, torch.float32
        )

    def stage_layers(self, pp: int, stage: int) -> list[int]:
        """Target layers of a PP stage: contiguous, balanced."""
        base, rem = divmod(self.num_layers, pp)
        start = stage * base + min(stage, rem)
        return list(range(start, start + base + int(stage < rem)))

    def draft_layers(self, pp: int, stage: int) -> list[int]:
        """Draft / MTP layers (indices after the target layers) run on the last stage."""
        return (
            list(range(self.num_layers, self.num_layers + self.num_draft_layers)) if stage == pp - 1 else []
        )


@dataclass
class Batch:
    """One forward: ``positions [T]``, cache ``slots [T]`` and per request ``(start, end, blocks, ctx)``."""

    positions: torch.Tensor
    slots: torch.Tensor
    requests: list[tuple[int, int, list[int], int]] = field(default_factory=list)
    has_history: bool = False


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    ang = pos.to(torch.float32)[:, None] * freq[None, :]
    if x.dim() == 3:
        ang = ang[:, None, :]
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class ToyMLA:
    def __init__(self, cfg: ToyMLAConfig) -> None:
        self.cfg = cfg
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        for layer in range(cfg.num_layers + cfg.num_draft_layers):
            g = torch.Generator().manual_seed(cfg.seed * 100003 + layer)

            def w(rows: int, cols: int, g: torch.Generator = g) -> torch.Tensor:
                return torch.randn(rows, cols, generator=g) / math.sqrt(rows)

            h, nh, r, d, i = cfg.hidden, cfg.heads, cfg.kv_lora_rank, cfg.rope_dim, cfg.index_dim
            self.weights[layer] = {
                "wq": w(h, nh * (r + d)),
                "wkv": w(h, r + d + i),
                "wqi": w(h, i),
                "wo": w(nh * r, h),
            }

    def input(self, request: int, positions: range) -> torch.Tensor:
        """Deterministic token embeddings ``[len(positions), hidden]`` (the toy's 'tokens')."""
        rows = []
        for p in positions:
            g = torch.Generator().manual_seed(self.cfg.seed * 7919 + request * 100_003 + p)
            rows.append(torch.randn(self.cfg.hidden, generator=g))
        return torch.stack(rows)

    def layer(
        self,
        layer: int,
        x: torch.Tensor,
        batch: Batch,
        cache: Callable[[int], dict[str, torch.Tensor]],
        hook: Callable[[int, dict[str, torch.Tensor]], None] | None,
    ) -> torch.Tensor:
        cfg, wt = self.cfg, self.weights[layer]
        t, nh, r, d = x.shape[0], cfg.heads, cfg.kv_lora_rank, cfg.rope_dim
        hx = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q = (hx @ wt["wq"]).view(t, nh, r + d)
        q_nope, q_pe = q[..., :r], _rope(q[..., r:], batch.positions)
        kv = hx @ wt["wkv"]
        c_kv, k_pe, k_idx = kv[:, :r], _rope(kv[:, r : r + d], batch.positions), kv[:, r + d :]
        q_idx = hx @ wt["wqi"]
        views = cache(layer)
        if hook is not None:
            hook(layer, views)  # KVPP: the layer's bundle must be here before the first KV read / write
        flat = {name: v.view(-1, v.shape[-1]) for name, v in views.items()}
        flat["c_kv"][batch.slots] = c_kv
        flat["k_pe"][batch.slots] = k_pe
        flat["index_k"][batch.slots] = k_idx
        out = torch.empty(t, nh, r)
        scale = 1.0 / math.sqrt(r + d)
        bs = cfg.block_size
        for start, end, blocks, ctx in batch.requests:
            pos = torch.arange(ctx)
            slots = torch.tensor(blocks, dtype=torch.int64)[pos // bs] * bs + pos % bs
            ckv, kpe, kidx = flat["c_kv"][slots], flat["k_pe"][slots], flat["index_k"][slots]
            s = torch.einsum("thd,sd->ths", q_nope[start:end], ckv) + torch.einsum(
                "thd,sd->ths", q_pe[start:end], kpe
            )
            s = s * scale + (q_idx[start:end] @ kidx.T)[:, None, :] * 0.1
            visible = pos[None, :] <= batch.positions[start:end, None]
            s = s.masked_fill(~visible[:, None, :], float("-inf"))
            out[start:end] = torch.einsum("ths,sd->thd", s.softmax(-1), ckv)
        return x + out.reshape(t, nh * r) @ wt["wo"]


def plain_caches(cfg: ToyMLAConfig, layers: list[int], num_blocks: int) -> dict[int, dict[str, torch.Tensor]]:
    """Caches without KVPP: every layer its own zero-filled ``[num_blocks, block_size, dim]`` tensors."""
    spec = cfg.bundle()
    return {
        layer: {
            c.name: torch.zeros(num_blocks, cfg.block_size, c.dim, dtype=c.dtype) for c in spec.components
        }
        for layer in layers
    }


def make_batches(cfg: ToyMLAConfig, script=DEFAULT_SCRIPT) -> list[Batch]:
    """Turn a script into batches with a deterministic block allocator (same on every process)."""
    bs = cfg.block_size
    lengths: dict[int, int] = {}
    tables: dict[int, list[int]] = {}
    next_block = 0
    batches = []
    for step in script:
        positions, slots, requests = [], [], []
        has_history = False
        for req, n in step:
            done = lengths.get(req, 0)
            has_history |= done > 0
            table = tables.setdefault(req, [])
            while len(table) * bs < done + n:
                table.append(next_block)
                next_block += 1
            start = len(positions)
            for p in range(done, done + n):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            lengths[req] = done + n
            requests.append((start, len(positions), list(table), done + n))
        batches.append(Batch(torch.tensor(positions), torch.tensor(slots), requests, has_history))
    return batches


def blocks_needed(cfg: ToyMLAConfig, script=DEFAULT_SCRIPT) -> int:
    totals: dict[int, int] = {}
    for step in script:
        for req, n in step:
            totals[req] = totals.get(req, 0) + n
    return sum(-(-n // cfg.block_size) for n in totals.values())


def step_inputs(model: ToyMLA, batch: Batch, script_step) -> torch.Tensor:
    parts = []
    for (req, _), (start, end, _, ctx) in zip(script_step, batch.requests, strict=True):
        parts.append(model.input(req, range(ctx - (end - start), ctx)))
    return torch.cat(parts)


def run_script(
    cfg: ToyMLAConfig,
    layers: list[int],
    cache: Callable[[int], dict[str, torch.Tensor]],
    *,
    script=DEFAULT_SCRIPT,
    hook: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
    begin: Callable[[Batch], None] | None = None,
    end: Callable[[Batch], None] | None = None,
    receive: Callable[[torch.Tensor], torch.Tensor] | None = None,
    send: Callable[[torch.Tensor], None] | None = None,
    boundaries: tuple[int, ...] = (),
) -> list[dict[int, torch.Tensor]]:
    """Serve ``script`` through ``layers``; per step, the hidden state after each layer in ``boundaries``
    (and after the last layer, keyed by it). ``receive`` replaces the step input (PP stages > 0)."""
    model = ToyMLA(cfg)
    outputs = []
    for step, batch in zip(script, make_batches(cfg, script), strict=True):
        x = step_inputs(model, batch, step)
        if receive is not None:
            x = receive(x)
        if begin is not None:
            begin(batch)
        recorded = {}
        for layer in layers:
            x = model.layer(layer, x, batch, cache, hook)
            if layer in boundaries:
                recorded[layer] = x.clone()
        recorded[layers[-1]] = x.clone()
        if end is not None:
            end(batch)
        if send is not None:
            send(x)
        outputs.append(recorded)
    return outputs


def reference_outputs(cfg: ToyMLAConfig, script=DEFAULT_SCRIPT, boundaries: tuple[int, ...] = ()):
    """The single-process run without KVPP over every layer (targets then drafts)."""
    layers = list(range(cfg.num_layers + cfg.num_draft_layers))
    caches = plain_caches(cfg, layers, blocks_needed(cfg, script))
    return run_script(cfg, layers, caches.__getitem__, script=script, boundaries=boundaries)


def kvpp_worker(
    rank: int, world: int, cfg_dict: dict, tp: int, pp: int, out_path: str, options: dict
) -> None:
    """One rank of a KVPP run of the toy stack (``spawn_local`` target); saves its results to
    ``out_path.format(rank=rank)``."""
    import torch.distributed as dist

    from torch_kvoffload.kvpp.groups import create_kvpp_group
    from torch_kvoffload.kvpp.runtime import build_kvpp_runtime
    from torch_kvoffload.ops.kvpp import kvpp_prefetch_layer, kvpp_wait_layer

    cfg = ToyMLAConfig(**cfg_dict)
    script = options.get("script", DEFAULT_SCRIPT)
    group = create_kvpp_group(dp=1, pp=pp, pcp=1, tp=tp, device=torch.device("cpu"))
    stage = group.pp_stage
    layers = cfg.stage_layers(pp, stage)
    drafts = cfg.draft_layers(pp, stage)
    spec = cfg.bundle()
    num_blocks = blocks_needed(cfg, script) + options.get("extra_blocks", 0)
    name = f"toy-kvpp-{rank}"
    mismatch = ""
    if options.get("mismatch_check"):  # ranks with different block counts must refuse to run
        bad = build_kvpp_runtime(
            group,
            dict.fromkeys(layers, spec),
            0,
            draft_bundles=dict.fromkeys(drafts, spec),
            num_blocks=num_blocks + group.local_rank,
        )
        try:
            bad.scheduler.schedule_forward(False)
        except RuntimeError as exc:
            mismatch = str(exc)
        bad.close()
    rt = build_kvpp_runtime(
        group,
        dict.fromkeys(layers, spec),
        0,
        draft_bundles=dict.fromkeys(drafts, spec),
        name=name,
        num_blocks=num_blocks,
        wait_timeout=60.0,
    )
    sched = rt.scheduler
    broadcasts_per_step: list[float] = []

    def hook(layer: int, views: dict[str, torch.Tensor]) -> None:
        kvpp_wait_layer(name, layer, list(views.values()))
        nxt = rt.plan.next_target(layer) if rt.plan.is_target(layer) else None
        if nxt is not None:  # as an FX pass would place it: idempotent after the wait's own prefetch
            kvpp_prefetch_layer(name, nxt, list(rt.views(nxt).values()))

    def begin(batch: Batch) -> None:
        sched.schedule_forward(batch.has_history)

    def end(batch: Batch) -> None:
        sched.complete_forward()
        broadcasts_per_step.append(sched.counters.get("broadcasts"))

    prev_rank = rank - tp if stage > 0 else None
    next_rank = rank + tp if stage < pp - 1 else None

    def receive(x: torch.Tensor) -> torch.Tensor:
        buf = torch.empty_like(x)
        dist.recv(buf, src=prev_rank)
        return buf

    def send(x: torch.Tensor) -> None:
        dist.send(x.contiguous(), dst=next_rank)

    start = time.perf_counter()
    outputs = run_script(
        cfg,
        layers + drafts,
        rt.views,
        script=script,
        hook=hook,
        begin=begin,
        end=end,
        receive=receive if prev_rank is not None else None,
        send=send if next_rank is not None else None,
    )
    elapsed = time.perf_counter() - start
    wait_seconds = sched.counters.get("wait_seconds")
    result = {
        "fail_layer": None,
        "rank": rank,
        "stage": stage,
        "group_ranks": list(group.ranks),
        "local_rank": group.local_rank,
        "layers": layers,
        "drafts": drafts,
        "owned": rt.plan.owned,
        "outputs": outputs,
        "broadcasts_per_step": broadcasts_per_step,
        "counters": sched.counters.snapshot(),
        "persistent_bytes": rt.allocation.persistent_bytes,
        "scratch_bytes": rt.allocation.scratch_bytes,
        "allocated_bytes": rt.allocation.allocated_bytes,
        "plan_bytes_per_block": rt.plan.bytes_per_block,
        "plan_allocation_bytes": rt.plan.allocation_bytes(num_blocks),
        "num_blocks": num_blocks,
        "elapsed": elapsed,
        "wait_seconds": wait_seconds,
        "cfg": asdict(cfg),
        "mismatch": mismatch,
    }
    if options.get("fail_target") is not None:  # index among this stage's target layers
        result["fail_layer"] = rt.plan.target_layers[options["fail_target"]]
        result["failure"] = _failure_check(rt, result["fail_layer"], group)
    sched.close()
    torch.save(result, out_path.format(rank=rank))


class _FailingTransport:
    """Wraps a transport: the broadcast of ``fail_layer`` raises on the transfer thread (on every rank,
    so no collective is left half-issued) instead of running."""

    def __init__(self, inner, fail_layer: int) -> None:
        self.inner, self.fail_layer, self.group = inner, fail_layer, inner.group
        self.submitted: list[int] = []

    def broadcast(self, layer, span, owner, after=()):
        self.submitted.append(layer)
        if layer == self.fail_layer:

            def boom() -> None:
                raise RuntimeError(f"injected failure of layer {layer}")

            return self.inner.stream.submit(boom, after=after)
        return self.inner.broadcast(layer, span, owner, after)

    def all_gather_object(self, obj):
        return self.inner.all_gather_object(obj)

    def close(self) -> None:
        self.inner.close()


def _failure_check(rt, fail_layer: int, group) -> dict:
    from torch_kvoffload.device import TransferError
    from torch_kvoffload.kvpp.scheduler import KVPPScheduler
    from torch_kvoffload.kvpp.transport import BroadcastTransport

    transport = _FailingTransport(BroadcastTransport(group), fail_layer)
    sched = KVPPScheduler(rt.allocation, transport, wait_timeout=60.0)
    sched.schedule_forward(True)
    raised_at, message = None, ""
    try:
        for layer in rt.plan.target_layers:
            sched.wait_for_layer(layer)
    except TransferError as exc:
        raised_at, message = layer, str(exc)
    submitted_at_failure = list(transport.submitted)
    later_error = ""
    try:
        sched.wait_for_layer(rt.plan.target_layers[-1])
    except TransferError as exc:
        later_error = str(exc)
    sched.complete_forward()
    sched.close()
    return {
        "raised_at": raised_at,
        "message": message,
        "submitted": submitted_at_failure,
        "submitted_after": list(transport.submitted),
        "later_error": later_error,
    }


def kvpp_jobs_worker(rank: int, world: int, jobs: list[tuple]) -> None:
    """Run several :func:`kvpp_worker` jobs ``(cfg_dict, tp, pp, out_path, options)`` in one set of
    processes (each job creates its own KVPP groups), saving process start-up time."""
    for cfg_dict, tp, pp, out_path, options in jobs:
        kvpp_worker(rank, world, cfg_dict, tp, pp, out_path, options)

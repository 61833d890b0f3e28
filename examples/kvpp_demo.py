"""KVPP on loopback: processes of a TP group share a paged KV cache by layer ownership.

    python examples/kvpp_demo.py            # TP 2
    python examples/kvpp_demo.py --tp 4     # TP 4 (4 processes)
    python examples/kvpp_demo.py --tp 2 --pp 2

Each rank builds its KVPP runtime with ``build_kvpp_runtime``: it owns a contiguous range of its
pipeline stage's layers, keeps only those (plus the local MTP layer) persistently, and receives the others
into two scratch buffers. It then serves a script of prefill / decode / chunked-prefill steps: before
every layer of a forward with history the layer's owner broadcasts the blocks the forward reads (the
union of its block tables, in contiguous runs) — gloo on 127.0.0.1.

The compute is a plain stand-in for attention, not a model: per layer, the new tokens' cache rows are
projected from the hidden state and written at their slots, then each request mixes its hidden state with
its cached rows through a few matmuls and a softmax. The demo checks every rank's outputs against a
single-process run without KVPP (one plain cache per layer) and prints what each rank stored and moved.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist

from torch_kvoffload._utils import free_port
from torch_kvoffload.kvpp import BundleSpec, KVPPConfig, build_kvpp_runtime, create_kvpp_group
from torch_kvoffload.ops import kvpp_wait_layer

BLOCK_SIZE = 4
HIDDEN = 32
SPEC = BundleSpec.mla(BLOCK_SIZE, 32, 8, torch.float32, index_dim=16, index_dtype=torch.float32)
DIMS = {c.name: c.dim for c in SPEC.components}
# (request, new tokens) per step; step 0 is a first prefill (no history: nothing is broadcast)
SCRIPT = (((0, 9), (1, 5)), ((0, 1), (1, 1)), ((0, 1), (1, 1), (2, 7)), ((2, 6),), ((0, 1), (1, 1), (2, 1)))


def make_batches(spare_blocks: int) -> list[dict]:
    """Slots and block tables per step from a simple allocator that interleaves requests' blocks, with
    ``spare_blocks`` unused blocks in between (a pool larger than what the script needs)."""
    lengths: dict[int, int] = {}
    tables: dict[int, list[int]] = {}
    next_block = 0
    batches = []
    for step in SCRIPT:
        slots, requests = [], []
        for req, n in step:
            done = lengths.get(req, 0)
            table = tables.setdefault(req, [])
            while len(table) * BLOCK_SIZE < done + n:
                table.append(next_block)
                next_block += 1 + spare_blocks // 16  # leave gaps: requests do not sit back to back
            for p in range(done, done + n):
                slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            lengths[req] = done + n
            requests.append((req, done, n, list(table)))
        history = any(done > 0 for _, done, _, _ in requests)
        batches.append({"slots": torch.tensor(slots), "requests": requests, "history": history})
    return batches


def num_blocks_needed(batches: list[dict]) -> int:
    return max(b for batch in batches for *_, table in batch["requests"] for b in table) + 1


def weights(layer: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(layer)
    w = {name: torch.randn(HIDDEN, dim, generator=g) / 6 for name, dim in DIMS.items()}
    width = sum(DIMS.values())
    w["q"] = torch.randn(HIDDEN, width, generator=g) / 6
    w["back"] = torch.randn(width, HIDDEN, generator=g) / 6
    return w


def layer_step(layer: int, x: torch.Tensor, caches: dict[str, torch.Tensor], batch: dict) -> torch.Tensor:
    """Write the new rows of ``layer`` at the batch's slots, then mix each request with its cached rows."""
    w = weights(layer)
    for name, view in caches.items():
        view.view(-1, DIMS[name])[batch["slots"]] = x @ w[name]
    out, row = [], 0
    for _, done, n, table in batch["requests"]:
        pos = torch.arange(done + n)
        slots = torch.tensor(table)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        rows = torch.cat([v.view(-1, DIMS[name])[slots] for name, v in caches.items()], dim=-1)
        xr = x[row : row + n]
        scores = (xr @ w["q"]) @ rows.T
        causal = pos[None, :] <= pos[done:, None]
        out.append(xr + torch.tanh(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ rows @ w["back"]))
        row += n
    return torch.cat(out)


def step_input(step: int, batch: dict) -> torch.Tensor:
    return torch.randn(len(batch["slots"]), HIDDEN, generator=torch.Generator().manual_seed(1000 + step))


def stage_layers(num_layers: int, pp: int, stage: int) -> list[int]:
    base, rem = divmod(num_layers, pp)
    start = stage * base + min(stage, rem)
    return list(range(start, start + base + int(stage < rem)))


def serve_plain(layers: list[int], batches: list[dict]) -> list[torch.Tensor]:
    """The run without KVPP: every layer keeps its own zero-initialised cache."""
    n = num_blocks_needed(batches)
    caches = {layer: {k: torch.zeros(n, BLOCK_SIZE, d) for k, d in DIMS.items()} for layer in layers}
    outputs = []
    for i, batch in enumerate(batches):
        x = step_input(i, batch)
        for layer in layers:
            x = layer_step(layer, x, caches[layer], batch)
        outputs.append(x)
    return outputs


def worker(
    rank: int, world: int, tp: int, pp: int, num_layers: int, drafts: int, spare: int, out: str
) -> None:
    group = create_kvpp_group(dp=1, pp=pp, pcp=1, tp=tp, device=torch.device("cpu"))
    layers = stage_layers(num_layers, pp, group.pp_stage)
    draft_layers = list(range(num_layers, num_layers + drafts)) if group.pp_stage == pp - 1 else []
    batches = make_batches(spare)
    cfg = KVPPConfig(
        enable_kvpp=True,
        tp_size=tp,
        attention="sfa",
        speculative_method="mtp" if drafts else None,
        num_speculative_tokens=1 if drafts else 0,
        wait_timeout_s=60,
    )
    name = f"kvpp-demo-{rank}"
    rt = build_kvpp_runtime(
        cfg,
        group,
        dict.fromkeys(layers, SPEC),
        num_blocks=num_blocks_needed(batches) + spare,
        draft_bundles=dict.fromkeys(draft_layers, SPEC),
        name=name,
    )
    outputs = []
    for i, batch in enumerate(batches):
        tables = [table for *_, table in batch["requests"]]
        rt.scheduler.begin_forward(batch["history"], tables)
        x = step_input(i, batch)
        for layer in layers + draft_layers:
            kvpp_wait_layer(name, layer, rt.caches(layer))  # after the projections, before KV reads
            x = layer_step(layer, x, rt.views(layer), batch)
        rt.scheduler.end_forward()
        outputs.append(x)
    torch.save(
        {
            "rank": rank,
            "stage": group.pp_stage,
            "layers": layers + draft_layers,
            "owned": rt.plan.owned,
            "num_blocks": rt.allocation.num_blocks,
            "persistent_bytes": rt.allocation.persistent_bytes,
            "scratch_bytes": rt.allocation.scratch_bytes,
            "counters": rt.counters.snapshot(),
            "outputs": outputs,
            "forwards_with_history": sum(b["history"] for b in batches),
        },
        out.format(rank=rank),
    )
    rt.close()


def _entry(rank: int, world: int, port: int, args: tuple) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        worker(rank, world, *args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--spare-blocks", type=int, default=2048, help="unused blocks (a realistic pool)")
    args = parser.parse_args()

    import torch.multiprocessing as mp

    world = args.tp * args.pp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank{rank}.pt")
        task = (args.tp, args.pp, args.layers, args.draft_layers, args.spare_blocks, out)
        mp.spawn(_entry, args=(world, free_port(), task), nprocs=world, join=True)
        results = [torch.load(out.format(rank=r), weights_only=False) for r in range(world)]

    torch.set_num_threads(1)  # as the ranks: same kernels, same bits
    batches = make_batches(args.spare_blocks)
    bundle = SPEC.bytes_per_block
    print(
        f"world {world} (TP {args.tp} x PP {args.pp}), {args.layers} layers + {args.draft_layers} MTP, "
        f"{results[0]['num_blocks']} blocks of {BLOCK_SIZE} tokens, {bundle} bundle bytes per block"
    )
    header = (
        f"{'rank':>4} {'stage':>5} {'owned':>10} {'no-KVPP B':>10} {'persistent B':>13} {'scratch B':>10} "
        f"{'bcast B':>9} {'whole-span B':>13} {'waited ms':>9}  matches"
    )
    print(header)
    ok = True
    for res in results:
        match = all(
            torch.equal(a, b)
            for a, b in zip(res["outputs"], serve_plain(res["layers"], batches), strict=True)
        )
        ok &= match
        c = res["counters"]
        targets = len(res["layers"]) - (args.draft_layers if res["stage"] == args.pp - 1 else 0)
        plain = len(res["layers"]) * bundle * res["num_blocks"]
        whole = res["forwards_with_history"] * targets * bundle * res["num_blocks"]
        print(
            f"{res['rank']:>4} {res['stage']:>5} {res['owned']!s:>10} {plain:>10} {res['persistent_bytes']:>13} "
            f"{res['scratch_bytes']:>10} {int(c['bytes_broadcast']):>9} {whole:>13} "
            f"{c['wait_seconds'] * 1e3:>9.2f}  {match}"
        )
    print("all ranks match the single-process run without KVPP" if ok else "MISMATCH")
    print(
        "(broadcasts move only the blocks each forward reads; 'whole-span B' is what whole bundles would move)"
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""KVPP on loopback: two (or more) processes share a small MLA stack's KV cache by layer ownership.

    python examples/kvpp_demo.py            # TP 2
    python examples/kvpp_demo.py --tp 4     # TP 4 (4 processes)
    python examples/kvpp_demo.py --tp 2 --pp 2

Each rank builds the same seeded model, owns a contiguous range of layers, and serves a script of
prefill / decode / chunked-prefill steps; before every layer of a forward with history, the layer's owner
broadcasts its bundle into the peers' scratch buffer (gloo on 127.0.0.1). The demo then checks every rank's
hidden states against a single-process run without KVPP and prints what each rank stored and moved.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import asdict

import torch

from torch_kvoffload.kvpp.launch import spawn_local
from torch_kvoffload.kvpp.toy_mla import ToyMLAConfig, kvpp_worker, reference_outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument(
        "--extra-blocks", type=int, default=4096, help="spare blocks beyond the script's (a realistic pool)"
    )
    args = parser.parse_args()

    cfg = ToyMLAConfig(num_layers=args.layers, num_draft_layers=args.draft_layers)
    world = args.tp * args.pp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank{rank}.pt")
        spawn_local(
            kvpp_worker,
            world,
            asdict(cfg),
            args.tp,
            args.pp,
            out,
            {"extra_blocks": args.extra_blocks},
            timeout=300,
        )
        results = [torch.load(out.format(rank=r), weights_only=False) for r in range(world)]

    torch.set_num_threads(1)
    boundaries = tuple(cfg.stage_layers(args.pp, s)[-1] for s in range(args.pp))
    ref = reference_outputs(cfg, boundaries=boundaries)
    bundle = cfg.bundle().bytes_per_block
    print(
        f"world {world} (TP {args.tp} x PP {args.pp}), {cfg.num_layers} layers + {cfg.num_draft_layers} draft, "
        f"{results[0]['num_blocks']} blocks of {cfg.block_size} tokens, {bundle} bundle bytes per block"
    )
    print(
        f"{'rank':>4} {'stage':>5} {'owned':>10} {'no-KVPP B':>10} {'persistent B':>13} {'scratch B':>10} "
        f"{'broadcasts':>10} {'bytes bcast':>11} {'waited ms':>9}  matches"
    )
    ok = True
    for res in results:
        last = (res["layers"] + res["drafts"])[-1]
        match = all(torch.equal(g[last], w[last]) for g, w in zip(res["outputs"], ref, strict=True))
        ok &= match
        c = res["counters"]
        plain = (len(res["layers"]) + len(res["drafts"])) * bundle * res["num_blocks"]
        print(
            f"{res['rank']:>4} {res['stage']:>5} {res['owned']!s:>10} {plain:>10} {res['persistent_bytes']:>13} "
            f"{res['scratch_bytes']:>10} {int(c['broadcasts']):>10} {int(c['bytes_broadcast']):>11} "
            f"{c['wait_seconds'] * 1e3:>9.2f}  {match}"
        )
    print("all ranks match the single-process run" if ok else "MISMATCH")
    print(
        "(broadcasts move whole bundles, every allocated block: traffic grows with the pool, not the tokens)"
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()

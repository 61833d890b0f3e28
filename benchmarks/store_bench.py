"""Host KV store throughput: LocalKVStore (and Mooncake when installed) against a plain-copy baseline.

Moves ``--blocks`` blocks of one MLA layer (``128 tokens x 576 x bf16`` = 144 KiB each) through each path
in one run and reports GB/s and microseconds per block side by side:

* ``copy baseline``: ``dst[i].copy_(src[i])`` into a preallocated buffer — the floor any store pays;
* ``local put`` / ``batch_put`` / ``get`` / ``batch_get``: the embedded store with room for every block;
* ``local get x2 threads``: two threads reading disjoint halves (the copies run outside the lock);
* ``local put, evicting``: the store holds half the blocks, so every put evicts;
* ``mooncake batch_put`` / ``mooncake batch_get``: loopback TCP master, if the package is installed.

Usage: ``python benchmarks/store_bench.py [--blocks 512] [--repeat 5] [--no-mooncake]``.
Writes ``benchmarks/results/store_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from torch_kvoffload.store import LocalKVStore, block_hashes, layer_block_keys

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # mooncake_master: a test service

BLOCK_SHAPE = (128, 576)
DTYPE = torch.bfloat16


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-mooncake", action="store_true")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads (1: no OpenMP fan-out per 144 KiB copy)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)

    n = args.blocks
    src = torch.randn(n, *BLOCK_SHAPE).to(DTYPE)
    dst = torch.empty_like(src)
    block_bytes = src[0].nbytes
    total = n * block_bytes
    keys = layer_block_keys(block_hashes(torch.randint(0, 100_000, (n * 128,)), 128), 0, model_id="bench")
    results: dict[str, float] = {}

    def copy_baseline() -> None:
        for i in range(n):
            dst[i].copy_(src[i])

    store = LocalKVStore(total)

    def put_all(s=store) -> None:
        for i in range(n):
            s.put(keys[i], src[i])

    def get_all() -> None:
        for i in range(n):
            store.get(keys[i], dst[i])

    def batch_get_all() -> None:
        store.batch_get(keys, list(dst.unbind(0)))

    def get_two_threads() -> None:
        def part(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                store.get(keys[i], dst[i])

        threads = [
            threading.Thread(target=part, args=(0, n // 2)),
            threading.Thread(target=part, args=(n // 2, n)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    small = LocalKVStore(total // 2)

    def put_evicting() -> None:
        for i in range(n):
            small.put(keys[i], src[i])

    cases: list[tuple[str, Callable[[], None]]] = [
        ("copy baseline", copy_baseline),
        ("local put", put_all),
        ("local batch_put", lambda: store.batch_put(keys, list(src.unbind(0)))),
        ("local get", get_all),
        ("local batch_get", batch_get_all),
        ("local get x2 threads", get_two_threads),
        ("local put, evicting", put_evicting),
    ]
    mooncake_note = "skipped (--no-mooncake)"
    master = mstore = None
    if not args.no_mooncake:
        try:
            from mooncake_master import MooncakeMaster

            from torch_kvoffload.store.mooncake import MooncakeKVStore

            master = MooncakeMaster().start()
            mstore = MooncakeKVStore(
                total, master_server_addr=master.master_addr, metadata_server=master.metadata_server
            )
            cases.append(("mooncake batch_put", lambda: mstore.batch_put(keys, list(src.unbind(0)))))
            cases.append(("mooncake batch_get", lambda: mstore.batch_get(keys, list(dst.unbind(0)))))
            mooncake_note = "loopback TCP"
        except Exception as exc:  # report and run the rest
            mooncake_note = f"unavailable: {exc}"
            if master is not None:
                master.stop()
                master = None

    try:
        for _, fn in cases:
            fn()  # warm up (and fill the stores for the get cases)
        # rounds interleave the cases so that load from other processes hits every case alike
        for _ in tqdm(range(args.repeat), desc="store bench rounds"):
            for name, fn in cases:
                results[name] = min(results.get(name, float("inf")), _timed(fn))
        dst.zero_()
        get_all()
        assert torch.equal(dst, src), "a get returned wrong bytes"
    finally:
        if mstore is not None:
            mstore.close()
        if master is not None:
            master.stop()

    base = results["copy baseline"]
    rows = []
    print(
        f"\n{n} blocks of {block_bytes} bytes ({total / 2**20:.0f} MiB), best of {args.repeat} interleaved rounds, {args.torch_threads} torch thread(s); mooncake: {mooncake_note}"
    )
    print(f"{'path':<24}{'GB/s':>8}{'us/block':>10}{'x baseline':>12}")
    for name, secs in results.items():
        gbs = total / secs / 1e9
        us = secs / n * 1e6
        rows.append(
            {"path": name, "seconds": secs, "gb_per_s": gbs, "us_per_block": us, "vs_baseline": secs / base}
        )
        print(f"{name:<24}{gbs:>8.2f}{us:>10.1f}{secs / base:>12.2f}")
    out = Path(__file__).parent / "results" / "store_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "blocks": n,
                "block_bytes": block_bytes,
                "repeat": args.repeat,
                "mooncake": mooncake_note,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

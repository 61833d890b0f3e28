"""Throughput of kvoffload::copy_rows / copy_blocks against torch gathers and a plain contiguous copy.

Realistic shapes: one DeepSeek MLA token row is 512 + 64 bf16 values = 1152 bytes; blocks hold 128 rows.
All variants move the same bytes in the same run; ratios are relative to the contiguous copy.

    python benchmarks/copy_bench.py [--rows 65536] [--pool-blocks 4096] [--repeat 15]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, interleaved_medians, write_json

import torch_kvoffload
from torch_kvoffload.device import empty_host
from torch_kvoffload.ops import copy_blocks, copy_rows

ROW = 512 + 64
BLOCK = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64 * 1024, help="rows gathered per call")
    parser.add_argument("--pool-blocks", type=int, default=4096, help="blocks in the source pool")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()

    torch.manual_seed(0)
    n = args.rows
    pool = empty_host((args.pool_blocks, BLOCK, ROW), torch.bfloat16)  # how host pools are allocated
    pool.normal_()
    pool_rows = pool.view(-1, ROW)
    nbytes = n * ROW * pool.element_size()
    dst = torch.empty(n // BLOCK, BLOCK, ROW, dtype=torch.bfloat16)
    dst_rows = dst.view(-1, ROW)
    contiguous_src = pool_rows[:n]
    src_slots = torch.randint(0, pool_rows.shape[0], (n,))
    seq_slots = torch.arange(n)
    scatter_slots = torch.randperm(n)
    gathered = pool_rows[src_slots].contiguous()
    n_blocks = n // BLOCK
    block_map = torch.stack([torch.randperm(args.pool_blocks)[:n_blocks], torch.arange(n_blocks)], 1)
    block_ids = block_map[:, 0].contiguous()

    variants = {
        "contiguous copy_": lambda: dst_rows.copy_(contiguous_src),
        "copy_rows (random gather)": lambda: copy_rows(pool, dst, src_slots, seq_slots),
        "copy_rows (random scatter)": lambda: copy_rows(
            dst, pool[: n // BLOCK * 2], seq_slots, scatter_slots
        ),
        "index_select (random gather)": lambda: torch.index_select(pool_rows, 0, src_slots, out=dst_rows),
        "index_copy_ (random scatter)": lambda: pool_rows[: 2 * n].index_copy_(0, scatter_slots, gathered),
        "copy_blocks (random blocks)": lambda: copy_blocks(pool, dst, block_map),
        "index_select (random blocks)": lambda: torch.index_select(pool, 0, block_ids, out=dst),
    }
    with tqdm(total=args.repeat, desc="copy_bench", unit="round") as progress:
        seconds = interleaved_medians(variants, repeat=args.repeat, progress=progress)

    base = seconds["contiguous copy_"]
    rows = [[name, nbytes / s / 1e9, base / s] for name, s in seconds.items()]
    print(
        f"\n{n} rows x {ROW * 2} B = {nbytes / 2**20:.1f} MiB per call, "
        f"extension={torch_kvoffload.extension_available()}, threads={torch.get_num_threads()}"
    )
    print(format_table(["variant", "GB/s", "x contiguous"], rows))
    ratio = base / seconds["copy_rows (random gather)"]
    print(
        f"\ncopy_rows / contiguous = {ratio:.3f} (goal >= 0.85); "
        f"index_select / contiguous = {base / seconds['index_select (random gather)']:.3f}"
    )
    path = write_json(
        "copy_bench",
        {
            "rows": n,
            "row_bytes": ROW * 2,
            "bytes_per_call": nbytes,
            "extension": torch_kvoffload.extension_available(),
            "results": {
                name: {"seconds": s, "gbps": nbytes / s / 1e9, "vs_contiguous": base / s}
                for name, s in seconds.items()
            },
            "goal": {"copy_rows_vs_contiguous": 0.85, "reached": ratio >= 0.85},
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Accelerator figures of the ops and the sparse decode step (CUDA / NPU; on CPU it says what it skipped).

Four measurements, each timed with device events after warm-up, variants of one case timed in turns:

* ``copy_rows`` / ``copy_blocks`` host → device bandwidth against a contiguous ``copy_`` of the same
  bytes (``cudaMemcpyAsync`` underneath): 64K random 1152-byte rows (576 bf16 = DeepSeek's 512 + 64) from
  a pinned host pool; blocks of 128 such rows for ``copy_blocks``. Target: ≥ 0.8.
* Copy-SFA decode step (``scatter_copy_sparse_mla_attention``: 5 % of the top-2048 rows missed and copied
  from the pinned host pool, then sparse attention over the hot buffer) at 32K and 128K context, against
  dense SDPA over the whole context on the device and against gather (``index_select``) of the selected
  rows + PyTorch attention. Target: faster than both at 32K.
* ``residency_update`` µs per layer at R = 64 decode rows, K = 2048, C = 4096 (LRU), against the Copy-SFA
  step of the same rows (target: under 5 % of a decode step).
* Sparse decode step per layer with offload (residency + Copy-SFA reading the pinned host pool) against
  the same step with the full latent cache on the device (gather from the device cache + sparse attention
  over the selected rows), at 32K context. Target ≥ 0.9 (offload time ratio ≤ 1 / 0.9).

    python benchmarks/device_bench.py [--quick]

Prints a table and writes ``benchmarks/results/device_bench.json`` (and ``$OUT/device_bench.json`` when
``OUT`` is set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from _common import format_table, write_json
from tqdm import tqdm

import torch_kvoffload  # noqa: F401  (registers the ops and the device kernels)
from torch_kvoffload import device as kv_device
from torch_kvoffload.ops import copy_blocks, copy_rows, scatter_copy_sparse_mla_attention
from torch_kvoffload.ops.residency import new_residency_outputs, new_residency_state

H, DC, DR, TOPK, CAP, BLOCK = 16, 512, 64, 2048, 4096, 128


def device_ms(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median milliseconds of each function on the compute stream (device events), timed in turns."""
    for fn in fns.values():
        fn()
        fn()
    torch.accelerator.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {k: statistics.median(v) for k, v in times.items()}


def bandwidth_case(dev: torch.device, rows: int, repeat: int) -> dict[str, float]:
    dt = torch.bfloat16
    pool = torch.randn(rows * 2, DC + DR, dtype=dt).pin_memory()
    dst = torch.empty(rows, DC + DR, dtype=dt, device=dev)
    src_idx = torch.randperm(rows * 2)[:rows].to(dev)
    dst_idx = torch.arange(rows, device=dev)
    contiguous_src = pool[:rows]
    nblk = rows // BLOCK
    pool_blocks = pool.view(-1, BLOCK, DC + DR)
    dst_blocks = dst.view(nblk, BLOCK, DC + DR)
    pairs = torch.stack([torch.randperm(pool_blocks.shape[0])[:nblk], torch.arange(nblk)], 1).to(dev)
    ms = device_ms(
        {
            "memcpy": lambda: dst.copy_(contiguous_src, non_blocking=True),
            "copy_rows": lambda: copy_rows(pool.unsqueeze(1), dst.unsqueeze(1), src_idx, dst_idx),
            "copy_blocks": lambda: copy_blocks(pool_blocks, dst_blocks, pairs),
        },
        repeat,
    )
    nbytes = dst.numel() * dst.element_size()
    return {
        "bytes": nbytes,
        **{f"{k}_GBps": nbytes / (v * 1e-3) / 1e9 for k, v in ms.items()},
        "copy_rows_vs_memcpy": ms["memcpy"] / ms["copy_rows"],
        "copy_blocks_vs_memcpy": ms["memcpy"] / ms["copy_blocks"],
    }


def decode_case(dev: torch.device, context: int, rows: int, miss: float, repeat: int) -> dict[str, float]:
    dt = torch.bfloat16
    scale = (DC + DR) ** -0.5
    blocks_per_row = context // BLOCK
    num_blocks = rows * blocks_per_row
    host_c = torch.randn(num_blocks, BLOCK, DC, dtype=dt).pin_memory()
    host_pe = torch.randn(num_blocks, BLOCK, DR, dtype=dt).pin_memory()
    table = torch.randperm(num_blocks).view(rows, blocks_per_row).to(torch.int32).to(dev)
    q_nope = torch.randn(rows, H, DC, dtype=dt, device=dev)
    q_pe = torch.randn(rows, H, DR, dtype=dt, device=dev)
    hot_c = torch.randn(rows, CAP, DC, dtype=dt, device=dev)
    hot_pe = torch.randn(rows, CAP, DR, dtype=dt, device=dev)
    n_miss = int(TOPK * miss)
    topk = torch.stack([torch.randperm(context)[:TOPK] for _ in range(rows)]).to(torch.int32).to(dev)
    slots = torch.stack([torch.randperm(CAP)[:TOPK] for _ in range(rows)]).to(torch.int32).to(dev)
    miss_tokens, miss_slots = topk[:, :n_miss].contiguous(), slots[:, :n_miss].contiguous()
    miss_count = torch.full((rows,), n_miss, dtype=torch.int32, device=dev)
    out = torch.empty(rows, H, DC, dtype=dt, device=dev)
    lse = torch.empty(rows, H, device=dev)

    def copy_sfa() -> None:
        scatter_copy_sparse_mla_attention(
            q_nope, q_pe, host_c, host_pe, table, hot_c, hot_pe, miss_tokens, miss_slots, miss_count, slots,
            scale, out, lse,
        )  # fmt: skip

    # The full latent cache on the device: the same step without offload gathers the selected rows.
    dev_c, dev_pe = host_c.to(dev), host_pe.to(dev)
    tok = topk.long()
    flat = (table.long().gather(1, tok // BLOCK) * BLOCK + tok % BLOCK).view(-1)
    q_cat = torch.cat([q_nope, q_pe], -1)

    def gather_attention() -> torch.Tensor:
        rc = dev_c.view(-1, DC).index_select(0, flat).view(rows, TOPK, DC)
        rp = dev_pe.view(-1, DR).index_select(0, flat).view(rows, TOPK, DR)
        k = torch.cat([rc, rp], -1)
        s = torch.bmm(q_cat, k.transpose(1, 2)).float() * scale
        return torch.bmm(torch.softmax(s, -1).to(dt), rc)

    dense_k = [
        torch.cat([dev_c[table[r].long()].view(-1, DC), dev_pe[table[r].long()].view(-1, DR)], -1)
        for r in range(rows)
    ]

    def dense_sdpa() -> list[torch.Tensor]:
        return [
            torch.nn.functional.scaled_dot_product_attention(
                q_cat[r : r + 1].unsqueeze(0),
                dense_k[r][None, None],
                dense_k[r][None, None, :, :DC],
                scale=scale,
            )
            for r in range(rows)
        ]

    state = new_residency_state(rows, CAP, dev)
    res = new_residency_outputs(rows, TOPK, dev)
    ids = torch.arange(rows, device=dev)
    stable = torch.full((rows,), context, dtype=torch.int64, device=dev)
    # steady state: shift most of the top-k by a few positions each call so ~miss of it is new
    shifts = [torch.where(torch.rand(rows, TOPK, device=dev) < miss, (topk + k + 1) % context, topk)
              for k in range(4)]  # fmt: skip
    turn = [0]

    def residency() -> None:
        turn[0] = (turn[0] + 1) % len(shifts)
        torch.ops.kvoffload.residency_update(
            *state, shifts[turn[0]], ids, stable, None, "lru", *res.as_tuple()
        )

    def offload_step() -> None:
        residency()
        copy_sfa()

    ms = device_ms(
        {
            "copy_sfa": copy_sfa,
            "gather_attention": gather_attention,
            "dense_sdpa": dense_sdpa,
            "residency_update": residency,
            "offload_step": offload_step,
        },
        repeat,
    )
    return {
        **{f"{k}_ms": v for k, v in ms.items()},
        "copy_sfa_vs_dense": ms["dense_sdpa"] / ms["copy_sfa"],
        "copy_sfa_vs_gather": ms["gather_attention"] / ms["copy_sfa"],
        "residency_share_of_step": ms["residency_update"] / ms["offload_step"],
        "offload_vs_on_device": ms["gather_attention"] / ms["offload_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, 32K context only")
    args = parser.parse_args()
    kind = kv_device.accelerator_type()
    payload: dict[str, object] = {"accelerator": kind}
    if kind == "cpu":
        payload["skipped"] = "no accelerator: the CUDA / NPU figures need one (CPU figures: sparse_ops_bench)"
        print(f"device_bench: skipped — {payload['skipped']}")
    else:
        dev = kv_device.default_device()
        repeat = 5 if args.quick else 20
        contexts = [32768] if args.quick else [32768, 131072]
        rows_out: list[list[object]] = []
        with tqdm(total=1 + len(contexts), desc="device_bench") as bar:
            bw = bandwidth_case(dev, 65536, repeat)
            bar.update(1)
            payload["bandwidth"] = bw
            rows_out.append(["copy_rows vs memcpy (64K rows)", bw["copy_rows_vs_memcpy"], "≥ 0.8"])
            rows_out.append(["copy_blocks vs memcpy", bw["copy_blocks_vs_memcpy"], "≥ 0.8"])
            for ctx in contexts:
                case = decode_case(dev, ctx, 64 if ctx == 32768 else 4, 0.05, repeat)
                payload[f"decode_{ctx}"] = case
                bar.update(1)
                rows_out.append([f"Copy-SFA vs dense SDPA, {ctx // 1024}K", case["copy_sfa_vs_dense"], "> 1"])
                rows_out.append(
                    [f"Copy-SFA vs gather + torch, {ctx // 1024}K", case["copy_sfa_vs_gather"], "> 1"]
                )
                if ctx == 32768:
                    rows_out.append(["residency_update µs (R 64)", case["residency_update_ms"] * 1e3, "—"])
                    rows_out.append(["residency share of step", case["residency_share_of_step"], "< 0.05"])
                    rows_out.append(
                        ["offload step vs on-device cache", case["offload_vs_on_device"], "≥ 0.9"]
                    )
        print(format_table(["figure", "measured", "target"], rows_out))
    path = write_json("device_bench", payload)
    print(f"wrote {path}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "device_bench.json").write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()

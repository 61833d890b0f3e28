"""A short tour of the transfer primitives: save / load a layer's KV blocks between a "device" buffer and
a host pool on a transfer stream while compute runs, then load missed token rows into a hot buffer.

    python examples/ops_demo.py
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

import torch_kvoffload
from torch_kvoffload.device import accelerator_type, empty_host
from torch_kvoffload.ops import copy_blocks, copy_rows
from torch_kvoffload.transfer import TransferStream

LATENT, ROPE, BLOCK = 512, 64, 128


def main() -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    host_pool = empty_host((1024, BLOCK, LATENT + ROPE), dtype)  # host KV pool of one layer
    host_pool.normal_()
    device_buffer = torch.zeros(64, BLOCK, LATENT + ROPE, dtype=dtype)  # physical layer buffer
    hot = torch.zeros(8, 4096, LATENT + ROPE, dtype=dtype)  # per-row hot buffer, capacity 4096
    block_map = torch.stack([torch.randperm(1024)[:64], torch.arange(64)], dim=1)
    weights = torch.randn(768, 768)

    def compute() -> None:
        w = weights
        for _ in range(6):
            w = torch.tanh(w @ w / 32)

    rows = []
    nbytes = device_buffer.numel() * device_buffer.element_size()
    with TransferStream("demo") as stream:

        def load_layers() -> list:
            return [stream.submit(copy_blocks, host_pool, device_buffer, block_map) for _ in range(6)]

        timings = {}
        for label in tqdm(["compute only", "transfers only", "compute + transfers"], desc="demo"):
            start = time.perf_counter()
            events = load_layers() if label != "compute only" else []
            if label != "transfers only":
                compute()
            for ev in events:
                ev.wait()
            timings[label] = time.perf_counter() - start
        assert torch.equal(device_buffer[5], host_pool[block_map[5, 0]])
        rows.append(("copy_blocks H2D x6 (layer loads)", 6 * nbytes, timings["transfers only"]))

        start = time.perf_counter()
        stream.submit(copy_blocks, device_buffer, host_pool, block_map.flip(1)).wait()
        rows.append(("copy_blocks D2H (layer save)", nbytes, time.perf_counter() - start))

    misses = torch.randint(0, 1024 * BLOCK, (8 * 256,))
    slots = torch.cat([r * 4096 + torch.randperm(4096)[:256] for r in range(8)])
    start = time.perf_counter()
    copy_rows(host_pool, hot, misses, slots)
    rows.append(
        (
            "copy_rows H2D (2048 missed rows)",
            misses.numel() * (LATENT + ROPE) * 2,
            time.perf_counter() - start,
        )
    )
    assert torch.equal(hot.view(-1, LATENT + ROPE)[slots[7]], host_pool.view(-1, LATENT + ROPE)[misses[7]])

    print(f"\naccelerator={accelerator_type()}  C++ extension={torch_kvoffload.extension_available()}")
    print(f"{'transfer':<34} {'MiB':>8} {'ms':>8} {'GB/s':>7}")
    for name, nbytes, seconds in rows:
        print(f"{name:<34} {nbytes / 2**20:>8.1f} {seconds * 1e3:>8.2f} {nbytes / seconds / 1e9:>7.2f}")
    c, t, both = (timings[k] for k in ("compute only", "transfers only", "compute + transfers"))
    hidden = min(1.0, max(0.0, (c + t - both) / min(c, t)))
    print(
        f"\ncompute {c * 1e3:.0f} ms, transfers {t * 1e3:.0f} ms, both on a transfer stream {both * 1e3:.0f} ms "
        f"-> {hidden:.0%} of the shorter one hidden"
    )
    print("\nregistered ops:\n" + torch_kvoffload.ops.format_registered_ops())


if __name__ == "__main__":
    main()

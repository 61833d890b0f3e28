"""Layerwise prefill offload on a toy MLA-style stack (CPU, fp32).

Eight layers share 2 + 1 physical latent buffers (B = 2, layer 0 independent). Request A is prefilled and
its KV saved to an in-process host store; request B shares A's first blocks, so its prefix is loaded from
the store layer by layer instead of recomputed. Outputs are compared with a run without offload, and a
summary table is printed.

    python examples/layerwise_prefill_demo.py
"""

from __future__ import annotations

import math

import torch

from torch_kvoffload.layerwise import (
    LayerCacheSpec,
    LayerwiseConfig,
    TensorSpec,
    allocate_layer_buffers,
    build_layerwise_runtime,
    plan_layer_buffers,
)

LAYERS, D, RANK, ROPE, BLOCK, BLOCKS, VOCAB = 8, 64, 32, 16, 8, 32, 1000


class ToyMLA:
    """Per layer: latent ``c_kv = norm(x W_kv)``, rotary-free key ``k_pe = x W_pe``, absorbed attention."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.embed = torch.randn(VOCAB, D, generator=g)
        self.w = [
            {
                "kv": torch.randn(D, RANK, generator=g) / math.sqrt(D),
                "pe": torch.randn(D, ROPE, generator=g) / math.sqrt(D),
                "q": torch.randn(D, RANK + ROPE, generator=g) / math.sqrt(D),
                "o": torch.randn(RANK, D, generator=g) / math.sqrt(RANK),
            }
            for _ in range(LAYERS)
        ]

    def specs(self) -> list[LayerCacheSpec]:
        main = (
            TensorSpec((BLOCKS, BLOCK, RANK), torch.float32),
            TensorSpec((BLOCKS, BLOCK, ROPE), torch.float32),
        )
        return [LayerCacheSpec(main) for _ in range(LAYERS)]

    def prefill(self, tokens, table, caches_of, cached=0, rt=None) -> torch.Tensor:
        pos = torch.arange(len(tokens))
        slots = torch.tensor(table)[pos // BLOCK] * BLOCK + pos % BLOCK
        x = self.embed[torch.tensor(tokens[cached:])]
        for layer, w in enumerate(self.w):
            c_cache, pe_cache = (t.view(-1, t.shape[-1]) for t in caches_of(layer))
            if rt is not None:
                rt.wait_layer(layer)  # previous user of the buffer saved, prefix loaded
            c_kv = torch.nn.functional.normalize(x @ w["kv"], dim=-1)
            c_cache[slots[cached:]] = c_kv
            pe_cache[slots[cached:]] = x @ w["pe"]
            if rt is not None:
                rt.save_layer(layer)  # start saving the new blocks
            q = x @ w["q"]
            s = q[:, :RANK] @ c_cache[slots].T + q[:, RANK:] @ pe_cache[slots].T
            s = s.masked_fill(pos[None, :] > pos[cached:, None], float("-inf")) / math.sqrt(RANK + ROPE)
            x = x + (s.softmax(-1) @ c_cache[slots]) @ w["o"]
        return x


def main() -> None:
    cfg = LayerwiseConfig(
        num_shared_buffers=2,
        independent_layers=[0],
        prefetch_depth=2,
        store={"kind": "local", "capacity_bytes": 64 << 20},
        model_id="toy-mla",
    )
    model = ToyMLA()
    rt = build_layerwise_runtime(cfg, model.specs(), device="cpu")
    plan, bufs = rt.plan, rt.buffers

    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, VOCAB, (70,), generator=g).tolist()
    b = a[:50] + torch.randint(0, VOCAB, (30,), generator=g).tolist()  # shares 6 full blocks with a
    full = allocate_layer_buffers(plan_layer_buffers(model.specs(), 1, "all"), "cpu")

    print(plan.describe())
    print(f"store keys: kv/{rt.fingerprint}/<layer>/<block hash>")
    rows = []
    for name, toks, table in (("A", a, list(range(9))), ("B", b, list(range(9, 19)))):
        cached = rt.begin_forward([toks], [table])[0]
        out = model.prefill(toks, table, bufs.layer_caches, cached, rt)
        rt.end_forward()
        ref = model.prefill(toks, table, full.layer_caches)[cached:]
        c = rt.counters.snapshot()
        rows.append((name, len(toks), cached, (out - ref).abs().max().item(), c))
        rt.counters.reset()
    rt.close()

    print(
        f"\n{'req':<4}{'tokens':>7}{'cached':>7}{'loads':>6}{'saves':>6}{'KiB in':>8}{'KiB out':>8}{'max |diff|':>12}"
    )
    for name, n, cached, diff, c in rows:
        print(
            f"{name:<4}{n:>7}{cached:>7}{int(c['loads']):>6}{int(c['saves']):>6}"
            f"{c['bytes_loaded'] / 1024:>8.0f}{c['bytes_saved'] / 1024:>8.0f}{diff:>12.2e}"
        )
    print(
        f"\ndevice main KV: {plan.main_bytes / 1024:.0f} KiB in {plan.num_physical_buffers} buffers vs "
        f"{plan.logical_main_bytes / 1024:.0f} KiB without offload (ratio {plan.footprint_ratio:.3f})"
    )


if __name__ == "__main__":
    main()

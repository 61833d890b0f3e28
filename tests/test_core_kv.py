"""``KVCore`` without any model library: requests with independent lifetimes through every backend.

A request finishes while another continues, a new one takes the freed slot, and forwards mix a new
request's prefill with an older request's next token. The reference is a dense causal softmax over each
request's own rows (the indexer's top-k covers every row here, so the sparse backends attend to all of
them too).
"""

from __future__ import annotations

import pytest
import torch

from torch_kvoffload.core.config import OffloadConfig
from torch_kvoffload.core.kv import KVCore
from torch_kvoffload.core.spec import ModelSpec

DC, DR, H, DI, HI = 16, 8, 2, 8, 2
BS = 4
SCALE = (16 + 8) ** -0.5


def _spec(indexer: bool) -> ModelSpec:
    return ModelSpec(
        model_class="Toy", num_layers=2, kv_lora_rank=DC, rope_dim=DR, qk_nope_head_dim=16, v_head_dim=16,
        num_heads=H, dtype=torch.float32, device=torch.device("cpu"), scale=SCALE, has_indexer=indexer,
        index_topk=64 if indexer else 0, index_head_dim=DI if indexer else 0, index_n_heads=HI if indexer else 0,
        fingerprint="toy", attention_modules=(), weights_fingerprint="w",
    )  # fmt: skip


CONFIGS = {
    "layerwise": (False, {"layerwise": {"num_shared_buffers": 1}}),
    "sparse-offload": (True, {"sparse": {}}),
    "sparse-resident": (True, {"sparse": {"offload": False}}),
    "layerwise+sparse": (True, {"layerwise": {}, "sparse": {}}),
    "layerwise+resident": (True, {"layerwise": {}, "sparse": {"offload": False}}),
}


class _Driver:
    """Runs forwards through a core and keeps every request's rows for the reference."""

    def __init__(self, core: KVCore, seed: int = 0) -> None:
        self.core, self.g = core, torch.Generator().manual_seed(seed)
        self.rows: dict[int, list[torch.Tensor]] = {}  # request id -> [kv_c rows, k_pe rows]

    def _rand(self, *shape):
        return torch.randn(*shape, generator=self.g)

    def forward(self, requests, counts):
        """One forward: ``counts[b]`` new tokens of ``requests[b]`` (left padded to the longest)."""
        core, spec = self.core, self.core.spec
        B, S = len(requests), max(counts)
        mask = torch.zeros(B, S, dtype=torch.bool)
        for b, n in enumerate(counts):
            mask[b, S - n :] = True
        tokens = [torch.randint(3, 1000, (n,), generator=self.g).tolist() for n in counts]
        old = [r.length for r in requests]
        core.begin_forward(requests, tokens, mask)
        outs = []
        for layer in range(spec.num_layers):
            kv_c, k_pe = self._rand(B, S, DC), self._rand(B, S, DR)
            index_k = self._rand(B, S, DI) if spec.has_indexer else None
            hooks, caches = core.backends.layerwise, core.layer_caches(layer)
            if hooks is not None:  # what the layer_wait / layer_prefetch / layer_save ops call
                hooks.wait_layer(layer, caches)
                hooks.prefetch_layer(layer, caches)
            core.write(layer, kv_c, k_pe, index_k)
            if hooks is not None:
                hooks.save_layer(layer, caches)
            qn, qp = self._rand(B, S, H, DC), self._rand(B, S, H, DR)
            iq = self._rand(B, S, HI, DI) if spec.has_indexer else None
            iw = self._rand(B, S, HI).abs() if spec.has_indexer else None
            out = torch.empty(B, S, H, DC)
            core.attend(layer, qn, qp, iq, iw, SCALE, out)
            outs.append((kv_c, k_pe, qn, qp, out))
        core.end_forward()
        for layer, (kv_c, k_pe, qn, qp, out) in enumerate(outs):
            for b, r in enumerate(requests):
                keep = self.rows.setdefault((r.id, layer), [torch.empty(0, DC), torch.empty(0, DR)])
                keep[0] = torch.cat([keep[0], kv_c[b][mask[b]]])
                keep[1] = torch.cat([keep[1], k_pe[b][mask[b]]])
                for j, s in enumerate(torch.nonzero(mask[b]).reshape(-1).tolist()):
                    p = old[b] + j
                    c, pe = keep[0][: p + 1], keep[1][: p + 1]
                    scores = (qn[b, s] @ c.T + qp[b, s] @ pe.T) * SCALE
                    want = torch.softmax(scores, dim=-1) @ c
                    torch.testing.assert_close(out[b, s], want, rtol=1e-4, atol=1e-5)
                seen = old[b] + torch.cumsum(mask[b].long(), 0)
                assert not out[b][~mask[b] & (seen == 0)].any()  # padding that sees no real token stays zero


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_request_finishes_while_another_continues(name):
    indexer, cfg = CONFIGS[name]
    core = KVCore(_spec(indexer), OffloadConfig(**cfg, block_size=BS), name=f"core-{name}")
    try:
        core.size(2, 12)
        a, b = core.admit(2)
        drv = _Driver(core)
        drv.forward([a, b], [5, 3])
        drv.forward([a, b], [1, 1])
        core.finish([a.id])
        assert a.id not in core.requests and core.requests.free_slots() == [0]
        (c,) = core.admit(1)
        assert c.slot == a.slot and c.id != a.id
        drv.forward([b], [1])  # b alone
        drv.forward([c, b], [4, 2])  # c's prompt next to b's continuation
        drv.forward([c, b], [1, 1])
        drv.forward([b], [1])
        assert (b.length, c.length) == (9, 5)
        if name.startswith("sparse-offload"):
            stats = core.backend_stats()
            assert stats["reserved_requests"] == 2 and stats["hits"] + stats["misses"] > 0
    finally:
        core.close()


def test_growth_keeps_the_live_requests_rows():
    """Resident caches grow in place while two requests of different lengths are live."""
    core = KVCore(_spec(True), OffloadConfig(sparse={"offload": False}, block_size=BS), name="core-grow")
    try:
        core.size(2, 6)
        a, b = core.admit(2)
        drv = _Driver(core, seed=1)
        drv.forward([a, b], [5, 2])
        core.grow(14)
        assert core.layout.tokens == 14 and core.counters.snapshot()["resizes"] == 2
        drv.forward([a, b], [6, 3])
    finally:
        core.close()


def test_fixed_pools_refuse_growth_before_any_change():
    core = KVCore(_spec(True), OffloadConfig(sparse={}, block_size=BS), name="core-fixed")
    try:
        core.size(1, 8)
        (a,) = core.admit(1)
        _Driver(core).forward([a], [3])
        with pytest.raises(ValueError, match="needs 9 tokens per request but 8 were reserved"):
            core.grow(9)
        assert core.layout.tokens == 8
        core.grow(8)  # what the pool holds: nothing to do
    finally:
        core.close()

"""``KVCore`` forwards with padding anywhere: right, inside, whole rows, in later forwards and decode steps.

A padding position keeps no KV but its query attends over its request's real tokens before it (what the
Hugging Face model computes for it); one that sees none gets zero. The reference is pure PyTorch over
each request's own rows: the lightning indexer's top-k (``index_topk`` below the context, so the selection
is really sparse) then a softmax over the selected rows, or a dense causal softmax without an indexer.
"""

from __future__ import annotations

import pytest
import torch

from torch_kvoffload.core.config import OffloadConfig
from torch_kvoffload.core.forward import visible_padding
from torch_kvoffload.core.kv import KVCore
from torch_kvoffload.core.spec import ModelSpec

DC, DR, H, DI, HI = 16, 8, 2, 8, 8
BS, TOPK = 4, 5
SCALE = (16 + 8) ** -0.5


def _spec(indexer: bool) -> ModelSpec:
    return ModelSpec(
        model_class="Toy", num_layers=2, kv_lora_rank=DC, rope_dim=DR, qk_nope_head_dim=16, v_head_dim=16,
        num_heads=H, dtype=torch.float32, device=torch.device("cpu"), scale=SCALE, has_indexer=indexer,
        index_topk=TOPK if indexer else 0, index_head_dim=DI if indexer else 0,
        index_n_heads=HI if indexer else 0, fingerprint="toy", attention_modules=(), weights_fingerprint="w",
    )  # fmt: skip


CONFIGS = {
    "layerwise": (False, {"layerwise": {"num_shared_buffers": 1}}),
    "layerwise-indexed": (True, {"layerwise": {}}),
    "sparse-offload": (True, {"sparse": {}}),
    "sparse-resident": (True, {"sparse": {"offload": False}}),
    "layerwise+sparse": (True, {"layerwise": {}, "sparse": {}}),
    "layerwise+resident": (True, {"layerwise": {}, "sparse": {"offload": False}}),
}


def _reference(qn, qp, iq, iw, kv_c, k_pe, index_k, v):
    """``[H, DC]``: a query over rows ``0 .. v - 1`` (the indexer's top-k of them when ``iq`` is given)."""
    c, pe = kv_c[:v], k_pe[:v]
    if iq is not None:
        scores = (torch.relu(iq @ index_k[:v].T) * iw[:, None]).sum(0)  # [v]
        keep = scores.topk(min(TOPK, v)).indices
        c, pe = c[keep], pe[keep]
    return torch.softmax((qn @ c.T + qp @ pe.T) * SCALE, dim=-1) @ c


class _Driver:
    """Runs forwards of given masks through a core, checking every position against :func:`_reference`."""

    def __init__(self, core: KVCore, seed: int = 0) -> None:
        self.core, self.g = core, torch.Generator().manual_seed(seed)
        # (request id, layer) -> kv_c, k_pe, index_k rows
        self.rows: dict[tuple[int, int], list[torch.Tensor]] = {}

    def _rand(self, *shape):
        return torch.randn(*shape, generator=self.g)

    def forward(self, requests, mask: torch.Tensor) -> None:
        core, spec = self.core, self.core.spec
        B, S = mask.shape
        tokens = [torch.randint(3, 1000, (int(m.sum()),), generator=self.g).tolist() for m in mask]
        old = [r.length for r in requests]
        fwd = core.begin_forward(requests, tokens, mask)
        outs = []
        for layer in range(spec.num_layers):
            kv_c, k_pe = self._rand(B, S, DC), self._rand(B, S, DR)
            # positive indexer keys and queries: no score is exactly 0, the top-k has no ties
            index_k = self._rand(B, S, DI).abs() if spec.has_indexer else None
            hooks, caches = core.backends.layerwise, core.layer_caches(layer)
            if hooks is not None:
                hooks.wait_layer(layer, caches)
                hooks.prefetch_layer(layer, caches)
            core.write(layer, kv_c, k_pe, index_k)
            if hooks is not None:
                hooks.save_layer(layer, caches)
            qn, qp = self._rand(B, S, H, DC), self._rand(B, S, H, DR)
            iq = self._rand(B, S, HI, DI).abs() if spec.has_indexer else None
            iw = self._rand(B, S, HI).abs() if spec.has_indexer else None
            out = torch.full((B, S, H, DC), float("nan"))
            core.attend(layer, qn, qp, iq, iw, SCALE, out)
            outs.append((kv_c, k_pe, index_k, qn, qp, iq, iw, out))
        core.end_forward()
        for layer, (kv_c, k_pe, index_k, qn, qp, iq, iw, out) in enumerate(outs):
            for b, r in enumerate(requests):
                keep = self.rows.setdefault(
                    (r.id, layer), [torch.empty(0, DC), torch.empty(0, DR), torch.empty(0, DI)]
                )
                real = mask[b]
                keep[0] = torch.cat([keep[0], kv_c[b][real]])
                keep[1] = torch.cat([keep[1], k_pe[b][real]])
                if index_k is not None:
                    keep[2] = torch.cat([keep[2], index_k[b][real]])
                seen = old[b] + torch.cumsum(real.long(), 0)  # real tokens at positions <= s
                for s in range(S):
                    v = int(seen[s])
                    if v == 0:  # sees no real token: fully masked
                        assert not out[b, s].any()
                        continue
                    iqs = None if iq is None else iq[b, s]
                    iws = None if iw is None else iw[b, s]
                    want = _reference(qn[b, s], qp[b, s], iqs, iws, *keep, v)
                    torch.testing.assert_close(out[b, s], want, rtol=1e-4, atol=1e-5)
        self.last = fwd


def _m(*rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_visible_padding_matches_a_loop():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        B, S = torch.randint(1, 5, (2,), generator=g).tolist()
        mask = torch.rand(B, S, generator=g) < 0.5
        old = torch.randint(0, 3, (B,), generator=g).tolist()
        want_at, want_len = [], []
        for b in range(B):
            for s in range(S):
                v = old[b] + int(mask[b, : s + 1].sum())
                if not mask[b, s] and v > 0:
                    want_at.append(b * S + s)
                    want_len.append(v)
        at, lens = visible_padding(mask, old)
        assert at.tolist() == want_at and lens.tolist() == want_len


@pytest.mark.parametrize("name", list(CONFIGS))
def test_padding_anywhere_in_every_forward(name):
    indexer, cfg = CONFIGS[name]
    core = KVCore(_spec(indexer), OffloadConfig(**cfg, block_size=BS), name=f"pad-{name}")
    try:
        core.size(3, 24)
        reqs = core.admit(3)
        drv = _Driver(core)
        # right padding, padding inside, a row with no real token
        first = [0] * 10
        drv.forward(reqs, _m([1, 1, 1, 1, 1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 1, 1, 1, 0, 1], first))
        assert drv.last.n_pad > 0 and not drv.last.decode
        # a padded chunk of a later forward (row 1 has no real token in it)
        drv.forward(reqs, _m([1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 1, 1, 0, 1, 0]))
        # decode steps: all rows, then one row skipping its step, then all rows again
        drv.forward(reqs, _m([1], [1], [1]))
        assert drv.last.decode == ("sparse" in cfg)
        drv.forward(reqs, _m([1], [0], [1]))
        assert not drv.last.decode and drv.last.n_pad == 1
        drv.forward(reqs, _m([1], [1], [1]))
        # left padding in a later forward sees the earlier tokens
        drv.forward(reqs, _m([0, 0, 1], [0, 1, 1], [1, 1, 1]))
        assert [r.length for r in reqs] == [13, 10, 9]
    finally:
        core.close()


LAYERWISE = [n for n in CONFIGS if "layerwise" in n]


@pytest.mark.parametrize("name", LAYERWISE)
def test_rows_without_new_tokens_in_layerwise_forwards(name):
    """Rows with no token yet, then rows with no new token whose earlier tokens fill whole blocks (all
    loaded from the store, none computed again) or end in a partial block (kept in the device tail)."""
    indexer, cfg = CONFIGS[name]
    core = KVCore(_spec(indexer), OffloadConfig(**cfg, block_size=BS), name=f"pad-idle-{name}")
    try:
        core.size(3, 24)
        reqs = core.admit(3)
        drv = _Driver(core, seed=1)
        drv.forward(reqs, _m([1] * 8, [0] * 8, [0, 1, 1, 1, 1, 1, 0, 0]))  # row 1: no token yet
        drv.forward(reqs, _m([0, 0, 0], [0, 0, 0], [0, 0, 0]))  # no new token anywhere
        assert [r.length for r in reqs] == [8, 0, 5]
        # row 0 (two full blocks) and row 2 (a partial block) skip, row 1 gets its first tokens
        drv.forward(reqs, _m([0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]))
        drv.forward(reqs, _m([1, 1, 0], [0, 0, 0], [0, 1, 1]))
        drv.forward(reqs, _m([1], [0], [1]))  # a decode step where row 1 skips (after 4 + 0 tokens)
        drv.forward(reqs, _m([1], [1], [1]))
        assert [r.length for r in reqs] == [12, 6, 9]
    finally:
        core.close()

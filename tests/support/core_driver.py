"""A test driver that feeds a ``KVCore`` random rows and queries directly (no model), and its reference.

:class:`CoreDriver` runs forwards through a core with random rows and queries, calling what the model's
ops call (the layerwise hooks and the KVPP scheduler around ``write``), keeps every request's rows itself
(forks and truncations included) and checks every output against :func:`reference_attention` over the
rows that output's query sees. The reference never imports the library's attention or ops.
"""

from __future__ import annotations

from typing import Literal

import torch

from torch_kvoffload.core.kv import KVCore
from torch_kvoffload.kv.spec import ModelSpec

#: The toy model of the core tests: latent 16, rope 8, 2 heads, indexer keys of 8, 2 layers.
TOY_SCALE = (16 + 8) ** -0.5

#: Every single-process backend combination: name -> (the model needs an indexer, OffloadConfig fields).
CORE_CONFIGS = {
    "layerwise": (False, {"layerwise": {"num_shared_buffers": 1}}),
    "sparse-offload": (True, {"sparse": {}}),
    "sparse-resident": (True, {"sparse": {"offload": False}}),
    "layerwise+sparse": (True, {"layerwise": {}, "sparse": {}}),
    "layerwise+resident": (True, {"layerwise": {}, "sparse": {"offload": False}}),
    # resident while the free memory holds them: the hybrid's block pools and indexer blocks
    "sparse-auto": (True, {"sparse": {"offload": "auto"}}),
}


def toy_spec(indexer: bool, *, top_k: int, index_heads: int = 8) -> ModelSpec:
    """The toy model's spec (no model behind it), with a lightning indexer of ``index_heads`` heads selecting
    ``top_k`` rows when ``indexer``."""
    return ModelSpec(
        model_class="Toy", num_layers=2, kv_lora_rank=16, rope_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_heads=2, dtype=torch.float32, device=torch.device("cpu"), scale=TOY_SCALE, has_indexer=indexer,
        index_topk=top_k if indexer else 0, index_head_dim=8 if indexer else 0,
        index_n_heads=index_heads if indexer else 0, fingerprint="toy", weights_fingerprint="w",
    )  # fmt: skip


#: What the driver checks at a padding position: nothing, that it is zero when it sees no real token, or
#: (``"check"``) also that it attends over its request's real tokens before it like a real token there.
Padding = Literal["skip", "zero", "check"]


def reference_attention(
    qn: torch.Tensor,
    qp: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    scale: float,
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """``[H, Dc]``: one position's absorbed queries over the rows it sees.

    ``qn [H, Dc]`` / ``qp [H, Dr]`` attend over ``kv_c [L, Dc]`` / ``k_pe [L, Dr]`` (fp32), softmax of
    ``(qn · c + qp · pe) · scale``. With ``index = (iq [Hi, Di], iw [Hi], index_k [L, Di], top_k)`` only
    the lightning indexer's top-k rows take part: scores ``Σ_h w_h · relu(q_h · k)``, the
    ``min(top_k, L)`` highest (like DeepSeek-V3.2); without it, all ``L`` rows (dense causal softmax).
    """
    c, pe = kv_c, k_pe
    if index is not None:
        iq, iw, index_k, top_k = index
        scores = (iw[:, None] * torch.relu(iq @ index_k.T)).sum(dim=0)  # [L]
        sel = torch.topk(scores, min(top_k, len(scores))).indices
        c, pe = c[sel], pe[sel]
    logits = (qn @ c.T + qp @ pe.T) * scale  # [H, k]
    return torch.softmax(logits, dim=-1) @ c


class CoreDriver:
    """Runs forwards through ``core`` with random rows and checks each output against the reference.

    ``scale`` is the softmax scale passed to ``core.attend``. The reference uses the indexer's top-k
    (``top_k``, else the spec's ``index_topk``) when the spec has an indexer and ``dense`` is false.
    ``positive_index`` draws the indexer keys and queries positive (no score exactly 0, no top-k ties);
    ``draw_index`` draws the indexer tensors (``max(Hi, 1)`` heads of ``max(Di, 1)``) even without an
    indexer, keeping the random stream of a spec with one. ``fill`` is the outputs' value before attention
    (``None``: uninitialised); ``padding`` what is checked at padding positions (:data:`Padding`).
    ``decode_entries`` counts the valid top-k entries of the decode steps and of the decode tokens of mixed
    forwards (the sparse offload backend's hits + misses).
    """

    def __init__(
        self,
        core: KVCore,
        *,
        scale: float,
        seed: int = 0,
        top_k: int | None = None,
        dense: bool = False,
        positive_index: bool = False,
        draw_index: bool = False,
        fill: float | None = None,
        padding: Padding = "skip",
        rtol: float = 1e-4,
        atol: float = 1e-5,
    ) -> None:
        self.core, self.spec, self.scale = core, core.spec, scale
        self.g = torch.Generator().manual_seed(seed)
        indexed = self.spec.has_indexer and not dense
        self.top_k = (self.spec.index_topk if top_k is None else top_k) if indexed else None
        self.positive_index, self.draw_index = positive_index, draw_index or self.spec.has_indexer
        self.fill, self.padding, self.rtol, self.atol = fill, padding, rtol, atol
        self.rows: dict[tuple[int, int], list[torch.Tensor]] = {}  # (request id, layer) -> [c, pe, ik]
        self.decode_entries = 0
        self.last = None  # the last forward's core.forward.Forward

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g)

    def _index_rand(self, *shape: int) -> torch.Tensor:
        t = self._rand(*shape)
        return t.abs() if self.positive_index else t

    def tokens(self, n: int) -> list[int]:
        """``n`` random token ids (from the driver's generator)."""
        return torch.randint(3, 1000, (n,), generator=self.g).tolist()

    def random_tokens(self, *counts: int) -> list[list[int]]:
        """``counts[b]`` random token ids per request."""
        return [self.tokens(int(n)) for n in counts]

    def fork(self, src):
        """``core.fork(src.id)``; the fork's kept rows are a copy of ``src``'s. Returns the fork."""
        dst = self.core.fork(src.id)
        for layer in range(self.spec.num_layers):
            self.rows[dst.id, layer] = [t.clone() for t in self.rows[src.id, layer]]
        return dst

    def truncate(self, req, length: int) -> None:
        """``core.truncate(req.id, length)``; the request's kept rows end at ``length`` too."""
        self.core.truncate(req.id, length)
        for layer in range(self.spec.num_layers):
            self.rows[req.id, layer] = [t[:length] for t in self.rows[req.id, layer]]

    def forward(
        self, requests, tokens: list[list[int]], mask: torch.Tensor | None = None, *, packed: bool = False
    ):
        """One forward of ``tokens[b]`` new tokens of ``requests[b]``, at the true positions of ``mask``
        (``[B, S]`` bool; default: left padded to the longest), or (``packed``) one after the other in one
        row ``[1, N]``; every output checked. Returns the core's forward (also kept as ``last``)."""
        B = len(requests)
        if packed:
            assert mask is None, "a packed forward has no mask"
        elif mask is None:
            mask = torch.zeros(B, max(len(t) for t in tokens), dtype=torch.bool)
            for b, t in enumerate(tokens):
                mask[b, mask.shape[1] - len(t) :] = True
        old = [r.length for r in requests]
        decode = all(old) and all(len(t) == 1 for t in tokens)
        self.last = self.core.begin_forward(requests, tokens, mask)
        shape = (1, sum(len(t) for t in tokens)) if packed else tuple(mask.shape)
        outs = [self._layer(layer, *shape) for layer in range(self.spec.num_layers)]
        self.core.end_forward()
        starts = [sum(len(t) for t in tokens[:b]) for b in range(B)]
        for layer, (new, queries, out) in enumerate(outs):
            for b, r in enumerate(requests):
                if packed:  # request b's run of the one row: all real
                    at = slice(starts[b], starts[b] + len(tokens[b]))
                    rows, q = [t[0, at] for t in new], [None if t is None else t[0, at] for t in queries]
                    real = torch.ones(len(tokens[b]), dtype=torch.bool)
                    self._check(layer, r.id, old[b], real, rows, q, out[0, at])
                else:
                    rows, q = [t[b] for t in new], [None if t is None else t[b] for t in queries]
                    self._check(layer, r.id, old[b], mask[b], rows, q, out[b])
                # a decode token: in a decode step, or in the decode part of a mixed forward
                stepped = decode or (bool(self.last.parts) and old[b] > 0 and len(tokens[b]) == 1)
                if stepped and self.top_k is not None:
                    self.decode_entries += min(self.top_k, old[b] + 1)
        return self.last

    def _layer(self, layer: int, B: int, S: int):
        """One layer of the running forward: random rows written, random queries attended. Returns the
        rows ``[kv_c, k_pe, index_k?]`` (``[B, S, ·]``), the queries ``(qn, qp, iq, iw)`` and the output."""
        core, spec = self.core, self.spec
        H, Dc, Dr = spec.num_heads, spec.kv_lora_rank, spec.rope_dim
        Hi, Di = max(spec.index_n_heads, 1), max(spec.index_head_dim, 1)
        kv_c, k_pe = self._rand(B, S, Dc), self._rand(B, S, Dr)
        index_k = self._index_rand(B, S, Di) if self.draw_index else None
        # the core runs the layer's layerwise loads / saves and KVPP broadcast waits itself
        core.cache_write(layer, kv_c, k_pe, index_k if spec.has_indexer else None)
        qn, qp = self._rand(B, S, H, Dc), self._rand(B, S, H, Dr)
        iq = self._index_rand(B, S, Hi, Di) if self.draw_index else None
        iw = self._rand(B, S, Hi).abs() if self.draw_index else None
        out = torch.empty(B, S, H, Dc) if self.fill is None else torch.full((B, S, H, Dc), self.fill)
        if spec.has_indexer:
            core.cache_attention(layer, qn, qp, iq, iw, self.scale, out)
        else:
            core.cache_attention(layer, qn, qp, None, None, self.scale, out)
        new = [kv_c, k_pe] if index_k is None else [kv_c, k_pe, index_k]
        return new, (qn, qp, iq, iw), out

    def _check(self, layer: int, rid: int, old: int, real: torch.Tensor, new, queries, out) -> None:
        """Keep request ``rid``'s new rows ``new[i] [S, ·]`` at ``real [S]`` and check its outputs
        ``out [S, H, Dc]`` of queries ``queries[i] [S, ·]`` (``old``: its length before the forward)."""
        keep = self.rows.setdefault((rid, layer), [torch.empty(0, t.shape[-1]) for t in new])
        keep[:] = [torch.cat([k, n[real]]) for k, n in zip(keep, new, strict=True)]
        qn, qp, iq, iw = queries
        seen = old + torch.cumsum(real.long(), 0)  # real tokens at positions <= s
        for s in range(real.shape[0]):
            v = int(seen[s])
            if not real[s] and self.padding == "skip":
                continue
            if v == 0:  # sees no real token: fully masked
                assert not out[s].any()
                continue
            if not real[s] and self.padding == "zero":
                continue
            index = None if self.top_k is None else (iq[s], iw[s], keep[2][:v], self.top_k)
            want = reference_attention(qn[s], qp[s], keep[0][:v], keep[1][:v], self.scale, index)
            torch.testing.assert_close(out[s], want, rtol=self.rtol, atol=self.atol)

"""The per-layer reads and writes of hybrid sparse attention (:class:`HybridLayers`): in a forward whose
requests are partly resident and partly offloaded, the resident ones' new rows go to their device blocks and
their decode steps attend over the blocks in place (:mod:`.resident_step`), the offloaded ones' run through
sparse decode offload (host pool, hot buffers, the fused step on a subset of the batch). Where each request
runs is decided before the forward (:class:`~torch_kvoffload.sparse.hybrid_backend.HybridSparseBackend`);
a layer waits for the promotions' copies of it before it touches the blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_kvoffload.kv.backend import IndexerView, NewRows, Queries, SelectedRows
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.kv.fp8_rows import latent_fp8_rows
from torch_kvoffload.kv.requests import Request
from torch_kvoffload.sparse.backend import SparseOffloadBackend
from torch_kvoffload.sparse.block_indexer import BlockIndexerCache
from torch_kvoffload.sparse.device_blocks import DeviceBlocks
from torch_kvoffload.sparse.hybrid_moves import PromotionLanding
from torch_kvoffload.sparse.resident_step import (
    ResidentInputs,
    merge_selected,
    resident_decode,
    resident_selected,
    split_new_rows,
)

__all__ = ["HybridLayers"]


class HybridLayers(SparseOffloadBackend):
    """Sparse decode offload whose requests holding device :attr:`blocks` read and write them instead (see
    the module docstring). The subclass sets :attr:`blocks`, :attr:`index` and the promotions under way."""

    blocks: DeviceBlocks
    index: BlockIndexerCache
    _offloaded: set[int]
    _pending: dict[int, int]
    _landing: PromotionLanding | None
    # the last decode step of a forward with resident rows: (layer, plan, top-k, block rows, offloaded step)
    _last_hybrid: tuple | None

    def _land(self, layer: int) -> None:
        """Before ``layer`` reads or writes blocks: the promotions' copies of it landed (they start at the
        forward's first layer: every part of it has decided by then, no block moves until it ends)."""
        landing = self._current_landing()
        if landing is not None:
            landing.land(layer)

    def _current_landing(self) -> PromotionLanding | None:
        """The copies of the promotions decided for this forward (of its every part) that still stand, made
        at the first ask after they were decided; ``None`` when none was."""
        if self._pending:
            assert self.runtime is not None
            rows = [
                (r, n) for r, n in self._pending.items() if self.blocks.holds(r) and r not in self._offloaded
            ]
            self._pending = {}
            self._landing = PromotionLanding(self.runtime, self.blocks, rows, fp8=self.fp8)
        return self._landing

    def _split(self, fwd: ForwardPlan) -> tuple[list[int], list[int]]:
        """Batch rows of ``fwd`` whose requests are resident, and offloaded: decided when every part of the
        forward began (a later part's decisions may move a request of an earlier one; no layer ran yet)."""
        split = fwd.memo.get("hybrid")
        if split is None:
            on = [self.blocks.holds(rid) for rid in fwd.request_ids]
            split = fwd.memo["hybrid"] = (
                [i for i, r in enumerate(on) if r],
                [i for i, r in enumerate(on) if not r],
            )
        return split

    # ------------------------------------------------------------------------------ per layer
    def layer_caches(self, layer: int) -> list[torch.Tensor]:
        own = list(self.blocks.flat(layer)) if self.blocks.built else []
        return [*super().layer_caches(layer), *own]

    def write(self, layer: int, fwd: ForwardPlan, rows: NewRows) -> None:
        self._land(layer)
        resident, offloaded = self._split(fwd)
        if not resident:
            super().write(layer, fwd, rows)
            return
        rt = self.runtime
        assert rt is not None and rows.index_k is not None
        kv_c, k_pe = rows.kv_c, rows.k_pe
        if self.fp8:
            kv_c = latent_fp8_rows(fwd, layer, rows)
            k_pe = kv_c[:, :0]
        split = fwd.memo.get("hybrid_rows")
        if split is None:  # once per forward part: each layer writes the same rows
            dev_at, dev_rows, host_at = split_new_rows(fwd, self.blocks, resident, self.spec.device)
            host, ids = fwd.row.cpu()[host_at.cpu()].tolist(), fwd.request_ids
            placed = (
                rt.place_rows([ids[r] for r in host], fwd.pos.cpu()[host_at.cpu()]) if offloaded else None
            )
            split = fwd.memo["hybrid_rows"] = (dev_at, dev_rows, host_at, placed)
        dev_at, dev_rows, host_at, placed = split
        values = [kv_c] if self.fp8 else [kv_c, k_pe]
        self.blocks.write(layer, dev_rows, [v[dev_at] for v in values] if offloaded else values)
        if placed is not None:
            rt.append_validated(layer, placed, kv_c[host_at], k_pe[host_at])
        self.index.write_keys(layer, fwd, rows)
        if not fwd.decode and not fwd.layerwise:
            self._rows[layer] = (kv_c, k_pe)

    def earlier_rows(
        self, layer: int, fwd: ForwardPlan, at: Sequence[int] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each request's rows before ``fwd``: a resident one's from its blocks, an offloaded one's from the
        host pool (every request: ``at`` is the base class's)."""
        self._land(layer)
        resident, offloaded = self._split(fwd)
        if not resident:
            return super().earlier_rows(layer, fwd)
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * fwd.B
        for i in resident:
            parts = self.blocks.read(layer, fwd.request_ids[i], 0, fwd.old_len[i])
            out[i] = (parts[0], parts[0][:, :0]) if self.fp8 else (parts[0], parts[1])
        if offloaded:
            for i, got in zip(offloaded, super().earlier_rows(layer, fwd, offloaded), strict=True):
                out[i] = got
        return out  # type: ignore[return-value]

    def attend(self, layer: int, fwd: ForwardPlan, q: Queries) -> torch.Tensor | None:
        """A decode step: the resident requests' sparse attention over their blocks in place, the
        offloaded ones' fused step over the hot buffers."""
        if not fwd.decode:
            return None
        self._land(layer)
        resident, offloaded = self._split(fwd)
        if not resident:
            return super().attend(layer, fwd, q)
        assert self.runtime is not None
        at = fwd.memo.get("hybrid_sub")
        if at is None:
            table = self.index.fwd_table(fwd)
            at = fwd.memo["hybrid_sub"] = ResidentInputs.of(fwd, self.blocks, table, resident, offloaded)
        view = IndexerView(self.index.layers[layer], at.index_table, self.runtime.top_k, fmt=self.index.fmt)
        own, topk, rows_at = resident_decode(
            view, self.blocks.flat(layer), q, at, self.block_size, every=not offloaded, fp8=self.fp8
        )
        out, step = own, None
        if offloaded:
            out = torch.empty_like(q.q_nope)
            step = self.offload_step(layer, fwd, q, offloaded)
            out[at.pick], out[at.host_pick] = own, step.out
        self._last_hybrid = (layer, fwd, topk, rows_at, step)
        return out

    def attended(self, layer: int, fwd: ForwardPlan) -> SelectedRows | None:
        """The rows the decode step of ``layer`` read: the resident requests' in their blocks, the offloaded
        ones' in the hot buffers."""
        if not self._split(fwd)[0]:
            return super().attended(layer, fwd)
        last = self._last_hybrid
        if last is None or last[0] != layer or last[1] is not fwd:
            return None
        _, _, topk, rows_at, step = last
        at = fwd.memo["hybrid_sub"]
        own = resident_selected(
            self.blocks.flat(layer), topk, rows_at, fp8=self.fp8, dc=self.spec.kv_lora_rank
        )
        if step is None:
            return own
        return merge_selected(fwd.B, [(at.pick, own), (at.host_pick, self.step_rows(layer, step))])

    def read(
        self, layer: int, requests: Sequence[Request], part: str, start: int = 0, *, stored: bool = False
    ) -> list[torch.Tensor] | None:
        """As :meth:`SparseOffloadBackend.read`, a resident request's rows from its blocks."""
        if part != "index_k" and self.fp8 and not stored:
            return super().read(layer, requests, part, start, stored=stored)  # refused there
        self._land(layer)
        out = []
        for r in requests:
            if part == "index_k" or not self.blocks.holds(r.id):
                out += super().read(layer, [r], part, start, stored=stored) or []
            else:
                out.append(self.blocks.read(layer, r.id, start, r.length)[0 if part == "kv_c" else 1])
        return out

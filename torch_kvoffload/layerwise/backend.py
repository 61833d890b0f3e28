"""``LayerwiseBackend``: layerwise prefill offload as a KV backend (DESIGN §6).

Every forward it takes part in runs the layerwise pipeline over the planned physical buffers
(``num_shared_buffers`` buffers shared by the reusable layers, one page of ``[num_blocks, block_size, D]``
per component; slot ``s`` owns blocks ``s * M .. s * M + M - 1``). Full blocks are saved to the host store
and loaded back by the next forward. The partial last block of each request survives between forwards in a
small per-layer device *tail* (``[slots, tail rows, D]`` per component, counted in the device bytes): after
a layer's write its partial block is copied into the tail, and the next forward copies it back into the
buffer. A prompt prefix found in the store is loaded instead of written: the model still computes its
projections, its attention reads the loaded KV.

The core calls :meth:`LayerwiseBackend.before_write` before each layer's write (wait for the layer's loads,
issue the next ones) and :meth:`LayerwiseBackend.after_write` after it (save). The backend is also the
layer-hook object the ``layer_wait`` / ``layer_prefetch`` / ``layer_save`` ops reach in graphs whose
attention the core does not drive (``wait_layer`` / ``prefetch_layer`` / ``save_layer``): during a forward
it takes part in they run the runtime's hooks, otherwise nothing.

A forward whose stored prefix cannot be loaded when its layer needs it (:class:`PrefixEvictedError`) may be
run again with each request's prefix cut at its first bad block: :meth:`retry_caps` / :meth:`restart`.

Forks and truncation: the full blocks are content-addressed, so a fork (whose tokens are a copy of its
source's) finds its source's stored blocks (shared, not copied); :meth:`fork` copies the tail rows. After
:meth:`truncate` a partial block that had been saved full is read back from the store into the tail
(blocks past it stay in the store under the dropped tokens' keys). An unkeyed request (``Request.keyed``
false: fed embeddings, ``-1`` placeholders) keys its blocks by random negative ids, one per position drawn
when the position is first written and inherited by its forks: nothing keyed by placeholders matches
another request's blocks, nor its own dropped ones after a truncation, while its own history still
round-trips through the store.

Positions: a block's key covers the model positions its KV was computed at (``Request.positions``: the
rotary part of the KV depends on them), so a block computed at other positions than a request's (a forward
without ``position_ids`` on left padding counts the pads; custom ``position_ids``) is never loaded for it,
while a later forward at the same positions still finds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from torch_kvoffload.kv.backend import IndexerView, KeyRows, KVBackend, NewRows, row_parts
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.kv.fp8_rows import index_fp8_rows, latent_fp8_rows
from torch_kvoffload.kv.layout import KVLayout
from torch_kvoffload.kv.requests import Request
from torch_kvoffload.kv.spec import ModelSpec
from torch_kvoffload.kv.totals import RuntimeTotals
from torch_kvoffload.layerwise.build import build_layerwise_runtime
from torch_kvoffload.layerwise.config import LayerwiseConfig
from torch_kvoffload.layerwise.errors import StoreMissError
from torch_kvoffload.layerwise.planner import LayerCacheSpec
from torch_kvoffload.layerwise.prefix_store import layer_cache_specs, store_namespace
from torch_kvoffload.layerwise.runtime import LayerwiseOffloadRuntime, PrefixEvictedError
from torch_kvoffload.layerwise.stored import stored_block, stored_spans
from torch_kvoffload.layerwise.tails import LayerTails, tail_moves
from torch_kvoffload.store import build_store
from torch_kvoffload.store.base import KVStore

logger = logging.getLogger(__name__)

__all__ = ["LayerwiseBackend", "RuntimeFactory"]

#: builds the runtime over externally supplied buffers (a P/D prefill role); ``None``: allocate locally
RuntimeFactory = Callable[
    [LayerwiseConfig, Sequence[LayerCacheSpec], KVStore], "LayerwiseOffloadRuntime | None"
]

_TOTALS = (
    "bytes_loaded",
    "bytes_saved",
    "loads",
    "saves",
    "store_hits",
    "store_misses",
    "store_errors",
    "forward_retries",
)


@dataclass
class _Pass:
    """What one forward through the pipeline needs between its hooks (device tensors)."""

    cached: list[int] = field(default_factory=list)  # prefix tokens loaded per request
    write: torch.Tensor | None = None  # bool [N]: rows written into the layer buffer
    tail_restore: tuple[torch.Tensor, torch.Tensor] | None = None  # (tail rows, paged rows)
    tail_keep: tuple[torch.Tensor, torch.Tensor] | None = None  # (paged rows, tail rows)


class LayerwiseBackend(KVBackend):
    """Layerwise offload of ``spec``'s KV (see the module docstring).

    Parameters
    ----------
    spec : ModelSpec
        With the weights' fingerprint: the store keys carry it.
    config : LayerwiseConfig
    block_size : int
    indexed : bool
        Whether the layer buffers carry the indexer keys (the last component).
    kv_fp8, index_fp8 : bool
        The layer buffers, tails and store records keep the latent KV (one component ``uint8 [.., Dc + 4 *
        Dc / 128 + 2 * Dr]``) / the indexer keys (``uint8 [.., Di + 4 * Di / 128]``) as DeepSeek's FP8 rows:
        quantized on write, read as kept.
    build_runtime : RuntimeFactory, optional
        Supplies the runtime over buffers allocated elsewhere (returns ``None`` to let the backend allocate).
    """

    name = "layerwise"

    def __init__(
        self,
        spec: ModelSpec,
        config: LayerwiseConfig,
        *,
        block_size: int,
        indexed: bool,
        kv_fp8: bool = False,
        index_fp8: bool = False,
        build_runtime: RuntimeFactory | None = None,
    ) -> None:
        self.spec, self.config, self.block_size = spec, config, block_size
        self.indexed, self.kv_fp8, self.index_fp8 = indexed, kv_fp8, index_fp8 and indexed
        #: the components of the buffers, tails and records, in order (FP8 latent rows hold the RoPE part)
        self.parts = row_parts(kv_fp8, indexed)
        self.components = len(self.parts)
        self._factory = build_runtime
        self.store: KVStore = build_store(config.store)
        self.runtime: LayerwiseOffloadRuntime | None = None
        self._tails = LayerTails()
        self._layout: KVLayout | None = None
        self._totals = RuntimeTotals(_TOTALS)
        self._pass: _Pass | None = None
        # request id -> the store-key tokens of an unkeyed request (one random negative id per position)
        self._unkeyed: dict[int, list[int]] = {}
        self._rng = np.random.default_rng()  # OS entropy: processes sharing a store draw different ids

    # -------------------------------------------------------------------------------- sizing
    @property
    def layers(self) -> list[int]:
        """The layers whose blocks the store holds, in the order of the rows of :meth:`write_block`: all."""
        return list(range(self.spec.num_layers))

    @property
    def built(self) -> bool:
        return self.runtime is not None

    def resize(self, layout: KVLayout, live: Sequence[Request]) -> None:
        old, self._layout = self._layout, layout
        if live:  # the running requests grow: buffers of another block count, tails with their rows
            if self.runtime is None:
                return  # released for decode: nothing to grow
            if old is None or old.blocks_per_request != layout.blocks_per_request:
                self._retire()
                self._build_runtime(layout)
            self._build_tails(layout)
            return
        self.free()
        self._unkeyed.clear()  # no request is live
        self._build_runtime(layout)
        self._build_tails(layout)

    def free(self) -> None:
        """Release the layer buffers and tails (decode continues without them)."""
        if self.runtime is not None:
            self._retire()
        self._tails.clear()

    def _build_runtime(self, layout: KVLayout) -> None:
        fp8 = {"index_fp8": self.index_fp8, "kv_fp8": self.kv_fp8}
        specs = layer_cache_specs(self.spec, layout.num_blocks, self.block_size, self.indexed, **fp8)
        lw = store_namespace(self.config, self.spec, self.indexed, **fp8)
        rt = self._factory(lw, specs, self.store) if self._factory is not None else None
        self.runtime = (
            rt
            if rt is not None
            else build_layerwise_runtime(lw, specs, device=self.spec.device, store=self.store)
        )

    def _tail_rows(self, layout: KVLayout) -> int:
        """Rows per request of a tail: a partial block, never more than a request's tokens."""
        return min(self.block_size, layout.tokens)

    def _build_tails(self, layout: KVLayout) -> None:
        assert self.runtime is not None  # tails like the buffers' components
        self._tails.build(
            self.runtime.layer_caches(0), self.spec.num_layers, layout.slots, self._tail_rows(layout)
        )

    def _retire(self) -> None:
        rt, self.runtime = self.runtime, None
        if rt is not None:
            self._totals.retire(rt)

    # ------------------------------------------------------------------------------ requests
    def release(self, request_ids: Sequence[int]) -> None:
        for rid in request_ids:
            self._unkeyed.pop(rid, None)

    def fork(self, layout: KVLayout, src: Request, dst: Request, length: int) -> None:
        """``dst`` shares ``src``'s stored full blocks (its tokens, or its inherited key ids, find them) and
        gets a copy of the rows of its partial block at ``length`` in every layer: ``src``'s tail rows, or,
        for a shorter length inside an earlier block, the stored block's (nothing to copy once the buffers
        are released). ``RuntimeError`` when the store no longer holds it."""
        if src.id in self._unkeyed:
            self._unkeyed[dst.id] = list(self._unkeyed[src.id][:length])
        if not self._tails or length % self.block_size == 0:
            return
        if length // self.block_size == src.length // self.block_size:  # src's own partial block: its tail
            self._tails.copy_slot(src.slot, dst.slot)
        else:
            self._tail_from_store(dst, length, self._key_tokens(src), self._key_positions(src), "KVCore.fork")

    def truncate(self, request: Request, length: int) -> None:
        """``request`` continues at ``length``: the rows of its new partial block go back into its tail
        (read from the store when that block had been saved full). ``RuntimeError`` when the store no
        longer holds it."""
        keys = self._unkeyed.get(request.id)
        if self._tails:
            self._restore_tail(request, length, request.tokens if keys is None else keys, request.positions)
        if keys is not None:
            del keys[length:]  # later positions draw new ids: the dropped blocks are never found again

    def _restore_tail(
        self, r: Request, length: int, key_tokens: Sequence[int], positions: Sequence[int] | None
    ) -> None:
        block, part = divmod(length, self.block_size)
        if part == 0 or block >= r.length // self.block_size:
            return  # no partial block, or its rows are still in the tail
        self._tail_from_store(r, length, key_tokens, positions, "KVCore.truncate")

    def _tail_from_store(
        self, r: Request, length: int, key_tokens: Sequence[int], positions: Sequence[int] | None, who: str
    ) -> None:
        """``r``'s tail gets the first ``length % block_size`` rows of stored block ``length // block_size``
        of ``key_tokens`` (at ``positions``). ``RuntimeError`` when the store no longer holds it."""
        block, part = divmod(length, self.block_size)
        assert self.runtime is not None
        self._tails.fill(r.slot, part, stored_block(self.runtime, r.id, key_tokens, positions, block, who))

    # --------------------------------------------------------------------------- prefix reuse
    def cached_prefix(self, tokens: Sequence[int], positions: Sequence[int] | None) -> int:
        """Leading tokens of a prompt ``tokens`` (its KV computed at ``positions``; ``None``: token ``t`` at
        ``t``) whose KV every layer has in the store: whole blocks, at least one token left to compute; 0
        before the buffers exist."""
        rt = self.runtime
        return 0 if rt is None else rt.lookup(list(tokens), positions)

    def adopt(self, request: Request, key_tokens: Sequence[int], positions: Sequence[int] | None) -> None:
        """``request`` now holds its first ``request.length`` tokens without a forward (their full blocks are
        in the store, under ``key_tokens`` at ``positions``, the request's whole prompt): the rows of a
        partial last block go into its tail from the stored block that holds them. ``RuntimeError`` when
        the store no longer holds it."""
        if request.length % self.block_size:
            self._tail_from_store(request, request.length, key_tokens, positions, "prefix reuse")

    def rebuild(self, layout: KVLayout) -> None:
        """The buffers and tails for ``layout`` again after :meth:`free` released them for decode (the next
        sizing would build them): the store's keys and record layouts come with them."""
        if self.runtime is None:
            self._layout = layout
            self._build_runtime(layout)
            self._build_tails(layout)

    def stored_blocks(self, request: Request) -> int:
        """Leading full blocks of ``request`` every layer has in the store (0 before the buffers exist)."""
        rt = self.runtime
        return 0 if rt is None else rt.stored_blocks(self._key_tokens(request), self._key_positions(request))

    def write_block(self, request: Request, block: int, rows: Sequence[Sequence[torch.Tensor]]) -> None:
        """Store full block ``block`` of ``request`` from ``rows`` (per layer, per component of :attr:`parts`,
        host ``[block_size, D]`` as the buffers keep it: the model's dtype or FP8 rows)."""
        assert self.runtime is not None
        self.runtime.write_block(self._key_tokens(request), block, self._key_positions(request), rows)

    def stored_rows(
        self,
        requests: Sequence[Request],
        key_tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int] | None],
        spans: Sequence[tuple[int, int]],
    ) -> list[list[torch.Tensor]]:
        """Per layer, per component (:attr:`parts`), the stored rows of tokens ``spans[r] = (start, end)`` of
        each request one after the other (host, ``[sum of the spans, D]``), read from the blocks of
        ``key_tokens[r]`` at ``positions[r]`` (each block read once, for every layer). ``RuntimeError`` when
        the store no longer holds a block."""
        assert self.runtime is not None
        return stored_spans(self.runtime, requests, key_tokens, positions, spans)

    def _key_tokens(self, r: Request) -> list[int]:
        """The tokens ``r``'s blocks are keyed by: its ids, or for an unkeyed request its random ids (drawn
        for the positions seen first now, kept for later forwards)."""
        if r.keyed and r.id not in self._unkeyed:
            return list(r.tokens)
        keys = self._unkeyed.setdefault(r.id, [])
        if len(keys) < r.length:
            keys += self._rng.integers(-(2**63), -1, size=r.length - len(keys), dtype=np.int64).tolist()
        return keys[: r.length]

    @staticmethod
    def _key_positions(r: Request) -> list[int] | None:
        """The positions ``r``'s blocks are keyed by: ``None`` while every token is at its logical position."""
        return None if r.positions is None else r.positions[: r.length]

    # ------------------------------------------------------------------------------ forwards
    def takes_part(self, fwd: ForwardPlan) -> bool:
        return fwd.layerwise

    def begin_forward(self, fwd: ForwardPlan, max_cached_tokens: list[int] | None = None) -> None:
        rt, layout = self.runtime, self._layout
        assert rt is not None and layout is not None
        bs, M, tr = self.block_size, layout.blocks_per_request, self._tail_rows(layout)
        caps = {} if max_cached_tokens is None else {"max_cached_tokens": max_cached_tokens}
        # a row with no new token computes none: its full blocks are all read, its tail restored
        idle = [o == n for o, n in zip(fwd.old_len, fwd.new_len, strict=True)]
        positions = [self._key_positions(r) for r in fwd.requests]
        if any(p is not None for p in positions):
            caps["positions"] = positions
        cached = rt.begin_forward(
            [self._key_tokens(r) for r in fwd.requests], fwd.block_table.cpu().tolist(), idle=idle, **caps
        )
        for r, (c, old) in enumerate(zip(cached, fwd.old_len, strict=True)):
            if old > 0 and c < old // bs * bs:
                rt.end_forward()
                raise StoreMissError(
                    f"KVCore.begin_forward: the host store no longer holds blocks of request {r} ({c} of "
                    f"{old // bs * bs} cached tokens found); raise the store capacity (layerwise.store.capacity_bytes)"
                )
        dev = self.spec.device
        p = _Pass(cached=cached)
        p.write = fwd.pos >= torch.tensor(cached, dtype=torch.int64, device=dev)[fwd.row]
        moves = tail_moves(fwd.slots, cached, fwd.old_len, fwd.new_len, bs, M * bs, tr, dev)
        p.tail_restore, p.tail_keep = moves
        self._pass = p

    def end_forward(self, fwd: ForwardPlan) -> None:
        self._pass = None
        if self.runtime is not None:
            self.runtime.end_forward()

    # -------------------------------------------------------------------------------- retries
    def retry_caps(self, fwd: ForwardPlan, caps: list[int] | None, exc: BaseException) -> list[int] | None:
        """The prefix caps of the next try of ``fwd``, which raised ``exc``; ``None`` when it cannot run
        again (another error, blocks of the requests' earlier tokens missing, or earlier tokens in a partial
        block whose device tail the failed try may have overwritten)."""
        rt, p = self.runtime, self._pass
        if not isinstance(exc, PrefixEvictedError) or rt is None or p is None or not fwd.layerwise:
            return None
        if len(exc.usable_tokens) != len(p.cached) or any(old % self.block_size for old in fwd.old_len):
            return None
        if any(u < old for u, old in zip(exc.usable_tokens, fwd.old_len, strict=True)):
            return None
        return rt.retry_caps(p.cached, caps, exc)

    def restart(self, fwd: ForwardPlan, caps: list[int]) -> None:
        """Close ``fwd``'s failed pass and begin it again with the prefixes capped at ``caps``."""
        assert self.runtime is not None
        self._pass = None
        self.runtime.end_aborted_forward()
        self.begin_forward(fwd, caps)

    # --------------------------------------------------------------------------- layer hooks
    def _hook(self, method: str, layer: int, caches: Sequence[torch.Tensor] | None) -> None:
        if self._pass is None or self.runtime is None:
            return  # a forward that does not run the layerwise pipeline
        own = None if caches is None else list(caches)[: self.components]
        getattr(self.runtime, method)(layer, own)

    def wait_layer(self, layer: int, caches: Sequence[torch.Tensor] | None = None) -> None:
        self._hook("wait_layer", layer, caches)

    def prefetch_layer(self, layer: int, caches: Sequence[torch.Tensor] | None = None) -> None:
        self._hook("prefetch_layer", layer, caches)

    def save_layer(self, layer: int, caches: Sequence[torch.Tensor] | None = None) -> None:
        self._hook("save_layer", layer, caches)

    # ------------------------------------------------------------------------------ per layer
    def before_write(self, layer: int, fwd: ForwardPlan) -> None:
        """The layer's buffer free and its cached prefix loaded; the next layers' loads issued."""
        self.wait_layer(layer)
        self.prefetch_layer(layer)

    def after_write(self, layer: int, fwd: ForwardPlan) -> None:
        """The layer's new full blocks saved to the store, asynchronously."""
        self.save_layer(layer)

    def layer_caches(self, layer: int) -> list[torch.Tensor]:
        return [] if self.runtime is None else list(self.runtime.layer_caches(layer))

    def write(self, layer: int, fwd: ForwardPlan, rows: NewRows) -> None:
        p, rt = self._pass, self.runtime
        assert p is not None and p.write is not None and rt is not None
        comps = [c.view(-1, c.shape[-1]) for c in rt.layer_caches(layer)]
        tails = [t.view(-1, t.shape[-1]) for t in self._tails.layers[layer]]
        news = [latent_fp8_rows(fwd, layer, rows)] if self.kv_fp8 else [rows.kv_c, rows.k_pe]
        if self.indexed:
            assert rows.index_k is not None
            news.append(
                index_fp8_rows(fwd, layer, rows) if self.index_fp8 else rows.index_k.to(self.spec.dtype)
            )
        w = p.write
        for comp, tail, new in zip(comps, tails, news, strict=True):
            if p.tail_restore is not None:
                comp.index_copy_(0, p.tail_restore[1], tail[p.tail_restore[0]])
            comp.index_copy_(0, fwd.phys[w], new[w])
            if p.tail_keep is not None:
                tail.index_copy_(0, p.tail_keep[1], comp[p.tail_keep[0]])

    def keys(self, layer: int, fwd: ForwardPlan) -> KeyRows | None:
        if not fwd.layerwise or self.runtime is None or self._layout is None:
            return None
        comps = self.runtime.layer_caches(layer)
        c = comps[0].view(-1, comps[0].shape[-1])
        pe = c[:, :0] if self.kv_fp8 else comps[1].view(-1, comps[1].shape[-1])
        rows = self._layout.blocks_per_request * self.block_size
        return KeyRows(c, pe, [s * rows for s in fwd.slots], fp8=self.kv_fp8)

    def read(
        self, layer: int, requests: Sequence[Request], part: str, start: int = 0, *, stored: bool = False
    ) -> list[torch.Tensor] | None:
        """The requests' full blocks from the host store (each read returns the block's record of every
        layer: the store keeps one record per layer and block) and the partial last block from the device
        tail. ``None`` once the buffers were released (decode on the sparse backend) or for the indexer
        keys of buffers that do not carry them; ``RuntimeError`` when the store no longer holds a block, or
        for the latent KV kept as FP8 rows without ``stored`` (``"kv_c"`` then gives the FP8 rows)."""
        rt, spec, bs = self.runtime, self.spec, self.block_size
        if rt is None or not self._tails or (part == "index_k" and not self.indexed):
            return None
        if (self.index_fp8 if part == "index_k" else self.kv_fp8) and not stored:
            what = "indexer keys" if part == "index_k" else "latent KV"
            raise RuntimeError(
                f"the layer buffers keep the {what} as FP8 rows (sparse.kv_dtype / indexer_dtype 'fp8_e4m3'), "
                f"which do not give the model's {what} back exactly; use the model's dtype to read it"
            )
        if part not in self.parts:
            return None  # FP8 rows: the rotary part is inside the latent rows
        at = self.parts.index(part)
        out: list[torch.Tensor] = []
        for r in requests:
            full = r.length // bs
            keys, positions = self._key_tokens(r), self._key_positions(r)
            parts: list[torch.Tensor] = []
            for block in range(start // bs, full):
                record = stored_block(rt, r.id, keys, positions, block, "reading the cache")
                parts.append(record[layer][at].to(spec.device))
            parts.append(self._tails.layers[layer][at][r.slot, : r.length - full * bs])
            skip = start - start // bs * bs
            out.append(torch.cat(parts)[skip:])  # a new tensor: neither the store's nor the tail's
        return out

    def indexer(self, layer: int, fwd: ForwardPlan) -> IndexerView | None:
        if not self.indexed or self.runtime is None:
            return None
        keys = self.runtime.layer_caches(layer)[-1]
        fmt = "fp8_e4m3" if self.index_fp8 else "bf16"
        return IndexerView((keys,), fwd.block_table, self.spec.index_topk, fmt)

    # ------------------------------------------------------------------------------ accounting
    def device_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        if self.runtime is not None:
            for layer in range(self.spec.num_layers):
                out += list(self.runtime.layer_caches(layer))
        return out + self._tails.tensors()

    def stats(self) -> dict[str, float]:
        lw = self._totals.snapshot(self.runtime)
        store = self.store.counters.snapshot()
        return {
            "bytes_h2d": lw["bytes_loaded"],
            "bytes_d2h": lw["bytes_saved"],
            "layer_loads": lw["loads"],
            "layer_saves": lw["saves"],
            "store_hits": lw["store_hits"],
            "store_misses": lw["store_misses"],
            "corrupt_records": store.get("corrupt_records", 0),
            "store_errors": store.get("store_errors", 0) + lw["store_errors"],
            "forward_retries": lw["forward_retries"],
        }

    def close(self) -> None:
        self.free()
        close = getattr(self.store, "close", None)
        if close is not None:
            close()

"""``KVPPBackend``: KV layer parallelism as a KV backend (DESIGN §8).

Every rank of the group runs the same model replica and the same forwards. Each layer's bundle (``c_kv``,
``k_pe`` — or with ``kv_dtype="fp8_e4m3"`` one ``kv_fp8`` component of DeepSeek's FP8 latent rows, quantized
on write and read dequantized by attention — [, indexer key]) is paged ``[num_blocks, block_size, D]`` in the KVPP runtime's views: an owned
layer's persistent buffer, another layer's scratch buffer. ``begin_forward`` schedules the forward with the
blocks holding each request's earlier tokens; :meth:`KVPPBackend.before_write`, which the core calls before
each layer's write, waits for the owner's broadcast of the layer (which starts the next layer's; in a graph
whose attention the core does not drive, the ``kvpp_wait_layer`` / ``kvpp_prefetch_layer`` ops do); every
rank writes the new rows itself and attends over the view; ``end_forward`` completes the forward. Sizes are fixed per sequence (no growth in place).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_kvoffload.kv.backend import IndexerView, KeyRows, KVBackend, NewRows, row_parts
from torch_kvoffload.kv.forward import ForwardPlan
from torch_kvoffload.kv.fp8_rows import (
    FP8_KV,
    check_indexer_format,
    check_kv_format,
    index_fp8_rows,
    latent_fp8_rows,
)
from torch_kvoffload.kv.layout import KVLayout
from torch_kvoffload.kv.requests import Request
from torch_kvoffload.kv.spec import ModelSpec
from torch_kvoffload.kv.totals import RuntimeTotals
from torch_kvoffload.kvpp.build import build_kvpp_runtime
from torch_kvoffload.kvpp.config import KVPPConfig, resolve_kvpp_config
from torch_kvoffload.kvpp.groups import create_kvpp_group
from torch_kvoffload.kvpp.layout import BundleSpec
from torch_kvoffload.kvpp.ownership import assign_owners
from torch_kvoffload.kvpp.runtime import KVPPRuntime

__all__ = ["KVPPBackend"]

_TOTALS = ("broadcasts", "broadcast_spans", "bytes_broadcast", "broadcast_seconds", "waits", "wait_seconds")


def _world_size() -> int:
    """World size of the default process group (``ValueError`` when torch.distributed is not initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "KVPP needs torch.distributed initialised (init_process_group) on every rank of its group before "
            "the model is offloaded"
        )
    return dist.get_world_size()


def _check_tensor_parallel(spec: ModelSpec, cfg: KVPPConfig) -> None:
    """A tensor-parallel model's KVPP group is its TP group: ``tp_size * pcp_size`` must equal it."""
    if spec.tp is not None and cfg.tp_size * cfg.pcp_size != spec.tp.size:
        raise ValueError(
            f"the model is sharded over a tensor-parallel group of {spec.tp.size} ranks but kvpp asks for "
            f"tp_size * pcp_size = {cfg.tp_size} * {cfg.pcp_size}; the KVPP group is the TP group (leave "
            "tp_size unset and pcp_size at 1: a tp_plan model has no context-parallel dimension)"
        )


class KVPPBackend(KVBackend):
    """This rank's KVPP over ``spec``'s KV (see the module docstring); the scheduler is registered for the
    ``kvpp_*`` ops under ``name``.

    ``ValueError`` naming the model when KVPP cannot run in the default process group.
    """

    name = "KVPP"

    def __init__(self, spec: ModelSpec, options: KVPPConfig, *, block_size: int, name: str) -> None:
        try:
            check_kv_format(options.kv_dtype, spec, "OffloadConfig.kvpp")
            check_indexer_format(options.indexer_dtype, spec, "OffloadConfig.kvpp")
            self.config: KVPPConfig = resolve_kvpp_config(options, spec, world_size=_world_size())
            _check_tensor_parallel(spec, self.config)
        except ValueError as exc:
            raise ValueError(f"torch_kvoffload cannot offload {spec.model_class}: {exc}") from exc
        self.spec, self.block_size, self.runtime_name = spec, block_size, name
        cfg = self.config
        self.kv_fp8 = cfg.kv_dtype == FP8_KV
        self.index_fp8 = spec.has_indexer and cfg.indexer_dtype == FP8_KV
        #: the bundle's components in order (FP8 latent rows hold the RoPE part)
        self.parts = row_parts(self.kv_fp8, spec.has_indexer)
        self.group = create_kvpp_group(dp=1, pp=1, pcp=cfg.pcp_size, tp=cfg.tp_size, device=spec.device)
        if spec.tp is not None and self.group.ranks != spec.tp.ranks:
            raise ValueError(
                f"torch_kvoffload cannot offload {spec.model_class}: the KVPP group holds ranks "
                f"{list(self.group.ranks)} but the model's tensor-parallel group is {list(spec.tp.ranks)}; KVPP "
                "shards the KV over the ranks that replicate it, the TP group"
            )
        self.runtime: KVPPRuntime | None = None
        self._layout: KVLayout | None = None
        self._totals = RuntimeTotals(_TOTALS)

    @property
    def built(self) -> bool:
        return self.runtime is not None

    @property
    def owned_layers(self) -> list[int]:
        """The layers this rank keeps persistently (their owner's rows survive a forward), as the runtime's
        plan assigns them (contiguous balanced ranges; empty on a trailing rank of a group larger than the
        model's layers)."""
        owners = assign_owners(range(self.spec.num_layers), self.group.size)
        return sorted(layer for layer, owner in owners.items() if owner == self.group.local_rank)

    def can_grow(self, layout: KVLayout, live: Sequence[Request]) -> bool:
        return False  # every rank of the group numbers the blocks alike: fixed per sequence

    def resize(self, layout: KVLayout, live: Sequence[Request]) -> None:
        assert not live, "KVPP caches do not grow in place"
        self.free()
        spec = self.spec
        bundle = BundleSpec.mla(
            self.block_size, spec.kv_lora_rank, spec.rope_dim, spec.dtype,
            index_dim=spec.index_head_dim if spec.has_indexer else 0, index_dtype=spec.dtype,
            kv_fp8=self.kv_fp8, index_fp8=self.index_fp8,
        )  # fmt: skip
        self.runtime = build_kvpp_runtime(
            self.config, self.group, dict.fromkeys(range(spec.num_layers), bundle), num_blocks=layout.num_blocks,
            device=spec.device, name=self.runtime_name,
        )  # fmt: skip
        self._layout = layout

    def free(self) -> None:
        rt, self.runtime = self.runtime, None
        if rt is not None:
            self._totals.retire(rt)

    def fork(self, layout: KVLayout, src: Request, dst: Request, length: int) -> None:
        """Copy ``src``'s first ``length`` rows to ``dst``'s blocks in this rank's persistent
        bundles (its owned layers and local draft layers). Every rank forks alike, so each owner copies its
        layers; a non-owned layer's scratch view is filled by the owner's broadcast of ``dst``'s blocks at
        the next forward."""
        rt = self.runtime
        assert rt is not None and self._layout is not None
        rows = self._layout.blocks_per_request * self.block_size
        a, b, n = src.slot * rows, dst.slot * rows, length
        alloc = rt.allocation
        for layer in [*alloc.plan.owned, *alloc.draft]:
            for comp in rt.caches(layer):
                flat = comp.view(-1, comp.shape[-1])
                flat[b : b + n] = flat[a : a + n]

    def truncate(self, request: Request, length: int) -> None:
        """Nothing to drop: attention and the indexer read a request's first ``seq_lens_k`` rows only, and
        the next forward rewrites position ``length`` on before reading it."""

    def begin_forward(self, fwd: ForwardPlan) -> None:
        """Schedule the forward with the blocks holding each request's tokens before it (``int64 [B, M]``,
        ``-1`` padded): what a broadcast must bring (every rank writes the forward's new rows itself).
        Rows taken over from a store (``fwd.writes_only``) are written into the owned layers alone, with no
        broadcast: the next forward's brings them to the other ranks."""
        assert self.runtime is not None and self._layout is not None
        if fwd.writes_only:
            return
        bs, M = self.block_size, self._layout.blocks_per_request
        table = torch.full((fwd.B, M), -1, dtype=torch.int64)
        for r, (slot, old) in enumerate(zip(fwd.slots, fwd.old_len, strict=True)):
            n = -(-old // bs)
            table[r, :n] = torch.arange(slot * M, slot * M + n)
        self.runtime.scheduler.begin_forward(any(fwd.old_len), table)

    def end_forward(self, fwd: ForwardPlan) -> None:
        if self.runtime is not None and not fwd.writes_only:
            self.runtime.scheduler.end_forward()

    def before_write(self, layer: int, fwd: ForwardPlan) -> None:
        """The owner's broadcast of the layer landed (which starts the next layer's)."""
        assert self.runtime is not None
        self.runtime.scheduler.wait_layer(layer)

    def layer_caches(self, layer: int) -> list[torch.Tensor]:
        return [] if self.runtime is None else self.runtime.caches(layer)

    def write(self, layer: int, fwd: ForwardPlan, rows: NewRows) -> None:
        assert self.runtime is not None
        if fwd.writes_only and layer not in self.runtime.allocation.plan.owned:
            return  # a scratch buffer: the owner's broadcast fills it
        news = [latent_fp8_rows(fwd, layer, rows)] if self.kv_fp8 else [rows.kv_c, rows.k_pe]
        if rows.index_k is not None:
            news.append(
                index_fp8_rows(fwd, layer, rows) if self.index_fp8 else rows.index_k.to(self.spec.dtype)
            )
        for comp, new in zip(self.runtime.caches(layer), news, strict=True):
            comp.view(-1, comp.shape[-1]).index_copy_(0, fwd.phys, new)

    def keys(self, layer: int, fwd: ForwardPlan) -> KeyRows:
        assert self.runtime is not None and self._layout is not None
        comps = self.runtime.caches(layer)
        c = comps[0].view(-1, comps[0].shape[-1])
        pe = c[:, :0] if self.kv_fp8 else comps[1].view(-1, comps[1].shape[-1])
        rows = self._layout.blocks_per_request * self.block_size
        return KeyRows(c, pe, [s * rows for s in fwd.slots], fp8=self.kv_fp8)

    def indexer(self, layer: int, fwd: ForwardPlan) -> IndexerView | None:
        if not self.spec.has_indexer or self.runtime is None:
            return None
        keys = self.runtime.caches(layer)[-1]
        fmt = FP8_KV if self.index_fp8 else "bf16"
        return IndexerView((keys,), fwd.block_table, self.spec.index_topk, fmt)

    def read(
        self, layer: int, requests: Sequence[Request], part: str, start: int = 0, *, stored: bool = False
    ) -> list[torch.Tensor] | None:
        """Copies of the requests' rows from ``start`` on of an owned layer (``None`` for another: its
        scratch buffer holds a later layer's rows once the forward moved on). FP8 latent rows only with
        ``stored`` (``"kv_c"`` gives them; ``RuntimeError`` otherwise: they do not give the model's values
        back exactly)."""
        rt, layout = self.runtime, self._layout
        if rt is None or layout is None or layer not in rt.allocation.plan.owned:
            return None
        if (self.index_fp8 if part == "index_k" else self.kv_fp8) and not stored:
            what, field = (
                ("indexer keys", "indexer_dtype") if part == "index_k" else ("latent KV", "kv_dtype")
            )
            raise RuntimeError(
                f"the KVPP bundles keep the {what} as FP8 rows (kvpp.{field}={FP8_KV!r}), which do not give "
                f"the model's {what} back exactly; use the model's dtype to read it"
            )
        comps = dict(zip(self.parts, rt.caches(layer), strict=True))
        if part not in comps:
            return None
        flat = comps[part].view(-1, comps[part].shape[-1])
        rows = layout.blocks_per_request * self.block_size
        return [flat[r.slot * rows + start : r.slot * rows + r.length].clone() for r in requests]

    def device_tensors(self) -> list[torch.Tensor]:
        if self.runtime is None:
            return []
        alloc = self.runtime.allocation
        return [*alloc.persistent.values(), *alloc.draft.values(), *alloc.scratch]

    def stats(self) -> dict[str, float]:
        kv = self._totals.snapshot(self.runtime)
        alloc = self.runtime.allocation if self.runtime is not None else None
        return {
            "broadcasts": kv["broadcasts"],
            "bytes_broadcast": kv["bytes_broadcast"],
            "kvpp_waits": kv["waits"],
            "kvpp_wait_seconds": kv["wait_seconds"],
            "kvpp_broadcast_seconds": kv["broadcast_seconds"],
            "kvpp_owned_layers": len(alloc.plan.owned) if alloc is not None else 0,
            "kvpp_persistent_bytes": alloc.persistent_bytes if alloc is not None else 0,
            "kvpp_scratch_bytes": alloc.scratch_bytes if alloc is not None else 0,
        }

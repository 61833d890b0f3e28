"""Layer buffer planning: map N cache-bearing layers onto fewer physical device buffers.

Rules (see ``docs/layerwise.md``):

* ``I`` independent layers keep a dedicated physical buffer each (default: layer 0).
* The ``R = N - I`` reusable layers are bucketed by their main-KV spec (layers whose main KV differs never
  share storage). Each non-empty bucket gets at least one shared buffer; the remaining ``B - K`` buffers
  (``K`` = number of buckets) go one at a time to the bucket with the most layers per buffer (ties: the
  bucket whose first layer comes first), never more buffers than layers. With one bucket (uniform layouts)
  this gives ``I + min(B, R)`` physical buffers.
* Inside a bucket, reusable layers are assigned to its buffers round-robin in layer order.
* The indexer cache follows its main buffer: a physical buffer gets indexer storage only when some layer
  using it has an indexer, and all such layers must have the same indexer layout.
* For every layer the plan records the previous layer that used its physical buffer: that layer's save
  (and any external reader) must finish before this layer loads into the buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from torch_kvoffload._utils import check_int

__all__ = ["LayerBufferPlan", "LayerCacheSpec", "TensorSpec", "plan_layer_buffers"]


def _fail(message: str, exc: type[Exception] = ValueError) -> None:
    raise exc(f"plan_layer_buffers: {message}")


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one paged cache component: ``[num_blocks, block_size, *row_shape]``."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), t.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class LayerCacheSpec:
    """Everything one layer caches.

    ``main``: the main-KV components, e.g. ``(c_kv [nb, bs, kv_lora_rank], k_pe [nb, bs, rope_dim])``.
    ``indexer``: the optional SFA indexer components, e.g. ``(index_k [nb, bs, 128],)`` or the int8 key
    with its scale. ``is_mtp`` marks MTP / draft layers (informational: they are planned like any layer).
    """

    main: tuple[TensorSpec, ...]
    indexer: tuple[TensorSpec, ...] | None = None
    is_mtp: bool = False

    @classmethod
    def from_tensors(
        cls,
        main: Sequence[torch.Tensor],
        indexer: Sequence[torch.Tensor] | None = None,
        *,
        is_mtp: bool = False,
    ) -> LayerCacheSpec:
        return cls(
            tuple(TensorSpec.of(t) for t in main),
            None if indexer is None else tuple(TensorSpec.of(t) for t in indexer),
            is_mtp,
        )

    @property
    def main_nbytes(self) -> int:
        return sum(c.nbytes for c in self.main)

    @property
    def indexer_nbytes(self) -> int:
        return 0 if self.indexer is None else sum(c.nbytes for c in self.indexer)


@dataclass(frozen=True)
class LayerBufferPlan:
    """Assignment of logical layers to physical buffers.

    ``slots[s]``: the layers of physical buffer ``s`` in ascending order; slots are numbered by their first
    layer. ``slot_of[layer]``: the buffer of a layer. ``previous_user[layer]``: the previous layer of the
    same buffer (``None`` for its first user). ``specs`` is ``None`` when planned from a layer count.
    """

    num_layers: int
    num_shared_buffers: int
    independent_layers: tuple[int, ...]
    slots: list[list[int]]
    slot_of: dict[int, int]
    previous_user: dict[int, int | None]
    specs: tuple[LayerCacheSpec, ...] | None = None
    slot_main_specs: list[tuple[TensorSpec, ...]] | None = None
    slot_indexer_specs: list[tuple[TensorSpec, ...] | None] | None = None

    @property
    def num_physical_buffers(self) -> int:
        return len(self.slots)

    @property
    def main_bytes(self) -> int:
        """Bytes of physical main-KV storage (needs specs)."""
        self._need_specs("main_bytes")
        return sum(sum(c.nbytes for c in spec) for spec in self.slot_main_specs)

    @property
    def indexer_bytes(self) -> int:
        """Bytes of physical indexer storage (needs specs)."""
        self._need_specs("indexer_bytes")
        return sum(sum(c.nbytes for c in spec) for spec in self.slot_indexer_specs if spec is not None)

    @property
    def logical_main_bytes(self) -> int:
        """Main-KV bytes without sharing: every layer its own buffer (needs specs)."""
        self._need_specs("logical_main_bytes")
        return sum(s.main_nbytes for s in self.specs)

    @property
    def footprint_ratio(self) -> float:
        """Physical main-KV bytes / logical main-KV bytes; ``physical / N`` when planned from a count."""
        if self.specs is None:
            return self.num_physical_buffers / self.num_layers
        return self.main_bytes / self.logical_main_bytes

    def _need_specs(self, what: str) -> None:
        if self.specs is None:
            raise ValueError(f"LayerBufferPlan.{what}: the plan was made from a layer count, not cache specs")

    def describe(self) -> str:
        """One line per physical buffer: its layers."""
        lines = []
        for s, layers in enumerate(self.slots):
            kind = "independent" if layers[0] in self.independent_layers else "shared"
            lines.append(f"buffer {s} ({kind}): layers {layers}")
        return "\n".join(lines)


def _check_tensor_spec(where: str, t: object) -> TensorSpec:
    if isinstance(t, torch.Tensor):
        t = TensorSpec.of(t)
    if not isinstance(t, TensorSpec):
        _fail(f"{where} must be a TensorSpec or a tensor, got {type(t).__name__}", TypeError)
    if not isinstance(t.dtype, torch.dtype):
        _fail(f"{where}.dtype must be a torch.dtype, got {t.dtype!r}", TypeError)
    if len(t.shape) < 2:
        _fail(f"{where} must have shape [num_blocks, block_size, ...], got {list(t.shape)}")
    for d in t.shape:
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
            _fail(f"{where} must have positive int dimensions, got {list(t.shape)}")
    return t


def _check_layer_spec(layer: int, spec: object) -> LayerCacheSpec:
    if not isinstance(spec, LayerCacheSpec):
        _fail(f"specs[{layer}] must be a LayerCacheSpec, got {type(spec).__name__}", TypeError)
    if len(spec.main) == 0:
        _fail(f"specs[{layer}].main must hold at least one component, got none")
    main = tuple(_check_tensor_spec(f"specs[{layer}].main[{i}]", c) for i, c in enumerate(spec.main))
    indexer = None
    if spec.indexer is not None:
        if len(spec.indexer) == 0:
            _fail(f"specs[{layer}].indexer must be None or hold at least one component, got an empty tuple")
        indexer = tuple(
            _check_tensor_spec(f"specs[{layer}].indexer[{i}]", c) for i, c in enumerate(spec.indexer)
        )
    lead = main[0].shape[:2]
    for part, comps in (("main", main), ("indexer", indexer or ())):
        for i, c in enumerate(comps):
            if c.shape[:2] != lead:
                _fail(
                    f"specs[{layer}].{part}[{i}] has [num_blocks, block_size] = {list(c.shape[:2])}, "
                    f"expected {list(lead)} like main[0]: all components of a layer are paged alike"
                )
    return LayerCacheSpec(main, indexer, bool(spec.is_mtp))


def _resolve_independent(independent: Sequence[int] | Literal["all"], n: int) -> tuple[int, ...]:
    if isinstance(independent, str):
        if independent != "all":
            _fail(f"'independent_layers' must be a sequence of ints or 'all', got {independent!r}")
        return tuple(range(n))
    if not isinstance(independent, Sequence):
        _fail(
            f"'independent_layers' must be a sequence of ints or 'all', got {type(independent).__name__}",
            TypeError,
        )
    out: list[int] = []
    for i, raw in enumerate(independent):
        v = check_int("plan_layer_buffers", f"'independent_layers[{i}]'", raw)
        if not -n <= v < n:
            _fail(f"'independent_layers[{i}]' is {v}, expected a layer in [-{n}, {n}) for {n} layers")
        v %= n
        if v in out:
            _fail(f"'independent_layers' names layer {v} more than once (negative indices wrap)")
        out.append(v)
    return tuple(sorted(out))


def _split_buffers(buckets: list[list[int]], b: int) -> list[int]:
    """Buffers per bucket: one each, then the rest to the bucket with most layers per buffer."""
    counts = [1] * len(buckets)
    for _ in range(max(0, b - len(buckets))):
        best, best_load = -1, 0.0
        for k, layers in enumerate(buckets):
            if counts[k] >= len(layers):
                continue
            load = len(layers) / counts[k]
            if load > best_load:
                best, best_load = k, load
        if best < 0:
            break
        counts[best] += 1
    return counts


def plan_layer_buffers(
    layers: int | Sequence[LayerCacheSpec],
    num_shared_buffers: int,
    independent_layers: Sequence[int] | Literal["all"] = (0,),
) -> LayerBufferPlan:
    """Plan which physical buffer each cache-bearing layer uses.

    Parameters
    ----------
    layers : int or sequence of LayerCacheSpec
        The number of cache-bearing layers (uniform layouts), or one spec per layer, MTP layers included.
    num_shared_buffers : int
        ``B >= 1``, the shared buffers the reusable layers rotate through (split across spec buckets as
        described in the module docstring).
    independent_layers : sequence of int or ``"all"``
        Layers with a dedicated buffer; negative indices wrap; ``"all"`` disables sharing.

    Raises ``TypeError`` for non-int counts / layers (booleans included) or wrong spec types, and
    ``ValueError`` for ``B < 1``, out-of-range or duplicate layers, components with mismatched
    ``[num_blocks, block_size]``, or layers of one buffer with different indexer layouts.
    """
    specs: tuple[LayerCacheSpec, ...] | None
    if isinstance(layers, bool):
        _fail("'layers' must be a layer count or a sequence of LayerCacheSpec, got bool", TypeError)
    if isinstance(layers, int):
        n = layers
        if n < 1:
            _fail(f"'layers' must be at least 1, got {n}")
        specs = None
    elif isinstance(layers, Sequence) and not isinstance(layers, str):
        specs = tuple(_check_layer_spec(i, s) for i, s in enumerate(layers))
        n = len(specs)
        if n < 1:
            _fail("'layers' must hold at least one LayerCacheSpec, got an empty sequence")
    else:
        _fail(
            f"'layers' must be a layer count or a sequence of LayerCacheSpec, got {type(layers).__name__}",
            TypeError,
        )
    b = check_int("plan_layer_buffers", "'num_shared_buffers'", num_shared_buffers)
    if b < 1:
        _fail(f"'num_shared_buffers' must be at least 1, got {b}")
    independent = _resolve_independent(independent_layers, n)

    reusable = [layer for layer in range(n) if layer not in independent]
    bucket_keys: list[tuple[TensorSpec, ...] | None] = []
    buckets: list[list[int]] = []
    for layer in reusable:
        key = None if specs is None else specs[layer].main
        if key not in bucket_keys:
            bucket_keys.append(key)
            buckets.append([])
        buckets[bucket_keys.index(key)].append(layer)

    groups: list[list[int]] = [[layer] for layer in independent]
    for bucket, count in zip(buckets, _split_buffers(buckets, b), strict=True):
        groups.extend([bucket[j] for j in range(k, len(bucket), count)] for k in range(count))
    groups.sort(key=lambda g: g[0])

    slot_of = {layer: s for s, g in enumerate(groups) for layer in g}
    previous_user: dict[int, int | None] = {}
    for g in groups:
        for j, layer in enumerate(g):
            previous_user[layer] = g[j - 1] if j else None

    slot_main: list[tuple[TensorSpec, ...]] | None = None
    slot_indexer: list[tuple[TensorSpec, ...] | None] | None = None
    if specs is not None:
        slot_main, slot_indexer = [], []
        for s, g in enumerate(groups):
            slot_main.append(specs[g[0]].main)
            idx: tuple[TensorSpec, ...] | None = None
            owner = None
            for layer in g:
                li = specs[layer].indexer
                if li is None:
                    continue
                if idx is None:
                    idx, owner = li, layer
                elif li != idx:
                    _fail(
                        f"layers {owner} and {layer} share physical buffer {s} but have different indexer "
                        f"layouts: {_fmt(idx)} vs {_fmt(li)}"
                    )
            slot_indexer.append(idx)

    return LayerBufferPlan(
        num_layers=n,
        num_shared_buffers=b,
        independent_layers=independent,
        slots=groups,
        slot_of=slot_of,
        previous_user=previous_user,
        specs=specs,
        slot_main_specs=slot_main,
        slot_indexer_specs=slot_indexer,
    )


def _fmt(comps: tuple[TensorSpec, ...]) -> str:
    return "[" + ", ".join(f"{list(c.shape)} {c.dtype}" for c in comps) + "]"

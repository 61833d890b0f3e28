"""Content keys for the host KV pool: chained block hashes of token ids, then per-layer keys.

``block_hashes`` hashes FULL blocks only: ``h_i = BLAKE2b(h_{i-1} ‖ int64-LE(tokens of block i))`` with
``h_{-1}`` derived from a salt, so two sequences with equal first ``k`` blocks get equal first ``k``
hashes, and changing one token changes the hash of its block and of every later block. A block whose KV
was computed at other positions than its own indices (``positions``: the rotary part of the KV depends
on them) hashes its positions too: ``h_i = BLAKE2b(h_{i-1} ‖ int64-LE(tokens) ‖ int64-LE(positions))``,
so equal tokens at different positions never share a key, and equal tokens at equal positions do. The
hash is stable across processes, platforms and Python versions (no ``hash()``; fixed byte order).

``layer_block_keys`` adds the model / spec id and the layer: ``kv/{model_id}/{layer}/{hash}``. Read from
the right (the hash is fixed-width hex, the layer an integer) a key names exactly one
``(model_id, layer, hash)``, so layers and models never collide.

``cache_layout_fingerprint`` makes the model id the runtimes put in their keys: the user's ``model_id``
plus a digest of the cache layout (per layer: every component's per-token shape and dtype, the block
size, the indexer layout), so two models on one store never read each other's blocks even when both
leave ``model_id`` empty, and two processes running the same model and layout share them.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from torch_kvoffload._utils import check_int

__all__ = [
    "DIGEST_SIZE",
    "FINGERPRINT_SIZE",
    "CacheComponent",
    "CacheLayout",
    "block_hashes",
    "cache_layout_fingerprint",
    "layer_block_keys",
    "layer_key_prefix",
    "parse_layer_block_key",
]

#: Bytes of each block digest (hex string of twice this length).
DIGEST_SIZE = 16
_DOMAIN = b"torch_kvoffload/block-hash/v2"
#: Bytes of the layout digest in :func:`cache_layout_fingerprint` (hex string of twice this length).
FINGERPRINT_SIZE = 8
# bump when the record format changes (component order, 16-byte aligned offsets inside one record)
_LAYOUT_DOMAIN = "torch_kvoffload/cache-layout/v1"


class CacheComponent(Protocol):
    """One cached tensor of a layer: ``shape`` is ``[num_blocks, block_size, *per_token]``."""

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def dtype(self) -> torch.dtype: ...


class CacheLayout(Protocol):
    """What one cache-bearing layer holds per block: its main components (the first sets the block size)
    and its optional indexer components. :class:`~torch_kvoffload.layerwise.planner.LayerCacheSpec` is one."""

    @property
    def main(self) -> Sequence[CacheComponent]: ...

    @property
    def indexer(self) -> Sequence[CacheComponent] | None: ...


def _tokens_int64(fn: str, token_ids: Sequence[int] | torch.Tensor, what: str = "token_ids") -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dtype == torch.bool or token_ids.dtype.is_floating_point or token_ids.dtype.is_complex:
            raise TypeError(f"{fn}: {what} must have an integer dtype, got {token_ids.dtype}")
        if token_ids.dim() != 1:
            raise ValueError(f"{fn}: {what} must be 1-D, got shape {tuple(token_ids.shape)}")
        if token_ids.dtype == torch.uint64 and token_ids.numel() and int(token_ids.max()) > 2**63 - 1:
            raise ValueError(f"{fn}: {what} must fit in int64")
        return token_ids.detach().to("cpu", torch.int64).numpy().astype("<i8", copy=False)
    if isinstance(token_ids, str | bytes):
        raise TypeError(f"{fn}: {what} must be a sequence of int or a tensor, got {type(token_ids).__name__}")
    values: list[int] = []
    for i, tok in enumerate(token_ids):
        if isinstance(tok, bool | np.bool_):
            raise TypeError(f"{fn}: {what}[{i}] is a bool, expected an int")
        try:
            v = operator.index(tok)
        except TypeError:
            raise TypeError(f"{fn}: {what}[{i}] must be an int, got {type(tok).__name__} {tok!r}") from None
        if not -(2**63) <= v < 2**63:
            raise ValueError(f"{fn}: {what}[{i}] = {v} does not fit in int64")
        values.append(v)
    return np.asarray(values, dtype="<i8")


def block_hashes(
    token_ids: Sequence[int] | torch.Tensor,
    block_size: int,
    *,
    salt: str = "",
    positions: Sequence[int] | torch.Tensor | None = None,
) -> list[str]:
    """Chained content hashes of the full blocks of ``token_ids``.

    Args:
        token_ids: 1-D token ids (a sequence of ints, or an integer tensor of shape ``[T]``).
        block_size: tokens per block (≥ 1). A trailing partial block is not hashed.
        salt: namespaces the chain (e.g. a LoRA or cache-salt id); different salts never share keys.
        positions: the model position (rotary position) each token's KV was computed at, ``[T]`` like
            ``token_ids``; ``None``: token ``t`` at position ``t``. A block whose positions are exactly its
            indices ``i * block_size ..`` hashes as without ``positions``; any other block hashes its
            positions after its tokens (and so changes every later hash of the chain).

    Returns:
        ``T // block_size`` lowercase hex strings of ``2 * DIGEST_SIZE`` characters.
    """
    fn = "block_hashes"
    check_int(fn, "block_size", block_size, minimum=1)
    if not isinstance(salt, str):
        raise TypeError(f"{fn}: salt must be a str, got {type(salt).__name__}")
    tokens = _tokens_int64(fn, token_ids)
    n_blocks = tokens.shape[0] // block_size
    n = n_blocks * block_size
    raw = memoryview(tokens[:n].tobytes())
    stride = block_size * 8
    # per block: None at its canonical positions, else the bytes of its positions
    moved: list[memoryview | None] = [None] * n_blocks
    if positions is not None:
        pos = _tokens_int64(fn, positions, "positions")
        if pos.shape[0] != tokens.shape[0]:
            raise ValueError(f"{fn}: {pos.shape[0]} positions for {tokens.shape[0]} token ids")
        off = (pos[:n] != np.arange(n, dtype=np.int64)).reshape(n_blocks, block_size).any(axis=1)
        if off.any():
            pos_raw = memoryview(pos[:n].astype("<i8", copy=False).tobytes())
            for i in np.flatnonzero(off).tolist():
                moved[i] = pos_raw[i * stride : (i + 1) * stride]
    blake2b = hashlib.blake2b
    prev = blake2b(_DOMAIN + salt.encode("utf-8"), digest_size=DIGEST_SIZE).digest()
    out: list[str] = []
    append = out.append
    for i, start in enumerate(range(0, n_blocks * stride, stride)):
        h = blake2b(prev, digest_size=DIGEST_SIZE)
        h.update(raw[start : start + stride])
        if moved[i] is not None:
            h.update(moved[i])
        prev = h.digest()
        append(prev.hex())  # not h.hexdigest(): that finalizes the hash a second time
    return out


def layer_block_keys(block_hashes: Sequence[str], layer: int, *, model_id: str = "") -> list[str]:
    """Per-layer store keys ``kv/{model_id}/{layer}/{hash}`` for the given block hashes.

    Args:
        block_hashes: hashes from :func:`block_hashes`.
        layer: the cache-bearing layer index (≥ 0).
        model_id: names the model and its KV spec (dtype, layout); different ids never share keys.
    """
    fn = "layer_block_keys"
    prefix = _layer_key_prefix(fn, layer, model_id)
    if isinstance(block_hashes, str):
        raise TypeError(f"{fn}: block_hashes must be a sequence of str, got a single str")
    keys = []
    for i, h in enumerate(block_hashes):
        if not isinstance(h, str) or not h or "/" in h:
            raise ValueError(
                f"{fn}: block_hashes[{i}] must be a non-empty hash string without '/', got {h!r}"
            )
        keys.append(prefix + h)
    return keys


def layer_key_prefix(layer: int, *, model_id: str = "") -> str:
    """``kv/{model_id}/{layer}/``: a block's key in :func:`layer_block_keys` is this plus its hash."""
    return _layer_key_prefix("layer_key_prefix", layer, model_id)


def _layer_key_prefix(fn: str, layer: int, model_id: str) -> str:
    check_int(fn, "layer", layer, minimum=0)
    if not isinstance(model_id, str):
        raise TypeError(f"{fn}: model_id must be a str, got {type(model_id).__name__}")
    return f"kv/{model_id}/{int(layer)}/"


def parse_layer_block_key(key: str) -> tuple[str, int, str]:
    """Inverse of :func:`layer_block_keys`: ``(model_id, layer, block_hash)``."""
    if not key.startswith("kv/"):
        raise ValueError(f"parse_layer_block_key: {key!r} is not a layer block key")
    head, layer, h = key[3:].rsplit("/", 2)
    return head, int(layer), h


def cache_layout_fingerprint(specs: Sequence[CacheLayout], model_id: str = "") -> str:
    """The model id for store keys of a model with cache layout ``specs``: ``"{model_id}@{digest}"``
    (``"{digest}"`` when ``model_id`` is empty).

    ``digest`` is a stable hex digest (``2 * FINGERPRINT_SIZE`` characters; BLAKE2b, the same in every
    process and platform) of the layer count and, per layer in order, each main and indexer component's
    per-token shape (``shape[2:]``) and dtype, the block size and whether the layer has an indexer. The
    pool size (``num_blocks``) and ``is_mtp`` do not enter it: they do not change what a block holds.

    Args:
        specs: one :class:`CacheLayout` (e.g. a :class:`~torch_kvoffload.layerwise.planner.LayerCacheSpec`)
            per cache-bearing layer.
        model_id: names the model (weights, revision); any str.
    """
    fn = "cache_layout_fingerprint"
    if not isinstance(model_id, str):
        raise TypeError(f"{fn}: model_id must be a str, got {type(model_id).__name__}")
    if isinstance(specs, str | bytes) or not isinstance(specs, Sequence) or not specs:
        raise ValueError(f"{fn}: specs must be a non-empty sequence of LayerCacheSpec, got {specs!r}")
    parts = [_LAYOUT_DOMAIN, f"layers={len(specs)}"]
    for i, spec in enumerate(specs):
        main = getattr(spec, "main", None)
        if not main:
            raise TypeError(f"{fn}: specs[{i}] must be a LayerCacheSpec, got {type(spec).__name__}")
        indexer = spec.indexer
        parts.append(
            f"{i}:bs={main[0].shape[1]}:main={_components(main)}:"
            f"indexer={'none' if indexer is None else _components(indexer)}"
        )
    digest = hashlib.blake2b("\n".join(parts).encode("utf-8"), digest_size=FINGERPRINT_SIZE).hexdigest()
    return f"{model_id}@{digest}" if model_id else digest


def _components(comps: Sequence[CacheComponent]) -> str:
    """``"[d1,d2]:dtype;..."``: each component's per-token shape and dtype."""
    return ";".join(f"{list(c.shape[2:])}:{str(c.dtype).removeprefix('torch.')}" for c in comps)

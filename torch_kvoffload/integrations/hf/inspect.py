"""Find the MLA / SFA attention of a Hugging Face model by structure and describe it (:class:`ModelSpec`).

An attention module is MLA when it has ``kv_a_proj_with_mqa``, ``kv_a_layernorm`` and ``kv_b_proj`` and the
model config gives ``kv_lora_rank``, ``qk_rope_head_dim``, ``qk_nope_head_dim`` and ``v_head_dim``; it has a
lightning indexer when it holds an ``indexer`` with ``wq_b``, ``wk``, ``k_norm`` and ``weights_proj`` and the
config gives ``index_topk``, ``index_head_dim`` and ``index_n_heads``. Nothing is allocated here: a model the
library cannot handle raises ``ValueError`` naming its class and the reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

__all__ = ["ModelSpec", "inspect_model", "weights_fingerprint"]

_WEIGHTS_DOMAIN = b"torch_kvoffload/weights/v1"
_HASH_CHUNK = 64 << 20  # bytes of a device tensor copied to the host at a time

_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_attention_heads")
_INDEXER_FIELDS = ("index_topk", "index_head_dim", "index_n_heads")
# cache layer types whose per-layer KV is the MLA latent (and, for "indexed_attention", the indexer key)
_SUPPORTED_LAYER_TYPES = {"full_attention", "indexed_attention"}


@dataclass(frozen=True)
class ModelSpec:
    """What the library needs to know about an MLA / SFA model.

    ``kv_lora_rank`` (Dc), ``rope_dim`` (Dr), ``qk_nope_head_dim``, ``v_head_dim``, ``num_heads`` (H);
    ``index_head_dim`` / ``index_n_heads`` / ``index_topk`` are 0 without an indexer; ``scale`` is the
    attention softmax scale; ``attention_modules[i]`` is the attention of layer ``i``. ``fingerprint``
    names the architecture and KV layout; ``weights_fingerprint`` the weights (:func:`weights_fingerprint`,
    taken by :meth:`with_weights`; ``""`` in what :func:`inspect_model` returns, which reads no weight).
    """

    model_class: str
    num_layers: int
    kv_lora_rank: int
    rope_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    num_heads: int
    dtype: torch.dtype
    device: torch.device
    scale: float
    has_indexer: bool
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    fingerprint: str
    attention_modules: tuple[torch.nn.Module, ...] = field(repr=False, compare=False)
    weights_fingerprint: str = ""

    def with_weights(self, model: torch.nn.Module) -> ModelSpec:
        """This spec with ``weights_fingerprint`` of ``model``'s weights, computed now (every byte read once).

        A value, not a view of the model: weights changed in place afterwards are not noticed (offload the
        model again), and the spec stays valid when the model is gone.
        """
        return dataclasses.replace(self, weights_fingerprint=weights_fingerprint(model))

    @property
    def main_row_bytes(self) -> int:
        """Bytes of one token's main KV (latent + rotary key) in one layer."""
        return (self.kv_lora_rank + self.rope_dim) * self.dtype.itemsize

    @property
    def indexer_row_bytes(self) -> int:
        """Bytes of one token's floating indexer key in one layer (0 without an indexer)."""
        return self.index_head_dim * self.dtype.itemsize


def _tensor_digest(name: str, t: torch.Tensor) -> bytes:
    """SHA-256 of ``t``'s bytes (device tensors are copied to the host in chunks)."""
    if t.device.type == "meta":
        raise ValueError(
            f"weights_fingerprint: {name!r} is on the meta device (not materialised); its weights cannot be "
            "fingerprinted, so KV of other weights could not be told apart"
        )
    raw = t.detach().contiguous().reshape(-1)
    raw = raw.view(torch.uint8) if raw.numel() else torch.empty(0, dtype=torch.uint8)
    h = hashlib.sha256()
    for start in range(0, raw.numel(), _HASH_CHUNK):
        h.update(raw[start : start + _HASH_CHUNK].cpu().numpy().data)  # releases the GIL
    return h.digest()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """16 hex characters of SHA-256 over every parameter and buffer of ``model``: name, dtype, shape and
    bytes, in ``named_parameters`` / ``named_buffers`` order.

    Two models of one architecture with different weights (fine-tunes) get different fingerprints, the
    same weights in another process the same one. Reads every byte once (the tensors are hashed on a
    thread pool); ``ValueError`` for a tensor on the meta device.
    """
    tensors = [*model.named_parameters(), *model.named_buffers()]
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(tensors)))) as pool:
        digests = list(pool.map(lambda item: _tensor_digest(*item), tensors))
    h = hashlib.sha256(_WEIGHTS_DOMAIN)
    for (name, t), digest in zip(tensors, digests, strict=True):
        h.update(f"{name}:{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}".encode())
        h.update(digest)
    return h.hexdigest()[:16]


def _fail(model: torch.nn.Module, reason: str) -> None:
    raise ValueError(f"torch_kvoffload cannot offload {type(model).__name__}: {reason}")


def _is_mla(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"))


def _has_indexer(module: torch.nn.Module) -> bool:
    idx = getattr(module, "indexer", None)
    return idx is not None and all(hasattr(idx, a) for a in ("wq_b", "wk", "k_norm", "weights_proj"))


def inspect_model(model: torch.nn.Module) -> ModelSpec:
    """Describe ``model``'s MLA attention; ``ValueError`` naming the class and the reason if unsupported."""
    config = getattr(model, "config", None)
    if config is None:
        _fail(model, "it has no Hugging Face 'config'")
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    attn = [m for m in model.modules() if _is_mla(m)]
    if not attn:
        _fail(
            model,
            "no MLA attention found (no module with kv_a_proj_with_mqa, kv_a_layernorm and kv_b_proj); "
            "only multi-head latent attention models are supported",
        )
    missing = [f for f in _MLA_FIELDS if getattr(config, f, None) is None]
    if missing:
        _fail(model, f"its config lacks the MLA fields {missing}")
    num_layers = getattr(config, "num_hidden_layers", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = sorted(set(layer_types) - _SUPPORTED_LAYER_TYPES)
        if other:
            _fail(model, f"hybrid KV layout: layer types {other} besides MLA attention are not supported")
    if num_layers is not None and len(attn) != num_layers:
        _fail(
            model,
            f"hybrid layout: {len(attn)} MLA attention modules for {num_layers} layers; every layer must be MLA",
        )
    idx = [getattr(m, "layer_idx", None) for m in attn]
    if sorted(i for i in idx if i is not None) != list(range(len(attn))):
        _fail(model, f"the MLA attention modules carry layer indices {idx}, expected 0..{len(attn) - 1}")
    attn.sort(key=lambda m: m.layer_idx)
    indexed = [_has_indexer(m) for m in attn]
    if any(indexed) and not all(indexed):
        _fail(model, "hybrid layout: only some layers have a lightning indexer")
    has_indexer = all(indexed)
    if has_indexer:
        missing = [f for f in _INDEXER_FIELDS if getattr(config, f, None) is None]
        if missing:
            _fail(model, f"its attention has an indexer but the config lacks {missing}")
    if getattr(config, "num_key_value_heads", config.num_attention_heads) not in (
        None,
        config.num_attention_heads,
    ):
        _fail(model, "num_key_value_heads differs from num_attention_heads (not a plain MLA layout)")
    first = attn[0]
    param = first.kv_b_proj.weight
    dims = {f: int(getattr(config, f)) for f in _MLA_FIELDS}
    extra = {f: int(getattr(config, f)) for f in _INDEXER_FIELDS} if has_indexer else {}
    scale = float(getattr(first, "scaling", (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5))
    desc = {"class": type(model).__name__, "layers": len(attn), "dtype": str(param.dtype), **dims, **extra}
    fingerprint = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    return ModelSpec(
        model_class=type(model).__name__,
        num_layers=len(attn),
        kv_lora_rank=dims["kv_lora_rank"],
        rope_dim=dims["qk_rope_head_dim"],
        qk_nope_head_dim=dims["qk_nope_head_dim"],
        v_head_dim=dims["v_head_dim"],
        num_heads=dims["num_attention_heads"],
        dtype=param.dtype,
        device=param.device,
        scale=scale,
        has_indexer=has_indexer,
        index_topk=extra.get("index_topk", 0),
        index_head_dim=extra.get("index_head_dim", 0),
        index_n_heads=extra.get("index_n_heads", 0),
        fingerprint=fingerprint,
        attention_modules=tuple(attn),
    )

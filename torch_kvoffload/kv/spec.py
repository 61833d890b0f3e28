"""``ModelSpec``: what the library needs to know about an MLA / SFA model, whatever library defined it.

A model integration (``integrations.hf.inspect`` for Hugging Face) finds the attention modules and fills a
:class:`ModelSpec`; the KV core and its backends read only the spec. :func:`weights_fingerprint` names a
model's weights (the layerwise store keys carry it).

Not a transfer: the thread pool of :func:`weights_fingerprint` hashes parameters on the host; it moves no
KV.
"""

from __future__ import annotations

import dataclasses
import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

__all__ = ["ModelSpec", "TensorParallel", "local_shard", "weights_fingerprint"]

_WEIGHTS_DOMAIN = b"torch_kvoffload/weights/v1"
_HASH_CHUNK = 64 << 20  # bytes of a device tensor copied to the host at a time


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel group a model's weights are sharded over (transformers' ``tp_plan``).

    ``size`` ranks, this process is ``rank`` among them (group-local), ``ranks`` their global ranks in
    group order, ``group`` the ``torch.distributed`` process group of the model's TP mesh. MLA's latent
    KV is replicated over the group: every rank computes the same KV rows.
    """

    size: int
    rank: int
    ranks: tuple[int, ...]
    group: object = field(repr=False, compare=False)


@dataclass(frozen=True)
class ModelSpec:
    """What the library needs to know about an MLA / SFA model.

    ``kv_lora_rank`` (Dc), ``rope_dim`` (Dr), ``qk_nope_head_dim``, ``v_head_dim``, ``num_heads`` (H: the
    heads this process computes, the local share of ``total_heads`` under tensor parallelism, ``tp``);
    ``index_head_dim`` / ``index_n_heads`` / ``index_topk`` are 0 without an indexer; ``scale`` is the
    attention softmax scale. ``fingerprint``
    names the architecture and KV layout; ``weights_fingerprint`` the weights (:func:`weights_fingerprint`,
    taken by :meth:`with_weights`; ``""`` in what a model inspection returns, which reads no weight).
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
    weights_fingerprint: str = ""
    tp: TensorParallel | None = None
    total_heads: int = 0

    @property
    def tp_size(self) -> int:
        """Ranks the attention heads are sharded over (1 without tensor parallelism)."""
        return 1 if self.tp is None else self.tp.size

    def with_weights(self, model: torch.nn.Module) -> ModelSpec:
        """This spec with ``weights_fingerprint`` of ``model``'s weights, computed now (every byte read once).

        A value, not a view of the model: weights changed in place afterwards are not noticed (offload the
        model again), and the spec stays valid when the model is gone.
        """
        return dataclasses.replace(self, weights_fingerprint=weights_fingerprint(model))


def _tensor_digest(name: str, t: torch.Tensor) -> bytes:
    """SHA-256 of ``t``'s bytes (device tensors are copied to the host in chunks)."""
    if t.device.type == "meta":
        raise ValueError(
            f"weights_fingerprint: {name!r} is on the meta device (not materialised); its weights cannot be "
            "fingerprinted, so KV of other weights could not be told apart"
        )
    t = local_shard(t)
    raw = t.detach().contiguous().reshape(-1)
    raw = raw.view(torch.uint8) if raw.numel() else torch.empty(0, dtype=torch.uint8)
    h = hashlib.sha256()
    for start in range(0, raw.numel(), _HASH_CHUNK):
        h.update(raw[start : start + _HASH_CHUNK].cpu().numpy().data)  # releases the GIL
    return h.digest()


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t``: a ``DTensor`` (a parameter of a model loaded with transformers' tensor
    parallelism, ``tp_plan="auto"``) gives its local tensor (reading it whole would be a collective), any
    other tensor is returned as is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _describe(name: str, t: torch.Tensor) -> str:
    """Name, dtype, shape and, for a ``DTensor``, its placements and this rank's coordinate in the mesh."""
    text = f"{name}:{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}"
    placements = getattr(t, "placements", None)
    if placements is not None:
        text += f":{list(map(str, placements))}@{t.device_mesh.get_coordinate()}"
    return text


def weights_fingerprint(model: torch.nn.Module) -> str:
    """16 hex characters of SHA-256 over every parameter and buffer of ``model``: name, dtype, shape and
    bytes, in ``named_parameters`` / ``named_buffers`` order.

    Two models of one architecture with different weights (fine-tunes) get different fingerprints, the
    same weights in another process the same one. Reads every byte once (the tensors are hashed on a
    thread pool); ``ValueError`` for a tensor on the meta device. A tensor-parallel ``DTensor`` contributes
    its local shard, placements and mesh coordinate: each TP rank gets its own fingerprint (no collective).
    """
    tensors = [*model.named_parameters(), *model.named_buffers()]
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(tensors)))) as pool:
        digests = list(pool.map(lambda item: _tensor_digest(*item), tensors))
    h = hashlib.sha256(_WEIGHTS_DOMAIN)
    for (name, t), digest in zip(tensors, digests, strict=True):
        h.update(_describe(name, t).encode())
        h.update(digest)
    return h.hexdigest()[:16]

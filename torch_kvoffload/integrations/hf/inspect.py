"""Find the MLA / SFA attention of a Hugging Face model by structure and describe it
(:class:`~torch_kvoffload.kv.spec.ModelSpec`).

An attention module is MLA when it has ``kv_a_proj_with_mqa``, ``kv_a_layernorm`` and ``kv_b_proj`` and the
model config gives ``kv_lora_rank``, ``qk_rope_head_dim``, ``qk_nope_head_dim`` and ``v_head_dim``; it has a
lightning indexer when it holds an ``indexer`` with ``wq_b``, ``wk``, ``k_norm`` and ``weights_proj`` and the
config gives ``index_topk``, ``index_head_dim`` and ``index_n_heads``. Nothing is allocated here: a model the
library cannot handle raises ``ValueError`` naming its class and the reason.

A model loaded with transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")``) is described
from this rank's point of view: ``num_heads`` counts the heads whose ``q_b_proj`` / ``kv_b_proj`` rows this
rank holds, ``tp`` names the TP group (the mesh's ``"tp"`` dimension). Only a head-sharded attention
(``q_b_proj`` / ``kv_b_proj`` colwise, ``o_proj`` rowwise) or a replicated one is understood: any other
sharding of the attention is a ``ValueError``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from torch_kvoffload.kv.spec import ModelSpec, TensorParallel, local_shard

__all__ = ["HFModelSpec", "inspect_model"]


@dataclass(frozen=True)
class HFModelSpec(ModelSpec):
    """The :class:`~torch_kvoffload.kv.spec.ModelSpec` of a Hugging Face model, with its attention modules
    (``attention_modules[i]``: layer ``i``'s), which only the integration uses (the KV core never sees a
    model's modules)."""

    attention_modules: tuple[torch.nn.Module, ...] = field(default=(), repr=False, compare=False)


_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_attention_heads")
_INDEXER_FIELDS = ("index_topk", "index_head_dim", "index_n_heads")
# cache layer types whose per-layer KV is the MLA latent (and, for "indexed_attention", the indexer key)
_SUPPORTED_LAYER_TYPES = {"full_attention", "indexed_attention"}


def _fail(model: torch.nn.Module, reason: str) -> None:
    raise ValueError(f"torch_kvoffload cannot offload {type(model).__name__}: {reason}")


def _is_mla(module: torch.nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"))


def _has_indexer(module: torch.nn.Module) -> bool:
    idx = getattr(module, "indexer", None)
    return idx is not None and all(hasattr(idx, a) for a in ("wq_b", "wk", "k_norm", "weights_proj"))


def _tensor_parallel(model: torch.nn.Module) -> TensorParallel | None:
    """The TP group of a model loaded with ``tp_plan`` (``None`` without tensor parallelism)."""
    mesh = getattr(model, "_device_mesh", None)
    size = int(getattr(model, "_tp_size", None) or 1)
    if mesh is None or size < 2:
        return None
    import torch.distributed as dist

    names = mesh.mesh_dim_names or ()
    group = mesh.get_group("tp") if "tp" in names else mesh.get_group()
    ranks = tuple(dist.get_process_group_ranks(group))
    if len(ranks) != size:
        _fail(model, f"its TP mesh has {len(ranks)} ranks but model.tp_size is {size}")
    return TensorParallel(size=size, rank=ranks.index(dist.get_rank()), ranks=ranks, group=group)


def _placement(t: torch.Tensor) -> str:
    """``"replicate"``, ``"rows"`` (sharded on dim 0) or another description of a parameter's sharding."""
    placements = getattr(t, "placements", None)
    if placements is None or all(p.is_replicate() for p in placements):
        return "replicate"
    if len(placements) == 1 and placements[0].is_shard(0):
        return "rows"
    return str(list(placements))


def _local_heads(model: torch.nn.Module, attn: list[torch.nn.Module], dims: dict[str, int]) -> int:
    """Heads this rank computes: all of them, or its colwise shard under tensor parallelism (the same in
    every layer). ``ValueError`` for a sharding the absorbed attention cannot follow."""
    nope, rope, v = dims["qk_nope_head_dim"], dims["qk_rope_head_dim"], dims["v_head_dim"]
    heads = set()
    for m in attn:
        q_proj = m.q_proj if getattr(m, "q_lora_rank", None) is None else m.q_b_proj
        q, kv, o = q_proj.weight, m.kv_b_proj.weight, m.o_proj.weight
        replicated = [m.kv_a_proj_with_mqa, m.kv_a_layernorm, getattr(m, "indexer", None)]
        sharded = [n for part in replicated if part is not None for n, p in part.named_parameters()
                   if _placement(p) != "replicate"]  # fmt: skip
        if sharded:
            _fail(
                model,
                f"layer {m.layer_idx}: the latent projection or the indexer is sharded ({sharded}); the "
                "library needs them replicated on every tensor-parallel rank",
            )
        kinds = (_placement(q), _placement(kv), _placement(o))
        if kinds == ("replicate",) * 3:
            heads.add(dims["num_attention_heads"])
            continue
        o_kind = getattr(o, "placements", None)
        if kinds[:2] != ("rows", "rows") or o_kind is None or len(o_kind) != 1 or not o_kind[0].is_shard(1):
            _fail(
                model,
                f"layer {m.layer_idx}'s attention is sharded as q {kinds[0]}, kv_b_proj {kinds[1]}, o_proj "
                f"{kinds[2]}; only heads sharded across tensor-parallel ranks (q / kv_b_proj colwise, "
                "o_proj rowwise) or a replicated attention are supported",
            )
        local_q, local_kv = local_shard(q).shape[0], local_shard(kv).shape[0]
        if (
            local_q % (nope + rope)
            or local_kv % (nope + v)
            or local_q // (nope + rope) != local_kv // (nope + v)
        ):
            _fail(model, f"layer {m.layer_idx}: q and kv_b_proj shards do not hold whole, matching heads")
        heads.add(local_q // (nope + rope))
    if len(heads) != 1:
        _fail(model, f"the layers hold different numbers of local heads {sorted(heads)}")
    return heads.pop()


def inspect_model(model: torch.nn.Module) -> HFModelSpec:
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
        shared = [m.layer_idx for m in attn if getattr(m, "skip_topk", False)]
        if shared:  # GLM-5 (glm_moe_dsa) with config.indexer_types "shared"
            _fail(
                model,
                f"layers {shared} reuse the previous layer's indexer top-k (cross-layer top-k sharing, "
                "config.indexer_types 'shared'); the library selects every layer's top-k with its own indexer",
            )
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
    tp = _tensor_parallel(model)
    heads = _local_heads(model, attn, dims)
    extra = {f: int(getattr(config, f)) for f in _INDEXER_FIELDS} if has_indexer else {}
    scale = float(getattr(first, "scaling", (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5))
    desc = {"class": type(model).__name__, "layers": len(attn), "dtype": str(param.dtype), **dims, **extra}
    fingerprint = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    return HFModelSpec(
        model_class=type(model).__name__,
        num_layers=len(attn),
        kv_lora_rank=dims["kv_lora_rank"],
        rope_dim=dims["qk_rope_head_dim"],
        qk_nope_head_dim=dims["qk_nope_head_dim"],
        v_head_dim=dims["v_head_dim"],
        num_heads=heads,
        total_heads=dims["num_attention_heads"],
        tp=tp,
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

"""How ``inspect_model`` reads an attention sharded by transformers' tensor parallelism, in one process:
the sharded weights are stand-ins carrying a ``DTensor``'s ``placements`` and local shard (a real
``tp_plan`` model runs in tests/hf/test_hf_kvpp.py and tests/hf/test_hf_tp_offload.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import build_model

from torch_kvoffload.integrations.hf import inspect_model

Shard = pytest.importorskip("torch.distributed.tensor").Shard
Replicate = pytest.importorskip("torch.distributed.tensor").Replicate


def _sharded(full: torch.Tensor, placement, rank: int, size: int) -> torch.nn.Parameter:
    """A parameter carrying what the inspection reads of a ``DTensor``: ``placements`` and ``to_local()``."""
    param = torch.nn.Parameter(full, requires_grad=False)
    local = full.chunk(size, dim=placement.dim)[rank] if isinstance(placement, Shard) else full
    param.placements = (placement,)
    param.to_local = lambda: local
    return param


def _shard(model, placements: dict[str, object], size: int = 2, rank: int = 0, layers=None):
    for attn in (m.self_attn for i, m in enumerate(model.model.layers) if layers is None or i in layers):
        for name, placement in placements.items():
            lin = attn.get_submodule(name)
            lin.weight = _sharded(lin.weight.detach(), placement, rank, size)
    return model


HEADS = {"q_b_proj": Shard(0), "kv_b_proj": Shard(0), "o_proj": Shard(1)}


@pytest.mark.parametrize("size", [2, 4])
def test_head_sharded_attention_gives_the_local_heads(size):
    model = _shard(build_model("deepseek_v32", num_hidden_layers=2), HEADS, size=size)
    spec = inspect_model(model)
    assert (spec.num_heads, spec.total_heads) == (4 // size, 4)


def test_replicated_attention_keeps_every_head():
    model = _shard(build_model("deepseek_v32", num_hidden_layers=2), dict.fromkeys(HEADS, Replicate()))
    assert inspect_model(model).num_heads == 4


@pytest.mark.parametrize(
    "placements, match",
    [
        ({**HEADS, "o_proj": Shard(0)}, r"o_proj rows; only heads sharded"),
        ({**HEADS, "kv_b_proj": Shard(1)}, r"kv_b_proj \[Shard\(dim=1\)\]"),
        ({**HEADS, "kv_a_proj_with_mqa": Shard(0)}, r"latent projection or the indexer is sharded"),
        ({**HEADS, "indexer.wq_b": Shard(0)}, r"latent projection or the indexer is sharded"),
    ],
)
def test_other_shardings_of_the_attention_are_refused(placements, match):
    model = _shard(build_model("deepseek_v32", num_hidden_layers=2), placements)
    with pytest.raises(ValueError, match=r"cannot offload DeepseekV32ForCausalLM: layer 0.*" + match):
        inspect_model(model)


def test_layers_with_different_local_heads_are_refused():
    model = build_model("deepseek_v32", num_hidden_layers=2)
    _shard(model, HEADS, size=2, layers={0})
    with pytest.raises(ValueError, match=r"different numbers of local heads \[2, 4\]"):
        inspect_model(model)

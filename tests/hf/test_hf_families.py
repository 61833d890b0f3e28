"""Other transformers MLA / DSA families with the same code: greedy tokens equal the unmodified model.

The eager adapter follows the DeepSeek-V3 attention code, so it serves the families whose modeling files
share it (Glm4MoeLite, Youtu) here; the families whose attention code differs (DeepseekV2's complex rotary,
MiniCPM3's half-split rotary, GlmMoeDsa's interleaved indexer rotary) it runs through its per-family table,
tested in ``test_hf_families_eager.py``. The compile path rewrites the captured graph from its op patterns.
Tiny random configs, the same shape as ``tests/support/hf_models.py``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from support.hf_models import _COMMON, _INDEXER, left_padded_batch

import torch_kvoffload

NEW_TOKENS = 16


def _model(config_name: str, indexer: bool, **overrides) -> torch.nn.Module:
    cfg = getattr(transformers, config_name)(**{**_COMMON, **(_INDEXER if indexer else {}), **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _generate(model: torch.nn.Module) -> torch.Tensor:
    ids, mask = left_padded_batch([20, 13])
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)


@pytest.mark.parametrize("config_name", ["Glm4MoeLiteConfig", "YoutuConfig"])
def test_eager_offload_serves_families_sharing_the_deepseek_attention(config_name):
    want = _generate(_model(config_name, indexer=False))
    got = _generate(torch_kvoffload.offload(_model(config_name, indexer=False), {"layerwise": {}}))
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("config_name", "indexer", "config"),
    [
        ("DeepseekV2Config", False, {"layerwise": {}, "block_size": 8}),
        ("MiniCPM3Config", False, {"layerwise": {}, "block_size": 8}),
        ("GlmMoeDsaConfig", True, {"layerwise": {}, "sparse": {}, "block_size": 8}),
    ],
)
def test_compile_serves_families_with_their_own_attention_code(config_name, indexer, config):
    torch._dynamo.reset()
    # one layer: the subject is each family's attention code, which every layer runs alike (Dynamo traces every
    # layer of every graph, seconds each)
    want = _generate(_model(config_name, indexer, num_hidden_layers=1))
    model = torch_kvoffload.compile(_model(config_name, indexer, num_hidden_layers=1), config)
    got = _generate(model)
    assert torch.equal(got, want)
    assert torch_kvoffload.stats(model)["layer_saves"] > 0  # the KV really went through the host store

"""Store keys of offloaded Hugging Face models: models of one architecture with different weights (two
fine-tunes) sharing one host store never read each other's KV; the same weights do.

The reference is the unmodified model with the same weights generating the same prompt.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import build_model, left_padded_batch

import torch_kvoffload
from torch_kvoffload.integrations.hf import session_of
from torch_kvoffload.integrations.hf.inspect import inspect_model
from torch_kvoffload.kv.spec import weights_fingerprint
from torch_kvoffload.layerwise import backend as layerwise_backend
from torch_kvoffload.store import LocalKVStore, parse_layer_block_key

BS = 8
NEW = 6


def _generate(model, ids, new=NEW):
    return model.generate(input_ids=ids, attention_mask=None, max_new_tokens=new, do_sample=False)


@pytest.fixture
def shared_store(monkeypatch):
    """One LocalKVStore every session of the test builds its store as (a pool several models share)."""
    store = LocalKVStore(64 << 20)
    monkeypatch.setattr(layerwise_backend, "build_store", lambda config: store)
    return store


def _model_ids(store):
    return {parse_layer_block_key(k)[0] for k in store.lru_keys()}


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_fine_tunes_on_one_store_do_not_share_kv(family, shared_store):
    prompt, _ = left_padded_batch([27], seed=5)  # 3 full blocks
    cfg = {"layerwise": {}, "block_size": BS}
    base = torch_kvoffload.offload(build_model(family, seed=0), cfg)
    # taken at offload, before any forward
    assert session_of(base).spec.weights_fingerprint == weights_fingerprint(build_model(family, seed=0))
    assert torch.equal(_generate(base, prompt), _generate(build_model(family, seed=0), prompt))
    first_ids = _model_ids(shared_store)
    assert len(first_ids) == 1 and len(shared_store) > 0

    tuned = torch_kvoffload.offload(build_model(family, seed=1), cfg)  # same config, other weights
    with torch.no_grad():
        tuned(input_ids=prompt)  # one prefill of the prompt the first model stored: nothing of it is found
    assert torch_kvoffload.stats(tuned)["store_hits"] == 0
    assert torch.equal(_generate(tuned, prompt), _generate(build_model(family, seed=1), prompt))
    assert len(_model_ids(shared_store)) == 2  # its own namespace beside the first model's

    # the same weights in another model object (and a fresh session) do hit the first model's records
    again = torch_kvoffload.offload(build_model(family, seed=0), cfg)
    with torch.no_grad():
        again(input_ids=prompt)
    assert torch_kvoffload.stats(again)["store_hits"] == 3  # the prompt's full blocks
    assert torch.equal(_generate(again, prompt), _generate(build_model(family, seed=0), prompt))
    assert _model_ids(shared_store) >= first_ids and len(_model_ids(shared_store)) == 2
    for m in (base, tuned, again):
        session_of(m).close()


def test_a_single_changed_weight_changes_the_fingerprint():
    model = build_model("deepseek_v3", num_hidden_layers=2)
    fp = weights_fingerprint(model)
    assert fp == weights_fingerprint(build_model("deepseek_v3", num_hidden_layers=2))  # deterministic
    spec = inspect_model(model).with_weights(model)
    assert spec.weights_fingerprint == fp
    with torch.no_grad():
        p = model.model.layers[1].self_attn.kv_b_proj.weight
        p.view(-1)[7] = torch.nextafter(p.view(-1)[7], torch.tensor(float("inf")))  # one ulp of one element
    assert weights_fingerprint(model) != fp
    assert spec.weights_fingerprint == fp  # a value taken once, not a view of the model
    # a dtype change with equal values is another model too
    assert weights_fingerprint(build_model("deepseek_v3", num_hidden_layers=2, dtype=torch.bfloat16)) != fp


def test_meta_weights_cannot_be_fingerprinted():
    with torch.device("meta"):
        model = build_model("deepseek_v3", num_hidden_layers=1)
    with pytest.raises(ValueError, match="meta device"):
        weights_fingerprint(model)

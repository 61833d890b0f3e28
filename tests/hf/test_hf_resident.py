"""Resident sparse attention (``OffloadConfig(sparse={"offload": False})``) on tiny Hugging Face V3.2
models: absorbed sparse MLA attention over the lightning indexer's top-k with the whole latent KV on the
device, no host pool and no hot buffers.

References: the unmodified model (a deep copy taken before offloading, generating from the same
left-padded batches), and the offloaded sparse mode (same selection, same attention: the same tokens).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import ONE_LAYER, build_model, indexer_boundary_ties, left_padded_batch

import torch_kvoffload
from torch_kvoffload import OffloadConfig
from torch_kvoffload.integrations.hf import session_of

BS = 8
RESIDENT = {"sparse": {"offload": False}, "block_size": BS}
MODES = {
    "resident": RESIDENT,
    "resident+layerwise": {**RESIDENT, "layerwise": {}},
}
# (batch, longest prompt, max_new_tokens) of each call; rows of a batch are 0..2 tokens shorter
CALLS = [(2, 14, 10), (3, 21, 6), (1, 5, 8)]


def _batch(b: int, p: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded_batch([max(1, p - (r % 3)) for r in range(b)], seed=seed)


def _generate(model, ids, mask, new):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _reference_run(overrides, calls):
    """The model to offload and, per call, ``(ids, mask, new, unmodified tokens)``."""
    model = build_model("deepseek_v32", **overrides)
    ref = copy.deepcopy(model)
    out = []
    for i, (b, p, new) in enumerate(calls):
        ids, mask = _batch(b, p, seed=10 + i)
        want = _generate(ref, ids, mask, new)
        rows = [want[r][mask[r].bool().tolist() + [True] * new] for r in range(b)]
        assert indexer_boundary_ties(ref, rows) == 0  # equal tokens need a top-k without boundary ties
        out.append((ids, mask, new, want))
    return model, out


def _resident_bytes(config, batch: int, tokens: int) -> int:
    """What the resident mode holds after a generate: per layer and request, ``tokens`` rows of latent,
    rotary key and indexer key in the model's dtype (fp32 here); no hot buffer, no layer buffer."""
    width = config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim
    return config.num_hidden_layers * batch * tokens * width * 4


@pytest.mark.parametrize("mode", list(MODES))
def test_generate_sequence_equals_unmodified_model(mode):
    """Greedy tokens of several generate calls (other batch sizes and prompt lengths) equal the
    unmodified model's; the device KV after each is the resident formula; nothing moves to the host
    except layerwise's prefill saves."""
    model, calls = _reference_run({}, CALLS)
    config = model.config
    model = torch_kvoffload.offload(model, MODES[mode])
    for ids, mask, new, want in calls:
        got = _generate(model, ids, mask, new)
        assert torch.equal(got, want)
        s = torch_kvoffload.stats(model)
        tokens = ids.shape[1] + new - 1
        assert s["device_kv_bytes"] == _resident_bytes(config, ids.shape[0], tokens)
        assert s["device_kv_bytes"] == s["dense_kv_bytes"]
        assert (s["hits"], s["misses"], s["evictions"], s["bytes_h2d"]) == (0, 0, 0, 0)
        assert (s["reserved_requests"], s["resident_rows"], s["reserved_tokens"]) == (0, 0, tokens)
    s = torch_kvoffload.stats(model)
    assert s["decode_forwards"] == sum(new - 1 for *_, new in CALLS)
    if "layerwise" in mode:
        assert s["layer_saves"] > 0 and s["bytes_d2h"] > 0
    else:
        assert s["bytes_d2h"] == 0 and s["layer_saves"] == 0
    session = session_of(model)
    assert session.sparse_offload is None
    session.close()


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_generate_sequence_equals_unmodified_model(mode):
    model, calls = _reference_run(ONE_LAYER, CALLS[:2])
    model = torch_kvoffload.compile(model, MODES[mode])
    for ids, mask, new, want in calls:
        assert torch.equal(_generate(model, ids, mask, new), want)
        tokens = ids.shape[1] + new - 1
        assert torch_kvoffload.stats(model)["device_kv_bytes"] == _resident_bytes(
            model.config, ids.shape[0], tokens
        )
    session_of(model).close()


@pytest.mark.parametrize("mode", list(MODES))
def test_chunked_prefill_and_growth_match_one_shot(mode):
    """A prompt fed in three forwards gives the logits of one forward of the whole prompt: the later
    chunks select and attend over the earlier chunks' resident rows; the caches grow in place when a
    forward outgrows the reservation."""
    prompt, _ = left_padded_batch([26], seed=5)
    model = build_model("deepseek_v32")
    with torch.no_grad():
        ref = copy.deepcopy(model)(input_ids=prompt).logits
    model = torch_kvoffload.offload(model, MODES[mode])
    session = session_of(model)
    session.reserve(1, 16)
    cache = session.new_cache()
    with torch.no_grad():
        model(input_ids=prompt[:, :9], cache=cache)
        mid = model(input_ids=prompt[:, 9:16], cache=cache).logits
        resizes = torch_kvoffload.stats(model)["resizes"]
        last = model(input_ids=prompt[:, 16:], cache=cache).logits  # 26 > 16 reserved: grows
    torch.testing.assert_close(mid, ref[:, 9:16], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(last, ref[:, 16:], rtol=1e-4, atol=1e-5)
    s = torch_kvoffload.stats(model)
    assert s["resizes"] == resizes + 1 and s["reserved_tokens"] == 26
    config = model.config
    layer_buffers = 0
    if "layerwise" in mode:  # prefill is not over: 1 + num_shared_buffers (2) layer buffers and the tails
        # with prefix reuse (the default) the layer buffers carry the indexer keys too
        row = (config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim) * 4
        layer_buffers = 3 * -(-26 // BS) * BS * row + config.num_hidden_layers * BS * row
    assert s["device_kv_bytes"] == _resident_bytes(config, 1, 26) + layer_buffers


@pytest.mark.parametrize("indexer_dtype", ["bf16", "int8"])
def test_tokens_equal_offloaded_sparse_mode(indexer_dtype):
    """The resident mode selects and attends as sparse decode offload does: same tokens (with the int8
    indexer too, whose selection may differ from the unmodified model's)."""
    ids, mask = _batch(2, 18, seed=3)
    sparse = {"indexer_dtype": indexer_dtype}
    offloaded = torch_kvoffload.offload(build_model("deepseek_v32"), {"sparse": sparse, "block_size": BS})
    resident = torch_kvoffload.offload(
        build_model("deepseek_v32"), {"sparse": {**sparse, "offload": False}, "block_size": BS}
    )
    want = _generate(offloaded, ids, mask, 12)
    assert torch_kvoffload.stats(offloaded)["misses"] > 0
    assert torch.equal(_generate(resident, ids, mask, 12), want)


def test_configuration_refusals():
    """Host-pool / hot-buffer fields and another KV dtype are refused with offload=False, as is a model
    without a lightning indexer."""
    for field, value in (("capacity", 16), ("host_pool_blocks", 4), ("policy", "lru"), ("fused", True)):
        with pytest.raises(ValueError, match=rf"'{field}'.*offload=False"):
            OffloadConfig(sparse={"offload": False, field: value})
    assert OffloadConfig(sparse={"offload": "false"}).sparse.offload is False
    with pytest.raises(ValueError, match="kv_dtype='bf16'"):
        torch_kvoffload.offload(
            build_model("deepseek_v32", num_hidden_layers=2),
            {"sparse": {"offload": False, "kv_dtype": "bf16"}},
        )
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM.*lightning indexer"):
        torch_kvoffload.offload(build_model("deepseek_v3", num_hidden_layers=2), RESIDENT)

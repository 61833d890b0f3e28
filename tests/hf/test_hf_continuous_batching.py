"""``enable_mla_continuous_batching``: ``generate_batch`` on unmodified DeepSeek-V3 / V3.2 models.

Reference: per-prompt ``model.generate`` of the same unmodified model (HF's own sdpa attention). A small
token budget and page count force chunked prefills and queued requests; a forward hook checks they happened.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("transformers.generation.continuous_batching")

from support.hf_models import build_model
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from torch_kvoffload.integrations.hf.continuous_batching import (
    OVERRIDDEN,
    disable_mla_continuous_batching,
    enable_mla_continuous_batching,
)

LENGTHS = (3, 40, 7, 25, 12, 33)
MAX_BATCH_TOKENS = 16
MAX_REQUESTS = 3


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in LENGTHS]


def _gen_config() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=999_999, pad_token_id=0)


def _cb_config() -> ContinuousBatchingConfig:
    # Why: 8-token pages and 10 blocks hold ~80 tokens of the 170 needed, so requests wait for freed blocks.
    return ContinuousBatchingConfig(
        page_size=8, num_blocks=10, max_batch_tokens=MAX_BATCH_TOKENS, max_requests_per_batch=MAX_REQUESTS
    )


def _reference(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    gc = _gen_config()
    return [model.generate(torch.tensor([p]), generation_config=gc)[0, len(p) :].tolist() for p in prompts]


def _generate_batch(
    model: torch.nn.Module, prompts: list[list[int]]
) -> tuple[list[list[int]], list[list[int]]]:
    """Tokens per request, in prompt order, and the per-step query lengths per request."""
    steps: list[list[int]] = []

    def hook(module, args, kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is not None:
            steps.append(torch.diff(cu).tolist())

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = model.generate_batch(
            prompts, generation_config=_gen_config(), continuous_batching_config=_cb_config()
        )
    finally:
        handle.remove()
    # Why: generate_batch logs a failed request and returns it with ``error`` set instead of raising.
    errors = [out[rid].error for rid in out if out[rid].error is not None]
    if errors or len(out) != len(prompts):
        raise RuntimeError(f"generate_batch: {len(out)}/{len(prompts)} results, errors {errors}")
    order = sorted(out, key=lambda rid: int(rid.rsplit("_", 1)[1]))
    return [list(out[rid].generated_tokens) for rid in order], steps


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
@pytest.mark.parametrize("seed", [0, 1])
def test_generate_batch_equals_per_prompt_generate(family: str, seed: int) -> None:
    model = build_model(family, seed=seed)
    prompts = _prompts(seed)
    reference = _reference(model, prompts)
    enable_mla_continuous_batching(model)
    try:
        got, steps = _generate_batch(model, prompts)
    finally:
        disable_mla_continuous_batching(model)
    assert got == reference
    real = [[q for q in step if q > 0] for step in steps]
    assert max(sum(s) for s in real) <= MAX_BATCH_TOKENS
    assert max(len(s) for s in real) <= MAX_REQUESTS  # six requests, three at a time: queueing
    assert any(q > 1 and q < 40 for s in real for q in s), "no chunked prefill happened"
    # Plain generate still works on the same model after continuous batching.
    assert _reference(model, prompts[:1]) == reference[:1]


#: The first transformers release that runs a plain DeepSeek-V3's continuous batching itself (its own MLA
#: allocator, ``cache.MLACacheAllocator``); older ones fail on its MLA shapes.
PLAIN_V3_CB_SINCE = "5.25.0"


def test_not_enabled_model_runs_as_transformers_does_and_enabling_one_model_leaves_another_alone() -> None:
    """A model that is not enabled keeps transformers' behaviour, which depends on the release: 5.24 fails on
    its MLA shapes, 5.25 gives the per-prompt ``generate`` tokens."""
    import transformers
    from packaging.version import Version

    names = {(m, n): getattr(importlib.import_module(m), n) for m, n in OVERRIDDEN}
    enabled, plain = build_model("deepseek_v3"), build_model("deepseek_v3", seed=1)
    prompts = _prompts(0)[:2]
    enable_mla_continuous_batching(enabled)
    try:
        got, _ = _generate_batch(enabled, prompts)
        assert got == _reference(enabled, prompts)
        if Version(transformers.__version__) >= Version(PLAIN_V3_CB_SINCE):
            plain_got, _ = _generate_batch(plain, prompts)
            assert plain_got == _reference(plain, prompts)
        else:
            with pytest.raises(Exception, match="same slice shapes"):
                _generate_batch(plain, prompts)
    finally:
        disable_mla_continuous_batching(enabled)
    assert {(m, n): getattr(importlib.import_module(m), n) for m, n in OVERRIDDEN} == names
    assert "init_continuous_batching" not in vars(enabled)


def test_v32_not_enabled_rejects_indexed_attention() -> None:
    with pytest.raises(Exception, match="indexed_attention"):
        _generate_batch(build_model("deepseek_v32"), _prompts(0)[:1])


def test_a_model_without_mla_is_rejected() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        enable_mla_continuous_batching(model)
    assert "init_continuous_batching" not in vars(model)


def test_the_overridden_transformers_names_exist() -> None:
    """The module swaps these private transformers names; a release that renames them must fail here."""
    for module_name, name in OVERRIDDEN:
        module = importlib.import_module(module_name)
        assert hasattr(module, name), (
            f"transformers {module_name}.{name} is gone: torch_kvoffload.integrations.hf.continuous_batching "
            "overrides it and must be ported to this transformers release"
        )
    from transformers.generation.continuous_batching import ContinuousBatchingManager
    from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

    assert callable(ContinuousBatchingManager._create_batch_processor)
    for hook in (
        "_before_cache_tensor_init",
        "_after_cache_tensor_init",
        "get_read_indices",
        "get_write_indices",
    ):
        assert hasattr(FullAttentionCacheAllocator, hook), (
            f"transformers FullAttentionCacheAllocator.{hook} is gone"
        )

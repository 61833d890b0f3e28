"""Continuous batching of offloaded models: ``generate_batch`` and the CB manager on the library's attention.

Reference: per-prompt ``generate`` of the unmodified model (HF's own attention). A small token budget,
few library slots and requests added while others run force chunked prefills, decode and prefill rows in
one step, queueing and early ends. The embedding row of token 0 is made non-zero: a zero embedding gives a
zero indexer query, whose scores all tie, and ``torch.topk`` then picks an arbitrary top-k.
"""

from __future__ import annotations

import copy
import inspect
import threading

import pytest
import torch

pytest.importorskip("transformers.generation.continuous_batching")

from support.hf_models import build_model
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import torch_kvoffload
from torch_kvoffload.integrations.hf.session import session_of

LENGTHS = (3, 40, 7, 25, 12, 33)
NEW = 8
SERVING = {"max_requests": 3, "max_request_tokens": 64}
CONFIGS = {
    "v32-sparse-offload": ("deepseek_v32", {"sparse": {}, "serving": SERVING}),
    "v32-resident": ("deepseek_v32", {"sparse": {"offload": False}, "serving": SERVING}),
    "v32-layerwise-sparse": ("deepseek_v32", {"layerwise": {}, "sparse": {}, "serving": SERVING}),
    "v32-int8-indexer": ("deepseek_v32", {"sparse": {"indexer_dtype": "int8"}, "serving": SERVING}),
    "v3-layerwise": ("deepseek_v3", {"layerwise": {}, "serving": SERVING}),
}


def _model(family: str, seed: int = 0) -> torch.nn.Module:
    model = build_model(family, seed=seed)
    with torch.no_grad():
        model.model.embed_tokens.weight[0].normal_()  # see the module docstring
    return model


def _prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def _gen(eos: int = 999_999, new: int = NEW) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0)


def _cb(**kw) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(page_size=8, max_batch_tokens=16, max_requests_per_batch=4, **kw)


def _reference(model: torch.nn.Module, prompts: list[list[int]], gen: GenerationConfig) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), generation_config=gen)[0, len(p) :].tolist() for p in prompts]


def _batch(model, prompts, gen=None, cb=None) -> list[list[int]]:
    out = model.generate_batch(
        prompts, generation_config=gen or _gen(), continuous_batching_config=cb or _cb()
    )
    errors = [out[rid].error for rid in out if out[rid].error is not None]
    if errors or len(out) != len(prompts):
        raise RuntimeError(f"generate_batch: {len(out)}/{len(prompts)} results, errors {errors}")
    order = sorted(out, key=lambda rid: int(rid.rsplit("_", 1)[1]))
    return [list(out[rid].generated_tokens) for rid in order]


class _StepLog:
    """Per step: the (past, query) of each request, and the library requests live after it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.serving = session_of(model).serving
        self.steps: list[list[tuple[int, int]]] = []
        self.live: list[int] = []
        self._run = type(self.serving).run_step.__get__(self.serving)

        def run_step(model, kwargs):
            self.steps.append([(p, q) for _, p, q in self.serving._step])
            out = self._run(model, kwargs)
            self.live.append(self.serving.live)
            return out

        self.serving.run_step = run_step


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_batch_equals_per_prompt_generate(name: str) -> None:
    family, config = CONFIGS[name]
    model = _model(family)
    prompts = _prompts(0)
    reference = _reference(model, prompts, _gen())
    torch_kvoffload.offload(model, copy.deepcopy(config))
    if config.get("sparse", {}).get("indexer_dtype") == "int8":
        # int8 indexer keys select their own top-k: the reference is the offloaded model's own generate()
        reference = _reference(model, prompts, _gen())
    session = session_of(model)
    model.init_continuous_batching(generation_config=_gen(), continuous_batching_config=_cb()).stop()
    log = _StepLog(model)
    before = session.stats()["forwards"]
    assert _batch(model, prompts) == reference
    steps = log.steps
    assert max(len(s) for s in steps) <= 4 and max(sum(q for _, q in s) for s in steps) <= 16
    assert max(log.live) == 3, "three library slots: at most three requests held, and all used"
    assert any(p > 0 and q > 1 for s in steps for p, q in s), "no chunked prefill continued a request"
    assert any(any(q == 1 and p > 0 for p, q in s) and any(q > 1 for _, q in s) for s in steps), (
        "no step mixed decode rows and a prefill chunk"
    )
    stats = session.stats()
    assert stats["reserved_requests"] == 0 and stats["resident_rows"] == 0, "requests left behind"
    assert (stats["serving_slots"], stats["serving_requests"], stats["serving_steps"]) == (3, 0, len(steps))
    # one model forward per step, decode tokens and chunks together; with a sparse backend the mixed steps'
    # forwards run in two parts (the decode tokens through the sparse decode path)
    assert stats["forwards"] - before == len(steps)
    assert (stats["mixed_forwards"] > 0) == ("sparse" in config)
    assert not session.serving.is_open
    # the same model generates as before once the manager stopped, and serves a second batch
    assert _reference(model, prompts[:2], _gen()) == reference[:2]
    assert _batch(model, prompts[3:]) == reference[3:]


def test_manager_requests_added_while_others_run_and_early_eos() -> None:
    model = _model("deepseek_v32", seed=1)
    prompts = _prompts(1, (9, 30, 4, 17, 22))
    full = _reference(model, prompts, _gen(new=10))
    eos = full[1][3]  # request 1 ends early on its 4th token; others may too
    reference = _reference(model, prompts, _gen(eos=eos, new=10))
    assert len(reference[1]) == 4
    torch_kvoffload.offload(model, {"sparse": {}, "serving": {"max_requests": 2, "max_request_tokens": 48}})
    manager = model.init_continuous_batching(
        generation_config=_gen(eos=eos, new=10), continuous_batching_config=_cb()
    )
    manager.start()
    got: dict[str, list[int]] = {}
    try:
        ids = [manager.add_request(prompts[0], request_id="r0")]
        first = manager.get_result(timeout=120)  # r0 finishes before the rest arrive
        got[first.request_id] = list(first.generated_tokens)
        with pytest.raises(RuntimeError, match="serving continuous batching"):
            model.generate(torch.tensor([prompts[0]]), generation_config=_gen())
        ids += [manager.add_request(p, request_id=f"r{i}") for i, p in enumerate(prompts[1:], 1)]
        while len(got) < len(prompts):
            result = manager.get_result(timeout=120)
            assert result is not None and result.error is None, result
            got[result.request_id] = list(result.generated_tokens)
    finally:
        manager.stop(block=True, timeout=120)
    assert [got[f"r{i}"] for i in range(len(prompts))] == reference
    assert _reference(model, prompts[:1], _gen(eos=eos, new=10)) == reference[:1]


def test_too_long_or_empty_request_is_refused_when_added_and_the_rest_run() -> None:
    model = _model("deepseek_v32")
    prompts = _prompts(2, (10, 30))
    reference = _reference(model, prompts[:1], _gen())
    torch_kvoffload.offload(model, {"sparse": {}, "serving": {"max_requests": 2, "max_request_tokens": 32}})
    manager = model.init_continuous_batching(generation_config=_gen(), continuous_batching_config=_cb())
    manager.start()
    try:
        with pytest.raises(ValueError, match=r"request long needs 38 tokens .*max_request_tokens=32"):
            manager.add_request(prompts[1], request_id="long")  # 30 + 8 > 32
        with pytest.raises(ValueError, match="request empty has an empty prompt"):
            manager.add_request([], request_id="empty")
        manager.add_request(prompts[0], request_id="long")  # the refused id was never taken
        result = manager.get_result(timeout=120)
    finally:
        manager.stop(block=True, timeout=120)
    assert result.request_id == "long" and result.error is None
    assert [list(result.generated_tokens)] == reference


def test_a_failed_step_fails_its_requests_and_the_next_requests_run() -> None:
    model = _model("deepseek_v32")
    prompts = _prompts(3, (6, 11))
    reference = _reference(model, prompts, _gen())
    torch_kvoffload.offload(model, {"sparse": {}, "serving": SERVING})
    session = session_of(model)
    model.init_continuous_batching(generation_config=_gen(), continuous_batching_config=_cb()).stop()
    serving = session.serving
    real, calls = type(serving)._agree_step, []

    def failing(self, *args):  # the second step cannot run at all
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real(self, *args)

    serving._agree_step = failing.__get__(serving)
    out = model.generate_batch(prompts, generation_config=_gen(), continuous_batching_config=_cb())
    assert len(out) == len(prompts)
    assert any(o.error is not None and "injected failure" in str(o.error) for o in out.values())
    assert session.stats()["reserved_requests"] == 0
    del serving._agree_step
    assert _batch(model, prompts) == reference


def test_device_budget_sets_the_requests_held() -> None:
    model = _model("deepseek_v32")
    one = {"sparse": {}, "serving": {"max_requests": 1, "max_request_tokens": 64}}
    probe = copy.deepcopy(model)
    torch_kvoffload.offload(probe, one)
    probe.init_continuous_batching(generation_config=_gen(), continuous_batching_config=_cb()).stop()
    s = session_of(probe).serving
    per, fixed = s.device_bytes_per_request, s.fixed_device_bytes
    assert per > 0 and session_of(probe).device_kv_bytes() == fixed + per
    budget = fixed + 5 * per + per // 2
    torch_kvoffload.offload(
        model, {"sparse": {}, "serving": {"max_request_tokens": 64, "device_kv_budget": budget}}
    )
    model.init_continuous_batching(generation_config=_gen(), continuous_batching_config=_cb()).stop()
    session = session_of(model)
    assert session.serving.slots == 5
    assert session.device_kv_bytes() == fixed + 5 * per <= budget
    small = copy.deepcopy(build_model("deepseek_v32"))
    torch_kvoffload.offload(
        small, {"sparse": {}, "serving": {"max_request_tokens": 64, "device_kv_budget": fixed + per // 2}}
    )
    with pytest.raises(ValueError, match="device_kv_budget"):
        small.init_continuous_batching(generation_config=_gen(), continuous_batching_config=_cb())
    # the failure left the model usable
    p = _prompts(4, (5,))
    assert small.generate(torch.tensor(p), generation_config=_gen()).shape == (1, 5 + NEW)


@pytest.mark.parametrize(
    ("gen", "cb", "match"),
    [
        (dict(num_return_sequences=2, num_beams=2), {}, "num_return_sequences"),
        ({}, dict(use_async_batching=True), "use_async_batching"),
        ({}, dict(default_compile_level=1), "compiled"),
    ],
)
def test_unsupported_cb_options_are_refused(gen, cb, match) -> None:
    model = _model("deepseek_v32")
    torch_kvoffload.offload(model, {"sparse": {}, "serving": SERVING})
    g = _gen()
    for k, v in gen.items():
        setattr(g, k, v)
    with pytest.raises(ValueError, match=match):
        model.init_continuous_batching(generation_config=g, continuous_batching_config=_cb(**cb))
    assert _batch(model, _prompts(5, (4,))) == _reference(model, _prompts(5, (4,)), _gen())


def test_two_offloaded_models_in_one_process_serve_in_two_threads() -> None:
    a, b = _model("deepseek_v32"), _model("deepseek_v32", seed=2)
    prompts = _prompts(6, (5, 14, 9))
    refs = [_reference(a, prompts, _gen()), _reference(b, prompts, _gen())]
    # one with sparse offload, one with hybrid sparse (its budget: what is free)
    for m, offload in ((a, True), (b, "auto")):
        torch_kvoffload.offload(m, {"sparse": {"offload": offload}, "serving": SERVING})
    results: dict[int, object] = {}

    def run(i, m):
        try:
            results[i] = _batch(m, prompts)
        except BaseException as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, m)) for i, m in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: refs[0], 1: refs[1]}


def test_the_wrapped_transformers_methods_keep_their_signatures() -> None:
    """The offload path wraps these on instances; a transformers release that changes them must fail here."""
    from transformers.generation.continuous_batching import ContinuousBatchingManager
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchProcessor,
        OutputRouter,
    )
    from transformers.generation.continuous_batching.scheduler import Scheduler

    expected = {
        ContinuousBatchProcessor.update_batch: ["self"],
        ContinuousBatchProcessor.handle_batch_error: ["self", "error"],
        OutputRouter.deliver: ["self", "output"],
        OutputRouter.deliver_batch: ["self", "outputs"],
        Scheduler.add_waiting_request: ["self", "state"],
        PagedAttentionCache.extend_read_and_write_indices: [
            "self", "request_id", "past_length", "query_length", "read_index", "write_index",
        ],
        PagedAttentionCache.can_store_request_tokens: ["self", "state", "request_len", "dry_run"],
        PagedAttentionCache.free_blocks: ["self", "request_id", "no_cache"],
        PagedAttentionCache.free_all_requests: ["self", "clear_ledgers"],
        ContinuousBatchingManager._run_generation_loop: ["self", "use_inference_mode"],
        ContinuousBatchingManager._create_batch_processor: ["self"],
    }  # fmt: skip
    for fn, params in expected.items():
        assert list(inspect.signature(fn).parameters) == params, (
            f"transformers {fn.__qualname__} changed: torch_kvoffload.integrations.hf.continuous_batching wraps it"
        )
    add = list(inspect.signature(ContinuousBatchingManager.add_request).parameters)
    assert add[:4] == ["self", "input_ids", "request_id", "max_new_tokens"]
    assert list(inspect.signature(ContinuousBatchingManager.add_requests).parameters)[:2] == [
        "self",
        "inputs",
    ]
    assert list(inspect.signature(ContinuousBatchingManager.stop).parameters)[:3] == [
        "self",
        "block",
        "timeout",
    ]
    # the request states the scheduler refuses are read by these fields
    from transformers.generation.continuous_batching.requests import RequestState

    fields = RequestState.__dataclass_fields__
    assert {"request_id", "initial_tokens", "max_new_tokens"} <= set(fields)


def test_a_cancelled_request_releases_its_slot_and_the_others_finish() -> None:
    model = _model("deepseek_v32", seed=3)
    prompts = _prompts(7, (12, 6, 9))
    reference = _reference(model, prompts, _gen(new=12))
    torch_kvoffload.offload(model, {"sparse": {}, "serving": {"max_requests": 2, "max_request_tokens": 48}})
    session = session_of(model)
    manager = model.init_continuous_batching(generation_config=_gen(new=40), continuous_batching_config=_cb())
    manager.start()
    got: dict[str, list[int]] = {}
    try:
        manager.add_request(prompts[0], request_id="long", max_new_tokens=30, streaming=True)
        first = manager.get_result(request_id="long", timeout=120)  # its first token: it holds a slot
        assert first is not None and first.error is None
        manager.cancel_request("long")
        for i in (1, 2):  # two slots: these run once the cancelled one released its slot
            manager.add_request(prompts[i], request_id=f"r{i}", max_new_tokens=12)
        while len(got) < 2:
            result = manager.get_result(timeout=120)
            assert result is not None
            if result.request_id != "long":
                assert result.error is None, result
                got[result.request_id] = list(result.generated_tokens)
    finally:
        manager.stop(block=True, timeout=120)
    assert [got["r1"], got["r2"]] == reference[1:]
    assert session.stats()["reserved_requests"] == 0


def test_a_deep_copy_serves_on_its_own_session() -> None:
    model = _model("deepseek_v32")
    prompts = _prompts(8, (6, 10))
    reference = _reference(model, prompts, _gen())
    torch_kvoffload.offload(model, {"sparse": {}, "serving": SERVING})
    twin = copy.deepcopy(model)
    assert _batch(twin, prompts) == reference
    assert session_of(twin).stats()["serving_steps"] > 0
    assert session_of(model).stats()["serving_steps"] == 0, "the copy ran on the original's session"


def test_a_compiled_model_refuses_continuous_batching() -> None:
    model = _model("deepseek_v3")
    torch_kvoffload.compile(model, {"layerwise": {}})
    with pytest.raises(ValueError, match=r"torch_kvoffload\.offload, not torch_kvoffload\.compile"):
        model.generate_batch([[5, 6, 7]], generation_config=_gen())


@pytest.mark.parametrize("config_name", ["Glm4MoeLiteConfig", "YoutuConfig"])
def test_other_families_the_eager_path_serves(config_name: str) -> None:
    import transformers
    from support.hf_models import _COMMON

    cfg = getattr(transformers, config_name)(**_COMMON)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    prompts = _prompts(9, (5, 21, 9))
    reference = _reference(model, prompts, _gen())
    torch_kvoffload.offload(model, {"layerwise": {}, "serving": SERVING})
    assert _batch(model, prompts) == reference

"""One bad request of an offloaded model under continuous batching fails alone: an empty or over-long prompt,
a request id already live, a step the library fails. The others get the unmodified model's tokens, the
generation loop goes on, and one manager at a time holds the model.

Reference: per-prompt ``generate`` of the unmodified model (HF's own attention). The embedding row of token 0
is made non-zero (a zero indexer query ties every score).
"""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("transformers.generation.continuous_batching")

from support.hf_models import build_model
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import torch_kvoffload
from torch_kvoffload.integrations.hf.session import session_of

NEW = 8
SERVING = {"max_requests": 2, "max_request_tokens": 48}
WAIT_S = 120  # a result of these tiny requests takes well under a second; the bound only ends a hang


def _model(seed: int = 0) -> torch.nn.Module:
    model = build_model("deepseek_v32", seed=seed)
    with torch.no_grad():
        model.model.embed_tokens.weight[0].normal_()
    return model


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def _gen(new: int = NEW) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=999_999, pad_token_id=0)


def _cb() -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(page_size=8, max_batch_tokens=16, max_requests_per_batch=4)


def _reference(model, prompts, new: int = NEW) -> list[list[int]]:
    return [
        model.generate(torch.tensor([p]), generation_config=_gen(new))[0, len(p) :].tolist() for p in prompts
    ]


def _drain(manager, want: set[str]) -> dict[str, object]:
    got: dict[str, object] = {}
    while not want <= set(got):
        result = manager.get_result(timeout=WAIT_S)
        assert result is not None, f"no result within {WAIT_S} s; still waiting for {want - set(got)}"
        if result.error is not None or result.is_finished():
            got[result.request_id] = result
    return got


def test_bad_prompts_fail_alone_and_generate_batch_answers_the_rest() -> None:
    model = _model()
    good = _prompts(0, (5, 17, 9))
    reference = _reference(model, good)
    torch_kvoffload.offload(model, {"sparse": {}, "serving": SERVING})
    session = session_of(model)
    long = _prompts(1, (45,))[0]  # 45 + 8 > 48
    prompts = [good[0], [], good[1], long, good[2]]
    for _ in range(2):  # the same model again: nothing of the failures is left behind
        out = model.generate_batch(prompts, generation_config=_gen(), continuous_batching_config=_cb())
        assert len(out) == len(prompts)
        order = sorted(out, key=lambda rid: int(rid.rsplit("_", 1)[1]))
        results = [out[rid] for rid in order]
        assert "empty prompt" in results[1].error and results[1].request_id in results[1].error
        assert "max_request_tokens=48" in results[3].error and "53 tokens" in results[3].error
        assert [list(results[i].generated_tokens) for i in (0, 2, 4)] == reference
        assert all(results[i].error is None for i in (0, 2, 4))
        stats = session.stats()
        assert stats["reserved_requests"] == 0 and stats["serving_requests"] == 0
    assert _reference(model, good[:1]) == reference[:1]  # generate() works after serving


def test_a_live_request_id_is_refused_and_the_first_request_keeps_its_tokens() -> None:
    model = _model(1)
    prompts = _prompts(2, (12, 7))
    reference = [_reference(model, prompts[:1], new=24)[0], _reference(model, prompts[1:])[0]]
    torch_kvoffload.offload(model, {"sparse": {}, "serving": SERVING})
    manager = model.init_continuous_batching(generation_config=_gen(), continuous_batching_config=_cb())
    manager.start()
    try:
        manager.add_request(prompts[0], request_id="same", max_new_tokens=24, streaming=True)
        first = manager.get_result(request_id="same", timeout=WAIT_S)
        assert first is not None and first.error is None
        with pytest.raises(ValueError, match="'same' is already in use"):
            manager.add_request(prompts[1], request_id="same", max_new_tokens=NEW)
        done = _drain(manager, {"same"})["same"]
        assert done.error is None and list(done.generated_tokens) == reference[0]
        # once answered, the id may be used again
        manager.add_request(prompts[1], request_id="same", max_new_tokens=NEW)
        again = _drain(manager, {"same"})["same"]
        assert again.error is None and list(again.generated_tokens) == reference[1]
    finally:
        manager.stop(block=True, timeout=WAIT_S)
    assert session_of(model).stats()["reserved_requests"] == 0


def _serve_with_failures(model, prompts, inject) -> dict:
    """Serves ``prompts[:3]`` as r0..r2 with ``inject(serving)`` installed on the model's serving state,
    then ``prompts[3]`` as r3 once they are answered; returns the results."""
    manager = model.init_continuous_batching(generation_config=_gen(), continuous_batching_config=_cb())
    inject(session_of(model).serving)
    manager.start()
    try:
        for i, p in enumerate(prompts[:3]):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=NEW)
        got = _drain(manager, {"r0", "r1", "r2"})
        assert manager.background_thread_status.fatal_error is None and manager.is_running()
        manager.add_request(prompts[3], request_id="r3", max_new_tokens=NEW)  # the loop goes on
        got.update(_drain(manager, {"r3"}))
    finally:
        manager.stop(block=True, timeout=WAIT_S)
    return got


def test_a_request_whose_rows_fail_fails_alone_and_its_step_goes_on() -> None:
    model = _model(2)
    prompts = _prompts(3, (6, 11, 9, 14))
    reference = _reference(model, prompts)
    torch_kvoffload.offload(model, {"sparse": {}, "serving": SERVING})
    session = session_of(model)
    shared = []

    def inject(serving):
        real_forward = type(serving)._forward

        def failing(self, model, layout, requests, ids, logits):
            bad = self._live.get("r1")
            if any(r is bad for r in requests):
                if len(requests) > 1:
                    shared.append(len(requests))
                raise RuntimeError("injected failure in r1's rows")
            return real_forward(self, model, layout, requests, ids, logits)

        serving._forward = failing.__get__(serving)

    got = _serve_with_failures(model, prompts, inject)
    assert shared, "r1 never shared a forward with another request: nothing was isolated"
    assert "injected failure in r1's rows" in got["r1"].error
    for i in (0, 2, 3):
        assert got[f"r{i}"].error is None and list(got[f"r{i}"].generated_tokens) == reference[i], f"r{i}"
    assert session.stats()["reserved_requests"] == 0


def test_a_step_that_cannot_run_fails_its_requests_and_the_loop_serves_the_others() -> None:
    model = _model(2)
    prompts = _prompts(3, (6, 11, 9, 14))
    reference = _reference(model, prompts)
    torch_kvoffload.offload(model, {"sparse": {}, "serving": SERVING})
    session = session_of(model)
    calls, failed_step = [], []

    def inject(serving):
        real_agree = type(serving)._agree_step

        def failing(self, step, *args):
            calls.append(1)
            if len(calls) == 3:
                failed_step.extend(rid for rid, _, _ in step)
                raise RuntimeError("injected step failure")
            return real_agree(self, step, *args)

        serving._agree_step = failing.__get__(serving)

    got = _serve_with_failures(model, prompts, inject)
    assert failed_step, "no step failed"
    for i in range(4):
        result = got[f"r{i}"]
        if f"r{i}" in failed_step:
            assert "injected step failure" in result.error
        else:
            assert result.error is None and list(result.generated_tokens) == reference[i]
    assert session.stats()["reserved_requests"] == 0


def test_one_manager_at_a_time_from_creation() -> None:
    model = _model()
    prompts = _prompts(4, (5, 8))
    reference = _reference(model, prompts)
    torch_kvoffload.offload(model, {"sparse": {}, "serving": SERVING})
    first = model.init_continuous_batching(generation_config=_gen(), continuous_batching_config=_cb())
    with pytest.raises(RuntimeError, match="another ContinuousBatchingManager"):
        model.init_continuous_batching(generation_config=_gen(), continuous_batching_config=_cb())
    with pytest.raises(RuntimeError, match="another ContinuousBatchingManager"):
        model.generate_batch(prompts, generation_config=_gen(), continuous_batching_config=_cb())
    first.stop()  # never started: stopping it lets another be created
    out = model.generate_batch(prompts, generation_config=_gen(), continuous_batching_config=_cb())
    assert [list(out[rid].generated_tokens) for rid in sorted(out)] == reference

    # generate_batch from two threads: one answers, the other is refused before any request is taken
    results: dict[int, object] = {}
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        barrier.wait()
        try:
            out = model.generate_batch(prompts, generation_config=_gen(), continuous_batching_config=_cb())
            results[i] = [list(out[rid].generated_tokens) for rid in sorted(out)]
        except RuntimeError as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    answered = [r for r in results.values() if not isinstance(r, Exception)]
    refused = [r for r in results.values() if isinstance(r, Exception)]
    assert answered and all(r == reference for r in answered)
    assert all("ContinuousBatchingManager" in str(e) or "second thread" in str(e) for e in refused)


def test_init_continuous_batching_during_a_generate_is_refused() -> None:
    model = _model(3)
    prompts = _prompts(5, (9,))
    reference = _reference(model, prompts, new=6)
    torch_kvoffload.offload(model, {"sparse": {}, "serving": SERVING})
    session = session_of(model)
    entered, release = threading.Event(), threading.Event()
    begin_forward = session.begin_forward
    calls = []

    def held_begin_forward(*args, **kwargs):  # the generate's second forward waits: between two forwards
        calls.append(1)
        if len(calls) == 2:
            entered.set()
            release.wait(WAIT_S)
        return begin_forward(*args, **kwargs)

    session.begin_forward = held_begin_forward
    got: dict[str, object] = {}

    def run() -> None:
        got["tokens"] = model.generate(torch.tensor(prompts), generation_config=_gen(6))[0, 9:].tolist()

    t = threading.Thread(target=run)
    t.start()
    try:
        assert entered.wait(WAIT_S)
        with pytest.raises(RuntimeError, match="init_continuous_batching: called from a second thread"):
            model.init_continuous_batching(generation_config=_gen(), continuous_batching_config=_cb())
    finally:
        release.set()
        t.join(WAIT_S)
    assert got["tokens"] == reference[0]
    del session.begin_forward
    # and afterwards a manager serves
    out = model.generate_batch(prompts, generation_config=_gen(6), continuous_batching_config=_cb())
    assert [list(o.generated_tokens) for o in out.values()] == reference

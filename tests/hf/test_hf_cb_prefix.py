"""Prefix reuse under continuous batching: a request whose prompt extends a system prompt or an earlier
conversation that the store holds schedules only its uncached tokens; the outputs are the unmodified
model's per-prompt ``generate``."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers.generation.continuous_batching")

from support.hf_models import build_model
from support.store_helpers import store_emptied_after_each_lookup
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import torch_kvoffload
from torch_kvoffload.integrations.hf.session import session_of

BS = 8
NEW = 6
SERVING = {"max_requests": 3, "max_request_tokens": 96}
CONFIGS = {
    "v32-layerwise-sparse": ("deepseek_v32", {"layerwise": {}, "sparse": {}, "block_size": BS, "serving": SERVING}),
    "v3-layerwise": ("deepseek_v3", {"layerwise": {}, "block_size": BS, "serving": SERVING}),
    # no layerwise offload: each step's completed blocks go to the prefix store from the host pool
    "v32-sparse": ("deepseek_v32", {"sparse": {}, "block_size": BS, "serving": SERVING}),
}  # fmt: skip


def _taken(stats: dict) -> float:
    """Prompt tokens taken over without a forward: from the store, or from a running request's KV."""
    return stats["prefix_store_tokens"] + stats["prefix_live_tokens"]


def _model(family: str) -> torch.nn.Module:
    model = build_model(family)
    with torch.no_grad():
        model.model.embed_tokens.weight[0].normal_()  # a zero embedding ties every indexer score
    return model


def _gen() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=999_999, pad_token_id=0)


def _cb() -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(page_size=8, max_batch_tokens=32, max_requests_per_batch=4)


def _reference(model, prompts) -> list[list[int]]:
    return [
        model.generate(torch.tensor([p]), generation_config=_gen())[0, len(p) :].tolist() for p in prompts
    ]


def _batch(model, prompts) -> list[list[int]]:
    out = model.generate_batch(prompts, generation_config=_gen(), continuous_batching_config=_cb())
    errors = [out[rid].error for rid in out if out[rid].error is not None]
    assert not errors and len(out) == len(prompts), errors
    order = sorted(out, key=lambda rid: int(rid.rsplit("_", 1)[1]))
    return [list(out[rid].generated_tokens) for rid in order]


def _steps(monkeypatch) -> list[list[tuple[int, int]]]:
    """Per step run from now on (by any model's serving state, the ones batches create later too): the
    (past, query) of each request."""
    from torch_kvoffload.integrations.hf.serving import ServingRequests

    real, steps = ServingRequests.run_step, []

    def run_step(self, model, kwargs):
        steps.append([(p, q) for _, p, q in self._step])
        return real(self, model, kwargs)

    monkeypatch.setattr(ServingRequests, "run_step", run_step)
    return steps


@pytest.mark.parametrize("name", list(CONFIGS))
def test_requests_sharing_a_system_prompt_schedule_only_their_own_tokens(name, monkeypatch):
    family, config = CONFIGS[name]
    model = _model(family)
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, 1000, (43,), generator=g).tolist()  # 5 full blocks + 3 tokens
    users = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (9, 4, 17, 12)]
    prompts = [system + u for u in users]
    reference = _reference(model, prompts)
    torch_kvoffload.offload(model, copy.deepcopy(config))
    session = session_of(model)
    assert _batch(model, prompts[:1]) == reference[:1]  # the first conversation computes the system prompt
    before = session.stats()
    steps = _steps(monkeypatch)
    assert _batch(model, prompts[1:]) == reference[1:]
    after = session.stats()
    # each later request found the system prompt's 5 blocks (the first request's 6th block holds its own
    # tokens): its first step starts at position 40
    assert _taken(after) - _taken(before) == 3 * 40
    # the later requests took the blocks from a running one (its host-pool blocks shared, its indexer rows
    # copied), not from the store; layerwise offload alone keeps no request's rows: all from the store
    live = after["prefix_live_tokens"] - before["prefix_live_tokens"]
    assert live == (0 if name == "v3-layerwise" else 2 * 40)
    shared = after["fork_shared_blocks"] - before["fork_shared_blocks"]
    assert shared == (0 if name == "v3-layerwise" else 2 * 5)
    firsts = [q for s in steps for p, q in s if p == 40]
    assert len(firsts) == 3, steps
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == sum(
        len(p) - 40 for p in prompts[1:]
    )
    assert after["reserved_requests"] == 0 and after["serving_requests"] == 0

    # the same prompt again: all its full blocks are found (at least one token computed)
    before = session.stats()
    assert _batch(model, prompts[3:]) == reference[3:]
    assert (
        session.stats()["prefix_store_tokens"] - before["prefix_store_tokens"]
        == (len(prompts[3]) - 1) // BS * BS
    )


def test_the_next_turn_of_a_conversation_skips_its_previous_answer_too():
    """A finished request's decoded blocks go to the store as it ends: the next turn (prompt + answer + a
    new message) finds the whole earlier conversation."""
    family, config = CONFIGS["v32-layerwise-sparse"]
    model = _model(family)
    g = torch.Generator().manual_seed(3)
    first = torch.randint(3, 1000, (30,), generator=g).tolist()
    answer = _reference(model, [first])[0]
    turn = first + answer + torch.randint(3, 1000, (7,), generator=g).tolist()  # 30 + 6 + 7 = 43 tokens
    reference = _reference(model, [turn])
    torch_kvoffload.offload(model, copy.deepcopy(config))
    session = session_of(model)
    assert _batch(model, [first]) == [answer]
    assert session.stats()["persisted_blocks"] == 1  # 35 tokens held: block 3 was completed by decoding
    before = session.stats()
    assert _batch(model, [turn]) == reference
    assert session.stats()["prefix_store_tokens"] - before["prefix_store_tokens"] == 32


def test_reuse_off_computes_every_prompt_and_a_lost_prefix_is_computed(monkeypatch):
    family, config = CONFIGS["v32-layerwise-sparse"]
    model = _model(family)
    g = torch.Generator().manual_seed(2)
    system = torch.randint(3, 1000, (32,), generator=g).tolist()
    prompts = [system + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 11)]
    reference = _reference(model, prompts)
    off = torch_kvoffload.offload(copy.deepcopy(model), {**copy.deepcopy(config), "prefix_cache": False})
    for _ in range(2):
        assert _batch(off, prompts) == reference
    assert session_of(off).stats()["prefix_store_tokens"] == 0

    torch_kvoffload.offload(model, copy.deepcopy(config))
    assert _batch(model, prompts[:1]) == reference[:1]
    before = session_of(model).stats()
    with store_emptied_after_each_lookup():
        assert _batch(model, prompts[1:]) == reference[1:]
    after = session_of(model).stats()
    assert after["prefix_fallbacks"] - before["prefix_fallbacks"] == 1
    assert after["prefix_store_tokens"] == before["prefix_store_tokens"]
    assert after["reserved_requests"] == 0


def test_a_failing_adoption_fails_no_request_and_frees_its_slot(monkeypatch):
    """Any error while a request takes its prefix over (here not the store's) leaves the scheduler's loop
    alone: the request computes its whole prompt in its slot, the others are answered."""
    from torch_kvoffload.core import prefix as prefix_mod

    family, config = CONFIGS["v32-layerwise-sparse"]
    model = _model(family)
    g = torch.Generator().manual_seed(4)
    system = torch.randint(3, 1000, (32,), generator=g).tolist()
    prompts = [system + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 11, 3)]
    reference = _reference(model, prompts)
    torch_kvoffload.offload(model, copy.deepcopy(config))
    assert _batch(model, prompts[:1]) == reference[:1]

    def broken(self, requests, *args):
        self.core.finish([r.id for r in requests])
        raise OSError("injected")

    monkeypatch.setattr(prefix_mod.PrefixReuse, "adopt", broken)
    before = session_of(model).stats()
    assert _batch(model, prompts[1:]) == reference[1:]
    after = session_of(model).stats()
    assert after["prefix_fallbacks"] - before["prefix_fallbacks"] == 2
    assert after["reserved_requests"] == 0 and after["serving_requests"] == 0


def _system_prompts(seed: int) -> list[list[int]]:
    """Three prompts after one 43-token system prompt (5 full blocks + 3 tokens): a shared prefix of 40."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 1000, (43,), generator=g).tolist()
    return [system + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (9, 4, 17)]


def _burst(seed: int, name: str = "v32-layerwise-sparse"):
    """``(model, session, prompts, reference)``: a V3.2 offloaded under ``CONFIGS[name]``, and the prompts of
    :func:`_system_prompts` with the unmodified model's tokens."""
    family, config = CONFIGS[name]
    model = _model(family)
    prompts = _system_prompts(seed)
    reference = _reference(model, prompts)
    torch_kvoffload.offload(model, copy.deepcopy(config))
    return model, session_of(model), prompts, reference


def test_blocks_the_store_cannot_keep_are_taken_from_the_request_that_holds_them(monkeypatch):
    """Sparse offload alone with a prefix store too small for one record: nothing is ever stored, yet the
    requests arriving with the first one take its 5 system-prompt blocks over while it runs (its host-pool
    blocks shared): the lookup counts what a running request holds."""
    family, config = CONFIGS["v32-sparse"]
    model = _model(family)
    prompts = _system_prompts(8)
    reference = _reference(model, prompts)
    torch_kvoffload.offload(model, {**copy.deepcopy(config), "prefix_store": {"capacity_bytes": 1024}})
    session = session_of(model)
    assert _batch(model, prompts) == reference
    stats = session.stats()
    assert stats["prefix_store_tokens"] == 0 and stats["prefix_live_tokens"] == 2 * 40
    assert stats["fork_shared_blocks"] == 2 * 5
    assert stats["prompt_tokens_computed"] == len(prompts[0]) + sum(len(p) - 40 for p in prompts[1:])
    assert stats["reserved_requests"] == 0 and stats["serving_requests"] == 0
    # one at a time nothing is running to take them from: every prompt is computed, the same tokens
    before = session.stats()
    assert _batch(model, prompts[:1]) == reference[:1]
    assert _taken(session.stats()) == _taken(before)


@pytest.mark.parametrize("name", ["v32-layerwise-sparse", "v32-sparse"])
def test_requests_arriving_together_compute_their_shared_prefix_once(monkeypatch, name):
    """Nothing stored yet: the first request computes the system prompt (two steps), the others sit out the
    step that completes its blocks and then take its 5 blocks over from the store."""
    model, session, prompts, reference = _burst(5, name)
    family, config = CONFIGS[name]
    steps = _steps(monkeypatch)
    assert _batch(model, prompts) == reference
    stats = session.stats()
    assert _taken(stats) == 2 * 40
    assert stats["prompt_tokens_computed"] == len(prompts[0]) + sum(len(p) - 40 for p in prompts[1:])
    # two steps compute the first prompt (32 + 20 tokens): its first chunk takes the whole token budget, the
    # others sit out the second (which computes the 5th block), then start at position 40
    assert steps[0] == [(0, 32)] and steps[1] == [(32, 20)], steps[:2]
    assert stats["prefix_waits"] == 2
    assert sorted(q for s in steps for p, q in s if p == 40) == [len(p) - 40 for p in prompts[1:]]
    assert stats["reserved_requests"] == 0 and stats["serving_requests"] == 0

    # reuse off: no request waits, each computes its prompt
    off = torch_kvoffload.offload(_model(family), {**copy.deepcopy(config), "prefix_cache": False})
    assert _batch(off, prompts) == reference
    assert session_of(off).stats()["prefix_waits"] == 0


def test_a_request_that_fails_while_others_wait_for_its_prefix_leaves_them_to_go_on(monkeypatch):
    """The first request's second chunk fails in the step the others sit out (its first stored 4 blocks):
    it fails alone; the next request takes those 4 blocks over and computes the 5th, the last waits for it
    and takes all 5 over."""
    model, session, prompts, reference = _burst(6)
    from torch_kvoffload.integrations.hf.serving import ServingRequests

    real_forward = ServingRequests._forward

    def failing(self, model, layout, requests, ids, logits):
        first = self.request("req_0")
        if first is not None and first.length and any(r is first for r in requests):
            raise RuntimeError("injected failure in req_0's rows")
        return real_forward(self, model, layout, requests, ids, logits)

    monkeypatch.setattr(ServingRequests, "_forward", failing)
    out = model.generate_batch(prompts, generation_config=_gen(), continuous_batching_config=_cb())
    assert "injected failure in req_0's rows" in str(out["req_0"].error)
    for i in (1, 2):
        assert out[f"req_{i}"].error is None and list(out[f"req_{i}"].generated_tokens) == reference[i], i
    stats = session.stats()
    assert _taken(stats) == 32 + 40
    assert stats["prefix_waits"] == 3  # both in req_0's failed step, req_2 in req_1's first
    assert stats["reserved_requests"] == 0 and stats["serving_requests"] == 0
    monkeypatch.undo()
    assert _batch(model, prompts[:1]) == reference[:1]  # and the model serves again, from the store

"""``generate`` options on an offloaded model, against the unmodified model (a deep copy taken before
offloading): beam search and beam sampling, ``num_return_sequences``, ``inputs_embeds``, ``use_cache=False``,
the cache options (``cache_implementation``, a cache object), every output option, ``logits_to_keep``,
assisted decoding and prompt lookup (cache cropping), and continuing from a returned cache.

Tokens must be equal, scores and logits equal to fp32 tolerance. Every backend that keeps KV per request
(layerwise, sparse offload, resident sparse) is run through the options that fork (beams) and truncate
(assisted decoding) its requests, eagerly; the compiled path runs the options in one sequence per family.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import ONE_LAYER, SMALL, build_model, left_padded_batch

import torch_kvoffload
from torch_kvoffload.integrations.hf import session_of

CONFIGS = {
    "default": None,
    "layerwise": {"layerwise": {}, "block_size": 4},
    "sparse": {"sparse": {"capacity": 9}, "block_size": 4},  # hot buffers barely above the top-k: misses
    "resident": {"sparse": {"offload": False}},
}
CASES = [
    ("deepseek_v3", "default"),
    ("deepseek_v3", "layerwise"),
    ("deepseek_v32", "default"),
    ("deepseek_v32", "layerwise"),
    ("deepseek_v32", "sparse"),
    ("deepseek_v32", "resident"),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pair(family: str, config, *, compiled: bool = False, **overrides):
    ref = build_model(family, **overrides)
    model = copy.deepcopy(ref)
    model = torch_kvoffload.compile(model, config) if compiled else torch_kvoffload.offload(model, config)
    return ref, model


def _batch():
    return left_padded_batch([7, 5, 6], seed=11)


def _generate(model, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(**kwargs)


def _assert_same(want, got, real: torch.Tensor | None = None) -> None:
    """Equal sequences; scores / logits / hidden states (at ``real`` positions of the first step) close."""
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{(got != want).sum().item()} tokens differ"
        return
    assert torch.equal(got.sequences, want.sequences), "sequences differ"
    for name in ("scores", "logits"):
        w, g = getattr(want, name, None), getattr(got, name, None)
        assert (w is None) == (g is None), name
        if w is not None:
            assert len(w) == len(g)
            for a, b in zip(w, g, strict=True):
                torch.testing.assert_close(b, a, msg=lambda m, n=name: f"{n}: {m}")
    for name in ("sequences_scores", "beam_indices"):
        w, g = getattr(want, name, None), getattr(got, name, None)
        assert (w is None) == (g is None), name
        if w is not None:
            torch.testing.assert_close(g, w)
    w, g = getattr(want, "hidden_states", None), getattr(got, "hidden_states", None)
    assert (w is None) == (g is None)
    if w is not None:
        assert len(w) == len(g)
        for step, (ws, gs) in enumerate(zip(w, g, strict=True)):
            for a, b in zip(ws, gs, strict=True):
                if step == 0 and real is not None:  # left padding sees no token: meaningless there
                    rows = real.bool().repeat_interleave(a.shape[0] // real.shape[0], dim=0)  # beams
                    a, b = a[rows], b[rows]
                torch.testing.assert_close(b, a)


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_beam_search_and_sampling_fork_requests(family, mode):
    ref, model = _pair(family, CONFIGS[mode])
    ids, mask = _batch()
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True)
    runs = [
        dict(num_beams=3, do_sample=False, output_scores=True, output_logits=True),
        dict(num_beams=3, num_return_sequences=2, do_sample=False, output_scores=True, length_penalty=0.5),
        dict(num_beams=2, do_sample=True, output_scores=True),
        dict(do_sample=True, num_return_sequences=3, output_logits=True),
        dict(num_beams=1, do_sample=False, output_scores=True),  # plain greedy after the forks
    ]
    for i, kw in enumerate(runs):
        want = _generate(ref, seed=i, **common, **kw)
        got = _generate(model, seed=i, **common, **kw)
        _assert_same(want, got)
        stats = torch_kvoffload.stats(model)
        assert stats["failed_forwards"] == 0
    if mode == "sparse":  # blocks of 4: the beams share their prompts' full host-pool blocks
        assert torch_kvoffload.stats(model)["fork_shared_blocks"] > 0
    # every request the beams forked was released with its sequence
    session = session_of(model)
    session.end_sequence()
    assert torch_kvoffload.stats(model)["reserved_requests"] == 0


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_assisted_decoding_and_prompt_lookup_crop_the_cache(family, mode):
    ref, model = _pair(family, CONFIGS[mode])
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(3, 1000, (5,), generator=g)
    ids = torch.cat([motif, torch.randint(3, 1000, (3,), generator=g), motif, motif[:2]])[None]
    for kw in (
        dict(prompt_lookup_num_tokens=3, max_new_tokens=12),
        dict(assistant_model=build_model(family, seed=7, **SMALL), max_new_tokens=10),
        dict(prompt_lookup_num_tokens=2, max_new_tokens=8, return_dict_in_generate=True, output_scores=True),
    ):
        want = _generate(ref, input_ids=ids, do_sample=False, **kw)
        got = _generate(model, input_ids=ids, do_sample=False, **kw)
        _assert_same(want, got)
    assert torch_kvoffload.stats(model)["failed_forwards"] == 0


def test_crop_drops_the_rejected_rows_in_every_backend():
    """A forward of draft tokens, a crop, then other tokens at the cropped positions: the logits equal the
    unmodified model fed only the kept tokens (nothing of the dropped rows shows)."""
    from transformers import DynamicCache

    for mode in ("default", "layerwise", "sparse", "resident"):
        ref, model = _pair("deepseek_v32", CONFIGS[mode])
        ids, mask = _batch()
        session_of(model).reserve(3, 32)  # room for the drafts: a host pool keeps its first size
        cache, ref_cache = session_of(model).new_cache(), DynamicCache(config=ref.config)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, cache=cache)
            ref(input_ids=ids, attention_mask=mask, cache=ref_cache)
            for step in range(3):
                draft = torch.randint(3, 1000, (3, 4), generator=g)
                m = torch.cat([mask, torch.ones(3, 4, dtype=mask.dtype)], dim=1)
                model(input_ids=draft, attention_mask=m, cache=cache)
                cache.crop(-3)  # keep the first draft token
                keep = draft[:, :1]
                mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
                ref(input_ids=keep, attention_mask=mask, cache=ref_cache)
                assert cache.get_seq_length() == ref_cache.get_seq_length() == mask.shape[1]
                nxt = torch.randint(3, 1000, (3, 2), generator=g)
                m = torch.cat([mask, torch.ones(3, 2, dtype=mask.dtype)], dim=1)
                got = model(input_ids=nxt, attention_mask=m, cache=cache).logits
                want = ref(input_ids=nxt, attention_mask=m, cache=ref_cache).logits
                torch.testing.assert_close(
                    got, want, msg=lambda msg, s=step, md=mode: f"{md} step {s}: {msg}"
                )
                mask = m


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_inputs_embeds_use_cache_off_and_every_output(family):
    ref, model = _pair(family, None)
    ids, mask = _batch()
    emb = ref.get_input_embeddings()(ids).detach()
    outputs = dict(
        return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True
    )
    runs = [
        dict(inputs_embeds=emb, attention_mask=mask, max_new_tokens=5, do_sample=False, **outputs),
        dict(input_ids=ids, inputs_embeds=emb, attention_mask=mask, max_new_tokens=5, do_sample=False),
        dict(inputs_embeds=emb, attention_mask=mask, max_new_tokens=4, num_beams=2, do_sample=False),
        dict(
            input_ids=ids, attention_mask=mask, max_new_tokens=5, use_cache=False, do_sample=False, **outputs
        ),
        dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, **outputs),
    ]
    for kw in runs:
        _assert_same(_generate(ref, **kw), _generate(model, **kw), real=mask)
    stats = torch_kvoffload.stats(model)
    assert stats["failed_forwards"] == 0
    # the runs fed embeddings without ids: 3 rows, 3 rows, then 3 x 2 beams (rows fed embeddings are
    # not keyed by content); the ones with input_ids count nothing
    assert stats["unkeyed_requests"] == 3 + 3 + 6


def test_a_mask_that_rewrites_earlier_positions_is_refused():
    """Padding keeps no KV: a later mask that turns earlier padding into real tokens (or the reverse) is
    refused before anything changes; the sequence continues with the right mask."""
    from transformers import DynamicCache

    ref, model = _pair("deepseek_v32", None)
    ids, mask = _batch()
    cache, ref_cache = session_of(model).new_cache(), DynamicCache(config=ref.config)
    nxt = torch.randint(3, 1000, (3, 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache)
        ref(input_ids=ids, attention_mask=mask, cache=ref_cache)
        for bad in (torch.ones_like(mask), mask.flip(1)):
            with pytest.raises(ValueError, match="mask so far"):
                model(
                    input_ids=nxt,
                    attention_mask=torch.cat([bad, torch.ones(3, 1, dtype=mask.dtype)], 1),
                    cache=cache,
                )
        assert cache.get_seq_length() == ids.shape[1]
        good = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        got = model(input_ids=nxt, attention_mask=good, cache=cache).logits
        want = ref(input_ids=nxt, attention_mask=good, cache=ref_cache).logits
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_cache_options_are_served_or_refused_by_the_library(family):
    from transformers import DynamicCache

    ref, model = _pair(family, None)
    ids, mask = _batch()
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    plain = _generate(ref, **common)
    for impl in ("static", "dynamic"):
        _assert_same(_generate(ref, **common, cache_implementation=impl), plain)
    # transformers' own offloaded cache needs CUDA streams: the plain run is the reference on CPU
    for impl in ("static", "dynamic", "offloaded"):
        _assert_same(plain, _generate(model, **common, cache_implementation=impl))
    for impl in ("quantized", "paged", "sliding_window"):
        with pytest.raises(ValueError, match=f"cache_implementation='{impl}'.*not supported"):
            _generate(model, **common, cache_implementation=impl)
    with pytest.raises(ValueError, match=r"library's cache.*DynamicCache"):
        _generate(model, **common, cache=DynamicCache(config=ref.config))
    # output_attentions is served (its values: test_hf_attentions.py), except with a static cache
    got = _generate(model, **common, return_dict_in_generate=True, output_attentions=True)
    assert torch.equal(got.sequences, plain) and len(got.attentions) == common["max_new_tokens"]
    with pytest.raises(ValueError, match="output_attentions=True, cache_implementation='static'"):
        _generate(model, **common, output_attentions=True, cache_implementation="static")
    # continuing from the cache a generate returned, then a plain call: the model stays usable
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    first_ref, first = _generate(ref, input_ids=ids, **kw), _generate(model, input_ids=ids, **kw)
    _assert_same(first_ref, first)
    more = torch.cat([mask, torch.ones(3, 3, dtype=mask.dtype)], dim=1)
    kw2 = dict(attention_mask=more, max_new_tokens=3, do_sample=False)
    want = _generate(ref, input_ids=first_ref.sequences, cache=first_ref.past_key_values, **kw2)
    got = _generate(model, input_ids=first.sequences, cache=first.past_key_values, **kw2)
    _assert_same(want, got)
    _assert_same(_generate(ref, **common), _generate(model, **common))


def test_compiled_model_serves_every_option_in_one_sequence():
    """What a static cache buys in transformers, the library's cache gives a compiled model: after one
    generate, generates of other batch sizes, prompt lengths, new tokens, with beams or a static-cache
    request run under ``fail_on_recompile`` with the unmodified model's tokens. Then every option, in one
    sequence of calls on the same model.

    One compiled family, one layer: DeepseekV32 under its default config runs both runtimes (layerwise prefill
    and sparse decode); the options are served by the core, not by the graphs (a fork, a crop, a static-cache
    request reach the same graphs), so DeepseekV3's compiled graphs (tests/hf/test_compile_hf.py) and its
    eager runs of every option (above) leave nothing a compiled V3 run of them would add."""
    ref, model = _pair("deepseek_v32", None, compiled=True, **ONE_LAYER)
    ids, mask = _batch()
    _generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    ids2, mask2 = left_padded_batch([9, 4], seed=2)
    with torch.compiler.set_stance("fail_on_recompile"):
        for kw in (
            dict(max_new_tokens=6, do_sample=False),
            dict(max_new_tokens=4, num_beams=2, do_sample=False),
            dict(max_new_tokens=4, do_sample=False, cache_implementation="static"),
        ):
            got = _generate(model, input_ids=ids2, attention_mask=mask2, **kw)
            _assert_same(_generate(ref, input_ids=ids2, attention_mask=mask2, **kw), got)

    emb = ref.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        for keep in (0, 1, 3, 1):
            want = ref(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
            got = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
            torch.testing.assert_close(got, want)
    outputs = dict(
        return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True
    )
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(3, 1000, (5,), generator=g)
    lookup_ids = torch.cat([motif, torch.randint(3, 1000, (3,), generator=g), motif, motif[:2]])[None]
    runs = [
        dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False, **outputs),
        dict(inputs_embeds=emb, attention_mask=mask, max_new_tokens=4, do_sample=False),
        dict(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, use_cache=False, do_sample=False, **outputs
        ),
        dict(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            cache_implementation="static",
            do_sample=False,
        ),
        dict(input_ids=lookup_ids, max_new_tokens=8, prompt_lookup_num_tokens=3, do_sample=False),
        dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True, num_return_sequences=2),
        dict(
            input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, logits_to_keep=0, **outputs
        ),
    ]
    for i, kw in enumerate(runs):
        real = kw.get("attention_mask")
        _assert_same(_generate(ref, seed=i, **kw), _generate(model, seed=i, **kw), real=real)


def test_a_p_d_node_refuses_to_fork_or_crop_and_keeps_its_sequence_usable_until_then():
    """A P/D decode node's peer was told each request's blocks: forking (beam search) or cropping its
    requests is refused with the role named, and the failed sequence leaves nothing reserved."""
    from torch_kvoffload._utils import free_port

    model = torch_kvoffload.offload(
        build_model("deepseek_v32"),
        {"sparse": {}, "block_size": 4, "pd": {"role": "decode", "kv_port": free_port()}},
    )
    session = session_of(model)
    try:
        for op in ("reorder", "crop"):
            session.reserve(2, 16)
            cache = session.new_cache()
            session.begin_external_sequence([[5, 6, 7], [8, 9, 10]], 3, cache)
            cache.seen_tokens = 3
            assert cache.get_seq_length() == 3
            with pytest.raises(NotImplementedError, match="P/D"):
                if op == "reorder":
                    cache.reorder_cache(torch.tensor([0, 0]))
                else:
                    cache.crop(-1)
            assert torch_kvoffload.stats(model)["reserved_requests"] == 0
        # a permutation needs no fork: it is served
        cache = session.new_cache()
        session.begin_external_sequence([[5, 6, 7], [8, 9, 10]], 3, cache)
        first = session.request_ids
        cache.reorder_cache(torch.tensor([1, 0]))
        assert session.request_ids == first[::-1]
    finally:
        torch_kvoffload.integrations.hf.install.detach(model)


def test_the_model_as_its_own_assistant_and_a_3d_mask_are_refused_by_name():
    """Both fail before anything runs, naming the option, and the model stays usable (4-D masks are
    served: tests/hf/test_hf_custom_masks.py)."""
    ref, model = _pair("deepseek_v3", CONFIGS["layerwise"], **SMALL)
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"assistant_model=<the model itself>"):
        _generate(model, input_ids=ids[:1], max_new_tokens=4, assistant_model=model, do_sample=False)
    mask3d = torch.ones(ids.shape[0], ids.shape[1], ids.shape[1])
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match=r"2-D .* or 4-D .* got a tensor of shape \(3, 7, 7\)"),
    ):
        model(input_ids=ids, attention_mask=mask3d)
    assert torch_kvoffload.stats(model)["reserved_requests"] == 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    _assert_same(_generate(ref, **kw), _generate(model, **kw))

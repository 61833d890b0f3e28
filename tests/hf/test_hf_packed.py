"""Packed (padding-free) rows on offloaded models: segments whose ``position_ids`` restart are independent
sequences, as in the unmodified transformers model (``use_cache=False``, no mask), and the flash-attention
style ``cu_seq_lens_q`` say the same. References: the unmodified model on the same packed input, and on each
segment alone."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import ONE_LAYER, build_model

import torch_kvoffload
from torch_kvoffload.integrations.hf.packed import PackedRows

# the compiled path once, on the family whose graphs hold the indexer too (each test compiles new variants)
CASES = [
    ("deepseek_v3", "offload", {}),
    ("deepseek_v32", "offload", {}),
    ("deepseek_v32", "compile", ONE_LAYER),
]
ATOL = 2e-5


def _positions(segments: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in segments])


def _separately(ref, ids: torch.Tensor, segments: list[list[int]]) -> torch.Tensor:
    """The unmodified model's logits of every segment run alone, packed like ``ids``."""
    rows = []
    for b, row in enumerate(segments):
        parts, start = [], 0
        for n in row:
            parts.append(ref(input_ids=ids[b : b + 1, start : start + n], use_cache=False).logits)
            start += n
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows)


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{m}" for f, m, _ in CASES])
def pair(request):
    family, mode, overrides = request.param
    torch._dynamo.reset()
    ref = build_model(family, **overrides)
    model = getattr(torch_kvoffload, mode)(build_model(family, **overrides))
    yield ref, model
    torch_kvoffload.stats(model)  # still usable after the sequence of calls


@torch.no_grad()
def test_packed_rows_are_independent_segments(pair):
    ref, model = pair
    gen = torch.Generator().manual_seed(0)
    # one row of two sequences, then two rows packed differently (one of them a single sequence)
    for segments in ([[5, 4]], [[3, 6, 2], [11]]):
        width = sum(segments[0])
        ids = torch.randint(3, 1000, (len(segments), width), generator=gen)
        pos = _positions(segments)
        want = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(want, _separately(ref, ids, segments), rtol=0, atol=ATOL)
        got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=ATOL)


@pytest.mark.parametrize("config", [{"layerwise": {}, "sparse": {}}, {"sparse": {"offload": False}}])
@torch.no_grad()
def test_an_offloaded_model_runs_packed_rows_as_one_unpadded_forward_of_the_core(config):
    """No padding is computed: the model's forward gets the segments' tokens one after the other ``[1, n]``,
    each segment a request of the KV core; after it no request is held (nothing continues a forward
    without a cache), and a generate of another shape follows with the unmodified model's tokens."""
    ref = build_model("deepseek_v32")
    model = torch_kvoffload.offload(build_model("deepseek_v32"), config)
    shapes = []
    original = model._kvoffload_originals["forward"]

    def spy(*args, **kwargs):
        given = kwargs.get("input_ids")
        shapes.append(tuple((given if given is not None else kwargs["inputs_embeds"]).shape[:2]))
        return original(*args, **kwargs)

    model._kvoffload_originals["forward"] = spy
    segments = [[3, 6, 2], [7, 4]]
    ids = torch.randint(3, 1000, (2, 11), generator=torch.Generator().manual_seed(9))
    pos = _positions(segments)
    want = _separately(ref, ids, segments)
    got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=ATOL)
    emb = ref.get_input_embeddings()(ids)
    got = model(inputs_embeds=emb, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=ATOL)
    assert shapes == [(1, 22), (1, 22)]
    assert torch_kvoffload.stats(model)["reserved_requests"] == 0
    prompt = ids[:1, :6]
    kw = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))


@torch.no_grad()
def test_one_row_of_positions_serves_every_row(pair):
    """``position_ids [1, T]`` with a batch of rows: transformers expands them to every row."""
    ref, model = pair
    ids = torch.randint(3, 1000, (2, 9), generator=torch.Generator().manual_seed(6))
    pos = _positions([[5, 4]])
    want = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(want, _separately(ref, ids, [[5, 4], [5, 4]]), rtol=0, atol=ATOL)
    torch.testing.assert_close(
        model(input_ids=ids, position_ids=pos, use_cache=False).logits, want, rtol=1e-4, atol=ATOL
    )


@torch.no_grad()
def test_packed_outputs_hidden_states_loss_and_logits_to_keep(pair):
    ref, model = pair
    segments = [[4, 6]]
    ids = torch.randint(3, 1000, (1, 10), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 4] = -100  # the collator's boundary label
    kw = dict(input_ids=ids, position_ids=_positions(segments), use_cache=False)
    want = ref(**kw, labels=labels, output_hidden_states=True)
    got = model(**kw, labels=labels, output_hidden_states=True)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=ATOL)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=ATOL)
    assert len(got.hidden_states) == len(want.hidden_states)
    for g, w in zip(got.hidden_states, want.hidden_states, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    last = model(**kw, logits_to_keep=1).logits
    torch.testing.assert_close(last, want.logits[:, -1:], rtol=1e-4, atol=ATOL)
    tup = model(**kw, return_dict=False)
    assert isinstance(tup, tuple) and torch.allclose(tup[0], want.logits, rtol=1e-4, atol=ATOL)


@torch.no_grad()
def test_cu_seq_lens_mark_the_segments(pair):
    ref, model = pair
    segments = [[2, 5, 3]]
    ids = torch.randint(3, 1000, (1, 10), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 2, 7, 10], dtype=torch.int32)
    got = model(
        input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5, use_cache=False
    )
    torch.testing.assert_close(got.logits, _separately(ref, ids, segments), rtol=1e-4, atol=ATOL)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q must rise from 0 to the row's 10 tokens"):
        model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 4, 9]), use_cache=False)
    with pytest.raises(ValueError, match="cu_seq_lens_k differs"):
        model(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 10]), use_cache=False)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match=r"one flattened \[1, tokens\] row, got 2 rows"):
        model(input_ids=ids.expand(2, -1), cu_seq_lens_q=cu, use_cache=False)


@torch.no_grad()
def test_restarting_positions_with_a_cache_are_one_sequence_as_in_transformers(pair):
    """With a cache (``use_cache`` on) or a mask, transformers does not split the row: neither does the library."""
    ref, model = pair
    ids = torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(3))
    pos = _positions([[5, 4]])
    want = ref(input_ids=ids, position_ids=pos, use_cache=True).logits
    assert not torch.allclose(want, _separately(ref, ids, [[5, 4]]), atol=1e-3)
    got = model(input_ids=ids, position_ids=pos, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=ATOL)
    mask = torch.ones(1, 9, dtype=torch.long)
    got = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got, ref(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits,
                               rtol=1e-4, atol=ATOL)  # fmt: skip


@torch.no_grad()
def test_output_attentions_equal_the_eager_models_packed_too_and_a_generate_follows(pair):
    ref, model = pair
    eager = copy.deepcopy(ref)
    eager.set_attn_implementation("eager")  # sdpa returns no attentions
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(4))
    for kw in ({}, {"position_ids": _positions([[3, 3]]), "use_cache": False}):  # packed: block diagonal
        want = eager(input_ids=ids, output_attentions=True, **kw).attentions
        got = model(input_ids=ids, output_attentions=True, **kw).attentions
        assert len(got) == len(want) == ref.config.num_hidden_layers
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=ATOL)
    want = ref.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=4, do_sample=False), want)


@pytest.mark.parametrize(
    "config",
    [
        {"sparse": {}},
        {"sparse": {"offload": False}},
        {"layerwise": {}},
        {"layerwise": {}, "sparse": {"offload": False}},
    ],
    ids=["sparse", "resident", "layerwise", "layerwise+resident"],
)
@torch.no_grad()
def test_packed_rows_in_every_mode(config):
    ref = build_model("deepseek_v32")
    model = torch_kvoffload.offload(build_model("deepseek_v32"), config)
    segments = [[5, 4], [3, 6]]
    ids = torch.randint(3, 1000, (2, 9), generator=torch.Generator().manual_seed(5))
    pos = _positions(segments)
    want = _separately(ref, ids, segments)
    torch.testing.assert_close(
        model(input_ids=ids, position_ids=pos, use_cache=False).logits, want, rtol=1e-4, atol=ATOL
    )


def _loops_gather(packed: torch.Tensor, lengths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference batch of segments, right-padded with zeros, and its mask, written with loops."""
    spans = [(b, sum(row[:i]), n) for b, row in enumerate(lengths) for i, n in enumerate(row)]
    longest = max(n for *_, n in spans)
    batch = torch.zeros(len(spans), longest, *packed.shape[2:], dtype=packed.dtype)
    mask = torch.zeros(len(spans), longest, dtype=torch.bool)
    for i, (b, start, n) in enumerate(spans):
        for c in range(n):
            batch[i, c] = packed[b, start + c]
            mask[i, c] = True
    return batch, mask


@pytest.mark.parametrize("seed", range(4))
def test_packed_layout_moves_tokens_both_ways(seed):
    g = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 4, (1,), generator=g))
    lengths = [torch.randint(1, 7, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]  # fmt: skip
    width = max(sum(row) for row in lengths)
    lengths = [[*row[:-1], row[-1] + width - sum(row)] for row in lengths]  # every row fills the width
    layout = PackedRows.from_lengths(lengths, width)
    packed = torch.randn(rows, width, 3, generator=g)
    want, mask = _loops_gather(packed, lengths)
    assert torch.equal(layout.gather(packed), want) and torch.equal(layout.mask(), mask)
    assert torch.equal(layout.scatter(want), packed), "the segments do not go back where they came from"
    ids = torch.randint(0, 100, (1, width), generator=g)
    assert torch.equal(layout.gather(ids), _loops_gather(ids.expand(rows, -1), lengths)[0]), (
        "[1, T] serves every row"
    )
    # take: the segments' tokens one after the other, in segment order (a packed forward's row)
    taken = layout.take(packed)
    assert taken.shape == (1, sum(map(sum, lengths)), 3)
    assert torch.equal(taken[0], torch.cat([want[i, :n] for i, n in enumerate(layout.lengths)]))
    # the last token of every segment, alone, into an output buffer; the rest stays untouched
    out = torch.full((rows, width, 3), -1.0)
    last = torch.tensor([n - 1 for n in layout.lengths])
    layout.scatter_last(want[torch.arange(len(layout.spans)), last], out)
    for b, row in enumerate(lengths):
        ends = {sum(row[: i + 1]) - 1 for i in range(len(row))}
        for t in range(width):
            assert torch.equal(out[b, t], packed[b, t] if t in ends else torch.full((3,), -1.0))
    # a subset of the segments: the others' positions are left as they are
    pick = list(range(0, len(layout.spans), 2))
    sub = layout.select(pick)
    assert torch.equal(sub.gather(packed), _loops_gather(packed, lengths)[0][pick][:, : sub.longest])
    partial = sub.scatter(sub.gather(packed), torch.zeros_like(packed))
    for b, start, n in layout.spans:
        chosen = (b, start, n) in sub.spans
        assert torch.equal(partial[b, start : start + n], packed[b, start : start + n] if chosen
                           else torch.zeros(n, 3))  # fmt: skip


def test_packed_layout_refuses_bad_lengths():
    with pytest.raises(ValueError, match=r"row 0's segment lengths \[3, 0\]"):
        PackedRows.from_lengths([[3, 0]], 3)
    with pytest.raises(ValueError, match=r"row 1's segment lengths \[4, 4\] do not fit 6 tokens"):
        PackedRows.from_lengths([[6], [4, 4]], 6)
    with pytest.raises(ValueError, match="step: cu_seq_lens_q must be an integer tensor"):
        PackedRows.from_cu("step", torch.tensor([0.0, 3.0]), 3)


@torch.no_grad()
def test_one_model_serves_packed_forwards_and_continuous_batching():
    """The packed layout serves both callers of one model, in turns: a packed forward, a continuous-batching
    run (its steps are packed rows of prefill chunks and decode tokens), a packed forward of two rows, and a
    ``generate``. References: the unmodified model on each segment alone, and its per-prompt ``generate``."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    ref = build_model("deepseek_v32")
    with torch.no_grad():  # a zero embedding ties the indexer's scores (see test_hf_cb_offload)
        ref.model.embed_tokens.weight[0].normal_()
    model = copy.deepcopy(ref)
    torch_kvoffload.offload(model, {"sparse": {}, "serving": {"max_requests": 2, "max_request_tokens": 32}})
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 11, 4)]
    gen = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=999_999, pad_token_id=0)
    want = [ref.generate(torch.tensor([p]), generation_config=gen)[0, len(p) :].tolist() for p in prompts]

    flat = torch.tensor([[t for p in prompts for t in p]])
    cu = torch.tensor([0, 6, 17, 21], dtype=torch.int32)
    got = model(input_ids=flat, cu_seq_lens_q=cu, use_cache=False).logits
    torch.testing.assert_close(got, _separately(ref, flat, [[6, 11, 4]]), rtol=1e-4, atol=ATOL)
    assert [int(got[0, int(e) - 1].argmax()) for e in cu[1:]] == [w[0] for w in want]

    cb = ContinuousBatchingConfig(page_size=8, max_batch_tokens=8, max_requests_per_batch=3)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    order = sorted(out, key=lambda rid: int(rid.rsplit("_", 1)[1]))
    assert [list(out[rid].generated_tokens) for rid in order] == want

    ids = torch.randint(3, 1000, (2, 9), generator=g)
    segments = [[5, 4], [2, 7]]
    got = model(input_ids=ids, position_ids=_positions(segments), use_cache=False).logits
    torch.testing.assert_close(got, _separately(ref, ids, segments), rtol=1e-4, atol=ATOL)
    p = torch.tensor([prompts[1]])
    assert model.generate(p, generation_config=gen)[0, 11:].tolist() == want[1]

"""A custom 4-D ``attention_mask`` through ``offload`` / ``compile``: the unmodified model's logits under the
same mask (a tree of branches sharing a prefix, a mask continuing a cached sequence, additive and boolean
masks), the branches' logits equal to running each branch as its own sequence, and the masks the library
cannot serve refused by name with the model left usable. V3.2 at ``index_topk`` 8 over 15-30 positions:
the indexer's selection, which the mask changes, is really sparse."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import ONE_LAYER, SMALL, build_model, left_padded_batch

import torch_kvoffload
from torch_kvoffload.integrations.hf import session_of

BS = 4
MIN = torch.finfo(torch.float32).min
CONFIGS = {
    "layerwise": {"layerwise": {}, "block_size": BS},
    "sparse": {"sparse": {}, "block_size": BS},
    "resident": {"sparse": {"offload": False}, "block_size": BS},
    "both": {"layerwise": {}, "sparse": {}, "block_size": BS},
}
CASES = [
    ("deepseek_v3", "layerwise", "offload"),
    ("deepseek_v3", "layerwise", "compile"),
    ("deepseek_v32", "sparse", "offload"),
    ("deepseek_v32", "resident", "offload"),
    ("deepseek_v32", "both", "offload"),
    ("deepseek_v32", "sparse", "compile"),
]


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _pair(family: str, config: str, mode: str = "offload"):
    model = build_model(
        family, **(ONE_LAYER if mode == "compile" else SMALL)
    )  # a compiled one traces one layer
    ref = copy.deepcopy(model)
    return getattr(torch_kvoffload, mode)(model, CONFIGS[config]), ref


def _additive(visible: torch.Tensor) -> torch.Tensor:
    """transformers' float form of a boolean mask: 0 where visible, the dtype's minimum elsewhere."""
    return torch.zeros(visible.shape).masked_fill(~visible, MIN)


def _tree(prefix: int, branches: int, depth: int, seed: int):
    """``(ids [1, T], visible bool [1, 1, T, T], positions [1, T], separate ids [branches, prefix + depth])``:
    ``branches`` chains of ``depth`` tokens after one shared ``prefix``, each seeing the prefix and its own
    earlier tokens (positions continue the prefix in every branch)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 1000, (prefix,), generator=g)
    chains = torch.randint(3, 1000, (branches, depth), generator=g)
    ids = torch.cat([shared, chains.reshape(-1)])[None]
    T = prefix + branches * depth
    visible = torch.zeros(T, T, dtype=torch.bool)
    visible[:prefix, :prefix] = torch.ones(prefix, prefix, dtype=torch.bool).tril()
    for b in range(branches):
        at = prefix + b * depth
        visible[at : at + depth, :prefix] = True
        visible[at : at + depth, at : at + depth] = torch.ones(depth, depth, dtype=torch.bool).tril()
    positions = torch.cat([torch.arange(prefix), (prefix + torch.arange(depth)).repeat(branches)])[None]
    separate = torch.cat([shared.expand(branches, prefix), chains], dim=1)
    return ids, visible[None, None], positions, separate


@pytest.mark.parametrize(("family", "config", "mode"), CASES, ids=["-".join(c) for c in CASES])
def test_a_shared_prefix_tree_gives_the_unmodified_logits_and_each_branchs_own(family, config, mode):
    model, ref = _pair(family, config, mode)
    ids, visible, positions, separate = _tree(prefix=12, branches=3, depth=3, seed=1)
    mask = _additive(visible)
    want = ref(ids, attention_mask=mask, position_ids=positions).logits
    got = model(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the reference means what it says: each branch run as its own sequence gives the same logits
    alone = ref(separate).logits[:, -3:]
    torch.testing.assert_close(got[0, 12:].reshape(3, 3, -1), alone, rtol=1e-4, atol=1e-5)
    # then the model generates as before (a new sequence)
    ids2, mask2 = left_padded_batch([9, 6], seed=2)
    kw = dict(attention_mask=mask2, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(ids2, **kw), ref.generate(ids2, **kw))


def _history_mask(mask2d: torch.Tensor, new_visible: torch.Tensor) -> torch.Tensor:
    """``[B, 1, S, past + S]`` float mask: every query sees the sequence's real earlier positions
    (``mask2d [B, past]``) and, among the new ones, ``new_visible [S, S]``."""
    B, S = mask2d.shape[0], new_visible.shape[0]
    past = mask2d.bool()[:, None, :].expand(B, S, -1)
    return _additive(torch.cat([past, new_visible.expand(B, S, S)], dim=2)[:, None])


CONTINUE = [("deepseek_v3", "layerwise"), ("deepseek_v32", "sparse"), ("deepseek_v32", "resident"),
            ("deepseek_v32", "both")]  # fmt: skip


@pytest.mark.parametrize(("family", "config"), CONTINUE, ids=["-".join(c) for c in CONTINUE])
def test_masks_continue_a_cached_sequence_and_decoding_follows(family, config):
    """A left-padded prompt (its first forward with a 4-D mask under layerwise offload, whose store keys
    plain prompts only: the padding queries, hidden from every column, average over the row as in
    transformers), a tree of 5 draft tokens over the history, one more token with its own mask, then
    plain decode steps: every step's logits equal the unmodified model's under the same masks."""
    from transformers import DynamicCache

    model, ref = _pair(family, config)
    ids, mask2d = left_padded_batch([14, 10], seed=3)
    session_of(model).reserve(2, 32)  # room for every step: a host pool keeps its first size
    cache, ref_cache = session_of(model).new_cache(), DynamicCache(config=ref.config)
    start = "layerwise" in CONFIGS[config]
    B, W = ids.shape
    positions = (mask2d.cumsum(-1) - 1).clamp(min=0)
    kw = dict(attention_mask=mask2d, position_ids=positions)
    if start:  # the prompt's own causal mask, its padding masked
        causal = torch.ones(W, W, dtype=torch.bool).tril()
        kw["attention_mask"] = _additive(causal[None, None] & mask2d.bool()[:, None, None, :])
    torch.testing.assert_close(
        model(ids, cache=cache, **kw).logits, ref(ids, cache=ref_cache, **kw).logits, rtol=1e-4, atol=1e-5
    )
    seen = mask2d.sum(dim=1, keepdim=True)
    g = torch.Generator().manual_seed(4)
    # a draft tree: token 0; 1 and 2 after 0; 3 after 1; 4 after 2
    parent = [-1, 0, 0, 1, 2]
    tree = torch.eye(5, dtype=torch.bool)
    for i, p in enumerate(parent):
        while p >= 0:
            tree[i, p], p = True, parent[p]
    depth = tree.sum(dim=1) - 1
    steps = [
        (torch.randint(3, 1000, (B, 5), generator=g), tree, seen + depth),
        (torch.randint(3, 1000, (B, 1), generator=g), None, None),  # sees all but the draft's branch 2 -> 4
    ]
    for step, (new, visible, pos) in enumerate(steps):
        if visible is None:  # one token seeing the history and the draft's tokens 0, 1, 3
            draft = torch.tensor([True, True, False, True, False])
            hist = torch.cat([mask2d[:, :-5].bool(), draft.expand(B, 5)], dim=1)
            m = _history_mask(hist, torch.ones(1, 1, dtype=torch.bool))
            pos = seen + 3
        else:
            m = _history_mask(mask2d, visible)
        got = model(new, cache=cache, attention_mask=m, position_ids=pos).logits
        want = ref(new, cache=ref_cache, attention_mask=m, position_ids=pos).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda s, i=step: f"step {i}: {s}")
        if step == 0:
            mask2d = torch.cat([mask2d, torch.ones(B, 5, dtype=mask2d.dtype)], dim=1)
    mask2d = torch.cat([mask2d, torch.ones(B, 1, dtype=mask2d.dtype)], dim=1)
    for _ in range(3):  # plain decode steps over everything cached
        nxt = torch.randint(3, 1000, (B, 1), generator=g)
        mask2d = torch.cat([mask2d, torch.ones(B, 1, dtype=mask2d.dtype)], dim=1)
        # the positions of a forward with a 4-D mask are all the sequence's tokens (the library keeps
        # their KV): after such a start, its padding stays hidden by 4-D masks, not by a 2-D one
        m = _additive(mask2d.bool()[:, None, None, :]) if start else mask2d
        got = model(nxt, cache=cache, attention_mask=m).logits
        want = ref(nxt, cache=ref_cache, attention_mask=m).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert cache.get_seq_length() == ref_cache.get_seq_length()


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_additive_and_boolean_masks(family):
    """A float mask is added as given (a soft bias, not only 0 / minimum); a boolean one masks."""
    config = "layerwise" if family == "deepseek_v3" else "sparse"
    model, ref = _pair(family, config)
    ids, visible, positions, _ = _tree(prefix=10, branches=2, depth=4, seed=5)
    soft = _additive(visible) + torch.where(
        visible, -torch.rand(visible.shape, generator=torch.Generator().manual_seed(6)) * 3, 0.0
    )
    for mask in (soft, visible):
        want = ref(ids, attention_mask=mask, position_ids=positions).logits
        got = model(ids, attention_mask=mask, position_ids=positions).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_masks_the_library_cannot_serve_are_refused_and_the_model_stays_usable():
    from transformers import DynamicCache

    model, ref = _pair("deepseek_v3", "layerwise")
    ids, visible, positions, _ = _tree(prefix=6, branches=2, depth=2, seed=7)
    T = ids.shape[1]
    bad = {
        "must be \\[batch, 1, new, past \\+ new\\]": _additive(visible)[:, :, :, :-1],
        "must be bool or floating": visible.long(),
        "some with -inf and some with the dtype's minimum": _additive(visible).index_fill_(2, torch.tensor([3]), MIN)
        .index_put_((torch.tensor([0]), torch.tensor([0]), torch.tensor([3]), torch.tensor([0])), torch.tensor(-torch.inf)),
        "NaN": torch.full((1, 1, T, T), float("nan")),
    }  # fmt: skip
    for match, mask in bad.items():
        with pytest.raises(ValueError, match=match):
            model(ids, attention_mask=mask, position_ids=positions)
    with pytest.raises(ValueError, match="custom 4-D attention_mask with output_attentions"):
        model(ids, attention_mask=_additive(visible), position_ids=positions, output_attentions=True)
    assert torch_kvoffload.stats(model)["failed_forwards"] == 0

    # a left-padded prompt, then a mask that shows a query the padding: refused, the sequence goes on
    ids2, mask2d = left_padded_batch([8, 5], seed=8)
    cache, ref_cache = session_of(model).new_cache(), DynamicCache(config=ref.config)
    torch.testing.assert_close(
        model(ids2, cache=cache, attention_mask=mask2d).logits,
        ref(ids2, cache=ref_cache, attention_mask=mask2d).logits,
    )
    nxt = torch.tensor([[5], [6]])
    sees_padding = _additive(torch.ones(2, 1, 1, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="lets query 0 of row 1 attend to column 0, a padding position"):
        model(nxt, cache=cache, attention_mask=sees_padding)
    hides_all = torch.full((2, 1, 1, 9), MIN)  # the unmodified model would average the padding's KV in
    with pytest.raises(ValueError, match="averages over every column, the sequence's padding included"):
        model(nxt, cache=cache, attention_mask=hides_all)
    # a sequence keyed by its token ids under layerwise offload cannot continue with a custom mask
    only_real = _additive(torch.cat([mask2d.bool(), torch.ones(2, 1, dtype=torch.bool)], 1)[:, None, None])
    with pytest.raises(ValueError, match="cannot continue with a custom 4-D attention_mask with layerwise"):
        model(nxt, cache=cache, attention_mask=only_real)
    mask2d = torch.cat([mask2d, torch.ones(2, 1, dtype=mask2d.dtype)], dim=1)
    torch.testing.assert_close(
        model(nxt, cache=cache, attention_mask=mask2d).logits,
        ref(nxt, cache=ref_cache, attention_mask=mask2d).logits,
    )


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_a_query_hidden_from_every_column_gets_what_transformers_gives(family):
    """All ``-inf`` (or ``False``): zeros, as SDPA gives a fully masked row; all the dtype's minimum: the
    average over every column (for DSA over every position, not only the indexer's selection). A DSA model
    refuses ``-inf`` there: its unmodified attention averages over what top-k's order of ties leaves."""
    config = "layerwise" if family == "deepseek_v3" else "sparse"
    model, ref = _pair(family, config)
    ids, visible, positions, _ = _tree(prefix=10, branches=2, depth=4, seed=10)
    hidden = visible.clone()
    hidden[..., 12, :] = False
    hidden[..., 15, :] = False
    neg_inf = _additive(hidden).masked_fill(~hidden, -torch.inf)
    for mask in (_additive(hidden), hidden, neg_inf):
        if family == "deepseek_v32" and mask is neg_inf:
            # the unmodified DSA attention then averages over what its top-k of tied -inf left out
            with pytest.raises(ValueError, match=r"query 12 of row 0 with -inf.*order of ties"):
                model(ids, attention_mask=mask, position_ids=positions)
            continue
        want = ref(ids, attention_mask=mask, position_ids=positions).logits
        got = model(ids, attention_mask=mask, position_ids=positions).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_trees_kv_never_serves_a_plain_prompt_from_the_store():
    """Under layerwise offload, the tree's blocks are not keyed by its tokens: the same tokens as one plain
    prompt afterwards find nothing in the store and give the unmodified logits."""
    model, ref = _pair("deepseek_v3", "layerwise")
    ids, visible, positions, _ = _tree(prefix=8, branches=2, depth=4, seed=9)
    model(ids, attention_mask=_additive(visible), position_ids=positions)
    before = torch_kvoffload.stats(model)
    assert before["unkeyed_requests"] == 1 and before["layer_saves"] > 0
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-5)
    assert torch_kvoffload.stats(model)["store_hits"] == before["store_hits"] == 0


def test_a_causal_4d_mask_gives_what_the_2d_path_gives_with_the_int8_indexer():
    """The int8 indexer cache (an approximation of the unmodified scores) under a causal 4-D mask: the
    biased path scores the same int8 keys as the kernel the plain forward runs, so the logits agree."""
    config = {"sparse": {"indexer_dtype": "int8"}, "block_size": BS}
    plain = torch_kvoffload.offload(build_model("deepseek_v32", **SMALL), config)
    masked = torch_kvoffload.offload(build_model("deepseek_v32", **SMALL), config)
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(11))
    causal = torch.ones(24, 24, dtype=torch.bool).tril()[None, None].expand(2, 1, 24, 24)
    torch.testing.assert_close(
        masked(ids, attention_mask=_additive(causal)).logits, plain(ids).logits, rtol=1e-4, atol=1e-5
    )

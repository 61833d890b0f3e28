"""Prefix reuse on Hugging Face models: a prompt whose leading blocks the store holds (the layerwise
store, or the prefix store of a model without layerwise offload) is not recomputed; the model runs only
the rest, and the tokens and logits are the cold run's and the unmodified model's."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from support.hf_models import ONE_LAYER, SMALL, build_model, indexer_boundary_ties, left_padded_batch
from support.store_helpers import empty_store

import torch_kvoffload
from torch_kvoffload.core import prefix as prefix_mod
from torch_kvoffload.layerwise.backend import LayerwiseBackend
from torch_kvoffload.layerwise.prefix_store import PrefixStore
from torch_kvoffload.store.local import LocalKVStore

BS = 16
NEW = 5
MODES = {
    "v3-layerwise": ("deepseek_v3", {"layerwise": {}, "block_size": BS}),
    "v32-layerwise": ("deepseek_v32", {"layerwise": {}, "block_size": BS}),
    "v32-both": ("deepseek_v32", {"layerwise": {}, "sparse": {}, "block_size": BS}),
    "v32-resident": ("deepseek_v32", {"layerwise": {}, "sparse": {"offload": False}, "block_size": BS}),
    "v32-int8-indexer": ("deepseek_v32", {"layerwise": {}, "sparse": {"indexer_dtype": "int8"}, "block_size": BS}),
    # no layerwise offload: the prefix store keeps the blocks, read back from the host pool / resident KV
    "v32-sparse": ("deepseek_v32", {"sparse": {}, "block_size": BS}),
    "v32-resident-only": ("deepseek_v32", {"sparse": {"offload": False}, "block_size": BS}),
}  # fmt: skip


def _generate(model, ids, mask=None, new=NEW, **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, return_dict_in_generate=True,
            output_logits=True, **kw,
        )  # fmt: skip


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(seed))


def _delta(model, before: dict, key: str) -> float:
    return torch_kvoffload.stats(model)[key] - before[key]


def _check_no_ties(ref, family, out, mask):
    if family == "deepseek_v32":
        rows = [out.sequences[b][mask[b].bool().tolist() + [True] * NEW] for b in range(len(mask))]
        assert indexer_boundary_ties(ref, rows) == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_a_cached_prompt_runs_only_its_suffix_with_the_cold_runs_tokens_and_logits(mode):
    family, config = MODES[mode]
    model = build_model(family)
    ref = copy.deepcopy(model)
    model = torch_kvoffload.offload(model, config)
    ids = _prompt(70, seed=1)
    want = _generate(ref, ids)
    _check_no_ties(ref, family, want, torch.ones_like(ids))
    before = torch_kvoffload.stats(model)
    cold = _generate(model, ids)
    if (
        exact := "int8" not in mode
    ):  # the int8 indexer approximates the scores: its own cold run is the reference
        assert torch.equal(cold.sequences, want.sequences)
    else:
        want = cold
    assert _delta(model, before, "prefix_store_tokens") == 0
    assert _delta(model, before, "prompt_tokens_computed") == 70

    # the same prompt: its 4 leading blocks (64 tokens; one token at least is computed) are not computed
    before = torch_kvoffload.stats(model)
    warm = _generate(model, ids)
    assert torch.equal(warm.sequences, want.sequences)
    for got, cold_logits in zip(warm.logits, cold.logits, strict=True):
        torch.testing.assert_close(got, cold_logits, rtol=1e-5, atol=1e-5)
    assert _delta(model, before, "prefix_store_tokens") == 64
    assert _delta(model, before, "prompt_tokens_computed") == 6
    assert _delta(model, before, "prefix_lookups") == 1 and _delta(model, before, "prefix_fallbacks") == 0

    # token 40 changed: blocks 0 and 1 (32 tokens) still match, the rest is computed
    other = ids.clone()
    other[0, 40] = 3 if int(other[0, 40]) != 3 else 4
    want = _generate(ref, other)
    _check_no_ties(ref, family, want, torch.ones_like(other))
    before = torch_kvoffload.stats(model)
    got = _generate(model, other)
    assert _delta(model, before, "prefix_store_tokens") == 32
    if not exact:  # against a cold run of the changed prompt, with reuse off
        cold_model = torch_kvoffload.offload(copy.deepcopy(ref), {**config, "prefix_cache": False})
        want = _generate(cold_model, other)
    assert torch.equal(got.sequences, want.sequences)


@pytest.mark.parametrize("mode", ["v3-layerwise", "v32-both", "v32-sparse"])
def test_rows_of_a_batch_hit_different_lengths_and_spans_end_inside_blocks(mode):
    """Row A has 64 tokens cached, row B (20 pads on the left) 48: the batch skips the 64 columns both
    have cached, so B adopts 44 tokens (its last block partly, from the stored block). With a third row
    that nothing was cached for (10 pads on the left), only the 10 columns before its first token are
    skipped: 10 tokens of row A, none of row B."""
    family, config = MODES[mode]
    model = build_model(family)
    ref = copy.deepcopy(model)
    model = torch_kvoffload.offload(model, config)
    ids, mask = left_padded_batch([70, 50], seed=3)
    for b in range(2):  # each prompt alone first: the store holds their blocks
        row = ids[b : b + 1, mask[b].bool()]
        assert torch.equal(_generate(model, row).sequences, _generate(ref, row).sequences)
    want = _generate(ref, ids, mask)
    _check_no_ties(ref, family, want, mask)
    before = torch_kvoffload.stats(model)
    got = _generate(model, ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    assert _delta(model, before, "prefix_store_tokens") == 64 + 44
    for g, w in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)

    # a row nobody cached: nothing is skipped, the whole batch is computed
    ids3, mask3 = left_padded_batch([70, 50, 60], seed=3)
    ids3[2] = left_padded_batch([70, 50, 60], seed=99)[0][2]
    want = _generate(ref, ids3, mask3)
    _check_no_ties(ref, family, want, mask3)
    before = torch_kvoffload.stats(model)
    assert torch.equal(_generate(model, ids3, mask3).sequences, want.sequences)
    assert _delta(model, before, "prefix_store_tokens") == 10


@pytest.mark.parametrize("mode", ["v3-layerwise", "v32-both", "v32-sparse"])
def test_rows_sharing_a_prefix_the_store_lacks_compute_it_once(mode):
    """Three prompts starting with one 48-token system prompt (3 blocks), nothing stored: the system prompt
    runs once on its own, then the batch skips the columns every row has cached (the padded batch's rule:
    the least of each row's padding plus its cached tokens) and each row takes its cached part over. Again:
    the store holds it, nothing runs first. With an unrelated row that has no padding the batch would skip
    nothing: nothing runs first either. Tokens and logits are the unmodified model's."""
    family, config = MODES[mode]
    model = build_model(family)
    ref = copy.deepcopy(model)
    model = torch_kvoffload.offload(model, config)
    system = _prompt(48, seed=21)[0]
    suffixes = [_prompt(n, seed=22 + n)[0] for n in (7, 12, 3)]
    rows = [torch.cat([system, x]) for x in suffixes]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :], mask[b, width - len(r) :] = r, 1
    want = _generate(ref, ids, mask)
    _check_no_ties(ref, family, want, mask)
    pads = [width - len(r) for r in rows]
    skip = min(p + 48 for p in pads)  # every row holds the system prompt once it ran
    for call in range(2):
        before = torch_kvoffload.stats(model)
        got = _generate(model, ids, mask)
        assert torch.equal(got.sequences, want.sequences)
        for g, w in zip(got.logits, want.logits, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        ran_first = 48 if call == 0 else 0
        adopted = sum(skip - p for p in pads)
        assert _delta(model, before, "shared_prefix_tokens") == ran_first
        assert _delta(model, before, "prefix_store_tokens") == adopted
        assert _delta(model, before, "prompt_tokens_computed") == ran_first + sum(map(len, rows)) - adopted

    other = _prompt(width, seed=40)
    ids2, mask2 = torch.cat([ids, other]), torch.cat([mask, torch.ones_like(other)])
    ids2[:3, :4] = _prompt(4, seed=41)  # the system prompt's first block differs now: nothing stored matches
    mask2[:3, :4] = 1
    want = _generate(ref, ids2, mask2)
    before = torch_kvoffload.stats(model)
    assert torch.equal(_generate(model, ids2, mask2).sequences, want.sequences)
    assert _delta(model, before, "shared_prefix_tokens") == 0


def test_beams_and_returned_sequences_reuse_the_prefix(monkeypatch):
    family, config = MODES["v32-both"]
    model = build_model(family)
    ref = copy.deepcopy(model)
    model = torch_kvoffload.offload(model, config)
    ids = _prompt(60, seed=4)
    _generate(model, ids)
    kw = dict(num_beams=2, num_return_sequences=2)
    want = _generate(ref, ids, **kw)
    adopted = []
    real = prefix_mod.PrefixReuse.adopt

    def adopt(self, requests, *args):
        adopted.append(len(requests))
        return real(self, requests, *args)

    monkeypatch.setattr(prefix_mod.PrefixReuse, "adopt", adopt)
    before = torch_kvoffload.stats(model)
    got = _generate(model, ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert _delta(model, before, "prefix_store_tokens") == 2 * 48  # two beam rows, 3 blocks each
    assert adopted == [1]  # the second beam row is a fork of the first: their host-pool blocks are shared


def test_reuse_off_and_calls_whose_outputs_cover_the_prompt_compute_everything():
    family, config = MODES["v32-both"]
    ids = _prompt(50, seed=5)
    off = torch_kvoffload.offload(build_model(family), {**config, "prefix_cache": False})
    ref = build_model(family)
    want = _generate(ref, ids)
    for _ in range(2):
        assert torch.equal(_generate(off, ids).sequences, want.sequences)
    assert torch_kvoffload.stats(off)["prefix_store_tokens"] == 0

    model = torch_kvoffload.offload(build_model(family), config)
    _generate(model, ids)
    before = torch_kvoffload.stats(model)
    # hidden states of every prompt position, and a forward returning every position's logits
    hidden = _generate(model, ids, output_hidden_states=True)
    ref_hidden = _generate(ref, ids, output_hidden_states=True)
    assert torch.equal(hidden.sequences, ref_hidden.sequences)
    assert hidden.hidden_states[0][0].shape == ref_hidden.hidden_states[0][0].shape
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits
        ref_logits = ref(ids, attention_mask=torch.ones_like(ids)).logits
    assert logits.shape == ref_logits.shape
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert _delta(model, before, "prefix_store_tokens") == 0
    # the next generate still reuses
    assert torch.equal(_generate(model, ids).sequences, want.sequences)
    assert _delta(model, before, "prefix_store_tokens") == 48


def _shared_store(monkeypatch) -> LocalKVStore:
    """One store every model offloaded from now on uses (layerwise backends and prefix stores)."""
    from torch_kvoffload.layerwise import backend as layerwise_backend
    from torch_kvoffload.layerwise import prefix_store

    store = LocalKVStore(64 << 20)
    store.close = lambda: None  # the models share it: none closes it for the others
    for module in (layerwise_backend, prefix_store):
        monkeypatch.setattr(module, "build_store", lambda config: store)
    return store


def _stored_once(monkeypatch, seed: int, mode: str = "v32-both"):
    """``(store, model, prompt, the unmodified model's output)``: a V3.2 model offloaded under ``mode`` on a
    store of its own, which its first generate of the 70-token prompt filled."""
    family, config = MODES[mode]
    store = _shared_store(monkeypatch)
    model = build_model(family)
    ref = copy.deepcopy(model)
    model = torch_kvoffload.offload(model, config)
    ids = _prompt(70, seed=seed)
    want = _generate(ref, ids)
    assert torch.equal(_generate(model, ids).sequences, want.sequences)
    return store, model, ids, want


@pytest.mark.parametrize(
    ("when", "mode"), [("adopting", "v32-both"), ("loading", "v32-both"), ("adopting", "v32-sparse")]
)
def test_a_prefix_the_store_loses_after_the_lookup_is_computed_with_the_same_tokens(monkeypatch, when, mode):
    """The store empties between the lookup and the read of the adopted rows (``adopting``: the partial
    block's and the sparse rows' read), or between the adoption and the forward's layer loads
    (``loading``, layerwise only): the prompt is computed whole, counted in ``prefix_fallbacks``; the next
    call works."""
    store, model, ids, want = _stored_once(monkeypatch, seed=6, mode=mode)
    if when == "adopting":
        holder = LayerwiseBackend if "both" in mode else PrefixStore
        real = holder.cached_prefix

        def lookup_then_lose(self, tokens, positions):
            found = real(self, tokens, positions)
            empty_store(store)
            return found

        monkeypatch.setattr(holder, "cached_prefix", lookup_then_lose)
    else:
        real = prefix_mod.PrefixReuse.adopt

        def adopt_then_lose(self, *args):
            real(self, *args)
            empty_store(store)

        monkeypatch.setattr(prefix_mod.PrefixReuse, "adopt", adopt_then_lose)
    before = torch_kvoffload.stats(model)
    assert torch.equal(_generate(model, ids).sequences, want.sequences)
    assert _delta(model, before, "prefix_fallbacks") == 1
    monkeypatch.undo()
    assert torch.equal(_generate(model, ids).sequences, want.sequences)


@pytest.mark.parametrize("mode", ["v32-both", "v32-sparse"])
def test_a_damaged_stored_block_is_computed_never_adopted(monkeypatch, mode):
    """A block whose record fails its checksum when it is read: the forward computes from it on."""
    store, model, ids, want = _stored_once(monkeypatch, seed=7, mode=mode)
    for e in list(store._index.values()):  # a flipped byte in every record, behind the store's back
        store._arena[e.offset + e.nbytes // 2] ^= 0x40
    before = torch_kvoffload.stats(model)
    got = _generate(model, ids)
    assert torch.equal(got.sequences, want.sequences)
    assert torch_kvoffload.stats(model)["corrupt_records"] > before["corrupt_records"]


@pytest.mark.slow
# V3.2 with both runtimes on two layers (the layerwise pipeline passes a reused prefix from layer to layer);
# V3's layerwise graphs on one layer
@pytest.mark.parametrize(
    ("mode", "widths"), [("v32-both", SMALL), ("v3-layerwise", ONE_LAYER)], ids=["v32-both", "v3-layerwise"]
)
def test_a_compiled_model_reuses_the_prefix_call_after_call(mode, widths):
    family, config = MODES[mode]
    model = build_model(family, **widths)
    ref = copy.deepcopy(model)
    model = torch_kvoffload.compile(model, config)
    for seed, n in ((8, 70), (9, 40)):
        ids = _prompt(n, seed=seed)
        want = _generate(ref, ids)
        cold = _generate(model, ids)
        before = torch_kvoffload.stats(model)
        warm = _generate(model, ids)
        assert torch.equal(cold.sequences, want.sequences) and torch.equal(warm.sequences, want.sequences)
        for got, c in zip(warm.logits, cold.logits, strict=True):
            torch.testing.assert_close(got, c, rtol=1e-5, atol=1e-5)
        assert _delta(model, before, "prefix_store_tokens") == (n - 1) // BS * BS


@pytest.mark.parametrize("mode", ["v32-both", "v32-resident", "v3-layerwise", "v32-sparse"])
def test_the_next_turn_of_a_conversation_finds_the_blocks_its_answer_completed(mode):
    """The blocks a generate's decode steps completed (on the sparse path: not saved by the layerwise
    pipeline) are stored when its sequence ends, so the next turn (prompt + answer + a new message) skips
    them too."""
    family, config = MODES[mode]
    model = build_model(family)
    ref = copy.deepcopy(model)
    model = torch_kvoffload.offload(model, config)
    ids = _prompt(40, seed=11)
    first = _generate(model, ids, new=30, eos_token_id=None).sequences
    assert torch.equal(first, _generate(ref, ids, new=30, eos_token_id=None).sequences)
    turn = torch.cat([first, _prompt(10, seed=12)], dim=1)  # 80 tokens: 69 held by the first sequence
    want = _generate(ref, turn)
    _check_no_ties(ref, family, want, torch.ones_like(turn))
    before = torch_kvoffload.stats(model)
    assert torch.equal(_generate(model, turn).sequences, want.sequences)
    assert _delta(model, before, "prefix_store_tokens") == 64  # blocks 0-3: the prompt's 2, the answer's 2
    assert torch_kvoffload.stats(model)["persist_failures"] == 0


def test_models_with_and_without_layerwise_offload_find_each_others_blocks(monkeypatch):
    """On one store and the same weights, a model with sparse offload alone (its prefix store) and one
    with layerwise + sparse key their blocks alike: each takes over what the other stored, with the
    unmodified model's tokens; a model of other weights finds nothing."""
    _shared_store(monkeypatch)
    ref = build_model("deepseek_v32")
    sparse_only = torch_kvoffload.offload(copy.deepcopy(ref), MODES["v32-sparse"][1])
    both = torch_kvoffload.offload(copy.deepcopy(ref), MODES["v32-both"][1])
    other = torch_kvoffload.offload(build_model("deepseek_v32", seed=1), MODES["v32-sparse"][1])
    for seed, (first, second) in enumerate([(sparse_only, both), (both, sparse_only)], start=20):
        ids = _prompt(70, seed=seed)
        want = _generate(ref, ids)
        assert torch.equal(_generate(first, ids).sequences, want.sequences)
        before = torch_kvoffload.stats(second)
        assert torch.equal(_generate(second, ids).sequences, want.sequences)
        assert _delta(second, before, "prefix_store_tokens") == 64
        before = torch_kvoffload.stats(other)
        _generate(other, ids)
        assert _delta(other, before, "prefix_store_tokens") == 0


def test_the_prefix_store_is_configured_only_where_it_serves():
    """``prefix_store`` sizes the store of a model without layerwise offload; beside ``layerwise`` (whose
    store serves) or with reuse off it is refused, naming why."""
    from torch_kvoffload import OffloadConfig

    cfg = OffloadConfig(sparse={}, prefix_store={"capacity_bytes": "8MiB"})
    assert cfg.prefix_store.capacity_bytes == 8 << 20
    with pytest.raises(ValueError, match=r"layerwise\.store is the prefix store"):
        OffloadConfig(layerwise={}, sparse={}, prefix_store={})
    with pytest.raises(ValueError, match="prefix_cache is off"):
        OffloadConfig(sparse={}, prefix_cache=False, prefix_store={})
    model = torch_kvoffload.offload(
        build_model("deepseek_v32"), {**MODES["v32-sparse"][1], "prefix_store": cfg.prefix_store}
    )
    ids = _prompt(40, seed=30)
    _generate(model, ids)
    before = torch_kvoffload.stats(model)
    _generate(model, ids)
    assert _delta(model, before, "prefix_store_tokens") == 32
    off = torch_kvoffload.offload(
        build_model("deepseek_v32"), {**MODES["v32-sparse"][1], "prefix_cache": False}
    )
    _generate(off, ids)
    _generate(off, ids)
    assert torch_kvoffload.stats(off)["prefix_store_tokens"] == 0

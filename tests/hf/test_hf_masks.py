"""Offloaded Hugging Face models under any 0/1 attention mask: right padding, padding inside, random
masks, padded later forwards and decode steps where a row skips its step, ``generate`` from right- and
inside-padded prompts, one compiled model, rows with no token yet or no new token in layerwise forwards.

The reference is the unmodified model (a deep copy taken before offloading, ``sdpa``) fed the same inputs,
with a transformers ``DynamicCache`` across forwards. Logits are compared at every position except the
fully masked ones (left padding before a row's first real token: no key to attend to).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import ONE_LAYER, SMALL, build_model, indexer_boundary_ties
from transformers import DynamicCache

import torch_kvoffload
from torch_kvoffload.integrations.hf import session_of
from torch_kvoffload.integrations.hf.inputs import new_positions

BS = 8
CONFIGS = {
    "layerwise": {"layerwise": {}, "block_size": BS},
    "sparse": {"sparse": {}},
    "resident": {"sparse": {"offload": False}},
    "default": None,
}
CASES = [("deepseek_v3", "layerwise"), ("deepseek_v3", "default")] + [("deepseek_v32", m) for m in CONFIGS]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _models(family, mode, **overrides):
    """``(offloaded, unmodified)`` copies of one tiny model."""
    model = build_model(family, num_hidden_layers=2, **overrides)
    ref = copy.deepcopy(model)
    return torch_kvoffload.offload(model, CONFIGS[mode]), ref


def _seen(full: torch.Tensor, S: int) -> torch.Tensor:
    """``bool [B, S]``: the last ``S`` positions of ``full`` that see a real token (not fully masked)."""
    return (full.cumsum(1) > 0)[:, -S:]


def _check_logits(got, want, seen):
    torch.testing.assert_close(got[seen], want[seen])


def _ids(shape, seed):
    return torch.randint(3, 1000, shape, generator=torch.Generator().manual_seed(seed))


def _masks():
    g = torch.Generator().manual_seed(7)
    right = torch.tensor([[1] * 9 + [0] * 3, [1] * 4 + [0] * 8, [1] * 12])
    inside = torch.tensor(
        [[1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1], [0, 0, 1, 0, 1, 0, 1, 1, 1, 1, 0, 1], [1] * 12]
    )
    rand = (torch.rand(3, 12, generator=g) < 0.6).long()
    rand[:, -1] = 1
    return {"right": right, "inside": inside, "random": rand}


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_one_forward_any_mask(family, mode):
    model, ref = _models(family, mode)
    for i, mask in enumerate(_masks().values()):
        ids = _ids(mask.shape, seed=i)
        with torch.no_grad():
            want = ref(input_ids=ids, attention_mask=mask).logits
            got = model(input_ids=ids, attention_mask=mask.bool() if i == 1 else mask).logits
        _check_logits(got, want, _seen(mask, mask.shape[1]))
    session_of(model).close()


# new columns of the attention mask per forward: a padded prompt (a row with no real token but its
# last), a padded chunk (a row without any real token in it), decode steps where a row skips its step
SEQUENCE = [
    [[1] * 7 + [0] * 3, [0, 1, 1, 0, 0, 1, 1, 1, 0, 1], [0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [0] * 9 + [1]],
    [[1, 0, 1, 1, 0], [0] * 5, [1] * 5, [0, 1, 1, 0, 1]],
    [[1], [0], [1], [1]],
    [[1], [1], [1], [1]],
    [[0], [1], [1], [0]],
    [[1], [1], [1], [1]],
]


def _run_sequence(model, ref, forwards, *, seed: int) -> None:
    """Forwards of one sequence, each adding the mask columns ``forwards[i]`` (rows x new columns) with
    random ids, on ``model`` (the library's cache) and ``ref`` (a ``DynamicCache``); logits compared at
    every position that sees a real token."""
    ref_cache, cache = DynamicCache(config=ref.config), session_of(model).new_cache()
    full = torch.zeros(len(forwards[0]), 0, dtype=torch.int64)
    for i, cols in enumerate(forwards):
        new = torch.tensor(cols)
        full = torch.cat([full, new], dim=1)
        ids = _ids(new.shape, seed=seed + i)
        with torch.no_grad():
            want = ref(input_ids=ids, attention_mask=full, cache=ref_cache).logits
            got = model(input_ids=ids, attention_mask=full, cache=cache).logits
        _check_logits(got, want, _seen(full, new.shape[1]))


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_padded_forwards_of_a_sequence(family, mode):
    model, ref = _models(family, mode)
    session = session_of(model)
    session.reserve(4, sum(len(m[0]) for m in SEQUENCE))  # the sparse host pool keeps its first size
    _run_sequence(model, ref, SEQUENCE, seed=10)
    counts = session._core.counters.snapshot()
    assert counts["decode_forwards"] == (2 if session.sparse_on else 0)  # the two unpadded steps
    session.close()


def _generate(model, ids, mask, new=6):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)


def _no_ties(family, ref, mask, out):
    if family != "deepseek_v32":
        return
    new = out.shape[1] - mask.shape[1]
    rows = [out[b][mask[b].bool().tolist() + [True] * new] for b in range(mask.shape[0])]
    assert indexer_boundary_ties(ref, rows) == 0


@pytest.mark.parametrize(
    ("family", "padding"), [("deepseek_v3", "right"), ("deepseek_v32", "right"), ("deepseek_v32", "inside")]
)
def test_generate_right_and_inside_padding(family, padding):
    model, ref = _models(family, "default")
    mask = _masks()[padding]
    ids = _ids(mask.shape, seed=20)
    want = _generate(ref, ids, mask)
    _no_ties(family, ref, mask, want)
    assert torch.equal(_generate(model, ids, mask), want)
    session_of(model).close()


def test_compiled_inside_padding():
    """A compiled model: a padded prompt, then a decode step where a row skips its step."""
    model = build_model("deepseek_v32", **ONE_LAYER)
    ref = copy.deepcopy(model)
    model = torch_kvoffload.compile(model, {"sparse": {}, "block_size": BS})
    session = session_of(model)
    session.reserve(3, 13)
    ref_cache, cache = DynamicCache(config=ref.config), session.new_cache()
    prompt = _masks()["inside"]
    full = torch.cat([prompt, torch.tensor([[1], [0], [1]])], dim=1)
    for ids, mask in [(_ids(prompt.shape, seed=30), prompt), (_ids((3, 1), seed=31), full)]:
        with torch.no_grad():
            want = ref(input_ids=ids, attention_mask=mask, cache=ref_cache).logits
            got = model(input_ids=ids, attention_mask=mask, cache=cache).logits
        _check_logits(got, want, _seen(mask, ids.shape[1]))
    session.close()


# ------------------------------------------------------------------------------------ mask values
def test_mask_values_and_dtypes():
    ones = torch.ones(2, 5, dtype=torch.int64)
    assert new_positions(torch.tensor([[0, 1, 0, 1, 1], [1, 1, 1, 0, 0]]), 2, 3, 2).tolist() == [
        [0, 1, 1],
        [1, 0, 0],
    ]
    assert new_positions(ones.bool(), 2, 5, 0).all() and new_positions(ones.to(torch.int8), 2, 5, 0).all()
    with pytest.raises(ValueError, match=r"'attention_mask' must hold 0 \(padding\) and 1.*got values \[2\]"):
        new_positions(ones * 2, 2, 5, 0)
    with pytest.raises(ValueError, match=r"bool or integer tensor of 0 / 1, got torch.float32"):
        new_positions(ones.float(), 2, 5, 0)
    with pytest.raises(ValueError, match=r"\[B, past \+ S\] = \[2, 6\]"):
        new_positions(ones, 2, 5, 1)
    with pytest.raises(ValueError, match=r"first 2 columns must be the sequence's mask so far"):
        new_positions(torch.tensor([[0, 1, 1], [1, 1, 1]]), 2, 1, 2, torch.tensor([[1, 1], [1, 1]]).bool())
    assert new_positions(
        torch.tensor([[0, 1, 1], [1, 1, 1]]), 2, 1, 2, torch.tensor([[0, 1], [1, 1]]).bool()
    ).all()


def test_the_sequence_mask_kept_on_a_device_follows_every_forward():
    """A decode step compares its mask's earlier columns with the sequence's mask where the mask lives: the
    copy kept there (here on the meta device, for its shapes) grows with each forward and is dropped when
    the rows change (a crop, a fork)."""
    model = build_model("deepseek_v32", **SMALL)
    torch_kvoffload.offload(model, {"sparse": {}})
    session = session_of(model)
    ids = torch.randint(3, 1000, (2, 6))
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    cache = session.new_cache()
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
        seq = session._seq
        kept = seq._masks_on(torch.device("meta"))
        assert kept.device.type == "meta" and kept.shape == seq.masks.shape == (2, 6)
        for step in range(2):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            model(torch.randint(3, 1000, (2, 1)), attention_mask=mask, cache=cache)
            assert seq._device_masks is not None and seq._device_masks.shape == seq.masks.shape == (
                2,
                7 + step,
            )
        assert seq._masks_on(torch.device("cpu")) is seq.masks  # on the host: the host copy itself
        cache.crop(-1)
        assert seq._device_masks is None and seq.masks.shape == (2, 7)
        # a mask whose earlier columns changed is refused, the sequence usable after it
        bad = torch.cat([mask[:, :7], torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        bad[1, 0] = 1
        with pytest.raises(ValueError, match="first 7 columns must be the sequence's mask so far"):
            model(torch.randint(3, 1000, (2, 1)), attention_mask=bad, cache=cache)
        good = torch.cat([mask[:, :7], torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        model(torch.randint(3, 1000, (2, 1)), attention_mask=good, cache=cache)
        assert seq.masks.shape == (2, 8)


# ----------------------------------------------------------------------- rows without tokens (layerwise)
# new mask columns per forward: a row with no real token in the first forward; rows with no new token
# after earlier ones filling whole blocks of 4 (all read back from the store) or ending in a partial block
# (kept on the device); a row's first tokens in a later forward; decode steps where a row skips its step
EMPTY_ROWS = [
    [[1] * 8 + [0] * 2, [0] * 10, [0, 1, 1, 1, 0, 1, 1, 0, 0, 0]],
    [[0] * 6, [1, 1, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0]],
    [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]],
    [[1], [0], [1]],
    [[0], [1], [1]],
    [[1], [1], [1]],
]
EMPTY_CONFIGS = {"layerwise": {"layerwise": {}, "block_size": 4}, "default": None}


@pytest.mark.parametrize("mode", list(EMPTY_CONFIGS))
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_rows_without_tokens_then_their_first_tokens(family, mode):
    model = build_model(family, num_hidden_layers=2)
    ref = copy.deepcopy(model)
    model = torch_kvoffload.offload(model, EMPTY_CONFIGS[mode])
    session = session_of(model)
    session.reserve(3, sum(len(m[0]) for m in EMPTY_ROWS))
    _run_sequence(model, ref, EMPTY_ROWS, seed=40)
    if mode == "layerwise":
        assert session._core.counters.snapshot()["decode_forwards"] == (1 if session.sparse_on else 0)
    session.close()

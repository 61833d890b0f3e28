"""Layerwise store keys identify the positions a block's KV was computed at, not only its tokens.

The rotary part of the KV (``k_pe``, and V3.2's indexer keys) depends on the absolute positions. A plain
forward of a left-padded batch without ``position_ids`` puts a padded row's first real token at position =
its number of pads (transformers counts the padding), while ``generate`` starts every row's real tokens at
0: the same tokens, other KV. Neither may load the other's blocks; each still reuses its own.

The reference for every call is the unmodified model given the same call.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_models import FAMILIES, SMALL, build_model, left_padded_batch

import torch_kvoffload
from torch_kvoffload.integrations.hf import session_of
from torch_kvoffload.store import block_hashes

BS = 4
NEW = 4
# width 13: row 0 is unpadded (canonical positions either way), rows 1 and 2 have 4 and 7 pads
LENGTHS = [13, 9, 6]
# full blocks a prefill may load per row: at least one token is always computed
CACHEABLE = [(n - 1) // BS for n in LENGTHS]  # [3, 2, 1]


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def batch():
    return left_padded_batch(LENGTHS, seed=7)


def _forward(model, ids, mask):
    """The plain forward, no position_ids: transformers' positions count the padding."""
    return model(input_ids=ids, attention_mask=mask).logits


def _generate(model, ids, mask):
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )


def _check_forward(model, ref, ids, mask):
    real = mask.bool()
    torch.testing.assert_close(
        _forward(model, ids, mask)[real], _forward(ref, ids, mask)[real], rtol=1e-4, atol=1e-5
    )


def _check_generate(model, ref, ids, mask):
    got, want = _generate(model, ids, mask), _generate(ref, ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits) == NEW
    for step, (g, w) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")


def _hits(model) -> int:
    return int(torch_kvoffload.stats(model)["store_hits"])


def _offloaded(family):
    return torch_kvoffload.offload(build_model(family), {"layerwise": {}, "block_size": BS})


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_without_position_ids_then_generate(family, batch):
    ids, mask = batch
    ref, model = build_model(family), _offloaded(family)
    _check_forward(model, ref, ids, mask)  # stores blocks of rows 1 and 2 at positions shifted by the pads
    assert _hits(model) == 0
    before = _hits(model)
    _check_generate(model, ref, ids, mask)  # must not load them: its positions start at 0
    # its prefill found only row 0's blocks (unpadded: the same positions); decode steps load their own
    assert _hits(model) - before >= CACHEABLE[0]
    session_of(model).close()


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_then_forward_without_position_ids(family, batch):
    ids, mask = batch
    ref, model = build_model(family), _offloaded(family)
    _check_generate(model, ref, ids, mask)
    before = _hits(model)
    _check_forward(model, ref, ids, mask)  # must not load generate's blocks of the padded rows
    assert _hits(model) - before == CACHEABLE[0]
    session_of(model).close()


@pytest.mark.parametrize("family", FAMILIES)
def test_same_positions_still_hit_the_store(family, batch):
    ids, mask = batch
    ref, model = build_model(family), _offloaded(family)
    _check_forward(model, ref, ids, mask)
    _check_generate(model, ref, ids, mask)
    # both kinds of blocks are stored now: each call finds every cacheable block at its own positions
    before = _hits(model)
    _check_forward(model, ref, ids, mask)
    assert _hits(model) - before == sum(CACHEABLE)
    before = _hits(model)
    one = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    assert _hits(model) - before == sum(CACHEABLE)  # one new token: the prefill is the only forward
    assert torch.equal(
        one, ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    )
    _check_generate(model, ref, ids, mask)
    session_of(model).close()


@pytest.mark.parametrize("family", FAMILIES)
def test_explicit_position_ids_key_their_blocks(family, batch):
    """Custom ``position_ids`` (every row shifted by 5): the blocks are keyed by those positions; a
    forward at the canonical positions does not load them, the same shifted forward does."""
    ids, mask = batch
    ref, model = build_model(family), _offloaded(family)
    pos = (mask.cumsum(-1) - 1).clamp(min=0) + 5
    real = mask.bool()

    def shifted(m):
        return m(input_ids=ids, attention_mask=mask, position_ids=pos).logits[real]

    torch.testing.assert_close(shifted(model), shifted(ref), rtol=1e-4, atol=1e-5)
    before = _hits(model)
    one = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    assert _hits(model) == before  # nothing is stored at the canonical positions yet
    assert torch.equal(
        one, ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    )
    before = _hits(model)
    torch.testing.assert_close(shifted(model), shifted(ref), rtol=1e-4, atol=1e-5)
    assert _hits(model) - before == sum(CACHEABLE)  # its own blocks, at its own positions
    _check_generate(model, ref, ids, mask)
    session_of(model).close()


def test_compiled_model_keys_blocks_by_position(batch):
    """``torch_kvoffload.compile`` runs its forwards through the same session: the same keys."""
    ids, mask = batch
    torch._dynamo.reset()
    ref = build_model("deepseek_v3", **SMALL)
    model = torch_kvoffload.compile(build_model("deepseek_v3", **SMALL), {"layerwise": {}, "block_size": BS})
    _check_forward(model, ref, ids, mask)
    before = _hits(model)
    one = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    want = ref.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    assert _hits(model) - before == CACHEABLE[0]  # the padded rows' blocks were stored at other positions
    assert torch.equal(one.sequences, want.sequences)
    torch.testing.assert_close(one.logits[0], want.logits[0], rtol=1e-4, atol=1e-5)
    session_of(model).close()
    torch._dynamo.reset()


def test_block_hashes_cover_positions():
    toks = list(range(100, 112))  # 3 blocks of 4
    plain = block_hashes(toks, BS)
    # the canonical positions hash as no positions (keys of generate-style forwards are unchanged)
    assert block_hashes(toks, BS, positions=list(range(12))) == plain
    assert block_hashes(torch.tensor(toks), BS, positions=torch.arange(12)) == plain
    shifted = block_hashes(toks, BS, positions=list(range(3, 15)))
    assert not set(shifted) & set(plain)  # no block of the chain is shared
    assert block_hashes(toks, BS, positions=list(range(3, 15))) == shifted  # same positions: same keys
    # only the last block moved: the first two keys stay, the last differs
    last = block_hashes(toks, BS, positions=[*range(8), 9, 10, 11, 12])
    assert last[:2] == plain[:2] and last[2] != plain[2]
    # positions past the last full block are not hashed, like its tokens
    assert block_hashes([*toks, 7], BS, positions=[*range(12), 99]) == plain
    with pytest.raises(ValueError, match="11 positions for 12 token ids"):
        block_hashes(toks, BS, positions=list(range(11)))
    with pytest.raises(TypeError, match=r"positions\[0\] is a bool"):
        block_hashes(toks, BS, positions=[True] * 12)

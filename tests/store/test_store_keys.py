"""torch_kvoffload.store.keys: chained block hashes and per-layer keys."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch

from torch_kvoffload.layerwise import LayerCacheSpec, TensorSpec
from torch_kvoffload.store.keys import (
    DIGEST_SIZE,
    FINGERPRINT_SIZE,
    block_hashes,
    cache_layout_fingerprint,
    layer_block_keys,
    layer_key_prefix,
    parse_layer_block_key,
)


def _reference_hashes(tokens: list[int], block_size: int, salt: str = "") -> list[str]:
    """Independent restatement of the documented formula, one token at a time."""
    prev = hashlib.blake2b(b"torch_kvoffload/block-hash/v2" + salt.encode(), digest_size=DIGEST_SIZE).digest()
    out = []
    for b in range(len(tokens) // block_size):
        payload = b"".join(struct.pack("<q", t) for t in tokens[b * block_size : (b + 1) * block_size])
        prev = hashlib.blake2b(prev + payload, digest_size=DIGEST_SIZE).digest()
        out.append(prev.hex())
    return out


@pytest.mark.parametrize("block_size", [1, 3, 16, 128])
@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 300])
def test_matches_reference_formula(block_size: int, length: int) -> None:
    tokens = torch.randint(0, 150_000, (length,)).tolist()
    got = block_hashes(tokens, block_size)
    assert got == _reference_hashes(tokens, block_size)
    assert len(got) == length // block_size
    assert all(len(h) == 2 * DIGEST_SIZE for h in got)


def test_tensor_and_list_inputs_agree() -> None:
    tokens = torch.randint(-5, 2**40, (64,))
    ref = block_hashes(tokens.tolist(), 8)
    assert block_hashes(tokens, 8) == ref
    small = torch.randint(0, 30_000, (64,), dtype=torch.int32)
    assert block_hashes(small, 8) == block_hashes(small.tolist(), 8)
    assert block_hashes(small.to(torch.int16), 8) == block_hashes(small.tolist(), 8)
    assert block_hashes(np.asarray(small.tolist(), dtype=np.int64).tolist(), 8) == block_hashes(small, 8)
    assert block_hashes([np.int32(v) for v in small.tolist()], 8) == block_hashes(small, 8)


def test_equal_prefix_equal_keys_and_change_propagates() -> None:
    bs = 4
    base = torch.randint(0, 1000, (40,)).tolist()
    other = base[:22] + torch.randint(0, 1000, (18,)).tolist()
    hb, ho = block_hashes(base, bs), block_hashes(other, bs)
    assert hb[:5] == ho[:5]  # blocks 0..4 cover tokens 0..19, shared
    # a single differing token changes its block and every later block
    changed = list(base)
    changed[13] += 1
    hc = block_hashes(changed, bs)
    assert hc[:3] == hb[:3]
    assert all(a != b for a, b in zip(hc[3:], hb[3:], strict=True))
    # a prefix of the sequence yields a prefix of the hashes; the partial tail is ignored
    assert block_hashes(base[:27], bs) == hb[:6]
    assert len(set(hb)) == len(hb)


def test_salt_namespaces_and_chaining_is_positional() -> None:
    tokens = [7] * 32
    plain = block_hashes(tokens, 8)
    salted = block_hashes(tokens, 8, salt="lora-1")
    assert set(plain).isdisjoint(salted)
    # identical block contents at different positions get different hashes (the chain differs)
    assert len(set(plain)) == 4


def test_errors() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        block_hashes([1, 2], 0)
    with pytest.raises(TypeError, match="block_size must be an int"):
        block_hashes([1, 2], 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"token_ids\[1\] must be an int"):
        block_hashes([1, 2.5, 3], 1)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"token_ids\[0\] is a bool"):
        block_hashes([True], 1)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="integer dtype"):
        block_hashes(torch.ones(4), 2)
    with pytest.raises(TypeError, match="integer dtype"):
        block_hashes(torch.ones(4, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="1-D"):
        block_hashes(torch.ones(2, 2, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="does not fit in int64"):
        block_hashes([2**63], 1)
    with pytest.raises(TypeError, match="sequence of int or a tensor"):
        block_hashes("abc", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="salt"):
        block_hashes([1], 1, salt=3)  # type: ignore[arg-type]


def test_layer_block_keys_are_distinct_and_parse_back() -> None:
    hashes = block_hashes(list(range(64)), 8)
    keys = {
        (m, layer): layer_block_keys(hashes, layer, model_id=m)
        for m in ["", "dsv3", "dsv3/1"]
        for layer in range(3)
    }
    flat = [k for ks in keys.values() for k in ks]
    assert len(set(flat)) == len(flat)
    for (m, layer), ks in keys.items():
        for h, k in zip(hashes, ks, strict=True):
            assert parse_layer_block_key(k) == (m, layer, h)
    assert layer_block_keys([], 5) == []
    for (m, layer), ks in keys.items():
        assert ks == [layer_key_prefix(layer, model_id=m) + h for h in hashes]


def test_layer_block_keys_errors() -> None:
    with pytest.raises(ValueError, match="layer must be >= 0"):
        layer_block_keys(["ab"], -1)
    with pytest.raises(TypeError, match="layer must be an int"):
        layer_block_keys(["ab"], True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="single str"):
        layer_block_keys("abcd", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"block_hashes\[1\]"):
        layer_block_keys(["ab", ""], 0)
    with pytest.raises(TypeError, match="model_id"):
        layer_block_keys(["ab"], 0, model_id=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a layer block key"):
        parse_layer_block_key("xyz")
    with pytest.raises(ValueError, match="layer_key_prefix: layer must be >= 0"):
        layer_key_prefix(-1)
    with pytest.raises(TypeError, match="layer_key_prefix: layer must be an int"):
        layer_key_prefix(True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layer_key_prefix: model_id"):
        layer_key_prefix(0, model_id=1)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------- fingerprint


def _mla_specs(layers=3, nb=64, bs=128, dtype=torch.bfloat16, rank=512, rope=64, indexer=(128,), mtp=()):
    main = (TensorSpec((nb, bs, rank), dtype), TensorSpec((nb, bs, rope), dtype))
    idx = None if indexer is None else tuple(TensorSpec((nb, bs, d), torch.bfloat16) for d in indexer)
    return [LayerCacheSpec(main, idx, i in mtp) for i in range(layers)]


def test_fingerprint_is_stable_and_carries_the_model_id() -> None:
    # pinned: keys written by one process / version must be found by the next
    assert cache_layout_fingerprint(_mla_specs()) == "a64406e710cf6478"
    assert cache_layout_fingerprint(_mla_specs(), "deepseek-v3.2") == "deepseek-v3.2@a64406e710cf6478"
    assert cache_layout_fingerprint(_mla_specs(), "org/model@rev") == "org/model@rev@a64406e710cf6478"
    fp = cache_layout_fingerprint(_mla_specs(layers=5, dtype=torch.float32))
    assert len(fp) == 2 * FINGERPRINT_SIZE and int(fp, 16) >= 0
    # usable as the model id of a key, and read back from it
    key = layer_block_keys(["ab" * DIGEST_SIZE], 2, model_id=cache_layout_fingerprint(_mla_specs(), "m/1"))[0]
    assert parse_layer_block_key(key) == ("m/1@a64406e710cf6478", 2, "ab" * DIGEST_SIZE)


@pytest.mark.parametrize(
    "change",
    [
        {"layers": 4},
        {"bs": 64, "nb": 128},
        {"dtype": torch.float16},
        {"rank": 256},
        {"rope": 32},
        {"indexer": None},
        {"indexer": (64,)},
        {"indexer": (128, 1)},
    ],
)
def test_fingerprint_changes_with_every_layout_field(change) -> None:
    assert cache_layout_fingerprint(_mla_specs(**change)) != cache_layout_fingerprint(_mla_specs())


def test_fingerprint_ignores_what_does_not_change_a_block() -> None:
    base = cache_layout_fingerprint(_mla_specs())
    assert cache_layout_fingerprint(_mla_specs(nb=7)) == base  # pool size
    assert cache_layout_fingerprint(_mla_specs(mtp=(2,))) == base  # MTP flag: planned like any layer
    # one layer differing (its indexer) is another layout
    mixed = _mla_specs()
    mixed[1] = LayerCacheSpec(mixed[1].main, None)
    assert cache_layout_fingerprint(mixed) != base
    # component order matters (records hold them in order)
    swapped = [LayerCacheSpec(tuple(reversed(s.main)), s.indexer) for s in _mla_specs()]
    assert cache_layout_fingerprint(swapped) != base


def test_fingerprint_errors() -> None:
    with pytest.raises(TypeError, match="cache_layout_fingerprint: model_id must be a str, got int"):
        cache_layout_fingerprint(_mla_specs(), 3)
    with pytest.raises(ValueError, match="non-empty sequence of LayerCacheSpec"):
        cache_layout_fingerprint([])
    with pytest.raises(TypeError, match=r"specs\[1\] must be a LayerCacheSpec, got int"):
        cache_layout_fingerprint([_mla_specs()[0], 5])

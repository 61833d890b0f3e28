"""Stored KV is checked before it is used: a value whose bytes changed (a flipped byte) or whose object is
truncated is a miss — never copied out, counted in ``corrupt_records``, removed — and a backend that
fails on a get or a put costs a miss or a dropped put, never the next request.

Every backend kind: ``local`` (the arena), ``memcache`` (the recording fake of ``support/memcache_fake.py``)
and ``mooncake`` (a real loopback master, skipped without the client). The references are the values
put (store level) and the unmodified Hugging Face model (end to end).
"""

from __future__ import annotations

import pytest
import torch
from support.memcache_fake import memcache_store
from support.mooncake import mooncake_client, mooncake_missing

from torch_kvoffload.layerwise import backend as layerwise_backend
from torch_kvoffload.store import KVStore, LocalKVStore, RecordLayout
from torch_kvoffload.store.integrity import TRAILER_BYTES

_MOONCAKE_MISSING = mooncake_missing()
_MOONCAKE = pytest.param(
    "mooncake", marks=pytest.mark.skipif(_MOONCAKE_MISSING is not None, reason=str(_MOONCAKE_MISSING))
)


def _build(kind, request):
    if kind == "local":
        return LocalKVStore(1 << 20)
    if kind == "memcache":
        request.getfixturevalue("fake")
        return memcache_store(1 << 20)
    return mooncake_client(request.getfixturevalue("master"), 1 << 20)


@pytest.fixture(params=["local", "memcache", _MOONCAKE])
def store(request):
    s = _build(request.param, request)
    yield s
    s.close()


@pytest.fixture(params=["memcache", _MOONCAKE])
def remote(request):
    """A remote adapter: the checksum travels in a trailer after the value."""
    s = _build(request.param, request)
    yield s
    s.close()


# ------------------------------------------------------------------------ raw access to stored bytes
def _raw(store: KVStore, key: str) -> bytes:
    """The bytes the backend holds for ``key`` (remote: value and trailer)."""
    if isinstance(store, LocalKVStore):
        e = store._index[key]
        return store._arena[e.offset : e.offset + e.nbytes].numpy().tobytes()
    if type(store).__name__ == "MemcacheKVStore":
        return store._client.data[key]
    size = store._client.get_size(key)
    buf = torch.empty(size, dtype=torch.uint8)
    assert store._client.get_into(key, buf.data_ptr(), size) == size
    return buf.numpy().tobytes()


def _overwrite_raw(store: KVStore, key: str, data: bytes) -> None:
    """Replace what the backend holds for ``key`` behind the store's back (as a bad disk, a bad DIMM or
    another writer would)."""
    if isinstance(store, LocalKVStore):
        e = store._index[key]
        if len(data) == e.nbytes:
            store._arena[e.offset : e.offset + e.nbytes] = torch.frombuffer(
                bytearray(data), dtype=torch.uint8
            )
        else:  # a shorter object under the key
            store.put(key, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return
    if type(store).__name__ == "MemcacheKVStore":
        store._client.data[key] = data
        return
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert store._client.remove(key, True) == 0
    assert store._client.upsert_from(key, buf.data_ptr(), buf.numel(), store._config) == 0


def _flip(store: KVStore, key: str, pos: int) -> None:
    raw = bytearray(_raw(store, key))
    raw[pos] ^= 0x40
    _overwrite_raw(store, key, bytes(raw))


def _truncate(store: KVStore, key: str, cut: int) -> None:
    _overwrite_raw(store, key, _raw(store, key)[:-cut])


def _values(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [
        ((7,), torch.float32),
        ((4, 3, 5), torch.bfloat16),
        ((2, 64, 9), torch.int8),
        ((33,), torch.float64),
    ]
    out = []
    for shape, dtype in shapes:
        v = torch.randn(shape, generator=g) * 10
        out.append(v.to(dtype))
    return out


# ------------------------------------------------------------------------------------------ values
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_is_a_miss_then_the_key_works_again(store, where):
    vals = _values(1)
    keys = [f"v/{i}" for i in range(len(vals))]
    store.batch_put(keys, vals)
    for i, (key, v) in enumerate(zip(keys, vals, strict=True)):
        pos = {"first": 0, "middle": v.nbytes // 2, "last": v.nbytes - 1}[where]
        _flip(store, key, pos)
        out = torch.full_like(v, 3)
        assert store.get(key, out) is False
        assert torch.equal(out, torch.full_like(v, 3))  # nothing copied out
        assert store.counters.get("corrupt_records") == i + 1
        assert not store.exists(key)  # removed
        store.put(key, v)  # a later put of the key is read normally
        assert store.get(key, out) and torch.equal(out, v)
    # batch reads: only the damaged key misses
    _flip(store, keys[1], 5)
    outs = [torch.zeros_like(v) for v in vals]
    assert store.batch_get(keys, outs) == [True, False, True, True]
    assert all(torch.equal(o, v) for i, (o, v) in enumerate(zip(outs, vals, strict=True)) if i != 1)
    assert (outs[1] == 0).all() and store.counters.get("corrupt_records") == len(vals) + 1


def test_remote_trailer_damage_and_truncation_are_misses(remote):
    store = remote
    v = _values(2)[1]
    for damage in ("trailer", "truncate", "truncate-trailer", "empty-ish"):
        store.put("k", v)
        raw = _raw(store, "k")
        assert len(raw) == v.nbytes + TRAILER_BYTES
        if damage == "trailer":
            _flip(store, "k", v.nbytes + 9)  # the length / CRC fields themselves
        elif damage == "truncate":
            _truncate(store, "k", 5)
        elif damage == "truncate-trailer":
            _truncate(store, "k", TRAILER_BYTES)  # exactly the value's bytes left
        else:
            _overwrite_raw(store, "k", raw[:3])
        before = store.counters.get("corrupt_records")
        out = torch.full_like(v, 7)
        assert store.get("k", out) is False and torch.equal(out, torch.full_like(v, 7))
        assert store.counters.get("corrupt_records") == before + 1
    # an intact value of another size is still the caller's error, and nothing is dropped
    store.put("k", v)
    with pytest.raises(ValueError, match="holds 120 bytes but out has 4 bytes"):
        store.get("k", torch.empty(2, dtype=torch.bfloat16))
    assert store.exists("k")


# ----------------------------------------------------------------------------------------- records
def _layout(seed: int, nb: int = 6) -> RecordLayout:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(nb, 4, 6, generator=g)
    b = torch.randn(nb, 4, 2, generator=g).to(torch.bfloat16)
    return RecordLayout([a, b], [0, a[0].nbytes + 8], a[0].nbytes + 8 + b[0].nbytes)


@pytest.mark.parametrize("damage", ["flip", "truncate", "grow"])
def test_damaged_record_is_a_miss_and_its_blocks_stay_untouched(store, damage):
    src = _layout(3)
    keys = ["r/a", "r/b", "r/c"]
    store.batch_put_blocks(keys, src, [4, 1, 2])
    if damage == "flip":
        _flip(store, "r/b", src.record_bytes - 1)
    elif damage == "truncate":
        _truncate(store, "r/b", 7)
    else:  # a longer object under the key (another layout's record)
        _overwrite_raw(store, "r/b", _raw(store, "r/b") + b"\x00" * 24)
        if isinstance(store, LocalKVStore):
            store.put("r/b", torch.zeros(src.record_bytes + 24, dtype=torch.uint8))
    dst = _layout(4)
    before = [t.clone() for t in dst.tensors]
    assert store.batch_get_blocks(keys, dst, [0, 3, 5]) == [True, False, True]
    for s, d, b in zip(src.tensors, dst.tensors, before, strict=True):
        assert torch.equal(d[0], s[4]) and torch.equal(d[5], s[2])
        assert torch.equal(d[3], b[3])  # the miss's blocks are untouched
    assert store.counters.get("corrupt_records") == 1 and not store.exists("r/b")
    # written again, the record loads
    store.batch_put_blocks(["r/b"], src, [1])
    assert store.batch_get_blocks(["r/b"], dst, [3]) == [True]
    assert all(torch.equal(d[3], s[1]) for s, d in zip(src.tensors, dst.tensors, strict=True))


def test_local_lease_checks_what_it_pins():
    store = LocalKVStore(1 << 16)
    src = _layout(5)
    keys = ["l/0", "l/1", "l/2", "l/3"]
    store.batch_put_blocks(keys, src, [0, 1, 2, 3])
    _flip(store, "l/1", 3)
    store.put("l/3", torch.zeros(src.record_bytes - 4, dtype=torch.uint8))  # intact, but not this record
    with store.lease(keys, nbytes=[src.record_bytes] * 4) as lease:
        assert lease.found == [True, False, True, False]
        assert store.counters.get("corrupt_records") == 2 and store.lru_keys() == ["l/0", "l/2"]
        dst = _layout(6)
        assert store.batch_get_leased_blocks([(lease, 0, 4)], dst, [5, 4, 3, 2]) == [True, False, True, False]
        assert torch.equal(dst.tensors[0][5], src.tensors[0][0]) and torch.equal(
            dst.tensors[1][3], src.tensors[1][2]
        )
    assert store.used_bytes == 2 * src.record_bytes  # the dropped regions were freed with the lease
    with pytest.raises(ValueError, match="4 keys but 1 sizes"):
        store.lease(keys, nbytes=[1])


# ---------------------------------------------------------------------------------- backend failures
class _FailOnce:
    """Delegates to a backend client; the first call of any of the named methods raises."""

    def __init__(self, client, names):
        self._client = client
        self._fail = set(names)

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if name in self._fail:
            self._fail.clear()

            def boom(*args, **kwargs):
                raise RuntimeError(f"injected {name} failure")

            return boom
        return attr


@pytest.mark.parametrize("op", ["get", "put"])
def test_remote_backend_failure_is_a_miss_then_works(remote, op):
    store = remote
    vals = _values(7)
    keys = [f"f/{i}" for i in range(len(vals))]
    outs = [torch.zeros_like(v) for v in vals]
    if op == "get":
        store.batch_put(keys, vals)
        store._client = _FailOnce(store._client, {"get_into", "batch_get_into"})
        assert store.batch_get(keys, outs) == [False] * len(keys)
        assert all((o == 0).all() for o in outs)
    else:
        store._client = _FailOnce(
            store._client, {"put_from", "batch_put_from", "upsert_from", "batch_upsert_from"}
        )
        store.batch_put(keys, vals)  # dropped, not raised
        assert store.counters.get("put_dropped") == len(keys) and store.used_bytes == 0
        assert store.batch_get(keys, outs) == [False] * len(keys)
        store.batch_put(keys, vals)
    assert store.counters.get("store_errors") == 1 and store.counters.get("corrupt_records") == 0
    assert store.batch_get(keys, outs) == [True] * len(keys)
    assert all(torch.equal(o, v) for o, v in zip(outs, vals, strict=True))


# -------------------------------------------------------------------------------------- end to end
BS = 8


@pytest.fixture
def hf():
    pytest.importorskip("transformers")
    from support import hf_models

    return hf_models


def _generate(model, ids, new=6):
    return model.generate(input_ids=ids, attention_mask=None, max_new_tokens=new, do_sample=False)


def _record_keys(store, prompt, blocks, layers):
    """Store keys of ``blocks`` (indices) of ``prompt`` in ``layers``."""
    from torch_kvoffload.store import block_hashes, parse_layer_block_key

    hashes = {block_hashes(prompt[0], BS)[b] for b in blocks}
    stored = store.lru_keys() if isinstance(store, LocalKVStore) else store._ledger.keys()
    return [
        k for k in stored if parse_layer_block_key(k)[1] in layers and parse_layer_block_key(k)[2] in hashes
    ]


def test_hf_damaged_local_records_are_recomputed(hf, monkeypatch):
    import torch_kvoffload

    shared = LocalKVStore(64 << 20)
    monkeypatch.setattr(layerwise_backend, "build_store", lambda config: shared)
    prompt, _ = hf.left_padded_batch([29], seed=11)  # 3 full blocks looked up on a second request
    want = _generate(hf.build_model("deepseek_v3"), prompt)
    model = torch_kvoffload.offload(hf.build_model("deepseek_v3"), {"layerwise": {}, "block_size": BS})
    assert torch.equal(_generate(model, prompt), want)
    flipped = _record_keys(shared, prompt, [1], [1, 2])
    truncated = _record_keys(shared, prompt, [2], [3])
    assert len(flipped) == 2 and len(truncated) == 1
    for key in flipped:  # the exponent byte of a float in the middle of the record
        _flip(shared, key, 4 * 37 + 3)
    for key in truncated:
        _truncate(shared, key, 64)
    before = torch_kvoffload.stats(model)
    assert before["corrupt_records"] == 0 and before["store_errors"] == 0
    assert torch.equal(_generate(model, prompt), want)  # recomputed from block 1 on, never used
    after = torch_kvoffload.stats(model)
    assert shared.counters.get("corrupt_records") == 3
    assert after["corrupt_records"] == 3 and after["store_errors"] == 0
    # the first forward found block 0 of every layer only; the damaged blocks were computed and saved again
    assert after["store_hits"] - before["store_hits"] >= 1
    assert all(shared.exists(k) for k in flipped + truncated)
    assert torch.equal(_generate(model, prompt), want)
    assert shared.counters.get("corrupt_records") == 3


def test_hf_failed_lookup_is_a_miss_counted_in_stats(hf, monkeypatch):
    import torch_kvoffload
    from torch_kvoffload.store import StoreError

    shared = LocalKVStore(64 << 20)
    monkeypatch.setattr(layerwise_backend, "build_store", lambda config: shared)
    prompt, _ = hf.left_padded_batch([29], seed=14)
    want = _generate(hf.build_model("deepseek_v32"), prompt)
    # the forward's own lookup (prefix reuse would skip the cached prompt before it: test_hf_prefix_cache)
    config = {"layerwise": {}, "block_size": BS, "prefix_cache": False}
    model = torch_kvoffload.offload(hf.build_model("deepseek_v32"), config)
    assert torch.equal(_generate(model, prompt), want)
    cold = torch_kvoffload.stats(model)["store_hits"]  # a generate's hits with nothing of it stored before
    lease, calls = shared.lease, []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise StoreError("lookup failed")
        return lease(*args, **kwargs)

    monkeypatch.setattr(shared, "lease", fail_once)
    before = torch_kvoffload.stats(model)
    assert torch.equal(_generate(model, prompt), want)  # the prefill found nothing: the prompt computed
    mid = torch_kvoffload.stats(model)
    assert mid["store_errors"] == 1 and mid["corrupt_records"] == 0
    assert mid["store_hits"] - before["store_hits"] == cold
    assert torch.equal(_generate(model, prompt), want)
    after = torch_kvoffload.stats(model)
    assert after["store_errors"] == 1 and after["store_hits"] - mid["store_hits"] == cold + 3


def test_hf_remote_store_failure_and_damage_are_recomputed(hf, fake, monkeypatch):
    """A remote store checks a record only when its layer reads it (after the lookup counted it): a read
    that fails or a damaged record makes that forward run again with the prefix cut at the first bad
    block, so generate still returns the unmodified model's tokens."""
    import torch_kvoffload

    remote = memcache_store(64 << 20)
    monkeypatch.setattr(layerwise_backend, "build_store", lambda config: remote)
    prompt, _ = hf.left_padded_batch([29], seed=12)
    want = _generate(hf.build_model("deepseek_v3"), prompt)
    # the forward's retry (prefix reuse computes the whole prompt instead: test_hf_prefix_cache)
    config = {"layerwise": {}, "block_size": BS, "prefix_cache": False}
    model = torch_kvoffload.offload(hf.build_model("deepseek_v3"), config)
    assert torch.equal(_generate(model, prompt), want)
    s0 = torch_kvoffload.stats(model)
    assert s0["forward_retries"] == 0 and s0["store_errors"] == 0
    # the backend raises once on a read: the prompt's prefix is computed instead
    remote._client = _FailOnce(remote._client, {"get_into", "batch_get_into"})
    assert torch.equal(_generate(model, prompt), want)
    s1 = torch_kvoffload.stats(model)
    assert remote.counters.get("store_errors") == 1 and s1["store_errors"] == 1
    assert s1["forward_retries"] == 1 and s1["failed_forwards"] == 0
    assert torch.equal(_generate(model, prompt), want)
    # the backend raises once on a write: the blocks are not kept. The sequence's own earlier blocks live
    # only in the store between forwards, so that generate may stop with a clear error; the next works
    remote._client = _FailOnce(remote._client, {"put_from", "batch_put_from"})
    other, _ = hf.left_padded_batch([21], seed=13)
    want_other = _generate(hf.build_model("deepseek_v3"), other)
    try:
        assert torch.equal(_generate(model, other), want_other)
    except RuntimeError as exc:
        assert "no longer holds blocks" in str(exc)
    assert remote.counters.get("store_errors") == 2
    assert torch.equal(_generate(model, other), want_other)
    # damaged records (a flipped byte in block 1 of layer 2, block 2 of layer 0 truncated): never used,
    # that generate recomputes from block 1 on
    for key in _record_keys(remote, prompt, [1], [2]):
        _flip(remote, key, 11)
    for key in _record_keys(remote, prompt, [2], [0]):
        _truncate(remote, key, 5)
    s2 = torch_kvoffload.stats(model)
    assert torch.equal(_generate(model, prompt), want)
    s3 = torch_kvoffload.stats(model)
    assert remote.counters.get("corrupt_records") == 2 and s3["corrupt_records"] == 2
    # cut at block 2 (layer 0), then at block 1 unless the first try's prefetch already found layer 2's
    assert 1 <= s3["forward_retries"] - s2["forward_retries"] <= 2
    assert s3["failed_forwards"] == s2["failed_forwards"]
    assert torch.equal(_generate(model, prompt), want)
    assert torch_kvoffload.stats(model)["corrupt_records"] == 2
    # a batch: one request's record damaged, the other request keeps its whole prefix
    batch, mask = hf.left_padded_batch([29, 18], seed=15)
    want_batch = hf.build_model("deepseek_v3").generate(
        input_ids=batch, attention_mask=mask, max_new_tokens=5, do_sample=False
    )
    got = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want_batch)
    for key in _record_keys(remote, batch, [0], [1]):
        _flip(remote, key, 3)
    s4 = torch_kvoffload.stats(model)
    got = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want_batch)
    s5 = torch_kvoffload.stats(model)
    assert s5["corrupt_records"] - s4["corrupt_records"] == 1
    assert s5["forward_retries"] - s4["forward_retries"] == 1

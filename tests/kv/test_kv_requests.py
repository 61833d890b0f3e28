"""``RequestTable``: requests admitted, extended and finished with independent lifetimes."""

from __future__ import annotations

import pytest

from torch_kvoffload.kv.requests import RequestTable


def test_admission_takes_the_lowest_free_slots_and_finish_frees_one():
    t = RequestTable(4)
    a, b, c = t.admit(3)
    assert [r.slot for r in (a, b, c)] == [0, 1, 2] and len({a.id, b.id, c.id}) == 3
    t.extend(a.id, [5, 6])
    t.extend(b.id, [7])
    finished = t.finish(b.id)
    assert finished is b and b.id not in t and t.free_slots() == [1, 3]
    # the others continue untouched; the next admission reuses slot 1 under a new id
    assert t.get(a.id).tokens == [5, 6] and t.get(c.id).length == 0
    (d,) = t.admit()
    assert d.slot == 1 and d.id not in (a.id, b.id, c.id)
    assert t.ids == [a.id, c.id, d.id] and [r.id for r in t] == t.ids


def test_refusals_change_nothing():
    t = RequestTable(2)
    (a,) = t.admit()
    with pytest.raises(ValueError, match="2 requests need free slots, 1 of 2 are free"):
        t.admit(2)
    assert t.ids == [a.id]
    with pytest.raises(KeyError, match="request 99 is not live"):
        t.finish(99)
    with pytest.raises(KeyError, match="is not live"):
        t.extend(99, [1])
    (b,) = t.admit()
    t.finish(a.id)
    with pytest.raises(ValueError, match=r"live requests hold slots \[1\]"):
        t.resize(1)
    assert t.slots == 2
    t.finish(b.id)
    t.resize(1)
    assert t.slots == 1 and t.free_slots() == [0]
    with pytest.raises(TypeError):
        t.admit(True)


def test_ids_are_never_reused():
    t = RequestTable(1)
    seen = set()
    for _ in range(5):
        (r,) = t.admit()
        assert r.id not in seen and r.slot == 0
        seen.add(r.id)
        t.finish(r.id)

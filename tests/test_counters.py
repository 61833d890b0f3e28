"""torch_kvoffload.counters.Counters: fixed names, tensor amounts, thread safety."""

from __future__ import annotations

import threading

import pytest
import torch

from torch_kvoffload.counters import Counters


def test_unknown_names_raise_and_create_nothing() -> None:
    c = Counters(["hits", "bytes_h2d"])
    with pytest.raises(KeyError, match=r"unknown counter 'hit'; known counters: \['bytes_h2d', 'hits'\]"):
        c.add("hit")
    with pytest.raises(KeyError, match="unknown counter 'bytes_hd2'"):
        c.get("bytes_hd2")
    with pytest.raises(KeyError, match="unknown counter 'hit'"):  # the known names untouched either
        c.add_many({"hits": 1, "hit": 1})
    assert c.snapshot() == {"hits": 0, "bytes_h2d": 0}


def test_numbers_and_tensors_add_up() -> None:
    c = Counters(["hits", "seconds"])
    c.add("hits")
    c.add("hits", 4)
    c.add("hits", torch.tensor(7))
    c.add("hits", torch.tensor([2], dtype=torch.int32))
    c.add("seconds", 0.25)
    c.add("seconds", torch.tensor(0.5, dtype=torch.float64))
    c.add_many({"hits": 3, "seconds": 0.125})
    snap = c.snapshot()
    assert snap == {"hits": 17, "seconds": 0.875} and isinstance(snap["hits"], int)
    with pytest.raises(ValueError, match="one-element tensor"):
        c.add("hits", torch.ones(2))
    c.reset()
    assert c.get("hits") == 0 and c.get("seconds") == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an accelerator tensor")
def test_device_amounts_accumulate_on_the_device() -> None:
    c = Counters(["hits"])
    for _ in range(3):
        c.add("hits", torch.tensor(5, device="cuda"))
    assert c.get("hits") == 15


def test_adds_from_threads_are_not_lost() -> None:
    c = Counters(["n"])

    def bump() -> None:
        for _ in range(2000):
            c.add("n")

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.get("n") == 8000

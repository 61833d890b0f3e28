"""``exchange_outcomes``: every rank of a group learns every rank's result or error, so all return or all
raise; without a group the step's own error still comes back."""

from __future__ import annotations

import pytest
from support.kvpp_helpers import spawn_gloo

from torch_kvoffload.kv.group_outcomes import exchange_outcomes
from torch_kvoffload.kv.spec import TensorParallel


def test_without_a_group_the_step_runs_alone():
    ok = exchange_outcomes(None, lambda: 7)
    assert (ok.values, ok.failed, ok.error) == ([7], {}, None)
    ok.raise_own()

    def fail():
        raise TimeoutError("slow")

    bad = exchange_outcomes(None, fail)
    assert bad.values == [None] and bad.failed == {0: ("TimeoutError", "slow")} and bad.all_timeouts
    with pytest.raises(TimeoutError, match="slow") as info:
        bad.raise_own()
    assert info.value is bad.error


def _ranks(rank: int, world: int) -> None:
    import torch.distributed as dist

    tp = TensorParallel(size=world, rank=rank, ranks=tuple(range(world)), group=dist.group.WORLD)
    every = exchange_outcomes(tp, lambda: rank * 10)
    assert every.values == [r * 10 for r in range(world)] and not every.failed

    def odd_fails():
        if rank % 2:
            raise OSError(f"no pool on {rank}")
        return rank

    out = exchange_outcomes(tp, odd_fails)
    odd = {r: ("OSError", f"no pool on {r}") for r in range(world) if r % 2}
    assert out.failed == odd and not out.all_timeouts
    assert out.values == [None if r % 2 else r for r in range(world)]
    assert out.failures() == "; ".join(f"TP rank {r}: OSError: no pool on {r}" for r in sorted(odd))
    assert (out.error is not None) == bool(rank % 2)
    # values_or_raise: this rank's own error, else one naming the ranks that failed
    with pytest.raises(OSError if rank % 2 else RuntimeError) as info:
        out.values_or_raise("the step")
    if not rank % 2:
        assert str(info.value) == f"the step failed on {out.failures()}"
    assert every.values_or_raise("the step") == every.values
    # the group is still in step after a failure: a third exchange agrees
    assert exchange_outcomes(tp, lambda: "again").values == ["again"] * world


def test_every_rank_learns_every_outcome():
    spawn_gloo(_ranks, 3)

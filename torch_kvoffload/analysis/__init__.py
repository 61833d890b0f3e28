"""Offline analysis tools (not needed to serve): residency policy studies on top-k traces."""

from torch_kvoffload.analysis.residency_policies import (
    PolicyResult,
    Trace,
    belady_misses,
    make_reuse_trace,
    simulate_policy,
)

__all__ = ["PolicyResult", "Trace", "belady_misses", "make_reuse_trace", "simulate_policy"]

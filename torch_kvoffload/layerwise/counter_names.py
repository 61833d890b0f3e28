"""The counters a :class:`~torch_kvoffload.layerwise.runtime.LayerwiseOffloadRuntime` reports (``stats()``)."""

from __future__ import annotations

__all__ = ["COUNTER_NAMES"]

#: name of each counter, and what it counts
COUNTER_NAMES = (
    "bytes_loaded",  # host pool -> device buffers
    "bytes_saved",  # device buffers -> host pool
    "loads",  # per-layer load batches
    "saves",  # per-layer save batches
    "blocks_loaded",
    "blocks_saved",
    "store_hits",  # cached request blocks loaded from the store (found for every layer, or given)
    "store_misses",  # full request blocks computed by the request (not found, or past the cap)
    "batch_shared_blocks",  # full blocks a request read from another request's compute in one forward
    "load_failures",
    "save_failures",
    "waits",  # blocking waits in wait_layer()
    "wait_seconds",
    "load_seconds",  # transfer-thread time spent loading (store reads + host->device copies)
    "save_seconds",  # transfer-thread time spent saving (device->host copies + store writes)
    "leased_blocks",  # store records pinned by begin_forward's leases (pinning stores only)
    "prefix_evictions",  # loads that found blocks of the looked-up prefix gone
    "forward_retries",  # forwards rerun by run_forward with a shorter prefix
    "store_errors",  # lookups whose store call raised (nothing found: the forward computes the prefix)
)

"""Gloo process groups of test ranks on 127.0.0.1 without a port race.

The group's rendezvous store is served by the process that starts the ranks, on a port the OS picks when it
binds (``port=0``): no port is chosen first and bound later by rank 0, when another test's process may have
taken it in between (``EADDRINUSE`` in rank 0, the others waiting out their deadline). The ranks join the
store as clients. The starting process keeps the returned store until its ranks are done.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

__all__ = ["init_gloo", "master_store"]

HOST = "127.0.0.1"


def master_store(timeout_s: float) -> dist.TCPStore:
    """A rendezvous store served by this process on ``HOST``, port chosen by the OS (``store.port``)."""
    return dist.TCPStore(
        HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def init_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Join the default gloo process group of ``world`` ranks whose store :func:`master_store` serves on
    ``port``; its collectives time out after ``timeout_s``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)

"""Run a function on N local processes joined by a gloo process group on loopback (tests, demo, bench).

``spawn_local(fn, world_size, *args)`` starts ``world_size`` processes (``spawn`` start method), each
initialising ``torch.distributed`` with gloo at ``127.0.0.1:<free port>`` and calling
``fn(rank, world_size, *args)``. It returns when all exited, raises with the failing rank's traceback if
any failed, and terminates the processes it started when ``timeout`` expires.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["free_port", "spawn_local"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    fn: Callable[..., Any], rank: int, world: int, port: int, pg_timeout: float, errors: Any, args: tuple
) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        fn(rank, world, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_local(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, pg_timeout: float = 60.0
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo processes; raise on any failure.

    The free port is picked before the processes bind it; if another process took it meanwhile, the run
    is retried once on a new port.
    """
    try:
        _spawn_once(fn, world_size, args, timeout, pg_timeout)
    except RuntimeError as exc:
        if "address already in use" not in str(exc).lower():
            raise
        _spawn_once(fn, world_size, args, timeout, pg_timeout)


def _spawn_once(
    fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, pg_timeout: float
) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, pg_timeout, errors, args), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for rank in stuck:
        procs[rank].terminate()
        procs[rank].join(5)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        rank, tb = sorted(failures)[0]
        raise RuntimeError(f"spawn_local: rank {rank} of {world_size} failed:\n{tb}")
    if stuck:
        raise TimeoutError(f"spawn_local: ranks {stuck} of {world_size} still running after {timeout} s")
    bad = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"spawn_local: processes exited abnormally (rank, exit code): {bad}")

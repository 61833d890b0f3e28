"""One caller at a time per offloaded model: :func:`exclusive` holds a model's session for the calling thread.

A session holds one sequence (or, under continuous batching, one serving state); two threads interleaving
their forwards over it would mix their requests. ``generate``, ``forward``, the compiled backend and
``init_continuous_batching`` each hold it while they run.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch_kvoffload.integrations.hf.session import OffloadSession

__all__ = ["exclusive"]

# one re-entrant lock per session: the thread holding it may call again (a forward inside generate)
_LOCKS: weakref.WeakKeyDictionary[OffloadSession, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


@contextlib.contextmanager
def exclusive(session: OffloadSession, who: str) -> Iterator[None]:
    """Hold ``session`` for the calling thread (again if it holds it already) while the block runs.

    Raises ``RuntimeError`` naming ``who``, without touching the session, when another thread holds it: two
    callers would interleave their forwards over the session's one sequence.
    """
    with _LOCKS_LOCK:
        lock = _LOCKS.get(session)
        if lock is None:
            lock = _LOCKS[session] = threading.RLock()
    if not lock.acquire(blocking=False):
        raise RuntimeError(
            f"{who}: called from a second thread while another thread runs a forward or generate of this "
            "model; an offloaded model serves one caller at a time (its session holds one sequence): call it "
            "from one thread, or give each thread its own copy.deepcopy(model)"
        )
    try:
        yield
    finally:
        lock.release()

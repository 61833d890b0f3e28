"""The Mooncake Store client in tests: whether it can run here, and a client of a loopback master (the
``master`` fixture of ``tests/store/conftest.py``)."""

from __future__ import annotations

_INSTALL = (
    "install it with: pip install '.[mooncake]' (the client and mooncake_master) and "
    "apt-get install libibverbs1"
)


def mooncake_missing() -> str | None:
    """Why the Mooncake tests cannot run here (``None`` when they can)."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: libibverbs.so.1 missing
        return f"the Mooncake client cannot be imported ({type(exc).__name__}: {exc}); {_INSTALL}"
    from mooncake_master import find_master_binary

    if find_master_binary() is None:
        return f"the mooncake_master binary is neither in the mooncake package nor on PATH; {_INSTALL}"
    return None


#: the master's lease on a key read (ms): a test waits past it before the key may be evicted or removed
LEASE_MS = 300


def mooncake_client(master, capacity: int, **kw):
    """A :class:`MooncakeKVStore` of ``capacity`` bytes against ``master``."""
    from torch_kvoffload.store.mooncake import MooncakeKVStore

    return MooncakeKVStore(
        capacity, master_server_addr=master.master_addr, metadata_server=master.metadata_server, **kw
    )

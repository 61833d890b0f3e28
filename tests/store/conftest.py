"""Fixtures of the store tests: the memcache_hybrid fake installed for one test, a loopback Mooncake master
for one module.

A test that talks to the Mooncake master (another process; each client's ``close()`` takes about 2 s inside
the client) is the ``slow`` tier: ``make test`` runs it, ``make test-fast`` leaves it out. The tests of the
same checks on the local and memcache stores stay in the unit tier.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support.memcache_fake import fake_module
from support.mooncake import LEASE_MS

_HERE = Path(__file__).parent


def _talks_to_mooncake(item: pytest.Item) -> bool:
    spec = getattr(item, "callspec", None)
    return "master" in getattr(item, "fixturenames", ()) or (
        spec is not None and "mooncake" in spec.params.values()
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(item.path).parent == _HERE and _talks_to_mooncake(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def fake(monkeypatch):
    """The recording ``memcache_hybrid`` fake, importable as that module for the test."""
    mod = fake_module()
    monkeypatch.setitem(sys.modules, "memcache_hybrid", mod)
    return mod


@pytest.fixture(scope="module")
def master():
    """A real Mooncake master on loopback (its read leases last ``LEASE_MS``)."""
    from mooncake_master import MooncakeMaster

    m = MooncakeMaster(lease_ttl_ms=LEASE_MS)
    m.start()
    try:
        yield m
    finally:
        m.stop()

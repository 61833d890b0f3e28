"""Fixtures of the store tests: the memcache_hybrid fake installed for one test, a loopback Mooncake master
for one module."""

from __future__ import annotations

import sys

import pytest
from support.memcache_fake import fake_module
from support.mooncake import LEASE_MS


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

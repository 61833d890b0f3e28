"""Free ports picked together are distinct; the loopback Mooncake master never shares one port between its
services."""

from __future__ import annotations

import socket

import pytest

from torch_kvoffload._utils import free_ports


def test_ports_picked_together_are_distinct_and_bindable():
    for count in (1, 3, 8):
        for _ in range(50):
            ports = free_ports(count)
            assert len(set(ports)) == count
    for port in free_ports(4):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # released again: each can be bound by the caller
    with pytest.raises(ValueError, match="free_ports: count must be >= 1"):
        free_ports(0)


def test_the_mooncake_master_gives_each_service_its_own_port(monkeypatch):
    import mooncake_master

    # the OS may hand out a port again once its socket is closed: picked one by one, the master's RPC port
    # could be the metadata server's, whose listening socket then answers for a master that never bound
    calls = []
    real = mooncake_master.free_ports

    def recording(count, host="127.0.0.1"):
        calls.append(count)
        return real(count, host)

    monkeypatch.setattr(mooncake_master, "free_ports", recording)
    m = mooncake_master.MooncakeMaster()
    assert calls == [3]
    assert len({m.rpc_port, m.metadata_port, m.metrics_port}) == 3
    with pytest.raises(ValueError, match="must differ"):
        mooncake_master.MooncakeMaster(rpc_port=5555, metadata_port=5555)


def test_ports_are_picked_below_the_range_the_os_gives_outgoing_connections(monkeypatch):
    """A port from the OS's ephemeral range could be handed to another process's outgoing connection before
    the caller binds it (seen: a gloo store and a P/D receiver failing with "address already in use")."""
    from torch_kvoffload import _utils

    try:
        with open(_utils._EPHEMERAL_RANGE) as f:
            low = int(f.read().split()[0])
    except OSError:
        pytest.skip("the OS does not publish its ephemeral port range here")
    if low - _utils._LOWEST_PICKED < 4096:
        pytest.skip(f"the ephemeral range starts at {low}: too few ports below it")
    ports = [p for _ in range(20) for p in free_ports(5)]
    assert all(_utils._LOWEST_PICKED <= p < low for p in ports), ports
    assert len(set(ports)) > 50  # random picks, not one sequence
    # where the range is unknown, the OS picks
    monkeypatch.setattr(_utils, "_EPHEMERAL_RANGE", "/nonexistent/ip_local_port_range")
    assert _utils._picked_range() is None
    assert len(set(free_ports(3))) == 3

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

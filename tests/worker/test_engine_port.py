"""The engine's port is chosen free on loopback and outside the kernel's range for outgoing
connections: the engine binds it only once its model has loaded, and a port of that range
was taken meanwhile by another connection often enough to fail a worker's start ('address
already in use')."""

from __future__ import annotations

import socket

from skytrain_backend.worker.main import ENGINE_PORTS_FROM, EPHEMERAL_RANGE, engine_port


def test_the_engines_port_is_free_and_below_the_range_connections_take() -> None:
    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    assert low > ENGINE_PORTS_FROM + 1  # else it falls back to bind(0), as the kernel chooses
    ports = {engine_port() for _ in range(20)}
    assert all(ENGINE_PORTS_FROM <= port < low for port in ports)
    assert len(ports) > 1  # drawn, not one port for every worker on the host
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # still free

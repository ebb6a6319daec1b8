"""free_port never hands the same ephemeral port out twice in one process, so services set up
one after the other before any binds get distinct ports; a preferred port is honoured."""

from __future__ import annotations

import socket

from flywheel.core.redis_server import free_port


def test_ephemeral_ports_are_never_handed_out_twice():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_a_preferred_port_or_the_next_free_one_above_it():
    base = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", base))
        busy.listen()
        assert free_port(base) > base  # taken: the next free one above
    assert free_port(base) == base  # free again: the preferred one

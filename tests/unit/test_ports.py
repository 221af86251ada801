"""Test ports that never race: reserved sockets, and no code that picks a "free" port for
another process to bind later."""

from __future__ import annotations

import pathlib
import re
import socket

import pytest

from tests.helpers import ports

REPO = pathlib.Path(__file__).resolve().parents[2]

# Binding port 0 only to read the number is allowed where the number never goes to another
# process to bind: reserved sockets stay held, and replica ports are the provisioner's own
# business (each replica has its own loopback address; the emulator's fake Pods mimic it).
_BIND_ZERO_ALLOWED = {
    "tests/helpers/ports.py",
    "services/provisioner/ports.py",
    "services/provisioner/addresses.py",
    "tests/helpers/kube_emulator.py",
    # A listener it holds itself (a full accept queue that makes connects hang).
    "tests/service/test_loadbalancer_edges.py",
    # Listeners they hold themselves: the ports the stack and the balancer must find taken.
    "tests/e2e/test_stack_ux.py",
    "tests/unit/test_stack_preflight.py",
    "tests/service/test_loadbalancer_startup.py",
    # PostgreSQL binds the port it is told and cannot report one it picked (no port 0): the test
    # server tries a free one and retries on another if it was taken meanwhile.
    "tests/helpers/postgres.py",
}


def test_nothing_picks_a_free_port_for_another_process_to_bind_later() -> None:
    pattern = re.compile(r"\.bind\(\([^()]*,\s*0\)\)")
    offenders = []
    for folder in ("services", "tests", "bench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel not in _BIND_ZERO_ALLOWED and pattern.search(path.read_text(encoding="utf-8")):
                offenders.append(rel)
    assert offenders == [], "bind port 0 in the server itself and read the port it reports"


def test_a_reserved_port_refuses_connections_and_cannot_be_taken() -> None:
    with ports.Reserved() as held:
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", held.port), timeout=2):
            pass
        # Servers bind with SO_REUSEADDR; the held socket still keeps the port theirs alone.
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", held.port))
        assert held.url == f"http://127.0.0.1:{held.port}"


def test_a_reserved_socket_handed_over_serves_on_the_same_port() -> None:
    held = ports.Reserved()
    sock = held.take()
    try:
        sock.listen()
        with socket.create_connection(("127.0.0.1", held.port), timeout=2):
            pass
    finally:
        sock.close()
    held.close()  # nothing left to close: the socket was handed over
    with pytest.raises(RuntimeError):
        held.take()


def test_the_private_host_is_loopback_outside_the_replica_range_and_stable() -> None:
    host = ports.private_host()
    assert host == ports.private_host()
    assert host.startswith("127.78.")
    assert all(1 <= int(part) <= 254 for part in host.split(".")[2:])
    with ports.Reserved(host) as held:  # routed to loopback
        assert held.addr.startswith(f"{host}:")

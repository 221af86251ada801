"""Own loopback addresses for local replicas, so unchanged SkyPilot YAMLs run side by side.

On a cloud each replica is its own machine, so SkyPilot apps bind a fixed port on every
interface (`examples/serve/http_server`: `('', 8080)` in the code, `run: python3 server.py`).
Two such replicas on one machine collide. Linux routes all of 127.0.0.0/8 to the loopback
interface, so the local backend gives each replica its own address (127.77.x.y) with the
declared ports unchanged, and tells the app with `$HOST`.

Apps that bind `$HOST` need nothing more. For Python apps that bind a fixed wildcard or
loopback address (`''`, `0.0.0.0`, `127.0.0.1`, `::`, `localhost`) a `sitecustomize` on their
PYTHONPATH moves binds of the declared ports to the replica's address. Other programs that bind
every interface on a fixed port still collide; they should bind `$HOST` (docs/provisioner.md).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import Iterable

BIND_HOST_ENV = "REPLICAPLANE_BIND_HOST"
"""The replica's own address, read by the bind shim."""
BIND_PORTS_ENV = "REPLICAPLANE_BIND_PORTS"
"""Comma-separated declared ports the bind shim moves to the replica's address."""

_POOL = 254 * 254  # 127.77.1.1 .. 127.77.254.254

SHIM = '''"""Replicaplane local backend: binds of declared ports go to this replica's own address."""

import os as _os
import socket as _socket

_host = _os.environ.get("REPLICAPLANE_BIND_HOST", "")
_ports = {int(p) for p in _os.environ.get("REPLICAPLANE_BIND_PORTS", "").split(",") if p.isdigit()}
_ANY4 = {"", "0.0.0.0", "127.0.0.1", "localhost"}
_ANY6 = {"", "::", "::1", "localhost"}

if _host and _ports:
    _bind = _socket.socket.bind

    def _replica_bind(self, address):
        if isinstance(address, tuple) and len(address) >= 2 and address[1] in _ports:
            if self.family == _socket.AF_INET and address[0] in _ANY4:
                address = (_host, address[1])
            elif self.family == _socket.AF_INET6 and address[0] in _ANY6:
                address = ("::ffff:" + _host, *address[1:])
        return _bind(self, address)

    _socket.socket.bind = _replica_bind


def _chain():
    # Run the sitecustomize this one shadows, if any.
    import importlib.util
    import sys

    here = _os.path.dirname(_os.path.abspath(__file__))
    for entry in sys.path:
        if _os.path.abspath(entry or ".") == here:
            continue
        path = _os.path.join(entry or ".", "sitecustomize.py")
        if _os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", path)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_chain()
'''


def write_shim(directory: str) -> str:
    """Write the bind shim as `<directory>/sitecustomize.py`; returns the directory."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, "sitecustomize.py")
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(SHIM)
    os.replace(tmp, path)
    return directory


def address_of(index: int) -> str:
    """The `index`-th address of the pool."""
    return f"127.77.{index // 254 + 1}.{index % 254 + 1}"


class AddressAllocator:
    """Hands out loopback addresses whose declared ports are free, never one in use.

    The search starts at a random place and moves on from the last address handed out, so a
    just-released address (its connections in TIME_WAIT) is not reused soon.
    """

    def __init__(self) -> None:
        self._taken: set[str] = set()
        self._next = random.randrange(_POOL)

    def allocate(self, ports: Iterable[int]) -> str:
        """An address on which every port in `ports` can be bound now.

        Raises:
            OSError: no such address in the pool.
        """
        wanted = list(ports)
        for _ in range(_POOL):
            address = address_of(self._next)
            self._next = (self._next + 1) % _POOL
            if address not in self._taken and all(_bindable(address, p) for p in wanted):
                self._taken.add(address)
                return address
        raise OSError("no free loopback address for the replica")

    def hold(self, address: str) -> None:
        """Mark `address` as held (a replica re-found after a restart)."""
        self._taken.add(address)

    def release(self, address: str) -> None:
        """Return `address`."""
        self._taken.discard(address)


def _bindable(address: str, port: int) -> bool:
    # Without SO_REUSEADDR, as most apps bind: TIME_WAIT leftovers count as taken.
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def supported() -> bool:
    """Whether this machine routes 127.0.0.0/8 to loopback (Linux does; macOS needs aliases)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        try:
            sock.bind((address_of(0), 0))
        except OSError:
            return False
    return True

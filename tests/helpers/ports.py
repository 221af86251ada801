"""Loopback addresses for tests that never race another process for a port.

Servers in tests bind port 0 and report the port they got (a port file, or the bound server
object). Two needs remain, and this module covers them:

- An address where nothing answers (a refused connection), or where an app starts answering
  later: `Reserved` holds a socket bound to a port without listening. Connections to it are
  refused, no other socket can bind the port while it is held, and the app that starts later
  listens on that very socket.
- A service that is restarted on the address it had (its peers keep dialing it): it runs on a
  `private_host()`, a loopback address of its own. A port freed by a kill can then be taken in
  the gap before the restart only by a socket bound to that same address or to the wildcard
  address, not by the connections every test opens from 127.0.0.1 (which take their local
  ports from the same range as port 0, the usual cause of `Errno 98` on a busy machine).
"""

from __future__ import annotations

import os
import socket


def private_host() -> str:
    """This test process's own loopback address for the services it restarts: 127.78.x.y,
    from the process id, so concurrent test runs on one machine get different ones (and test
    certificates can name it).

    127.77.0.0/16 is the local backend's range for replicas; Linux routes all of 127.0.0.0/8
    to the loopback interface.
    """
    pid = os.getpid()
    return f"127.78.{1 + (pid // 254) % 254}.{1 + pid % 254}"


class Reserved:
    """A loopback port held by a bound socket that does not listen: connections to it are
    refused until someone listens on `take()`'s socket. Use as a context manager."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._sock: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self.port = int(self._sock.getsockname()[1])

    @property
    def addr(self) -> str:
        """host:port."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """http://host:port."""
        return f"http://{self.addr}"

    def take(self) -> socket.socket:
        """Hand over the bound socket (the caller listens on it and closes it)."""
        if self._sock is None:
            raise RuntimeError(f"{self.addr} was already handed over")
        sock, self._sock = self._sock, None
        return sock

    def close(self) -> None:
        """Let the port go (unless it was handed over)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Reserved:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

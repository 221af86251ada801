"""Loopback port allocation and the port substitution rule of the local backend.

The rule: every port a spec declares (`resources.ports`, plus the serving port) is mapped to a
free loopback port picked by the backend. In `setup`, `run` and the values of `envs`, each
whole-number token equal to a declared port is replaced by its mapped port ("8080" in
`http.server 8080` or `--port=8080`, not in "18080" or "8080.5"). `PORT` is set to the mapped
serving port. So two replicas of `run: python3 -m http.server 8080` serve on different ports.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Iterable, Mapping


def substitute(text: str, mapping: Mapping[int, int]) -> str:
    """Replace every whole-number token equal to a key of `mapping` with its value.

    Args:
        text: a command or an environment value.
        mapping: declared port -> allocated port.

    Returns:
        The text with the ports replaced; unchanged when `mapping` is empty.
    """
    if not mapping or not text:
        return text
    alternatives = "|".join(str(p) for p in sorted(mapping, key=lambda p: -len(str(p))))
    # A port is a token when no digit touches it and it is not the integer part of a decimal.
    pattern = re.compile(rf"(?<![0-9])({alternatives})(?![0-9]|\.[0-9])")
    return pattern.sub(lambda m: str(mapping[int(m.group(1))]), text)


def declared(ports: Iterable[int], serving_port: int) -> list[int]:
    """The distinct ports a spec declares, serving port first."""
    result: list[int] = []
    for port in (serving_port, *ports):
        if port and port not in result:
            result.append(port)
    return result


class PortAllocator:
    """Hands out free loopback ports, never one it handed out and not released yet."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._host = host
        self._taken: set[int] = set()

    def allocate(self) -> int:
        """A port that was free on the host a moment ago and is not held by another replica.

        Raises:
            OSError: no free port could be found.
        """
        for _ in range(64):
            with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
                sock.bind((self._host, 0))
                port = int(sock.getsockname()[1])
            if port not in self._taken:
                self._taken.add(port)
                return port
        raise OSError("no free loopback port found")

    def hold(self, port: int) -> None:
        """Mark `port` as held (a replica re-found after a restart)."""
        self._taken.add(port)

    def release(self, port: int) -> None:
        """Return `port`."""
        self._taken.discard(port)

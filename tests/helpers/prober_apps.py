"""Tiny HTTP apps to probe: an in-process aiohttp app tests control, and a fast server process.

Run `python -m tests.helpers.prober_apps --port-file PATH` for the fast server: a bare asyncio
HTTP/1.1 keep-alive server that answers every request with 200, for throughput benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time

from aiohttp import web

from services.common import grpc_server
from tests.helpers import procs


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One request the app received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    time: float


class App:
    """An aiohttp app on 127.0.0.1 that answers every path with `status` after `delay_s`.

    Args:
        status: HTTP status to answer with; change it at any time.
        delay_s: seconds to wait before answering; change it at any time.
    """

    def __init__(self, *, status: int = 200, delay_s: float = 0.0) -> None:
        self.status = status
        self.delay_s = delay_s
        self.requests: list[Recorded] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """Base URL, for example http://127.0.0.1:4242."""
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests.append(Recorded(request.method, request.path, dict(request.headers), body, time.time()))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return web.Response(status=self.status, text="ok")

    async def start(self, *, sock: socket.socket | None = None) -> App:
        """Start listening on a free port, or on `sock` (a bound socket, see ports.Reserved:
        an address that refused connections until now), and return self."""
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site: web.BaseSite
        if sock is None:
            site = web.TCPSite(self._runner, "127.0.0.1", 0, reuse_address=True)
        else:
            site = web.SockSite(self._runner, sock)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        """Stop listening; later connections are refused."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


# The fast server -------------------------------------------------------------------------

_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


class _FastProtocol(asyncio.Protocol):
    """Answers each request head with 200; request bodies are not expected (GET probes)."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._pending = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        data = self._pending + data
        count = data.count(b"\r\n\r\n")
        self._pending = data[data.rfind(b"\r\n\r\n") + 4 :] if count else data
        if count and self._transport is not None:
            self._transport.write(_RESPONSE * count)


async def _serve_fast(port_file: str) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_FastProtocol, "127.0.0.1", 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    grpc_server.write_port_file(port_file, port)
    async with server:
        await server.serve_forever()


@dataclasses.dataclass
class FastServer:
    """A fast HTTP server process answering 200 on every path."""

    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Terminate the process and reap it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_fast_server(timeout: float = 10.0) -> FastServer:
    """Start the fast server in its own process and wait for its port."""
    port_file = os.path.join(tempfile.mkdtemp(prefix="rp-fast-"), "port")
    env = {**os.environ, "PYTHONPATH": procs.REPO}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.prober_apps", "--port-file", port_file], cwd=procs.REPO, env=env
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(port_file):
            with open(port_file, encoding="utf-8") as fh:
                return FastServer(proc, int(fh.read()))
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise RuntimeError("fast HTTP server did not start")


def main() -> None:
    """Run the fast server until terminated."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_fast(args.port_file))


if __name__ == "__main__":
    main()

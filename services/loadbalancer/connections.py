"""Client connections of the proxy: a cap on how many are open, and timeouts for clients that
send their request too slowly or not at all.

aiohttp has no timeout for a request head that trickles in, so each connection's protocol is
wrapped: the wrapper sees every byte arrive and the proxy tells it when a request starts and ends.
A connection must deliver a complete request head within `header_timeout_s` of opening, or of the
first byte of a later request; between requests it may stay idle for `idle_timeout_s`. A request
body that stalls is the proxy's to time out (it reads the body).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
import ssl
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

_FDS_KEPT_FREE = 100
"""File descriptors left for logs, the admin server and the controller channel."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Timeouts and the cap of client connections."""

    header_timeout_s: float = 10.0
    idle_timeout_s: float = 60.0
    max_connections: int = 4096


def _reply(status: str, text: str, **headers: str) -> bytes:
    body = (text + "\n").encode()
    lines = [f"HTTP/1.1 {status}", "Content-Type: text/plain; charset=utf-8", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join([*lines, "Connection: close", "", ""])).encode() + body


class Tracker:
    """Open client connections across the proxy's sites."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.open = 0
        self.refused = 0
        self._last_warning = 0.0

    def refuse(self) -> None:
        """Count a connection refused at the cap; warn now and then, not once per connection."""
        self.refused += 1
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            log.warning(
                "connection cap reached: %d client connections open (max_connections); %d refused so far",
                self.open,
                self.refused,
            )


class Guarded(asyncio.Protocol):
    """One client connection: aiohttp's protocol inside, the timeouts and the cap outside."""

    def __init__(self, inner: asyncio.Protocol, tracker: Tracker) -> None:
        self._inner = inner
        self._tracker = tracker
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._waiting_for_head = False
        self._busy = False
        self._refused = False
        self._lost = False

    # ---- asyncio protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        limits = self._tracker.limits
        if self._tracker.open >= limits.max_connections:
            self._refused = True
            self._tracker.refuse()
            transport.write(
                _reply("503 Service Unavailable", "too many connections to the load balancer", **{"Retry-After": "1"})
            )
            transport.close()
            return
        self._tracker.open += 1
        self._inner.connection_made(transport)
        self._expect_head()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._busy and not self._waiting_for_head:
            self._expect_head()  # the first byte of the next request
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._refused:
            return None
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._cancel_timer()
        if self._refused:
            return
        self._tracker.open -= 1
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self._refused:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if not self._refused:
            self._inner.resume_writing()

    # ---- told by the proxy ---------------------------------------------------------------------

    def request_started(self) -> None:
        """The request head arrived in full; the handler runs."""
        self._busy = True
        self._waiting_for_head = False
        self._cancel_timer()

    def request_finished(self) -> None:
        """The handler is done; the connection may wait for the next request."""
        self._busy = False
        self._arm(self._tracker.limits.idle_timeout_s, self._idle_expired)

    # ---- timers --------------------------------------------------------------------------------

    def _expect_head(self) -> None:
        self._waiting_for_head = True
        self._arm(self._tracker.limits.header_timeout_s, self._head_expired)

    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        self._cancel_timer()
        if self._lost:
            return  # a handler may finish after its client left
        self._timer = asyncio.get_running_loop().call_later(delay, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_expired(self) -> None:
        self._timer = None
        if self._busy or self._transport is None or self._transport.is_closing():
            return
        seconds = self._tracker.limits.header_timeout_s
        self._transport.write(_reply("408 Request Timeout", f"request head not received within {seconds:g} s"))
        self._transport.close()

    def _idle_expired(self) -> None:
        self._timer = None
        if not self._busy and self._transport is not None:
            self._transport.close()


def of_request(request: web.BaseRequest) -> Guarded | None:
    """The guard of the connection a request came on (None outside a guarded site)."""
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, Guarded) else None


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through `Guarded`."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        tracker: Tracker,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=1024)
        self._host = host
        self._port = port
        self._tracker = tracker

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server: Any = self._runner.server
        assert server is not None
        tracker = self._tracker
        self._server = await asyncio.get_running_loop().create_server(
            lambda: Guarded(server(), tracker),
            self._host,
            self._port,
            ssl=self._ssl_context,
            ssl_handshake_timeout=tracker.limits.header_timeout_s if self._ssl_context else None,
            backlog=self._backlog,
            reuse_address=True,
        )


def connection_cap(
    wanted: int,
    *,
    getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
    setrlimit: Callable[[int, tuple[int, int]], None] = resource.setrlimit,
) -> int:
    """`wanted`, or less if the process may not open that many files.

    Each client connection needs a file descriptor, and one more to its replica. The soft limit is
    raised toward the hard one when it is too low (as Go programs do); if even the hard limit is too
    low, the cap is lowered to fit, with a warning.
    """
    needed = 2 * wanted + _FDS_KEPT_FREE
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        try:
            setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return wanted
    fitted = max(1, (soft - _FDS_KEPT_FREE) // 2)
    log.warning(
        "max_connections %d needs %d open files but the limit is %d; using max_connections %d "
        "(raise `ulimit -n` to allow more)",
        wanted,
        needed,
        soft,
        fitted,
    )
    return fitted

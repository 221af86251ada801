"""The HTTP proxy: every method, path, query, header and body to a ready replica, responses
streamed back chunk by chunk as they arrive.

Which failed attempts go to another replica (RFC 9110 9.2.2): one that never reached a replica
(connection refused, connect timeout) always; one whose connection broke after the request went
out only if its method is idempotent, since the replica may have acted on it. Either way the body
must still be at hand (see bodies.py). An upstream HTTP error is returned as it is. A client that
goes away cancels the handler (aiohttp's handler cancellation), which closes the upstream
connection, so the replica sees the disconnect at once.

Each attempt's outcome is counted for its replica's version (see `Balancer.record_answer`): the
answer's status and how long its headers took, or a transport error. An attempt the client
abandoned counts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import ssl
import time

import aiohttp
import yarl
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from services.loadbalancer import balancer as bal
from services.loadbalancer import bodies, connections, metrics, policies

log = logging.getLogger(__name__)

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
"""Methods a replica may receive twice with the effect of once (RFC 9110 9.2.2)."""

# Headers that describe one connection, not the message (RFC 9110 7.6.1), plus `Proxy-*`, the ones
# aiohttp sets itself for each side, and `Expect` (the balancer answers 100-continue itself).
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
    }
)

_LINGER_S = 2.0

_ABSOLUTE_FORM = re.compile(r"(?i:https?)://([^/?#]*)(.*)", re.DOTALL)


def _connection_tokens(headers: CIMultiDictProxy[str]) -> frozenset[str]:
    """Header names listed in `Connection` (all of its fields): they belong to this hop only."""
    return frozenset(token.strip().lower() for value in headers.getall("Connection", ()) for token in value.split(","))


def end_to_end(headers: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    """The headers to pass on: all but hop-by-hop ones and those the `Connection` header names."""
    named = _connection_tokens(headers)
    return [
        (k, v)
        for k, v in headers.items()
        if (name := k.lower()) not in _HOP_BY_HOP and name not in named and not name.startswith("proxy-")
    ]


def split_target(target: str) -> tuple[str, str] | None:
    """The path and query to send a replica, byte for byte, and the authority of an absolute-form
    target ("" for origin-form); None for a target that is neither (`*`, `host:port`, other schemes).
    """
    if target.startswith("/"):
        return target, ""
    match = _ABSOLUTE_FORM.fullmatch(target)
    if match is None:
        return None
    authority, rest = match.groups()
    return (rest if rest.startswith("/") else "/" + rest), authority.rpartition("@")[2]


@dataclasses.dataclass(frozen=True)
class ProxySettings:
    """Timeouts, retries and limits of the proxy (server.Settings documents each)."""

    connect_timeout_s: float = 5.0
    stream_timeout_s: float = 0.0
    """Longest a response may take, headers to last byte; 0 takes the spec's (default 120 s)."""
    attempts: int = 3
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 1.0
    max_body_bytes: int = 64 * 1024 * 1024
    retry_buffer_bytes: int = 1024 * 1024
    max_buffered_bytes: int = 64 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 60.0
    max_connections: int = 4096


def _forward_headers(request: web.BaseRequest, authority: str, body: bodies.Body) -> CIMultiDict[str]:
    headers = CIMultiDict(end_to_end(request.headers))
    if not body.whole and body.length is not None:
        headers["Content-Length"] = str(body.length)  # streamed: say how much is coming, as the client did
    peer = request.remote or ""
    prior = headers.get("X-Forwarded-For")
    headers["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    headers["X-Forwarded-Proto"] = request.scheme
    # For an absolute-form target the target's authority is the host asked for (RFC 9112 3.2.2).
    headers["X-Forwarded-Host"] = authority or request.host
    return headers


@dataclasses.dataclass
class _Answer:
    """What the metrics say of one request: the version of the replica it went to last, and the
    status sent (499 while none is: the client went away before an answer started)."""

    version: str = metrics.NO_VERSION
    code: str = metrics.CLIENT_CLOSED


def _text(status: int, message: str, *, close: bool = False, headers: dict[str, str] | None = None) -> web.Response:
    resp = web.Response(status=status, text=message + "\n", headers=headers)
    if close:
        resp.force_close()  # the rest of the request was not read: the connection cannot carry another
    return resp


class Proxy:
    """The aiohttp handler and the client session to replicas."""

    def __init__(self, balancer: bal.Balancer, settings: ProxySettings) -> None:
        self.balancer = balancer
        self.settings = settings
        self.session: aiohttp.ClientSession | None = None
        self.buffered = bodies.Budget(settings.max_buffered_bytes)
        """Request-body bytes held for retries, across requests."""
        self.connections = connections.Tracker(
            connections.Limits(
                header_timeout_s=settings.header_timeout_s,
                idle_timeout_s=settings.idle_timeout_s,
                max_connections=settings.max_connections,
            )
        )

    async def start(self) -> None:
        """Open the pooled client session (inside the running loop)."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        )
        # aiohttp resends an idempotent request once by itself when a connection breaks; retries
        # happen here only, where replicas and attempts are counted.
        self.session._retry_connection = False

    async def close(self) -> None:
        """Close the client session."""
        if self.session is not None:
            await self.session.close()

    def _timeout(self) -> aiohttp.ClientTimeout:
        total = self.settings.stream_timeout_s or self.balancer.config.stream_timeout_s
        return aiohttp.ClientTimeout(total=total or None, connect=self.settings.connect_timeout_s)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Proxy one request."""
        guard = connections.of_request(request)
        if guard is not None:
            guard.request_started()
        stats = self.balancer.stats
        stats.in_flight.inc()
        start = time.perf_counter()
        answer = _Answer()
        try:
            resp = await self._handle(request, answer)
            answer.code = str(resp.status)
            return resp
        except Exception:
            answer.code = "500"  # aiohttp answers an unexpected error with 500
            raise
        finally:
            stats.in_flight.dec()
            stats.request_finished(answer.version, answer.code, time.perf_counter() - start)
            if guard is not None:
                guard.request_finished()

    async def _handle(self, request: web.BaseRequest, answer: _Answer) -> web.StreamResponse:
        target = split_target(request.raw_path)
        if target is None:
            return _text(
                400,
                "the request target must be a path (/x) or an http(s) URL; the load balancer does not "
                "tunnel (CONNECT) or answer for the server as a whole (*)",
                close=True,
            )
        expect = request.headers.get("Expect")
        if expect is not None:
            if expect.lower() != "100-continue":
                return _text(417, f"unsupported expectation: {expect}", close=True)
            if request.version >= (1, 1) and request.body_exists:
                # The client waits for this before it sends the body (RFC 9110 10.1.1).
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.balancer.record_arrival()
        s = self.settings
        body = bodies.Body(
            request.content,
            length=request.content_length,
            present=request.body_exists,
            max_bytes=s.max_body_bytes,
            timeout_s=s.body_timeout_s,
            retry_bytes=s.retry_buffer_bytes,
            budget=self.buffered,
        )
        try:
            try:
                await body.prepare()
            except bodies.BodyError as exc:
                return _text(exc.status, exc.message, close=True)
            return await self._attempts(request, *target, body, answer)
        finally:
            body.release()

    async def _attempts(
        self, request: web.BaseRequest, path: str, authority: str, body: bodies.Body, answer: _Answer
    ) -> web.StreamResponse:
        assert self.session is not None, "start() first"
        headers = _forward_headers(request, authority, body)
        tried: set[int] = set()
        last_error = ""
        delay = self.settings.backoff_initial_s
        for attempt in range(1, self.settings.attempts + 1):
            try:
                replica = await self.balancer.pick(frozenset(tried))
            except bal.NoReplicaError as exc:
                self.balancer.stats.no_ready_replica(exc.reason)
                return _text(503, str(exc), headers={"Retry-After": "1"})
            answer.version = str(replica.version)
            failure: Exception
            sent = time.monotonic()
            try:
                upstream = await self.session.request(
                    request.method,
                    yarl.URL(replica.url.rstrip("/") + path, encoded=True),  # byte for byte
                    headers=headers,
                    data=body.data(),
                    allow_redirects=False,
                    timeout=self._timeout(),
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                reached, failure = False, exc  # no connection: the replica never saw the request
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError) as exc:
                reached, failure = True, exc  # the request (or part of it) went out, or the answer was garbled
            except TimeoutError:
                self.balancer.record_transport_error(replica)
                self.balancer.release(replica)
                return _text(504, f"replica {replica.replica_id} did not answer in time")
            except BaseException:
                self.balancer.release(replica)  # cancelled: the client went away
                raise
            else:
                body.release()  # an answer has started: no attempt will need the body again
                return await self._relay(request, replica, upstream, time.monotonic() - sent, answer)
            self.balancer.record_transport_error(replica)
            self.balancer.release(replica)
            tried.add(replica.replica_id)
            if body.error is not None:
                return _text(body.error.status, body.error.message, close=True)
            # The client sees the replica id and the kind of error; the log has the details.
            last_error = f"replica {replica.replica_id}: {type(failure).__name__}"
            # Logs name the path, never the query (it may carry tokens), not even inside aiohttp's message.
            bare, _, query = path.partition("?")
            detail = str(failure).replace("?" + query, "?...") if query else str(failure)
            log.info(
                "%s: attempt %d of %s %s failed: %s: %s",
                self.balancer.service_name,
                attempt,
                request.method,
                bare,
                last_error,
                detail,
            )
            where = f"replica {replica.replica_id} of service {self.balancer.service_name!r}"
            kind = type(failure).__name__
            if reached and request.method not in IDEMPOTENT_METHODS:
                return _text(
                    502,
                    f"the connection to {where} broke after the request went out ({kind}); {request.method} is not "
                    "idempotent and the replica may have processed it, so it was not sent to another replica",
                )
            if not body.replayable:
                return _text(
                    502,
                    f"the connection to {where} broke after the request body was streamed to it ({kind}), "
                    "so it could not be sent again",
                )
            if attempt < self.settings.attempts:
                self.balancer.stats.retried("connection_broken" if reached else "not_reached")
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.backoff_max_s)
        return _text(
            502,
            f"could not reach a replica of service {self.balancer.service_name!r} after "
            f"{self.settings.attempts} attempts; last error: {last_error}",
        )

    async def _relay(
        self,
        request: web.BaseRequest,
        replica: policies.Replica,
        upstream: aiohttp.ClientResponse,
        latency_s: float,
        answer: _Answer,
    ) -> web.StreamResponse:
        """Stream the replica's response back; always release the replica and the connection.

        The outcome is counted when the answer ends: a break from the replica's side midway is a
        transport error, whatever the status was.
        """
        finished = False
        try:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            resp.headers.extend(end_to_end(upstream.headers))
            if upstream.content_length is not None and "chunked" not in upstream.headers.get("Transfer-Encoding", ""):
                resp.content_length = upstream.content_length
            await resp.prepare(request)
            # The status went out with the headers, whatever happens to the body (a client that
            # closes once it has the whole body may even cancel this handler in its last write).
            answer.code = str(resp.status)
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
            except (aiohttp.ClientError, TimeoutError) as exc:
                # The replica or the client broke off after the headers went out: all that is left
                # is to cut both connections.
                name, rid = self.balancer.service_name, replica.replica_id
                log.info("%s: response from replica %d not completed: %s", name, rid, exc)
                if request.transport is not None and not request.transport.is_closing():
                    self.balancer.record_transport_error(replica)  # the replica's side broke, not the client's
                if request.transport is not None:
                    request.transport.close()
                return resp
            await resp.write_eof()
            finished = True
            self.balancer.record_answer(replica, upstream.status, latency_s)
            return resp
        finally:
            if finished:
                upstream.release()
            else:
                upstream.close()  # drop the connection, so the replica sees the client leave
            self.balancer.release(replica)


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext | None:
    """A server TLS context, or None when TLS is off (no certificate given)."""
    if not certfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile or None)
    return ctx


async def start_http(
    proxy: Proxy, host: str, port: int, *, ssl_context: ssl.SSLContext | None, shutdown_timeout_s: float = 3.0
) -> tuple[web.BaseRunner, int]:
    """Serve the proxy on host:port (0 picks a port); returns the runner and the bound port.

    On stop, requests in flight get `shutdown_timeout_s` to finish before they are cut.
    """
    await proxy.start()
    s = proxy.settings
    server = web.Server(
        proxy.handle,
        handler_cancellation=True,
        access_log=None,
        max_field_size=65536,
        # aiohttp's own idle timer, a backstop: the connection guard closes idle connections first.
        keepalive_timeout=max(s.idle_timeout_s, s.header_timeout_s),
        # After an answer that left part of the body unread (413, 408, 502), the rest is read and
        # dropped this long before closing, so the client sees the answer rather than a reset.
        lingering_time=_LINGER_S,
    )
    runner = web.ServerRunner(server, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    site = connections.GuardedSite(runner, host, port, tracker=proxy.connections, ssl_context=ssl_context)
    await site.start()
    return runner, int(runner.addresses[0][1])


async def stop_http(runner: web.BaseRunner, proxy: Proxy) -> None:
    """Stop serving, then close the client session."""
    with contextlib.suppress(Exception):
        await runner.cleanup()
    await proxy.close()

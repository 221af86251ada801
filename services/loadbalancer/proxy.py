"""The HTTP proxy: every method, path, query, header and body to a ready replica, responses
streamed back chunk by chunk as they arrive.

A request that cannot reach a replica (connection refused or reset before a response) is
retried on another replica; an upstream HTTP error is returned as it is. A client that goes away
cancels the handler (aiohttp's handler cancellation), which closes the upstream connection, so
the replica sees the disconnect at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl

import aiohttp
import yarl
from aiohttp import web
from multidict import CIMultiDict

from services.loadbalancer import balancer as bal
from services.loadbalancer import policies

log = logging.getLogger(__name__)

# Headers that describe one connection, not the message (RFC 9110 7.6.1), plus the ones aiohttp
# sets itself for each side.
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)


@dataclasses.dataclass(frozen=True)
class ProxySettings:
    """Timeouts and retries of the proxy."""

    connect_timeout_s: float = 5.0
    stream_timeout_s: float = 0.0
    """Longest a response may take, headers to last byte; 0 takes the spec's (default 120 s)."""
    attempts: int = 3
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 1.0
    max_body_bytes: int = 64 * 1024 * 1024


def _forward_headers(request: web.Request) -> CIMultiDict[str]:
    headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP)
    peer = request.remote or ""
    prior = request.headers.get("X-Forwarded-For")
    headers["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    headers["X-Forwarded-Proto"] = request.scheme
    headers["X-Forwarded-Host"] = request.host
    return headers


def _text(status: int, message: str, **headers: str) -> web.Response:
    return web.Response(status=status, text=message + "\n", headers=headers)


class Proxy:
    """The aiohttp handler and the client session to replicas."""

    def __init__(self, balancer: bal.Balancer, settings: ProxySettings) -> None:
        self.balancer = balancer
        self.settings = settings
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the pooled client session (inside the running loop)."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )

    async def close(self) -> None:
        """Close the client session."""
        if self.session is not None:
            await self.session.close()

    def _timeout(self) -> aiohttp.ClientTimeout:
        total = self.settings.stream_timeout_s or self.balancer.config.stream_timeout_s
        return aiohttp.ClientTimeout(total=total or None, connect=self.settings.connect_timeout_s)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Proxy one request."""
        assert self.session is not None, "start() first"
        self.balancer.record_arrival()
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            return _text(413, f"request body too large: {exc.text}")
        headers = _forward_headers(request)
        tried: set[int] = set()
        last_error = ""
        delay = self.settings.backoff_initial_s
        for attempt in range(1, self.settings.attempts + 1):
            try:
                replica = await self.balancer.pick(frozenset(tried))
            except bal.NoReplicaError as exc:
                return _text(503, str(exc), **{"Retry-After": "1"})
            try:
                upstream = await self.session.request(
                    request.method,
                    yarl.URL(replica.url.rstrip("/") + request.raw_path, encoded=True),  # byte for byte
                    headers=headers,
                    data=body or None,
                    allow_redirects=False,
                    timeout=self._timeout(),
                )
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                # Nothing came back: safe to try another replica.
                self.balancer.release(replica)
                tried.add(replica.replica_id)
                # The client sees the replica id and the kind of error; the log has the details.
                last_error = f"replica {replica.replica_id}: {type(exc).__name__}"
                log.info("attempt %d of %s %s failed: %s: %s", attempt, request.method, request.path, last_error, exc)
                if attempt < self.settings.attempts:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.settings.backoff_max_s)
                continue
            except TimeoutError:
                self.balancer.release(replica)
                return _text(504, f"replica {replica.replica_id} did not answer in time")
            except BaseException:
                self.balancer.release(replica)  # cancelled: the client went away
                raise
            return await self._relay(request, replica, upstream)
        return _text(
            502,
            f"could not reach a replica of service {self.balancer.service_name!r} after "
            f"{self.settings.attempts} attempts; last error: {last_error}",
        )

    async def _relay(
        self, request: web.Request, replica: policies.Replica, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """Stream the replica's response back; always release the replica and the connection."""
        finished = False
        try:
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP_BY_HOP:
                    resp.headers.add(k, v)
            if upstream.content_length is not None and "chunked" not in upstream.headers.get("Transfer-Encoding", ""):
                resp.content_length = upstream.content_length
            await resp.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
            except (aiohttp.ClientError, TimeoutError) as exc:
                # The replica or the client broke off after the headers went out: all that is left
                # is to cut both connections.
                log.info("response from replica %d not completed: %s", replica.replica_id, exc)
                if request.transport is not None:
                    request.transport.close()
                return resp
            await resp.write_eof()
            finished = True
            return resp
        finally:
            if finished:
                upstream.release()
            else:
                upstream.close()  # drop the connection, so the replica sees the client leave
            self.balancer.release(replica)


def build_app(proxy: Proxy, *, max_body_bytes: int) -> web.Application:
    """The aiohttp application: one catch-all route for every method and path."""
    app = web.Application(client_max_size=max_body_bytes, handler_args={"max_field_size": 65536})
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    return app


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext | None:
    """A server TLS context, or None when TLS is off (no certificate given)."""
    if not certfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile or None)
    return ctx


async def start_http(
    proxy: Proxy, host: str, port: int, *, ssl_context: ssl.SSLContext | None, shutdown_timeout_s: float = 3.0
) -> tuple[web.AppRunner, int]:
    """Serve the proxy on host:port (0 picks a port); returns the runner and the bound port.

    On stop, requests in flight get `shutdown_timeout_s` to finish before they are cut.
    """
    await proxy.start()
    runner = web.AppRunner(
        build_app(proxy, max_body_bytes=proxy.settings.max_body_bytes),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_address=True)
    await site.start()
    return runner, int(runner.addresses[0][1])


async def stop_http(runner: web.AppRunner, proxy: Proxy) -> None:
    """Stop serving, then close the client session."""
    with contextlib.suppress(Exception):
        await runner.cleanup()
    await proxy.close()

"""The dashboard's HTTP side: the static page and a Server-Sent Events stream of the fleet.

Read-only: GET (and HEAD) only. The page sends the user's API token in an `Authorization`
header of its event-stream request (never in a URL, so no access log or proxy log holds it),
and the dashboard passes it on to the controller, which decides.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import prometheus_client
from aiohttp import web

from services.dashboard import bridge as br
from services.dashboard import metrics

log = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
_FILES = {
    "/": ("index.html", "text/html"),
    "/app.js": ("app.js", "text/javascript"),
    "/style.css": ("style.css", "text/css"),
}
_MAX_TOKEN = 4096

# Everything the page needs is served from here; nothing inline, nothing from elsewhere.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}

BRIDGES: web.AppKey[br.Bridges] = web.AppKey("bridges", br.Bridges)


def host_allowed(host_header: str, allowed: Sequence[str]) -> bool:
    """True for an IP address, `localhost`, or a name in `allowed` (`*` allows any).

    A page on another site cannot read this one through a DNS name it points at 127.0.0.1
    (DNS rebinding) unless that name is allowed.
    """
    if "*" in allowed:
        return True
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host
    else:
        host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    if host in ("localhost", *(a.lower() for a in allowed)):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def bearer_token(header: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` value; "" when there is no header; None
    when it is not a usable bearer token."""
    if not header:
        return ""
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > _MAX_TOKEN:
        return None
    if not token.isascii() or not token.isprintable():
        return None
    return token


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers={"Cache-Control": "no-store"})


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def make_app(
    bridges: br.Bridges,
    *,
    allowed_hosts: Sequence[str] = (),
    heartbeat_s: float = 15.0,
    join_timeout_s: float = 5.0,
    stats: metrics.DashboardMetrics | None = None,
) -> web.Application:
    """The dashboard's web application; `stats` counts its pages and events (by default in a
    registry nobody scrapes)."""
    stats = stats or metrics.DashboardMetrics(prometheus_client.CollectorRegistry())
    stats.watch(pages=lambda: bridges.clients, bridges=bridges.states, streams=lambda: bridges.streams)
    pages = {}
    for path, (name, content_type) in _FILES.items():
        with open(os.path.join(STATIC_DIR, name), "rb") as fh:
            pages[path] = (fh.read(), content_type)

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
        if not host_allowed(request.host, allowed_hosts):
            response: web.StreamResponse = web.Response(
                status=421, text="this host name is not allowed (dashboard setting allowed_hosts)\n"
            )
        else:
            try:
                response = await handler(request)
            except web.HTTPException as exc:  # 404, 405
                exc.headers.update(SECURITY_HEADERS)
                raise
        if not response.prepared:  # an event stream set its headers before it began
            response.headers.update(SECURITY_HEADERS)
        return response

    async def page(request: web.Request) -> web.Response:
        body, content_type = pages[request.path]
        return web.Response(
            body=body, content_type=content_type, charset="utf-8", headers={"Cache-Control": "no-cache"}
        )

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "pages": bridges.clients}, headers={"Cache-Control": "no-store"})

    async def events(request: web.Request) -> web.StreamResponse:
        token = bearer_token(request.headers.get("Authorization", ""))
        if token is None:
            stats.connection("bad_token")
            return _json_error(401, "the Authorization header must be `Bearer <token>`")
        try:
            bridge, sub = await bridges.join(token, timeout=join_timeout_s)
        except br.Full:
            stats.connection("full")
            return _json_error(503, "too many dashboard pages are open; try again later")
        if sub is None:
            stats.connection("denied")
            return _json_error(401, bridge.message)
        stats.connection("accepted")
        try:
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-store",
                    "X-Accel-Buffering": "no",
                    **SECURITY_HEADERS,
                }
            )
            await response.prepare(request)
            log.info("a dashboard page connected (%d open)", bridges.clients)
            await response.write(_sse("snapshot", bridge.snapshot()))
            stats.sent("snapshot")
            while not sub.ended:
                items = await sub.take(heartbeat_s)
                if sub.resync:
                    sub.resync = False
                    items = [("snapshot", bridge.snapshot())]
                if not items:
                    await response.write(b": keep-alive\n\n")
                for kind, data in items:
                    await response.write(_sse(kind, data))
                    stats.sent(kind)
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
        except ConnectionError:
            pass  # the page went away
        finally:
            bridges.leave(bridge, sub)
            log.info("a dashboard page disconnected (%d open)", bridges.clients)
        return response

    async def on_shutdown(app: web.Application) -> None:
        await bridges.close()

    app = web.Application(middlewares=[guard])
    app[BRIDGES] = bridges
    for path in _FILES:
        app.router.add_get(path, page)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/events", events)
    app.on_shutdown.append(on_shutdown)
    return app


async def start_http(
    app: web.Application, host: str, port: int, *, shutdown_timeout_s: float
) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0 picks a port); returns the runner and the bound port."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, int(runner.addresses[0][1])

"""Composition root of the dashboard: settings, the bridges to the controller, the web page, and a
gRPC health server (so the stack and compose check it like every other service)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from aiohttp import web

from replicaplane.controller.v1 import controller_service_pb2_grpc
from services.common import clients, config, errors, grpc_server, logs
from services.common import metrics as metrics_mod
from services.dashboard import bridge, metrics
from services.dashboard import web as dweb


@dataclasses.dataclass(frozen=True)
class Settings:
    """Dashboard settings; env REPLICAPLANE_DASHBOARD_<FIELD> overrides each."""

    http_addr: str = config.DASHBOARD_HTTP_ADDR
    """host:port of the web page; port 0 picks a free port."""
    listen_addr: str = config.DASHBOARD_ADDR
    """host:port of the gRPC health check (port 0 picks a free port), or unix:PATH (the local
    stack's choice: it serves health only, so it needs no TCP port)."""
    port_file: str = ""
    """If set, the bound health-check port is written here once serving."""
    http_port_file: str = ""
    """If set, the bound HTTP port is written here once serving."""
    metrics_addr: str = config.DASHBOARD_METRICS_ADDR
    """host:port of the Prometheus `/metrics` endpoint; port 0 picks a free port; empty turns
    metrics off."""
    metrics_port_file: str = ""
    """If set, the bound metrics port is written here once serving."""
    controller_addr: str = config.CONTROLLER_ADDR
    """Where the controller listens. The dashboard has no API token of its own: it passes on the
    one each page presents, and the controller decides."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names the page may be reached by besides IP addresses and `localhost` (a guard against
    DNS rebinding); `*` allows any. Comma-separated in the environment."""
    discover_interval_s: float = 1.0
    """How often the service list is read to find new services (changes of known services arrive
    on their watch streams at once)."""
    max_pages: int = 64
    """Pages connected at once; more get 503."""
    linger_s: float = 30.0
    """How long the streams of a token stay open after its last page closed (a reload is instant)."""
    heartbeat_s: float = 15.0
    """A keep-alive goes to a page that got nothing for this long."""
    call_timeout_s: float = 5.0
    """Deadline of each ListServices call."""
    shutdown_grace_s: float = 3.0
    """Seconds open pages get on SIGTERM."""


def _split(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(addr)
    return host.strip("[]"), int(port)


def load_settings(**overrides: Any) -> Settings:
    """Settings from defaults, the config file and the environment.

    Raises:
        errors.ValidationError: a bad value, each naming its setting.
    """
    settings = config.load(Settings, "dashboard", **overrides)
    violations = []
    for name in ("http_addr", "listen_addr", "controller_addr"):
        if name == "listen_addr" and settings.listen_addr.startswith("unix:"):
            continue
        try:
            _split(getattr(settings, name))
        except ValueError:
            violations.append(errors.FieldViolation(f"dashboard.{name}", "must be host:port"))
    if settings.metrics_addr.strip():
        try:
            _split(settings.metrics_addr)
        except ValueError:
            violations.append(errors.FieldViolation("dashboard.metrics_addr", "must be host:port, or empty (off)"))
    for name in ("discover_interval_s", "heartbeat_s", "call_timeout_s"):
        if not getattr(settings, name) > 0:
            violations.append(errors.FieldViolation(f"dashboard.{name}", "must be > 0"))
    for name in ("linger_s", "shutdown_grace_s"):
        if getattr(settings, name) < 0:
            violations.append(errors.FieldViolation(f"dashboard.{name}", "must be >= 0"))
    if settings.max_pages < 1:
        violations.append(errors.FieldViolation("dashboard.max_pages", "must be >= 1"))
    errors.require(violations, subject="dashboard settings")
    return settings


def page_url(settings: Settings, port: int) -> str:
    """The page's URL for a browser on this machine."""
    host, _ = _split(settings.http_addr)
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


@dataclasses.dataclass
class Running:
    """A started dashboard."""

    built: grpc_server.Built
    bridges: bridge.Bridges
    runner: web.AppRunner
    http_port: int
    url: str
    channel: Any

    async def stop(self, grace: float | None = None) -> None:
        """Stop the health server, then the page and the streams."""
        await self.built.stop(grace)
        await self.close()

    async def close(self) -> None:
        """Stop everything but the health server."""
        await self.runner.cleanup()  # ends every page's stream first (on_shutdown)
        await self.channel.close()


async def start(settings: Settings, *, start_health: bool = True) -> Running:
    """Serve the page and (unless told not to) the health check."""
    channel = clients.channel(settings.controller_addr)
    bridges = bridge.Bridges(
        controller_service_pb2_grpc.ControllerServiceStub(channel),
        discover_interval_s=settings.discover_interval_s,
        call_timeout_s=settings.call_timeout_s,
        linger_s=settings.linger_s,
        max_clients=settings.max_pages,
    )
    registry = metrics_mod.for_address("dashboard", settings.metrics_addr)
    app = dweb.make_app(
        bridges,
        allowed_hosts=settings.allowed_hosts,
        heartbeat_s=settings.heartbeat_s,
        stats=metrics.DashboardMetrics(registry.registry) if registry else None,
    )
    host, port = _split(settings.http_addr)
    runner, http_port = await dweb.start_http(app, host, port, shutdown_timeout_s=settings.shutdown_grace_s)
    if settings.http_port_file:
        grpc_server.write_port_file(settings.http_port_file, http_port)
    server = grpc_server.new_server(domain="dashboard.replicaplane", metrics=registry)
    built = grpc_server.finish(server, settings.listen_addr, [], metrics=registry)
    if start_health:
        await built.start()
    return Running(
        built=built,
        bridges=bridges,
        runner=runner,
        http_port=http_port,
        url=page_url(settings, http_port),
        channel=channel,
    )


async def serve(settings: Settings) -> None:
    """Run until SIGTERM."""
    running = await start(settings, start_health=False)
    health = settings.listen_addr if settings.listen_addr.startswith("unix:") else f"port {running.built.port}"
    logging.getLogger(__name__).info(
        "dashboard at %s (controller %s, health on %s)", running.url, settings.controller_addr, health
    )
    await grpc_server.serve_until_signal(
        running.built,
        grace=settings.shutdown_grace_s,
        port_file=settings.port_file,
        on_stop=[running.close],
        metrics_addr=settings.metrics_addr,
        metrics_port_file=settings.metrics_port_file,
    )


def main() -> None:
    """Load settings, set up logging and serve."""
    logs.setup("dashboard")
    asyncio.run(serve(load_settings()))

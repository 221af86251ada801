"""Composition root of the load balancer: settings, balancer, controller link, proxy, servers."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
from typing import Any

from replicaplane.controller.v1 import controller_service_pb2_grpc
from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2, loadbalancer_service_pb2_grpc
from services.common import clients, config, errors, grpc_server, logs, security
from services.common import metrics as metrics_mod
from services.loadbalancer import balancer as bal
from services.loadbalancer import fleet as fleets
from services.loadbalancer import link as ctl_link
from services.loadbalancer import metrics, proxy, servicer
from services.loadbalancer import settings as settings_mod

SERVICE_NAME = loadbalancer_service_pb2.DESCRIPTOR.services_by_name["LoadBalancerService"].full_name

# The settings live in settings.py; these names stay here for callers of the composition root
# (every service's `Settings` is documented as being in its server.py).
Settings = settings_mod.Settings
load_settings = settings_mod.load_settings


def _http_unbindable(settings: Settings, exc: OSError) -> errors.StartupError:
    return errors.StartupError(
        f"could not serve HTTP on {settings.http_addr} ({_bind_error(exc)}); set "
        f"{config.env_name('loadbalancer', 'http_addr')} to a free address (port 0 picks one)"
    )


def _bind_error(exc: OSError) -> str:
    """Why a bind failed, in a few words (asyncio wraps the errno in a long message)."""
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)


def first_port(settings: Settings) -> int:
    """A fleet's first HTTP port, checked free now (port 0: a free port picked now); the first
    service gets it, the next ones count up from it.

    Raises:
        OSError: it is taken.
    """
    host, port = settings_mod.split_addr(settings.http_addr)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host or "0.0.0.0", port))
        sock.listen()  # a socket another process listens on clashes only here, as in the real bind
        return int(sock.getsockname()[1])


async def start_unit(
    settings: Settings,
    service: str,
    port: int,
    *,
    stub: controller_service_pb2_grpc.ControllerServiceStub,
    registry: Any,
) -> fleets.Unit:
    """Serve `service` over HTTP on `port` (0 picks one) and follow it on the controller.

    Raises:
        OSError: the port could not be bound.
    """
    stats = metrics.BalancerMetrics(registry.registry, service) if registry else None
    balancer = bal.Balancer(
        service,
        hold_timeout_s=settings.hold_timeout_s,
        hold_max=settings.hold_max_requests,
        startup_wait_s=settings.startup_wait_s,
        policy_override=settings.policy,
        stats=stats,
    )
    px = proxy.Proxy(balancer, settings_mod.proxy_settings(settings))
    host, _ = settings_mod.split_addr(settings.http_addr)
    try:
        runner, http_port = await proxy.start_http(
            px,
            host,
            port,
            ssl_context=proxy.tls_context(settings.tls_certfile, settings.tls_keyfile),
            shutdown_timeout_s=settings.shutdown_grace_s,
        )
    except OSError:
        await px.close()
        raise
    balancer.stats.watch(
        in_flight=lambda: balancer.in_flight,
        ready=lambda: len(balancer.policy.replicas),
        held=lambda: balancer.held,
        tracker=lambda: px.connections,
    )
    link = ctl_link.ControllerLink(
        stub,
        balancer,
        url=settings_mod.advertised_url(settings, http_port),
        report_interval_s=settings.report_interval_s,
        heartbeat_s=settings.report_heartbeat_s,
    )
    link.start()
    return fleets.Unit(service=service, balancer=balancer, link=link, proxy=px, runner=runner, http_port=http_port)


@dataclasses.dataclass
class Running:
    """A started balancer (of one service, or a fleet): HTTP proxies, admin server, controller link."""

    built: grpc_server.Built
    channel: Any
    unit: fleets.Unit | None = None
    """The one service's unit (None for a fleet)."""
    fleet: fleets.Fleet | None = None

    @property
    def balancer(self) -> bal.Balancer:
        """The one service's balancer."""
        assert self.unit is not None, "a fleet has a balancer per service"
        return self.unit.balancer

    @property
    def link(self) -> ctl_link.ControllerLink:
        """The one service's controller link."""
        assert self.unit is not None, "a fleet has a link per service"
        return self.unit.link

    @property
    def proxy(self) -> proxy.Proxy:
        """The one service's proxy."""
        assert self.unit is not None, "a fleet has a proxy per service"
        return self.unit.proxy

    @property
    def http_port(self) -> int:
        """The one service's HTTP port."""
        assert self.unit is not None, "a fleet has a port per service"
        return self.unit.http_port

    @property
    def url(self) -> str:
        """The one service's URL."""
        return self.link.url

    def units(self) -> dict[str, fleets.Unit]:
        """Every service served -> its unit."""
        if self.fleet is not None:
            return dict(self.fleet.units)
        assert self.unit is not None
        return {self.unit.service: self.unit}

    async def stop(self, grace: float | None = None) -> None:
        """Stop the admin server, the proxies and the links (reporting what is left)."""
        await self.built.stop(grace)
        await self.close()

    async def close(self) -> None:
        """Stop everything but the admin server."""
        if self.fleet is not None:
            await self.fleet.stop()
        if self.unit is not None:
            await self.unit.close()
        await self.channel.close()


async def start(settings: Settings, *, start_admin: bool = True) -> Running:
    """Serve HTTP, follow the controller, and (unless told not to) start the admin server."""
    registry = metrics_mod.for_address("loadbalancer", settings.metrics_addr)
    token = settings_mod.api_token(settings)
    # The link retries every call itself (a load report must know whether it was sent before), so
    # gRPC must not retry underneath it.
    channel = clients.channel(
        clients.controller_target(settings.controller_addr),
        interceptors=security.token_interceptors(token),
        retries=False,
    )
    stub = controller_service_pb2_grpc.ControllerServiceStub(channel)
    unit: fleets.Unit | None = None
    the_fleet: fleets.Fleet | None = None
    if settings.fleet:
        try:
            first = first_port(settings)
        except OSError as exc:
            await channel.close()
            raise _http_unbindable(settings, exc) from None
        if settings.http_port_file:
            grpc_server.write_port_file(settings.http_port_file, first)
        the_fleet = fleets.Fleet(
            stub,
            ports=settings_mod.fleet_ports(settings, first),
            start_unit=lambda service, port: start_unit(settings, service, port, stub=stub, registry=registry),
            advertise_host=settings_mod.advertised_host(settings),
            poll_s=settings.fleet_poll_s,
        )
        the_fleet.start()
    else:
        try:
            unit = await start_unit(
                settings,
                settings.service_name,
                settings_mod.split_addr(settings.http_addr)[1],
                stub=stub,
                registry=registry,
            )
        except OSError as exc:
            await channel.close()
            raise _http_unbindable(settings, exc) from None
        if settings.http_port_file:
            grpc_server.write_port_file(settings.http_port_file, unit.http_port)

    def units() -> dict[str, fleets.Unit]:
        if the_fleet is not None:
            return dict(the_fleet.units)
        assert unit is not None
        return {unit.service: unit}

    # Where the controller wants a token, the admin API wants the same one (health stays open).
    guard = [security.TokenInterceptor({token: "api_token"})] if token else []
    server = grpc_server.new_server(domain="loadbalancer.replicaplane", interceptors=guard, metrics=registry)
    loadbalancer_service_pb2_grpc.add_LoadBalancerServiceServicer_to_server(
        servicer.LoadBalancerServicer(units, fleet=settings.fleet), server
    )
    built = grpc_server.finish(server, settings.listen_addr, [SERVICE_NAME], metrics=registry)
    if start_admin:
        await built.start()
    running = Running(built=built, channel=channel, unit=unit, fleet=the_fleet)
    return running


async def serve(settings: Settings) -> None:
    """Run until SIGTERM."""
    running = await start(settings, start_admin=False)
    if running.fleet is not None:
        logging.getLogger(__name__).info(
            "balancing every service of the controller from port %s (admin on port %d)",
            settings_mod.split_addr(settings.http_addr)[1] or "0 (picked per service)",
            running.built.port,
        )
    else:
        logging.getLogger(__name__).info(
            "balancing service %s at %s (admin on port %d)", settings.service_name, running.url, running.built.port
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
    logs.setup("loadbalancer")
    asyncio.run(serve(load_settings()))

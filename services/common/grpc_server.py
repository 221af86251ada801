"""gRPC server bootstrap shared by the three services: options, health, reflection, shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import errors, grpc_errors, grpc_metrics, tracing
from services.common import metrics as metrics_mod

log = logging.getLogger(__name__)

# Client keepalive (clients.py) pings every 30 s; the server must allow at least that often
# or it answers GOAWAY too_many_pings.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
]


@dataclasses.dataclass
class Built:
    """A built, not yet started server."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    metrics: metrics_mod.Metrics | None = None
    """The process's metrics registry; None when metrics are off."""

    async def start(self) -> None:
        """Start serving and mark every service SERVING."""
        await self.server.start()
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def set_serving(self, serving: bool) -> None:
        """Report every service SERVING, or NOT_SERVING while a dependency is broken."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float | None) -> None:
        """Mark NOT_SERVING first so balancers drain, then stop with `grace` seconds."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


def new_server(
    *,
    domain: str,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    metrics: metrics_mod.Metrics | None = None,
    trace_roots: Sequence[str] = (),
) -> grpc.aio.Server:
    """A grpc.aio server with the shared options; `interceptors` (auth, audit) run outside the
    error interceptor, in the order given. With `metrics`, the gRPC metrics interceptor runs
    outermost, so calls refused by the others are counted too. While traces are on, calls that
    carry a trace context (and the `trace_roots` methods) get a server span, just outside the
    error interceptor so the span has the status the client gets."""
    chain = [*interceptors, grpc_errors.ErrorInterceptor(domain=domain)]
    if tracing.current().enabled:
        chain.insert(len(chain) - 1, tracing.TracingInterceptor(domain.split(".")[0], trace_roots))
    if metrics is not None:
        chain.insert(0, grpc_metrics.MetricsInterceptor(grpc_metrics.GrpcServerMetrics(metrics.registry)))
    return grpc.aio.server(interceptors=chain, options=SERVER_OPTIONS)


def finish(
    server: grpc.aio.Server,
    listen_addr: str,
    service_names: Sequence[str],
    *,
    credentials: grpc.ServerCredentials | None = None,
    metrics: metrics_mod.Metrics | None = None,
) -> Built:
    """Add health checking and reflection, bind `listen_addr`, and return the built server.

    Args:
        server: a server from new_server() with the service's servicers added.
        listen_addr: host:port; port 0 picks a free port (tests).
        service_names: full names of the services, for health and reflection.
        credentials: TLS server credentials; None serves plaintext.
        metrics: the registry given to new_server(), kept with the server; None when off.
    """
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        *service_names,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    socket_path = unix_path(listen_addr)
    if socket_path:
        private_socket_dir(socket_path)
    if credentials is None:
        port = server.add_insecure_port(listen_addr)
    else:
        port = server.add_secure_port(listen_addr, credentials)
    if port == 0:
        raise errors.StartupError(
            f"could not bind {listen_addr} for its gRPC API (in use, or not an address of this host)"
        )
    if socket_path:
        os.chmod(socket_path, 0o600)
    return Built(server=server, port=port, health=health_servicer, service_names=tuple(service_names), metrics=metrics)


def unix_path(addr: str) -> str:
    """The socket path of a `unix:PATH` (or `unix:///PATH`) address; "" for anything else."""
    if not addr.startswith("unix:"):
        return ""
    path = addr[len("unix:") :]
    return "/" + path.lstrip("/") if path.startswith("//") else path


def private_socket_dir(path: str) -> None:
    """Make sure only this user can reach the socket at `path`: its directory is created 0700
    if missing, and refused if it belongs to another user or others may enter it (anyone who
    can connect to the socket can call every method on it).

    Raises:
        errors.ValidationError: the directory is shared.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.stat(folder)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise errors.ValidationError(
            [
                errors.FieldViolation(
                    "listen_addr",
                    f"the socket's directory {folder} must belong to this user and be closed to others "
                    f"(mode 0700, it is {st.st_mode & 0o777:o}): anyone who can reach the socket can call the service",
                )
            ],
            subject="settings",
        )


def write_port_file(path: str, port: int) -> None:
    """Write `port` to `path` atomically, so a reader never sees a partial number."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(str(port))
    os.replace(tmp, path)


async def serve_metrics(built: Built, addr: str, *, port_file: str = "") -> metrics_mod.Endpoint | None:
    """Serve `built`'s metrics on http://addr/metrics, if metrics are on.

    Args:
        built: the server; nothing is served when it has no metrics.
        addr: host:port; port 0 picks a free port; empty serves nothing.
        port_file: if set, the bound port is written there (atomically).

    Raises:
        errors.ValidationError: `addr` is not host:port.
        RuntimeError: the address cannot be bound: a service does not run without the metrics
            it was told to serve.
    """
    if built.metrics is None or not addr.strip():
        return None
    setting = f"{built.metrics.component}.metrics_addr"
    try:
        endpoint = await metrics_mod.serve(built.metrics, addr)
    except ValueError as exc:
        raise errors.ValidationError([errors.FieldViolation(setting, str(exc))], subject="settings") from None
    except OSError as exc:
        raise errors.StartupError(
            f"could not serve metrics on {addr} ({exc.strerror or exc}); set {setting} to another "
            "address, or to an empty value to turn metrics off"
        ) from None
    if port_file:
        write_port_file(port_file, endpoint.port)
    log.info("metrics at %s", endpoint.url)
    return endpoint


async def serve_until_signal(
    built: Built,
    *,
    grace: float,
    port_file: str = "",
    on_stop: Sequence[object] = (),
    metrics_addr: str = "",
    metrics_port_file: str = "",
    stop: asyncio.Event | None = None,
) -> None:
    """Start `built`, wait for SIGTERM or SIGINT (or `stop`), then shut down gracefully.

    Args:
        built: the server.
        grace: seconds in-flight RPCs get to finish.
        port_file: if set, the bound port is written there (atomically) once serving.
        on_stop: async callables run after the server stopped (close stores, stop backends).
        metrics_addr: where `/metrics` is served (port 0 picks one); empty serves none.
        metrics_port_file: if set, the bound metrics port is written there.
        stop: an event that also stops the server when set (the signals set it too).
    """
    # Metrics first: its port file is written before the gRPC one, so a reader that waits for
    # the gRPC port (the local stack, tests) finds both.
    endpoint = await serve_metrics(built, metrics_addr, port_file=metrics_port_file)
    await built.start()
    if port_file:
        write_port_file(port_file, built.port)
    log.info("serving %s on port %d", ", ".join(built.service_names), built.port)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await built.stop(grace)
    for hook in on_stop:
        await hook()  # type: ignore[operator]
    if endpoint is not None:
        await endpoint.stop()
    log.info("stopped")

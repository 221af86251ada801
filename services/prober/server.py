"""Composition root of the prober: settings, servicer, server lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import resource
import socket
from typing import Any

from replicaplane.prober.v1 import prober_service_pb2, prober_service_pb2_grpc
from services.common import config, grpc_server, logs, probe_fleet, security, tracing
from services.common import metrics as metrics_mod
from services.prober import metrics, probing, servicer, streams

SERVICE_NAME = prober_service_pb2.DESCRIPTOR.services_by_name["ProberService"].full_name


@dataclasses.dataclass(frozen=True)
class Settings:
    """Prober settings; env REPLICAPLANE_PROBER_<FIELD> overrides each."""

    listen_addr: str = config.PROBER_ADDR
    """host:port to serve on; port 0 picks a free port."""
    shutdown_grace_s: float = 3.0
    """Seconds in-flight RPCs get on SIGTERM (probe streams are ended at once, so clients move)."""
    port_file: str = ""
    """If set, the bound port is written here once serving (tests and scripts use port 0)."""
    metrics_addr: str = config.PROBER_METRICS_ADDR
    """host:port of the Prometheus `/metrics` endpoint; port 0 picks a free port; empty turns
    metrics off."""
    metrics_port_file: str = ""
    """If set, the bound metrics port is written here once serving."""
    prober_id: str = ""
    """Identity stamped on every result; empty means hostname:pid."""
    fast_interval_s: float = 0.1
    """Probe interval of a starting target that does not set its own."""
    interval_s: float = 10.0
    """Probe interval of a target that does not set its own."""
    timeout_s: float = 15.0
    """Probe timeout of a target that does not set its own."""
    min_interval_s: float = 0.001
    """Shortest interval honoured; shorter ones are raised to it."""
    max_concurrent_probes: int = 1000
    """Probes in flight at once over all streams; the rest wait (not counted in their timeout)."""
    keepalive_s: float = 30.0
    """How long an idle connection to a replica is kept for reuse."""
    verify_tls: bool = True
    """Verify the TLS certificates of https replicas."""
    batch_max: int = 500
    """Results per ProbeResponse at most."""
    flush_interval_s: float = 0.002
    """How long a batch waits for more results after its first one."""
    max_targets_per_stream: int = 50_000
    """Targets one stream may hold; more are refused as invalid."""
    heartbeat_s: float = probe_fleet.HEARTBEAT_INTERVAL_S
    """An empty message is sent on a stream quiet for this long, so clients can tell a frozen
    prober from a quiet one."""
    tls_cert_file: str = ""
    """This server's certificate (PEM). Setting the three tls_* files turns mTLS on: callers
    must show a certificate signed by tls_ca_file."""
    tls_key_file: str = ""
    """Private key of tls_cert_file (PEM)."""
    tls_ca_file: str = ""
    """CA (PEM) that signed the callers' certificates."""
    tls_allowed_clients: str = "controller"
    """With mTLS, the certificate names (CN or SAN) allowed to call; others get PERMISSION_DENIED."""


@dataclasses.dataclass
class Built(grpc_server.Built):
    """The prober's server plus the engine whose streams and HTTP client it must close."""

    engine: streams.Engine | None = None

    async def stop(self, grace: float | None) -> None:
        """End every probe stream first (clients move at once), then stop the server."""
        if self.engine is not None:
            self.engine.drain()
        await super().stop(grace)
        if self.engine is not None:
            await self.engine.close()


def load_settings(**overrides: Any) -> Settings:
    """Settings from defaults, the config file and the environment."""
    return config.load(Settings, "prober", **overrides)


def prober_id(settings: Settings) -> str:
    """The prober's identity: the setting, or hostname:pid."""
    return settings.prober_id or f"{socket.gethostname()}:{os.getpid()}"


async def build_server(settings: Settings) -> Built:
    """Create the prober server; the caller starts and stops it."""
    registry = metrics_mod.for_address("prober", settings.metrics_addr)
    http = probing.HttpProber(
        max_concurrent=settings.max_concurrent_probes,
        keepalive_s=settings.keepalive_s,
        verify_tls=settings.verify_tls,
    )
    engine = streams.Engine(
        http,
        probing.Defaults(
            timeout_s=settings.timeout_s,
            interval_s=settings.interval_s,
            fast_interval_s=settings.fast_interval_s,
            min_interval_s=settings.min_interval_s,
        ),
        streams.StreamSettings(
            batch_max=settings.batch_max,
            flush_interval_s=settings.flush_interval_s,
            max_targets=settings.max_targets_per_stream,
        ),
        stats=metrics.ProberMetrics(registry.registry) if registry else None,
    )
    interceptors, credentials = security.internal_server(
        "prober",
        security.Tls(settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file),
        settings.tls_allowed_clients,
    )
    server = grpc_server.new_server(domain="prober.replicaplane", interceptors=interceptors, metrics=registry)
    prober_service_pb2_grpc.add_ProberServiceServicer_to_server(
        servicer.ProberServicer(engine, prober_id(settings), heartbeat_s=settings.heartbeat_s), server
    )
    built = grpc_server.finish(server, settings.listen_addr, [SERVICE_NAME], credentials=credentials, metrics=registry)
    return Built(**{f.name: getattr(built, f.name) for f in dataclasses.fields(built)}, engine=engine)


def _raise_fd_limit() -> None:
    # Each probe in flight and each pooled connection holds a file descriptor.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def serve(settings: Settings) -> None:
    """Run until SIGTERM."""
    built = await build_server(settings)
    await grpc_server.serve_until_signal(
        built,
        grace=settings.shutdown_grace_s,
        port_file=settings.port_file,
        metrics_addr=settings.metrics_addr,
        metrics_port_file=settings.metrics_port_file,
    )


def main() -> None:
    """Load settings, set up logging and serve."""
    logs.setup("prober")
    traces = tracing.setup("prober")  # off unless OTEL_TRACES_EXPORTER=otlp
    _raise_fd_limit()
    try:
        asyncio.run(serve(load_settings()))
    finally:
        traces.shutdown()

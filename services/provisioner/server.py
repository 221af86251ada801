"""Composition root of the provisioner: settings, backend, core, servicer, server lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
import os

from replicaplane.provisioner.v1 import provisioner_service_pb2, provisioner_service_pb2_grpc
from services.common import errors, grpc_server, logs, security, tracing
from services.common import metrics as metrics_mod
from services.provisioner import (
    addresses,
    capability,
    copies,
    kube,
    local,
    logstore,
    manager,
    servicer,
    store,
)
from services.provisioner import backend as backend_mod
from services.provisioner import metrics as provisioner_metrics
from services.provisioner import settings as settings_mod
from services.provisioner import zones as zone_config

SERVICE_NAME = provisioner_service_pb2.DESCRIPTOR.services_by_name["ProvisionerService"].full_name

# The settings live in settings.py; these names stay here for callers of the composition root.
Settings = settings_mod.Settings
load_settings = settings_mod.load_settings


@dataclasses.dataclass
class Server(grpc_server.Built):
    """The built provisioner server; stopping it also stops the core (replicas keep running)."""

    provisioner: manager.Provisioner | None = None

    async def stop(self, grace: float | None) -> None:
        """End open streams, stop serving, then stop operations and watchers."""
        await self.health.enter_graceful_shutdown()
        if self.provisioner is not None:
            self.provisioner.end_streams()
        await self.server.stop(grace)
        if self.provisioner is not None:
            await self.provisioner.close()


def make_backend(settings: Settings) -> backend_mod.Backend:
    """The backend the settings name.

    Raises:
        errors.ValidationError: an unknown backend, malformed zones or kubernetes settings.
    """
    if settings.backend == "kubernetes":
        opts = settings_mod.kube_options(settings)
        return kube.KubernetesBackend(opts, log_path=logstore.LogStore(settings.state_dir).path)
    if settings.backend != "local":
        raise errors.ValidationError(
            [
                errors.FieldViolation(
                    "provisioner.backend", f"unknown backend {settings.backend!r}; use local or kubernetes"
                )
            ]
        )
    network = settings.replica_network
    if network not in ("auto", "address", "port"):
        raise errors.ValidationError(
            [errors.FieldViolation("provisioner.replica_network", f"must be auto, address or port, got {network!r}")]
        )
    try:
        accelerators = capability.parse_offered(settings.local_accelerators)
    except ValueError as exc:
        raise errors.ValidationError([errors.FieldViolation("provisioner.local_accelerators", str(exc))]) from None
    violations = [
        errors.FieldViolation(f"provisioner.{name}", "must be positive")
        for name in ("local_copy_max_mb", "local_copy_max_files")
        if getattr(settings, name) <= 0
    ]
    errors.require(violations, subject="provisioner settings")
    if network == "auto":
        # An advertised 127.0.0.1 (the local stack sets it) is still plain loopback.
        loopback = settings.replica_host == "127.0.0.1" and settings.advertise_host in ("", "127.0.0.1")
        network = "address" if loopback and addresses.supported() else "port"
    return local.LocalBackend(
        settings.state_dir,
        zone_list=zone_config.parse(settings.zones),
        replica_host=settings.replica_host,
        advertise_host=settings.advertise_host,
        network=network,
        accelerators=accelerators,
        copy_limits=copies.Limits(
            max_bytes=int(settings.local_copy_max_mb * (1 << 20)), max_entries=settings.local_copy_max_files
        ),
        python_envs=settings.local_venv,
        system_site_packages=settings.local_venv_system_site_packages,
    )


def _prepare_state_dir(path: str) -> str:
    state_dir = os.path.abspath(os.path.expanduser(path))
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    return state_dir


async def build_server(settings: Settings, *, backend: backend_mod.Backend | None = None) -> Server:
    """Create the provisioner server and re-find existing replicas; the caller starts and stops it.

    Args:
        settings: the settings.
        backend: runs replicas; by default the one `settings.backend` names.
    """
    opts = settings_mod.options(settings)
    state_dir = _prepare_state_dir(settings.state_dir)
    backend = backend or make_backend(settings)
    registry = metrics_mod.for_address("provisioner", settings.metrics_addr)
    provisioner = manager.Provisioner(
        backend=backend,
        records=store.RecordStore(state_dir),
        logs=logstore.LogStore(state_dir),
        options=opts,
        stats=provisioner_metrics.ProvisionerMetrics(registry.registry, backend.name) if registry else None,
    )
    await provisioner.start()
    try:
        interceptors, credentials = security.internal_server(
            "provisioner",
            security.Tls(settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file),
            settings.tls_allowed_clients,
        )
        server = grpc_server.new_server(domain="provisioner.replicaplane", interceptors=interceptors, metrics=registry)
        provisioner_service_pb2_grpc.add_ProvisionerServiceServicer_to_server(
            servicer.ProvisionerServicer(provisioner), server
        )
        built = grpc_server.finish(
            server, settings.listen_addr, [SERVICE_NAME], credentials=credentials, metrics=registry
        )
    except BaseException:
        await provisioner.close()
        raise
    fields = {f.name: getattr(built, f.name) for f in dataclasses.fields(built)}
    return Server(**fields, provisioner=provisioner)


async def serve(settings: Settings) -> None:
    """Run until SIGTERM; replicas keep running and are re-found on the next start."""
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
    logs.setup("provisioner")
    traces = tracing.setup("provisioner")  # off unless OTEL_TRACES_EXPORTER=otlp
    try:
        asyncio.run(serve(load_settings()))
    finally:
        traces.shutdown()

"""Composition root of the provisioner: settings, backend, core, servicer, server lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

from replicaplane.provisioner.v1 import provisioner_service_pb2, provisioner_service_pb2_grpc
from services.common import config, errors, grpc_server, logs
from services.provisioner import addresses, local, logstore, manager, servicer, store
from services.provisioner import backend as backend_mod
from services.provisioner import zones as zone_config

SERVICE_NAME = provisioner_service_pb2.DESCRIPTOR.services_by_name["ProvisionerService"].full_name

# The core's defaults are the settings' defaults: stated once, in manager.Options.
_CORE = manager.Options()


@dataclasses.dataclass(frozen=True)
class Settings:
    """Provisioner settings; env REPLICAPLANE_PROVISIONER_<FIELD> overrides each."""

    listen_addr: str = config.PROVISIONER_ADDR
    """host:port to serve on; port 0 picks a free port."""
    shutdown_grace_s: float = 3.0
    """Seconds in-flight RPCs get on SIGTERM."""
    port_file: str = ""
    """If set, the bound port is written here once serving (tests and scripts use port 0)."""
    state_dir: str = "~/.replicaplane/provisioner"
    """Where records, logs and replica working directories live; replicas are re-found from it."""
    backend: str = "local"
    """Which backend runs replicas; only "local" (process groups on this machine) exists."""
    max_in_flight: float = _CORE.max_in_flight
    """Launches in flight at once; a teardown counts 1/2. More wait in FIFO order."""
    launch_attempts: int = _CORE.launch_attempts
    """Launch attempts before a launch fails."""
    launch_backoff_initial_s: float = _CORE.launch_backoff_initial_s
    """Gap after the first failed launch attempt (jittered +-40 %)."""
    launch_backoff_multiplier: float = _CORE.launch_backoff_multiplier
    """Growth of the launch backoff per attempt."""
    launch_backoff_max_s: float = _CORE.launch_backoff_max_s
    """Cap of the launch backoff."""
    teardown_attempts: int = _CORE.teardown_attempts
    """Teardown attempts before a teardown fails."""
    teardown_backoff_initial_s: float = _CORE.teardown_backoff_initial_s
    """Gap after the first failed teardown attempt (x1.6 per attempt, jittered)."""
    teardown_backoff_max_s: float = _CORE.teardown_backoff_max_s
    """Cap of the teardown backoff."""
    cancel_timeout_s: float = _CORE.cancel_timeout_s
    """How long cancelling an in-flight launch may take before teardown goes ahead anyway."""
    kill_grace_s: float = _CORE.kill_grace_s
    """Seconds between SIGTERM and SIGKILL when a replica is torn down."""
    zones: str = zone_config.DEFAULT_ZONES
    """Simulated zones of the local backend, as name:price_per_hour pairs."""
    watch_history: int = _CORE.watch_history
    """Watch events kept for resuming; an older resume point gets a new snapshot."""
    sweep_interval_s: float = _CORE.sweep_interval_s
    """How often the level-triggered pass restarts operations whose task died."""
    replica_host: str = "127.0.0.1"
    """Address local replicas bind to (given to them as $HOST); 0.0.0.0 in containers."""
    advertise_host: str = ""
    """Host put in replica endpoints; default replica_host (127.0.0.1 when that is a wildcard)."""
    replica_network: str = "auto"
    """How local replicas share the machine: `address` gives each its own loopback address
    (127.77.x.y) with the spec's ports unchanged, so apps that bind a fixed port run side by
    side; `port` maps each declared port to a free one on replica_host. `auto` is `address`
    on loopback where the system supports it (Linux), else `port` (containers, replica_host
    0.0.0.0)."""


def load_settings(**overrides: Any) -> Settings:
    """Settings from defaults, the config file and the environment."""
    return config.load(Settings, "provisioner", **overrides)


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
        errors.ValidationError: an unknown backend or malformed zones.
    """
    if settings.backend != "local":
        raise errors.ValidationError(
            [errors.FieldViolation("provisioner.backend", f"unknown backend {settings.backend!r}; use local")]
        )
    network = settings.replica_network
    if network not in ("auto", "address", "port"):
        raise errors.ValidationError(
            [errors.FieldViolation("provisioner.replica_network", f"must be auto, address or port, got {network!r}")]
        )
    if network == "auto":
        loopback = settings.replica_host == "127.0.0.1" and not settings.advertise_host
        network = "address" if loopback and addresses.supported() else "port"
    return local.LocalBackend(
        settings.state_dir,
        zone_list=zone_config.parse(settings.zones),
        replica_host=settings.replica_host,
        advertise_host=settings.advertise_host,
        network=network,
    )


def options(settings: Settings) -> manager.Options:
    """The core's options from the settings.

    Raises:
        errors.ValidationError: a value out of range, naming each.
    """
    violations = []
    if settings.max_in_flight < 0.5:
        violations.append(errors.FieldViolation("provisioner.max_in_flight", "must be at least 0.5"))
    for name in ("launch_attempts", "teardown_attempts", "watch_history"):
        if getattr(settings, name) < 1:
            violations.append(errors.FieldViolation(f"provisioner.{name}", "must be at least 1"))
    for name in (
        "launch_backoff_initial_s",
        "launch_backoff_max_s",
        "teardown_backoff_initial_s",
        "teardown_backoff_max_s",
        "cancel_timeout_s",
        "kill_grace_s",
    ):
        if getattr(settings, name) < 0:
            violations.append(errors.FieldViolation(f"provisioner.{name}", "must not be negative"))
    if settings.sweep_interval_s <= 0:
        violations.append(errors.FieldViolation("provisioner.sweep_interval_s", "must be positive"))
    if settings.launch_backoff_multiplier < 1:
        violations.append(errors.FieldViolation("provisioner.launch_backoff_multiplier", "must be at least 1"))
    errors.require(violations, subject="provisioner settings")
    shared = {f.name for f in dataclasses.fields(manager.Options)} & {f.name for f in dataclasses.fields(Settings)}
    return manager.Options(**{name: getattr(settings, name) for name in shared})


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
    opts = options(settings)
    state_dir = _prepare_state_dir(settings.state_dir)
    provisioner = manager.Provisioner(
        backend=backend or make_backend(settings),
        records=store.RecordStore(state_dir),
        logs=logstore.LogStore(state_dir),
        options=opts,
    )
    await provisioner.start()
    try:
        server = grpc_server.new_server(domain="provisioner.replicaplane")
        provisioner_service_pb2_grpc.add_ProvisionerServiceServicer_to_server(
            servicer.ProvisionerServicer(provisioner), server
        )
        built = grpc_server.finish(server, settings.listen_addr, [SERVICE_NAME])
    except BaseException:
        await provisioner.close()
        raise
    fields = {f.name: getattr(built, f.name) for f in dataclasses.fields(built)}
    return Server(**fields, provisioner=provisioner)


async def serve(settings: Settings) -> None:
    """Run until SIGTERM; replicas keep running and are re-found on the next start."""
    built = await build_server(settings)
    await grpc_server.serve_until_signal(built, grace=settings.shutdown_grace_s, port_file=settings.port_file)


def main() -> None:
    """Load settings, set up logging and serve."""
    logs.setup("provisioner")
    asyncio.run(serve(load_settings()))

"""Composition root of the controller: settings, store, clients, servicer, server lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from replicaplane.controller.v1 import controller_service_pb2, controller_service_pb2_grpc
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc
from services.common import clients, config, grpc_server, logs, probe_fleet
from services.controller import controller, reconciler, servicer, store

SERVICE_NAME = controller_service_pb2.DESCRIPTOR.services_by_name["ControllerService"].full_name


@dataclasses.dataclass(frozen=True)
class Settings:
    """Controller settings; env REPLICAPLANE_CONTROLLER_<FIELD> overrides each."""

    listen_addr: str = config.CONTROLLER_ADDR
    """host:port to serve on; port 0 picks a free port."""
    shutdown_grace_s: float = 3.0
    """Seconds in-flight RPCs get on SIGTERM."""
    port_file: str = ""
    """If set, the bound port is written here once serving (tests and scripts use port 0)."""
    state_dir: str = "~/.replicaplane/controller"
    """Directory of the SQLite store."""
    provisioner_addr: str = config.PROVISIONER_ADDR
    """Where the provisioner listens."""
    prober_addrs: str = config.PROBER_ADDR
    """Probers: a comma-separated address list, or `dns:///name:port` resolving to every prober."""
    drain_s: float = 120.0
    """Drain before a scale-down or manual termination (SkyPilot: 120 s)."""
    probe_fast_interval_s: float = 0.1
    """Probe interval of a replica that has not passed a probe yet."""
    sweep_interval_s: float = 5.0
    """How often the level-triggered pass runs: it restarts any launch, teardown or probe that
    should be in motion and is not, and checks that the store takes writes."""
    store_busy_timeout_s: float = 5.0
    """How long a store write waits for another process's lock before it counts as failed."""
    max_replicas_per_service: int = 1000
    """The most replicas a spec may ask for (replicas, min/max_replicas): more is refused."""
    autoscaler_interval_s: float = 20.0
    """Autoscaler decisions are made at least this often (SkyPilot: 20 s); a load report, an
    update and an elapsed up/downscale delay also decide at once."""
    autoscaler_zero_interval_s: float = 5.0
    """Decision cadence while the target is 0 (SkyPilot: 5 s)."""
    qps_window_s: float = 60.0
    """Load reports count toward QPS over this window (SkyPilot: 60 s)."""


def load_settings(**overrides: Any) -> Settings:
    """Settings from defaults, the config file and the environment."""
    return config.load(Settings, "controller", **overrides)


@dataclasses.dataclass
class Running:
    """A started controller and what must be closed with it."""

    built: grpc_server.Built
    controller: controller.Controller
    fleet: probe_fleet.ProbeFleet
    db: store.Store

    @property
    def port(self) -> int:
        """The bound port."""
        return self.built.port

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving, then stop following replicas (they keep running)."""
        await self.built.stop(grace)
        await self.controller.stop()
        await self.fleet.stop()
        self.db.close()


async def start(settings: Settings) -> Running:
    """Open the store, connect to the provisioner and probers, recover, and serve."""
    db = store.Store.in_state_dir(settings.state_dir, busy_timeout_s=settings.store_busy_timeout_s)
    channel = clients.channel(settings.provisioner_addr)
    tuning = reconciler.Tuning(
        drain_s=settings.drain_s,
        probe_fast_interval_s=settings.probe_fast_interval_s,
        sweep_interval_s=settings.sweep_interval_s,
        max_replicas_per_service=settings.max_replicas_per_service,
        decision_interval_s=settings.autoscaler_interval_s,
        zero_decision_interval_s=settings.autoscaler_zero_interval_s,
        qps_window_s=settings.qps_window_s,
    )
    holder: list[controller.Controller] = []
    fleet = probe_fleet.ProbeFleet(
        settings.prober_addrs,
        on_results=lambda results: holder[0].on_probe_results(results),
        on_stale=lambda stale: holder[0].on_probe_stale(stale),
    )
    ctl = controller.Controller(
        db=db,
        provisioner=provisioner_service_pb2_grpc.ProvisionerServiceStub(channel),
        probes=fleet,
        tuning=tuning,
    )
    holder.append(ctl)
    server = grpc_server.new_server(domain="controller.replicaplane")
    controller_service_pb2_grpc.add_ControllerServiceServicer_to_server(servicer.ControllerServicer(ctl), server)
    built = grpc_server.finish(server, settings.listen_addr, [SERVICE_NAME])
    # NOT_SERVING while the store refuses writes: nothing the controller decides would stick.
    background: set[asyncio.Task[None]] = set()

    def store_health(writable: bool) -> None:
        task = asyncio.get_running_loop().create_task(built.set_serving(writable))
        background.add(task)
        task.add_done_callback(background.discard)

    db.on_writable_change(store_health)
    await ctl.start()
    await fleet.start()
    await built.start()
    return Running(built=built, controller=ctl, fleet=fleet, db=db)


async def serve(settings: Settings) -> None:
    """Run until SIGTERM."""
    running = await start(settings)
    await grpc_server.serve_until_signal(
        running.built,
        grace=settings.shutdown_grace_s,
        port_file=settings.port_file,
        on_stop=[running.controller.stop, running.fleet.stop],
    )
    running.db.close()


def main() -> None:
    """Load settings, set up logging and serve."""
    logs.setup("controller")
    asyncio.run(serve(load_settings()))

"""Composition root of the controller: settings, store, clients, servicer, server lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import grpc

from replicaplane.controller.v1 import controller_service_pb2, controller_service_pb2_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc
from services.common import audit, clients, errors, grpc_server, logs, metrics, probe_fleet, security, tracing
from services.controller import controller, forward, identity, leader, reconciler, servicer, store, writer
from services.controller import metrics as controller_metrics
from services.controller import settings as settings_mod

# The settings live in settings.py; these names stay here for callers of the composition root.
Settings = settings_mod.Settings
load_settings = settings_mod.load_settings
check = settings_mod.check
advertised = settings_mod.advertised

log = logging.getLogger(__name__)

SERVICE = controller_service_pb2.DESCRIPTOR.services_by_name["ControllerService"]
SERVICE_NAME = SERVICE.full_name

DEPOSED_EXIT_CODE = 3
"""The controller's exit code when it stopped because another controller took the lease."""

# Calls that change state, recorded in the audit log. ReportLoad is telemetry, not recorded.
MUTATIONS = tuple(
    f"/{SERVICE_NAME}/{m}"
    for m in (
        "CreateService",
        "UpdateService",
        "DeleteService",
        "TerminateReplica",
        "PurgeReplicas",
        "ReapOrphans",
        "RollbackService",
        "PromoteRollout",
        "AbortRollout",
    )
)


# Calls whose work is followed by a trace even when the caller sends no trace context.
TRACE_ROOTS = tuple(f"/{SERVICE_NAME}/{m}" for m in ("CreateService", "UpdateService"))


@dataclasses.dataclass
class Running:
    """A started controller and what must be closed with it."""

    built: grpc_server.Built
    controller: controller.Controller | None
    """None while this controller stands by (leader_election)."""
    fleet: probe_fleet.ProbeFleet | None
    db: store.Store
    db_writer: writer.Writer | None = None
    """The controller's store writer (None while standing by)."""
    audit_file: audit.FileSink | None = None
    leadership: leader.Leadership | None = None
    """With leader_election: this controller's side of the election."""
    switch: forward.Switch | None = None
    lead_task: asyncio.Task[None] | None = None
    leading: bool = True
    """The API is served by this process's controller (always, without leader_election)."""

    @property
    def port(self) -> int:
        """The bound port."""
        return self.built.port

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving, then stop following replicas (they keep running)."""
        await self.built.stop(grace)
        await self.stop_leading()
        self.db.close()
        if self.audit_file is not None:
            self.audit_file.close()

    async def stop_leading(self) -> None:
        """Stop the controller and probe fleet (if leading) and the election (releasing the
        lease unless deposed, so a standby takes over at once)."""
        # Each part is taken before it is stopped: a second call (shutdown after a step-down)
        # finds nothing left to stop.
        self.leading = False
        lead_task, self.lead_task = self.lead_task, None
        if lead_task is not None:
            lead_task.cancel()
            await asyncio.gather(lead_task, return_exceptions=True)
        ctl, self.controller = self.controller, None
        if ctl is not None:
            await ctl.stop()
        fleet, self.fleet = self.fleet, None
        if fleet is not None:
            await fleet.stop()
        db_writer, self.db_writer = self.db_writer, None
        if db_writer is not None:
            await db_writer.close()
        switch, self.switch = self.switch, None
        if switch is not None:
            await switch.close()
        leadership = self.leadership
        if leadership is not None and not leadership.closed:
            await asyncio.to_thread(leadership.close, release=True)


def _interceptors(settings: Settings) -> tuple[list[grpc.aio.ServerInterceptor], audit.FileSink | None]:
    """Audit outermost (it records refused calls too), then the token check."""
    tokens = security.read_tokens(settings.auth_token, settings.auth_token_file)
    sink = audit.FileSink(settings.audit_log_file) if settings.audit_log_file else None
    chain: list[grpc.aio.ServerInterceptor] = [audit.AuditInterceptor(MUTATIONS, sink=sink)]
    if tokens:
        chain.append(security.TokenInterceptor(tokens))
    return chain, sink


def _identity(settings: Settings, db: store.Store) -> str:
    """The controller id (see identity.py), kept in the store too. Controllers sharing a store
    (leader_election) share the store's id: each leader owns the replicas the last one launched."""
    stored = db.stored_controller_id()
    setting = settings.controller_id or (stored if settings.leader_election else "")
    chosen = identity.resolve(settings.state_dir, setting=setting, stored=stored)
    if stored != chosen:
        try:
            db.set_controller_id(chosen)
        except errors.UnavailableError:
            pass  # the id file holds it; the store's copy is written on a later start
    return chosen


def _fleet(ctl: controller.Controller, fleet: probe_fleet.ProbeFleet) -> controller_metrics.Fleet:
    """What the controller's gauges read at scrape time, through its public reads."""

    def services() -> Iterator[tuple[res.Service, list[res.Replica]]]:
        token = ""
        while True:
            page, token = ctl.list_services(1000, token)
            for svc in page:
                yield svc, _replicas(ctl, svc.name)
            if not token:
                return

    return controller_metrics.Fleet(
        services=services, watchers=ctl.watchers, queue_depth=ctl.queue_depth, probing_stale=lambda: fleet.stale
    )


def _replicas(ctl: controller.Controller, name: str) -> list[res.Replica]:
    out: list[res.Replica] = []
    token = ""
    while True:
        try:
            page, token = ctl.list_replicas(name, 1000, token)
        except errors.NotFoundError:
            return out  # deleted meanwhile
        out += page
        if not token:
            return out


async def start(settings: Settings) -> Running:
    """Open the store, connect to the provisioner and probers, recover, and serve.

    With leader_election the server answers at once (forwarding to the leader) and the
    controller itself starts once this process holds the lease (`Running.lead_task`).
    """
    check(settings)
    interceptors, audit_file = _interceptors(settings)
    tls = security.Tls(settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file)
    credentials = tls.channel_credentials("controller") if tls.enabled else None

    def make_channel(addr: str) -> grpc.aio.Channel:
        return clients.channel(addr, credentials=credentials, server_name=settings.tls_server_name)

    db = store.open_store(
        settings.store_url,
        state_dir=settings.state_dir,
        synchronous=settings.store_synchronous,
        busy_timeout_s=settings.store_busy_timeout_s,
    )
    registry = metrics.for_address("controller", settings.metrics_addr)
    own = controller_metrics.ControllerMetrics(registry.registry) if registry is not None else None
    if own is not None:
        db.on_write(own.store_write)
    server = grpc_server.new_server(
        domain="controller.replicaplane", interceptors=interceptors, metrics=registry, trace_roots=TRACE_ROOTS
    )
    switch: forward.Switch | None = None
    if settings.leader_election:
        holder: list[leader.Leadership] = []
        switch = forward.Switch(
            SERVICE,
            leader_address=lambda: holder[0].leader_address() if holder else "",
            make_channel=lambda addr: clients.channel(addr, retries=False),
        )
        server.add_generic_rpc_handlers((switch,))
        built = grpc_server.finish(server, settings.listen_addr, [SERVICE_NAME], metrics=registry)
        holder.append(
            leader.Leadership(db, address=advertised(settings, built.port), duration_s=settings.lease_duration_s)
        )
        running = Running(
            built=built,
            controller=None,
            fleet=None,
            db=db,
            audit_file=audit_file,
            leadership=holder[0],
            switch=switch,
            leading=False,
        )
        if await holder[0].try_lead():  # a free lease: lead before serving, as without election
            await _lead(running, settings, make_channel, own)
        else:
            running.lead_task = asyncio.get_running_loop().create_task(
                _lead(running, settings, make_channel, own), name="leader election"
            )
            running.lead_task.add_done_callback(_failed_to_lead(holder[0]))
        await built.start()
        return running
    ctl, fleet, api, db_writer = _controller(settings, db, make_channel, own)
    controller_service_pb2_grpc.add_ControllerServiceServicer_to_server(api, server)
    built = grpc_server.finish(server, settings.listen_addr, [SERVICE_NAME], metrics=registry)
    running = Running(built=built, controller=ctl, fleet=fleet, db=db, db_writer=db_writer, audit_file=audit_file)
    _follow_store_health(running)
    await ctl.start()
    await fleet.start()
    await built.start()
    return running


def _controller(
    settings: Settings, db: store.Store, make_channel: Any, own: controller_metrics.ControllerMetrics | None
) -> tuple[controller.Controller, probe_fleet.ProbeFleet, servicer.ControllerServicer, writer.Writer]:
    """The controller, its probe fleet, its servicer and its store writer (nothing started)."""
    controller_id = _identity(settings, db)
    channel = make_channel(settings.provisioner_addr)
    tuning = reconciler.Tuning(
        drain_s=settings.drain_s,
        probe_fast_interval_s=settings.probe_fast_interval_s,
        sweep_interval_s=settings.sweep_interval_s,
        max_replicas_per_service=settings.max_replicas_per_service,
        max_replicas_total=settings.max_replicas_total,
        max_launches_in_flight=settings.max_launches_in_flight,
        decision_interval_s=settings.autoscaler_interval_s,
        zero_decision_interval_s=settings.autoscaler_zero_interval_s,
        qps_window_s=settings.qps_window_s,
        balancer_ttl_s=settings.balancer_ttl_s,
    )
    # Every write of the controller goes through the writer thread and its own connection,
    # which checks the same lease epoch as `db` (reopen shares the fence).
    db_writer = writer.Writer(db.path, db=db.reopen())
    if own is not None:
        db_writer.db.on_write(own.store_write)  # called on the writer thread
    holder: list[controller.Controller] = []
    fleet = probe_fleet.ProbeFleet(
        settings.prober_addrs,
        on_results=lambda results: holder[0].on_probe_results(results),
        on_stale=lambda stale: holder[0].on_probe_stale(stale),
        liveness_timeout_s=settings.prober_liveness_timeout_s,
        make_channel=make_channel,
    )
    ctl = controller.Controller(
        db=db,
        db_writer=db_writer,
        provisioner=provisioner_service_pb2_grpc.ProvisionerServiceStub(channel),
        probes=fleet,
        tuning=tuning,
        controller_id=controller_id,
        hub_observers=[own.published] if own is not None else [],
        on_pass=own.pass_seconds.observe if own is not None else None,
    )
    holder.append(ctl)
    if own is not None:
        own.watch(_fleet(ctl, fleet))
        # Whose fault a failure was, as the core decided it: the launch counts' `cause`.
        ctl.hooks.on_failure.append(lambda service, rid, failure: own.failed(service, rid, failure.cause.name.lower()))
    return ctl, fleet, servicer.ControllerServicer(ctl), db_writer


def _follow_store_health(running: Running) -> None:
    """NOT_SERVING while the store refuses writes: nothing the controller decides would stick."""
    background: set[asyncio.Task[None]] = set()

    def store_health(writable: bool) -> None:
        task = asyncio.get_running_loop().create_task(running.built.set_serving(writable))
        background.add(task)
        task.add_done_callback(background.discard)

    running.db.on_writable_change(store_health)
    if running.db_writer is not None:
        running.db_writer.on_writable_change(store_health)


def _failed_to_lead(leadership: leader.Leadership) -> Any:
    """A controller that won the lease but could not start must not sit on the lease: it steps down."""

    def done(task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("the controller could not start as the leader", exc_info=task.exception())
        leadership.step_down("the controller could not start")

    return done


async def _lead(
    running: Running, settings: Settings, make_channel: Any, own: controller_metrics.ControllerMetrics | None
) -> None:
    """Wait for the lease, then start the controller here and serve the API from it."""
    assert running.leadership is not None and running.switch is not None
    await running.leadership.wait_to_lead()
    ctl, fleet, api, db_writer = _controller(settings, running.db, make_channel, own)
    running.controller, running.fleet, running.db_writer = ctl, fleet, db_writer
    _follow_store_health(running)
    await ctl.start()
    await fleet.start()
    running.switch.lead(
        forward.method_handlers(controller_service_pb2_grpc.add_ControllerServiceServicer_to_server, api)
    )
    running.leading = True
    log.info("the controller runs here now (epoch %d)", running.leadership.epoch)


async def serve(settings: Settings) -> int:
    """Run until SIGTERM (exit code 0), or until another controller takes the lease (3)."""
    running = await start(settings)
    stop = asyncio.Event()
    watcher: asyncio.Task[None] | None = None
    if running.leadership is not None:
        leadership = running.leadership

        async def step_down() -> None:
            await leadership.deposed.wait()
            await running.stop_leading()  # first: a deposed controller must stop acting at once
            stop.set()

        watcher = asyncio.get_running_loop().create_task(step_down(), name="step down")
    await grpc_server.serve_until_signal(
        running.built,
        grace=settings.shutdown_grace_s,
        port_file=settings.port_file,
        on_stop=[running.stop_leading],
        metrics_addr=settings.metrics_addr,
        metrics_port_file=settings.metrics_port_file,
        stop=stop,
    )
    if watcher is not None and not watcher.done():
        watcher.cancel()
    running.db.close()
    if running.leadership is not None and running.leadership.deposed.is_set():
        log.error("exiting with code %d: %s", DEPOSED_EXIT_CODE, running.leadership.reason)
        return DEPOSED_EXIT_CODE
    return 0


def main() -> None:
    """Load settings, set up logging and serve."""
    logs.setup("controller")
    traces = tracing.setup("controller")  # off unless OTEL_TRACES_EXPORTER=otlp
    try:
        code = asyncio.run(serve(load_settings()))
    finally:
        traces.shutdown()
    raise SystemExit(code)

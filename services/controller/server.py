"""Composition root of the controller: settings, store, clients, servicer, server lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Iterator
from typing import Any

import grpc

from replicaplane.controller.v1 import controller_service_pb2, controller_service_pb2_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc
from services.common import audit, clients, config, errors, grpc_server, logs, metrics, probe_fleet, security, tracing
from services.controller import controller, forward, identity, leader, reconciler, servicer, store, writer
from services.controller import metrics as controller_metrics

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


@dataclasses.dataclass(frozen=True)
class Settings:
    """Controller settings; env REPLICAPLANE_CONTROLLER_<FIELD> overrides each."""

    listen_addr: str = config.CONTROLLER_ADDR
    """host:port to serve on; port 0 picks a free port."""
    shutdown_grace_s: float = 3.0
    """Seconds in-flight RPCs get on SIGTERM."""
    port_file: str = ""
    """If set, the bound port is written here once serving (tests and scripts use port 0)."""
    metrics_addr: str = config.CONTROLLER_METRICS_ADDR
    """host:port of the Prometheus `/metrics` endpoint; port 0 picks a free port; empty turns metrics off."""
    metrics_port_file: str = ""
    """If set, the bound metrics port is written here once serving."""
    state_dir: str = "~/.replicaplane/controller"
    """Directory of the SQLite store (and of the controller id file, with either store)."""
    store_url: str = dataclasses.field(default="", repr=False)
    """Where the store is: empty for `state.db` in state_dir; `sqlite:PATH` for another SQLite
    file; `postgresql://user:password@host:5432/db` for PostgreSQL, which several controllers
    can share (docs/ha.md). It may hold a password: it is never logged."""
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
    store_synchronous: str = "FULL"
    """SQLite `synchronous` of the store: FULL fsyncs every commit, so an acknowledged change
    survives power loss and a failing disk; NORMAL survives process crashes only (faster)."""
    controller_id: str = ""
    """This controller's id (the owner of the replicas it launches), at most 128 printable
    characters. Empty: the id kept in the state directory (created on first start)."""
    max_replicas_per_service: int = 1000
    """The most replicas a spec may ask for (replicas, min/max_replicas): more is refused."""
    max_replicas_total: int = 5000
    """The most replicas every service together may run. Each service holds the most its spec
    can run (replicas, or max_replicas plus overprovision and on-demand fallback); a create or
    update that would go over is refused with RESOURCE_EXHAUSTED."""
    max_launches_in_flight: int = 128
    """Launch streams to the provisioner followed at once, over every service; more launches
    wait their turn, so a large scale-up never floods the controller or the provisioner."""
    autoscaler_interval_s: float = 20.0
    """Autoscaler decisions are made at least this often (SkyPilot: 20 s); a load report, an
    update and an elapsed up/downscale delay also decide at once."""
    autoscaler_zero_interval_s: float = 5.0
    """Decision cadence while the target is 0 (SkyPilot: 5 s)."""
    qps_window_s: float = 60.0
    """Load reports count toward QPS over this window (SkyPilot: 60 s)."""
    prober_liveness_timeout_s: float = probe_fleet.DEFAULT_LIVENESS_TIMEOUT_S
    """A prober stream silent this long counts as lost; with every prober lost, probing is
    reported stale (and nothing is torn down for want of probes)."""
    auth_token: str = dataclasses.field(default="", repr=False)
    """If set, the public API requires `authorization: Bearer <token>` (health and reflection
    stay open). Prefer the environment variable or auth_token_file to a config file."""
    auth_token_file: str = ""
    """File of accepted tokens, one a line as TOKEN or NAME:TOKEN; the name goes to the audit log."""
    audit_log_file: str = ""
    """If set, audit records of API mutations are appended here as JSON lines (they are always
    logged on the replicaplane.audit logger too)."""
    tls_cert_file: str = ""
    """The controller's certificate (PEM), shown to the provisioner and probers when mTLS is on."""
    tls_key_file: str = ""
    """Private key of tls_cert_file (PEM)."""
    tls_ca_file: str = ""
    """CA (PEM) that signed the provisioner's and probers' certificates. Setting the three
    tls_* files turns mTLS on toward the provisioner and probers."""
    tls_server_name: str = ""
    """Name the provisioner's and probers' certificates must carry, when not their address host."""
    leader_election: bool = False
    """Run as one of several controllers sharing one store (store_url, PostgreSQL): one leads,
    holding a lease in the store that it renews every lease_duration_s / 3; the others stand
    by, forward every API call to it, and the first to see its lease lapse takes over. Every
    write of the leader checks its lease epoch, so a deposed leader changes nothing; it exits
    with code 3 (docs/ha.md)."""
    lease_duration_s: float = 3.0
    """How long the leader's lease lasts unless renewed: a dead leader is replaced within about
    this long plus a third of it."""
    advertise_addr: str = ""
    """host:port where the other controllers (forwarding to the leader) reach this one. Default:
    the listen address with the bound port (this host's name for a wildcard host)."""
    allow_open_internal: bool = False
    """With a token on the API, the controller refuses to start while it would reach the
    provisioner or probers over plaintext TCP (any local user could call them and run commands
    as their user): use unix: sockets or mTLS. Set this only where no one else can reach their
    ports."""


def load_settings(**overrides: Any) -> Settings:
    """Settings from defaults, the config file and the environment."""
    return config.load(Settings, "controller", **overrides)


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


def check(settings: Settings) -> None:
    """Refuse settings the controller cannot start with.

    Raises:
        errors.ValidationError: each bad setting, named.
    """
    violations = [
        errors.FieldViolation(f"controller.{name}", f"must be at least 1, got {getattr(settings, name)}")
        for name in ("max_replicas_per_service", "max_replicas_total", "max_launches_in_flight")
        if getattr(settings, name) < 1
    ]
    if problem := store.url_problem(settings.store_url):
        violations.append(errors.FieldViolation("controller.store_url", problem))
    if settings.lease_duration_s < 0.3:
        violations.append(
            errors.FieldViolation(
                "controller.lease_duration_s", f"must be at least 0.3, got {settings.lease_duration_s}"
            )
        )
    if settings.advertise_addr and not _host_port(settings.advertise_addr):
        violations.append(errors.FieldViolation("controller.advertise_addr", "must be host:port"))
    if settings.store_synchronous.upper() not in ("FULL", "NORMAL"):
        violations.append(errors.FieldViolation("controller.store_synchronous", "must be FULL or NORMAL"))
    if settings.controller_id and (problem := identity.problem(settings.controller_id)):
        violations.append(errors.FieldViolation("controller.controller_id", problem))
    violations += _open_internal(settings)
    errors.require(violations, subject="controller settings")


def _open_internal(settings: Settings) -> list[errors.FieldViolation]:
    """With auth on the API, the provisioner and probers must not be open: a token on the API
    protects nothing while Launch is one plaintext TCP call away for every local user."""
    guarded = bool(settings.auth_token or settings.auth_token_file)
    tls = bool(settings.tls_cert_file or settings.tls_key_file or settings.tls_ca_file)
    if not guarded or tls or settings.allow_open_internal:
        return []
    why = (
        "is plaintext TCP while the API requires a token: every local user could call it; use unix:PATH "
        "sockets in a private directory or mTLS (tls_* settings), or set allow_open_internal"
    )
    violations = []
    if not settings.provisioner_addr.startswith("unix:"):
        violations.append(errors.FieldViolation("controller.provisioner_addr", why))
    probers = [a.strip() for a in settings.prober_addrs.split(",") if a.strip()]
    if any(not a.startswith("unix:") for a in probers):
        violations.append(errors.FieldViolation("controller.prober_addrs", why))
    return violations


def _host_port(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    return bool(host) and port.isdigit()


def advertised(settings: Settings, port: int) -> str:
    """Where the other controllers reach this one."""
    if settings.advertise_addr:
        return settings.advertise_addr
    if settings.listen_addr.startswith("unix:"):
        return settings.listen_addr
    host = settings.listen_addr.rpartition(":")[0]
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = socket.gethostname()
    return f"{host}:{port}"


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

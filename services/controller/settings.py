"""The controller's settings: defaults, the config file and the environment, checked once."""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

from services.common import config, errors, probe_fleet
from services.controller import identity, store


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
    balancer_ttl_s: float = 15.0
    """A load balancer's URL is shown on its service until it has not reported for this long (our
    balancers report at least every 5 s), so a dead balancer's URL goes away."""
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
    if not settings.balancer_ttl_s > 0:
        violations.append(
            errors.FieldViolation("controller.balancer_ttl_s", f"must be > 0, got {settings.balancer_ttl_s}")
        )
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

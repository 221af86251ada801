"""The load balancer's settings: defaults, the config file and the environment, checked once at
start; and what follows from them (the advertised URL, a fleet's ports, the proxy's part)."""

from __future__ import annotations

import dataclasses
from typing import Any

from services.common import clients, config, errors, security
from services.loadbalancer import connections, policies, proxy
from services.loadbalancer import fleet as fleets


@dataclasses.dataclass(frozen=True)
class Settings:
    """Load balancer settings; env REPLICAPLANE_LOADBALANCER_<FIELD> overrides each."""

    service_name: str = ""
    """The service this balancer serves (required unless `fleet`): one balancer, one URL."""
    fleet: bool = False
    """Serve every service of the controller (pools excepted), each on its own HTTP port counting
    up from `http_addr`'s, started and stopped with the service: one URL per service with no
    process to run per service."""
    fleet_port_max: int = 0
    """A fleet's last HTTP port; 0 is `http_addr`'s port + 999. A service finding none free gets
    no URL (logged)."""
    fleet_ports_file: str = ""
    """Where a fleet keeps each service's port, so a restarted fleet gives every service its port
    again (empty: it keeps the ports while it runs, and takes the port of the URL the controller
    still shows after a restart)."""
    fleet_poll_s: float = 1.0
    """How often a fleet lists the controller's services to start and stop their balancers."""
    advertise_host: str = ""
    """The host in the URLs a fleet reports (`scheme://host:port`); empty derives it from
    `http_addr` (a wildcard host becomes 127.0.0.1)."""
    http_addr: str = config.LOADBALANCER_HTTP_ADDR
    """host:port of the proxied HTTP (or HTTPS) traffic (a fleet's first port); port 0 picks a
    free port (for each service, in a fleet)."""
    listen_addr: str = config.LOADBALANCER_ADDR
    """host:port of the admin gRPC API and health checks; port 0 picks a free port."""
    port_file: str = ""
    """If set, the bound admin port is written here once serving (tests and scripts use port 0)."""
    metrics_addr: str = config.LOADBALANCER_METRICS_ADDR
    """host:port of the Prometheus `/metrics` endpoint (never the proxied port, whose paths belong
    to the service); port 0 picks a free port; empty turns metrics off."""
    metrics_port_file: str = ""
    """If set, the bound metrics port is written here once serving."""
    http_port_file: str = ""
    """If set, the bound HTTP port is written here once serving."""
    shutdown_grace_s: float = 3.0
    """Seconds in-flight RPCs and proxied requests get on SIGTERM."""
    controller_addr: str = config.CONTROLLER_ADDR
    """Where the controller listens; several `host:port,host:port` where controllers share a
    store (the balancer follows whichever answers; a standby forwards to the leader)."""
    api_token: str = dataclasses.field(default="", repr=False)
    """Bearer token for the controller's API, when it requires one. Empty falls back to
    api_token_file, then to $REPLICAPLANE_API_TOKEN(_FILE) and the controller's own token settings
    in the environment (as every client of the stack does). With a token, the admin API
    requires the same one (health and reflection stay open)."""
    api_token_file: str = ""
    """File whose first token (TOKEN or NAME:TOKEN) is sent to the controller."""
    advertise_url: str = ""
    """The URL clients use, reported to the controller and shown as the service's endpoint;
    empty derives it from `http_addr` (a wildcard host becomes 127.0.0.1)."""
    policy: str = ""
    """round_robin, least_load or instance_aware_least_load; empty takes the spec's (default least_load)."""
    report_interval_s: float = 1.0
    """How often received requests are reported to the controller (a held request at once)."""
    report_heartbeat_s: float = 5.0
    """An empty report goes at least this often, so the service keeps showing this balancer's URL
    (the controller drops it after its `balancer_ttl_s`, 15 s, without a report)."""
    hold_timeout_s: float = 60.0
    """How long a request to a service that scales from zero (`min_replicas: 0`) waits for a first
    ready replica; 0 answers 503 at once."""
    hold_max_requests: int = 1000
    """Requests held at most; more get 503 at once."""
    startup_wait_s: float = 5.0
    """Until the first endpoint set arrives from the controller, a request that finds no replica
    waits up to this long for it instead of getting 503 at once."""
    connect_timeout_s: float = 5.0
    """Timeout of a connection to a replica."""
    stream_timeout_s: float = 0.0
    """Longest a response may take, headers to last byte; 0 takes the spec's
    `service.load_balancer.stream_timeout_seconds` (default 120 s)."""
    attempts: int = 3
    """Tries per request; a try that cannot reach a replica moves to another one."""
    retry_backoff_initial_s: float = 0.05
    """Pause before the second try; doubled for each further one."""
    retry_backoff_max_s: float = 1.0
    """Longest pause between tries."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request body accepted (413 beyond)."""
    retry_buffer_bytes: int = 1024 * 1024
    """A request body up to this size is read whole before it is sent, so a failed attempt can send
    it again; a larger one streams to the replica as it arrives and is retried only if no byte of it
    went out. 0 streams every body."""
    max_buffered_bytes: int = 64 * 1024 * 1024
    """Most bytes of request bodies held for retries at once, across all requests; a body that does
    not fit streams instead."""
    header_timeout_s: float = 10.0
    """Longest a client may take to send a request head (line and headers), counted from the
    connection's start or the first byte of a later request; then 408 and the connection closes."""
    body_timeout_s: float = 30.0
    """Longest pause while a request body is read; then 408 and the connection closes."""
    idle_timeout_s: float = 60.0
    """How long a keep-alive connection may wait between requests before it is closed."""
    max_connections: int = 4096
    """Client connections open at once; more get 503 and are closed. Lowered (with a warning) if the
    open-file limit cannot hold two descriptors per connection."""
    tls_certfile: str = ""
    """PEM certificate (chain): set it (and `tls_keyfile`) to serve HTTPS."""
    tls_keyfile: str = ""
    """PEM private key of `tls_certfile`."""


def load_settings(**overrides: Any) -> Settings:
    """Settings from defaults, the config file and the environment.

    Raises:
        errors.ValidationError: a bad value, each naming its setting.
    """
    settings = config.load(Settings, "loadbalancer", **overrides)
    violations = []
    if not settings.service_name and not settings.fleet:
        violations.append(
            errors.FieldViolation("loadbalancer.service_name", "required: the service to balance (or set fleet)")
        )
    if settings.service_name and settings.fleet:
        violations.append(
            errors.FieldViolation("loadbalancer.service_name", "must be empty with fleet: it serves every service")
        )
    if settings.fleet and settings.advertise_url:
        violations.append(
            errors.FieldViolation("loadbalancer.advertise_url", "must be empty with fleet (set advertise_host)")
        )
    first = _port_of(settings.http_addr)
    if settings.fleet and first is not None and settings.fleet_port_max:
        if first == 0:
            # The first port is picked at start, so a fixed last port may lie below it.
            violations.append(
                errors.FieldViolation("loadbalancer.fleet_port_max", "must be 0 when http_addr's port is 0")
            )
        elif settings.fleet_port_max < first:
            violations.append(
                errors.FieldViolation(
                    "loadbalancer.fleet_port_max", f"must be at least http_addr's port ({first}) or 0"
                )
            )
    if settings.fleet_port_max < 0 or settings.fleet_port_max > 65535:
        violations.append(errors.FieldViolation("loadbalancer.fleet_port_max", "must be 0..65535"))
    if not settings.fleet_poll_s > 0:
        violations.append(errors.FieldViolation("loadbalancer.fleet_poll_s", "must be > 0"))
    if settings.policy and settings.policy not in policies.NAMES:
        violations.append(
            errors.FieldViolation("loadbalancer.policy", f"must be one of {', '.join(policies.NAMES)} or empty")
        )
    if settings.attempts < 1:
        violations.append(errors.FieldViolation("loadbalancer.attempts", "must be >= 1"))
    for name in ("max_body_bytes", "max_connections"):
        if getattr(settings, name) < 1:
            violations.append(errors.FieldViolation(f"loadbalancer.{name}", "must be >= 1"))
    for name in ("retry_buffer_bytes", "max_buffered_bytes"):
        if getattr(settings, name) < 0:
            violations.append(errors.FieldViolation(f"loadbalancer.{name}", "must be >= 0"))
    for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
        if not getattr(settings, name) > 0:
            violations.append(errors.FieldViolation(f"loadbalancer.{name}", "must be > 0"))
    if settings.tls_keyfile and not settings.tls_certfile:
        violations.append(errors.FieldViolation("loadbalancer.tls_certfile", "required with tls_keyfile"))
    try:
        clients.controller_target(settings.controller_addr)
    except ValueError as exc:
        violations.append(errors.FieldViolation("loadbalancer.controller_addr", str(exc)))
    errors.require(violations, subject="loadbalancer settings")
    return settings


def api_token(settings: Settings) -> str:
    """The token sent to the controller ("" for none); never logged."""
    if settings.api_token:
        return settings.api_token.strip()
    if settings.api_token_file:
        return security.client_token({security.CLIENT_TOKEN_FILE_ENV: settings.api_token_file})
    return security.client_token()


def split_addr(addr: str) -> tuple[str, int]:
    """(host, port) of host:port ([v6]:port too)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def _port_of(addr: str) -> int | None:
    try:
        return split_addr(addr)[1]
    except ValueError:
        return None


def advertised_host(settings: Settings) -> str:
    """The host in the URLs reported to the controller."""
    if settings.advertise_host:
        return settings.advertise_host
    host, _ = split_addr(settings.http_addr)
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def advertised_url(settings: Settings, port: int) -> str:
    """The URL reported to the controller for the service served on `port`."""
    if settings.advertise_url:
        return settings.advertise_url
    host = advertised_host(settings)
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if settings.tls_certfile else "http"
    return f"{scheme}://{host}:{port}"


def fleet_ports(settings: Settings, first: int) -> fleets.Ports:
    """A fleet's ports from `first` (the bound first port) up. With http_addr's port 0 the range
    follows the port picked at start (`fleet_port_max` is then 0), and a port kept in
    `fleet_ports_file` from an earlier run stays its service's wherever it lies."""
    picked = split_addr(settings.http_addr)[1] == 0
    last = min(first + 999, 65535) if picked or not settings.fleet_port_max else settings.fleet_port_max
    return fleets.Ports(first, last, settings.fleet_ports_file, keep_any=picked)


def proxy_settings(settings: Settings) -> proxy.ProxySettings:
    """The proxy's part of the settings."""
    return proxy.ProxySettings(
        connect_timeout_s=settings.connect_timeout_s,
        stream_timeout_s=settings.stream_timeout_s,
        attempts=settings.attempts,
        backoff_initial_s=settings.retry_backoff_initial_s,
        backoff_max_s=settings.retry_backoff_max_s,
        max_body_bytes=settings.max_body_bytes,
        retry_buffer_bytes=settings.retry_buffer_bytes,
        max_buffered_bytes=settings.max_buffered_bytes,
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        idle_timeout_s=settings.idle_timeout_s,
        max_connections=connections.connection_cap(settings.max_connections),
    )

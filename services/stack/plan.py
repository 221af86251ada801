"""What the local stack runs, as data: one ProcessSpec per service process.

The stack is safe on a shared host by default: the internal services (provisioner, probers, the
balancer's admin API) listen on Unix sockets in the private state dir, so only the stack's user
can call them, and the controller's public API requires a token the stack generates there
(unless the user set controller tokens of their own). The metrics endpoints stay on loopback TCP,
where Prometheus can scrape them: read-only, no secrets (docs/security.md).

docker-compose.yml runs the same modules with the same environment variables (apart from host
names, sockets and the stack's token and port files); tests/unit/test_compose.py holds the two
together.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping

from replicaplane.controller.v1 import controller_service_pb2
from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2
from replicaplane.prober.v1 import prober_service_pb2
from replicaplane.provisioner.v1 import provisioner_service_pb2
from services.common import config

CONTROLLER_SERVICE = controller_service_pb2.DESCRIPTOR.services_by_name["ControllerService"].full_name
PROVISIONER_SERVICE = provisioner_service_pb2.DESCRIPTOR.services_by_name["ProvisionerService"].full_name
PROBER_SERVICE = prober_service_pb2.DESCRIPTOR.services_by_name["ProberService"].full_name
LOADBALANCER_SERVICE = loadbalancer_service_pb2.DESCRIPTOR.services_by_name["LoadBalancerService"].full_name


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """One service process of the stack.

    Attributes:
        name: unique process name: controller, provisioner, prober-1, prober-2, ..., loadbalancer,
            dashboard.
        component: the service package: controller, provisioner, prober, loadbalancer or dashboard.
        argv: the command line.
        env: the REPLICAPLANE_* variables the process gets on top of the caller's environment.
        addr: host:port it listens on; port 0 lets the process pick one and report it.
        grpc_service: full name of its gRPC service, for the health check ("" checks the whole
            server: the dashboard has no gRPC API of its own).
        url: the HTTP URL it serves users on, if any (the load balancer, the dashboard); port 0 as
            in `addr`.
        needs: env variable -> the processes whose addresses (comma-separated) it holds. `env`
            has them for the planned ports; `resolve` puts in the ports actually bound.
        metrics_addr: host:port of its Prometheus `/metrics` endpoint ("" when metrics are off);
            port 0 as in `addr`.
    """

    name: str
    component: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    addr: str
    grpc_service: str
    url: str = ""
    needs: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    metrics_addr: str = ""

    @property
    def metrics_url(self) -> str:
        """The URL of its metrics ("" when off); port 0 until the process reports its port."""
        return f"http://{dial_addr(self.metrics_addr)}/metrics" if self.metrics_addr else ""


SOCKET_DIR = "sockets"
"""Where the internal services' Unix sockets live, inside the state dir."""
TOKEN_FILE = "api-token"
"""The token the stack generates for the controller's API, inside the state dir (0600)."""

# Longest path a Unix socket may have (108 bytes with the terminating NUL on Linux).
_MAX_SOCKET_PATH = 107


def split_addr(addr: str) -> tuple[str, int]:
    """Split `host:port` (IPv6 hosts in brackets).

    Raises:
        ValueError: no port, or the port is not a number.
    """
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {addr!r}")
    return host, int(port)


def is_unix(addr: str) -> bool:
    """True for a Unix socket address (`unix:PATH`)."""
    return addr.startswith("unix:")


def dial_addr(listen_addr: str) -> str:
    """The address a local client dials for a server listening on `listen_addr`."""
    if is_unix(listen_addr):
        return listen_addr
    host, port = split_addr(listen_addr)
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


def _listen(environ: Mapping[str, str], section: str, default: str, field: str = "listen_addr") -> str:
    var = config.env_name(section, field)
    addr = environ.get(var) or default
    if is_unix(addr):
        return addr
    try:
        split_addr(addr)
    except ValueError as exc:
        raise ValueError(f"{var}: {exc}") from None
    return addr


def _socket(state_dir: str, name: str) -> str:
    path = os.path.join(state_dir, SOCKET_DIR, f"{name}.sock")
    if len(path.encode()) > _MAX_SOCKET_PATH:
        raise ValueError(f"the state dir {state_dir} is too long a path for Unix sockets; choose a shorter one")
    return f"unix:{path}"


def _internal(environ: Mapping[str, str], section: str, socket: str) -> str:
    """The listen address of an internal service: its socket, or a TCP address the user set
    for it, which the stack accepts only with mTLS on (anyone on the host could call it else)."""
    var = config.env_name(section, "listen_addr")
    addr = environ.get(var)
    if not addr:
        return socket
    if is_unix(addr):
        return addr
    if not environ.get(config.env_name(section, "tls_cert_file")):
        raise ValueError(
            f"{var}: {addr} would let every user of this machine call the {section} (it runs commands); "
            f"leave it unset (the stack uses a Unix socket in its state dir), give unix:PATH, or set "
            f"REPLICAPLANE_{section.upper()}_TLS_* (docs/security.md)"
        )
    return _listen(environ, section, addr)


def token_file(state_dir: str, environ: Mapping[str, str]) -> str:
    """The token file the stack generates for the controller's API, or "" when the user set
    controller tokens (REPLICAPLANE_CONTROLLER_AUTH_TOKEN or ..._FILE) of their own."""
    if environ.get("REPLICAPLANE_CONTROLLER_AUTH_TOKEN") or environ.get("REPLICAPLANE_CONTROLLER_AUTH_TOKEN_FILE"):
        return ""
    return os.path.join(state_dir, TOKEN_FILE)


def _public(environ: Mapping[str, str], section: str, default: str) -> str:
    """The HTTP address a user reaches a service on: TCP host:port."""
    addr = _listen(environ, section, default, "http_addr")
    if is_unix(addr):
        raise ValueError(f"{config.env_name(section, 'http_addr')}: the stack serves it on TCP (host:port)")
    return addr


def _metrics(environ: Mapping[str, str], section: str, listen: str, default: str, *, picked: bool) -> str:
    """The metrics address of a process: the environment's (empty turns metrics off), else port 0
    on the listen host when the process picks its gRPC port too (for a Unix socket: on loopback
    when the stack picks its ports, `picked`), else `default`. Prometheus scrapes TCP only, so
    metrics stay on loopback TCP even for a process on a socket."""
    var = config.env_name(section, "metrics_addr")
    if var in environ:
        addr = environ[var].strip()
        if addr:
            try:
                split_addr(addr)
            except ValueError as exc:
                raise ValueError(f"{var}: {exc}") from None
        return addr
    if is_unix(listen):
        return "127.0.0.1:0" if picked else default
    host, port = split_addr(listen)
    return f"{host}:0" if port == 0 else default


def resolve(spec: ProcessSpec, bound: Mapping[str, str]) -> dict[str, str]:
    """`spec.env` with the addresses it needs taken from `bound` (process name -> host:port
    it listens on, with the port it got, or unix:PATH)."""
    env = dict(spec.env)
    for var, names in spec.needs.items():
        env[var] = ",".join(dial_addr(bound[n]) for n in names)
    return env


def plan(
    *,
    probers: int = 1,
    state_dir: str = ".state",
    environ: Mapping[str, str] | None = None,
) -> list[ProcessSpec]:
    """The processes of a local stack, in start order (provisioner, probers, controller, load balancer,
    dashboard).

    The controller, the balancer's HTTP and the dashboard's page listen on
    REPLICAPLANE_<SERVICE>_LISTEN_ADDR (or ..._HTTP_ADDR) in `environ`, else the shared defaults.
    The provisioner, the probers, the balancer's admin API and the dashboard's health check
    listen on Unix sockets under `state_dir`/sockets unless `environ` sets theirs (TCP only with
    mTLS for the provisioner and probers); TCP probers take the prober port and the ports after
    it, skipping the other services' ports. Port 0 (tests, several stacks on one machine) lets
    each process pick a free port; the runner reads the ports they got before starting the
    processes that dial them.

    Args:
        probers: number of prober processes, at least 1.
        state_dir: directory for the controller's and provisioner's state.
        environ: environment to read addresses from; defaults to os.environ.

    Returns:
        One ProcessSpec per process.

    Raises:
        ValueError: probers < 1, an address that is not host:port (or unix:PATH where allowed),
            an internal service on TCP without mTLS, or a state dir too long for Unix sockets.
    """
    if probers < 1:
        raise ValueError(f"probers must be at least 1, got {probers}")
    env = os.environ if environ is None else environ
    python = sys.executable
    provisioner_addr = _internal(env, "provisioner", _socket(state_dir, "provisioner"))
    controller_addr = _listen(env, "controller", config.CONTROLLER_ADDR)
    if is_unix(controller_addr):
        raise ValueError("REPLICAPLANE_CONTROLLER_LISTEN_ADDR: the stack's controller listens on TCP (host:port)")
    # The admin API has no mTLS, but the stack always gives the balancer a token it requires.
    balancer_addr = _listen(env, "loadbalancer", _socket(state_dir, "loadbalancer"))
    http_addr = _public(env, "loadbalancer", config.LOADBALANCER_HTTP_ADDR)
    # The dashboard's gRPC server answers health checks only: nothing to guard, but no reason
    # to take a TCP port either.
    dashboard_addr = _listen(env, "dashboard", _socket(state_dir, "dashboard"))
    dashboard_http = _public(env, "dashboard", config.DASHBOARD_HTTP_ADDR)
    prober_listen = _internal(env, "prober", "")
    prober_addrs: list[str] = []
    if not prober_listen:
        prober_addrs = [_socket(state_dir, f"prober-{i}") for i in range(1, probers + 1)]
    elif is_unix(prober_listen):
        base = prober_listen.removesuffix(".sock")
        prober_addrs = [prober_listen] + [f"{base}-{i}.sock" for i in range(2, probers + 1)]
    else:
        # TCP probers count up from the prober port, stepping over the other services' ports;
        # with port 0 each picks.
        others = (provisioner_addr, controller_addr, balancer_addr, http_addr, dashboard_addr, dashboard_http)
        taken = {split_addr(a)[1] for a in others if not is_unix(a)}
        prober_host, port = split_addr(prober_listen)
        prober_addrs = [f"{prober_host}:0"] * probers if port == 0 else []
        while len(prober_addrs) < probers:
            if port not in taken:
                prober_addrs.append(f"{prober_host}:{port}")
            port += 1
    token = token_file(state_dir, env)
    controller_auth = {"REPLICAPLANE_CONTROLLER_AUTH_TOKEN_FILE": token} if token else {}
    balancer_auth = {"REPLICAPLANE_LOADBALANCER_API_TOKEN_FILE": token} if token else {}
    # A stack on picked ports (tests, stacks side by side) picks its metrics ports too.
    picked = split_addr(controller_addr)[1] == 0
    metrics = {
        "provisioner": _metrics(env, "provisioner", provisioner_addr, config.PROVISIONER_METRICS_ADDR, picked=picked),
        "controller": _metrics(env, "controller", controller_addr, config.CONTROLLER_METRICS_ADDR, picked=picked),
        "loadbalancer": _metrics(env, "loadbalancer", balancer_addr, config.LOADBALANCER_METRICS_ADDR, picked=picked),
        "dashboard": _metrics(env, "dashboard", dashboard_addr, config.DASHBOARD_METRICS_ADDR, picked=picked),
    }
    # Probers' metrics count up the same way, stepping over the other services' metrics ports.
    first = _metrics(env, "prober", prober_addrs[0], config.PROBER_METRICS_ADDR, picked=picked)
    prober_metrics = [first] * probers
    if first and split_addr(first)[1] != 0:
        metrics_host, metrics_port = split_addr(first)
        taken_metrics = {split_addr(a)[1] for a in metrics.values() if a}
        prober_metrics = []
        while len(prober_metrics) < probers:
            if metrics_port not in taken_metrics:
                prober_metrics.append(f"{metrics_host}:{metrics_port}")
            metrics_port += 1

    def metrics_env(section: str, addr: str) -> dict[str, str]:
        return {config.env_name(section, "metrics_addr"): addr}

    specs = [
        ProcessSpec(
            name="provisioner",
            component="provisioner",
            argv=(python, "-m", "services.provisioner"),
            env={
                "REPLICAPLANE_PROVISIONER_LISTEN_ADDR": provisioner_addr,
                "REPLICAPLANE_PROVISIONER_STATE_DIR": os.path.join(state_dir, "provisioner"),
                "REPLICAPLANE_PROVISIONER_REPLICA_HOST": "127.0.0.1",
                "REPLICAPLANE_PROVISIONER_ADVERTISE_HOST": "127.0.0.1",
                **metrics_env("provisioner", metrics["provisioner"]),
            },
            addr=provisioner_addr,
            grpc_service=PROVISIONER_SERVICE,
            metrics_addr=metrics["provisioner"],
        )
    ]
    for i, (addr, metrics_addr) in enumerate(zip(prober_addrs, prober_metrics, strict=True), start=1):
        specs.append(
            ProcessSpec(
                name=f"prober-{i}",
                component="prober",
                argv=(python, "-m", "services.prober"),
                env={"REPLICAPLANE_PROBER_LISTEN_ADDR": addr, **metrics_env("prober", metrics_addr)},
                addr=addr,
                grpc_service=PROBER_SERVICE,
                metrics_addr=metrics_addr,
            )
        )
    specs.append(
        ProcessSpec(
            name="controller",
            component="controller",
            argv=(python, "-m", "services.controller"),
            env={
                "REPLICAPLANE_CONTROLLER_LISTEN_ADDR": controller_addr,
                "REPLICAPLANE_CONTROLLER_STATE_DIR": os.path.join(state_dir, "controller"),
                "REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR": dial_addr(provisioner_addr),
                "REPLICAPLANE_CONTROLLER_PROBER_ADDRS": ",".join(dial_addr(a) for a in prober_addrs),
                **controller_auth,
                **metrics_env("controller", metrics["controller"]),
            },
            addr=controller_addr,
            grpc_service=CONTROLLER_SERVICE,
            metrics_addr=metrics["controller"],
            needs={
                "REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR": ("provisioner",),
                "REPLICAPLANE_CONTROLLER_PROBER_ADDRS": tuple(f"prober-{i}" for i in range(1, probers + 1)),
            },
        )
    )
    specs.append(
        ProcessSpec(
            name="loadbalancer",
            component="loadbalancer",
            argv=(python, "-m", "services.loadbalancer"),
            env={
                "REPLICAPLANE_LOADBALANCER_LISTEN_ADDR": balancer_addr,
                "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": http_addr,
                # One fleet serves every service, each on its own port from the HTTP port up.
                "REPLICAPLANE_LOADBALANCER_FLEET": "true",
                "REPLICAPLANE_LOADBALANCER_FLEET_PORTS_FILE": os.path.join(state_dir, "loadbalancer", "ports.json"),
                "REPLICAPLANE_LOADBALANCER_CONTROLLER_ADDR": dial_addr(controller_addr),
                **balancer_auth,
                **metrics_env("loadbalancer", metrics["loadbalancer"]),
            },
            addr=balancer_addr,
            grpc_service=LOADBALANCER_SERVICE,
            url=f"http://{dial_addr(http_addr)}",
            metrics_addr=metrics["loadbalancer"],
            needs={"REPLICAPLANE_LOADBALANCER_CONTROLLER_ADDR": ("controller",)},
        )
    )
    # The web dashboard: no token of its own, it passes on each page's (docs/observability.md).
    specs.append(
        ProcessSpec(
            name="dashboard",
            component="dashboard",
            argv=(python, "-m", "services.dashboard"),
            env={
                "REPLICAPLANE_DASHBOARD_LISTEN_ADDR": dashboard_addr,
                "REPLICAPLANE_DASHBOARD_HTTP_ADDR": dashboard_http,
                "REPLICAPLANE_DASHBOARD_CONTROLLER_ADDR": dial_addr(controller_addr),
                **metrics_env("dashboard", metrics["dashboard"]),
            },
            addr=dashboard_addr,
            grpc_service="",
            url=f"http://{dial_addr(dashboard_http)}",
            metrics_addr=metrics["dashboard"],
            needs={"REPLICAPLANE_DASHBOARD_CONTROLLER_ADDR": ("controller",)},
        )
    )
    return specs

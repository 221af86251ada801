"""The local stack as a user meets it: Ctrl-C through a pipe, a killed stack, ports already
taken, bad settings, a balancer that cannot bind, and a terminal that follows every service.

Every stack here runs from a private state dir with its public ports on port 0, except where a
test takes a port on purpose.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import controller_service_pb2_grpc
from tests.e2e import test_stack as base

pytestmark = pytest.mark.e2e

REPO = base.REPO
EXAMPLE = base.EXAMPLE
APP = os.path.join(REPO, "examples", "hello", "app.py")
COMPONENTS = ("CONTROLLER", "PROVISIONER", "PROBER", "LOADBALANCER", "DASHBOARD")


def up_command(state_dir: Path, *extra: str) -> str:
    """The shell words of `make up` without make: the stack in the foreground."""
    argv = [sys.executable, "-m", "services.stack", "up", "--state-dir", str(state_dir), *extra]
    return " ".join(shlex.quote(a) for a in argv)


def wait_for(predicate, timeout: float, what: str, details=lambda: "") -> None:
    """Poll `predicate` every 50 ms for at most `timeout` s; fail naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    if not predicate():
        pytest.fail(f"{what} after {timeout:.0f} s\n{details()}")


def read_state(state_dir: Path) -> dict:
    with contextlib.suppress(FileNotFoundError, ValueError):
        return json.loads((state_dir / "stack.json").read_text())
    return {}


def stack_pids(state: dict) -> dict[str, int]:
    """Every process of a stack: the stack itself and its services."""
    return {"stack": state["pid"], **{p["name"]: p["pid"] for p in state["processes"]}}


def is_stack_process(pid: int) -> bool:
    """True for a live process of a stack (guards against a reused pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"services." in fh.read() and base.alive(pid)
    except FileNotFoundError:
        return False


def left_running(pids: dict[str, int]) -> list[str]:
    return [f"{name} (pid {pid})" for name, pid in pids.items() if base.alive(pid)]


@pytest.fixture
def state_dir(tmp_path) -> Iterator[Path]:
    """A state dir whose stack is stopped at the end whatever the test did: `down`, then SIGKILL
    for any process the stack recorded that is still there (all started by this test)."""
    state = tmp_path / "state"
    yield state
    recorded = read_state(state)
    if recorded or (state / "stack.pid").exists():
        base.stack("down", "--state-dir", str(state), env=dict(os.environ), timeout=200)
    for pid in stack_pids(recorded).values() if recorded.get("processes") else []:
        if is_stack_process(pid):
            os.kill(pid, signal.SIGKILL)


def start_piped(state_dir: Path, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`up ... 2>&1 | tee OUT` in a shell of its own process group, as a terminal runs it."""
    return subprocess.Popen(
        ["sh", "-c", f"{up_command(state_dir, *extra)} 2>&1 | tee {shlex.quote(str(out))} >/dev/null"],
        cwd=REPO,
        env=base.stack_env(),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def test_ctrl_c_stops_the_whole_stack_when_its_output_goes_through_tee(state_dir, tmp_path) -> None:
    out = tmp_path / "up.txt"
    shell = start_piped(state_dir, out, "--example", EXAMPLE)
    try:
        wait_for(
            lambda: "hello: replica 2 READY" in text(out) and "hello: replica 1 READY" in text(out),
            180,
            "hello not READY",
            lambda: f"{text(out)}\n{base.logs(state_dir)}",
        )
        pids = stack_pids(read_state(state_dir))
        # Ctrl-C: the terminal sends SIGINT to the whole foreground group, tee included, so the
        # stack's next line meets a pipe nobody reads.
        os.killpg(shell.pid, signal.SIGINT)
        shell.wait(timeout=200)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
    wait_for(lambda: not left_running(pids), 60, "stack processes still running", lambda: str(left_running(pids)))
    assert base.processes_touching(str(tmp_path), []) == []  # no replica either
    # The lines after Ctrl-C had no reader once tee died; they are kept in the stack's log. A tee
    # the kernel had not yet scheduled when the cleanup began may still have copied the first
    # ones, so the user finds each line in one of the two files, never in neither.
    tail = text(state_dir / "stack.log")
    seen = text(out) + tail
    assert "services left: none (1 deleted)" in seen and "stack stopped" in seen, f"{text(out)}\n---\n{tail}"
    assert not (state_dir / "stack.json").exists()


def _controlling_terminal() -> None:
    """In the child: make stdin (the pty) the controlling terminal of its new session."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_closing_the_terminal_stops_the_whole_stack(state_dir, tmp_path) -> None:
    main, child = os.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.stack", "up", "--state-dir", str(state_dir), "--example", EXAMPLE],
            cwd=REPO,
            env=base.stack_env(),
            stdin=child,
            stdout=child,
            stderr=child,
            start_new_session=True,
            preexec_fn=_controlling_terminal,
        )
    finally:
        os.close(child)
    seen = bytearray()

    def read_terminal() -> bool:
        while select.select([main], [], [], 0)[0]:
            try:
                seen.extend(os.read(main, 65536))
            except OSError:
                return False
        return b"hello: replica 1 READY" in seen and b"hello: replica 2 READY" in seen

    try:
        wait_for(read_terminal, 180, "hello not READY", lambda: f"{seen.decode(errors='replace')}")
        pids = stack_pids(read_state(state_dir))
        os.close(main)  # the terminal window closes: SIGHUP, and every later write fails
        main = -1
        proc.wait(timeout=200)
    finally:
        if main >= 0:
            os.close(main)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert not left_running(pids)
    assert base.processes_touching(str(tmp_path), []) == []
    tail = text(state_dir / "stack.log")
    assert "services left: none (1 deleted)" in tail and "stack stopped" in tail, tail


def test_a_killed_stack_takes_its_processes_with_it_and_down_removes_its_replicas(state_dir, tmp_path) -> None:
    up = base.stack(
        "up", "--detach", "--state-dir", str(state_dir), "--example", EXAMPLE, env=base.stack_env(), timeout=240
    )
    assert up.returncode == 0, f"{up.stdout}{up.stderr}\n{base.logs(state_dir)}"
    state = read_state(state_dir)
    with grpc.insecure_channel(state["controller"]) as channel:
        stub = controller_service_pb2_grpc.ControllerServiceStub(channel)

        def ready() -> bool:
            resp = stub.GetService(
                pb.GetServiceRequest(service_name="hello"), metadata=base.auth(state_dir), timeout=10
            )
            return resp.service.ready_replicas == 2

        wait_for(ready, 120, "hello not READY", lambda: base.logs(state_dir))
    children = {name: pid for name, pid in stack_pids(state).items() if name != "stack"}

    os.kill(state["pid"], signal.SIGKILL)
    wait_for(lambda: not left_running(children), 60, "children outlived the stack", lambda: str(left_running(children)))

    # The replicas outlive it (a control plane that crashes leaves its workloads); `down` removes them.
    down = base.stack("down", "--state-dir", str(state_dir), env=base.stack_env(), timeout=200)
    assert down.returncode == 0, f"{down.stdout}{down.stderr}"
    assert "hello: deleting" in down.stdout and "services left: none (1 deleted)" in down.stdout, down.stdout
    assert base.processes_touching(str(tmp_path), []) == []
    assert not (state_dir / "stack.json").exists()


def test_ports_in_use_are_named_before_anything_starts(state_dir) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    with holder:
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        # Metrics on picked ports, so only the taken one can clash whatever else runs here.
        metrics = {f"REPLICAPLANE_{c}_METRICS_ADDR": "127.0.0.1:0" for c in COMPONENTS}
        env = {**base.stack_env(), **metrics, "REPLICAPLANE_CONTROLLER_LISTEN_ADDR": taken}
        up = base.stack("up", "--state-dir", str(state_dir), "--example", EXAMPLE, env=env, timeout=60)
    assert up.returncode != 0
    lines = up.stdout.splitlines() + up.stderr.splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1, lines
    assert taken in errors[0] and "REPLICAPLANE_CONTROLLER_LISTEN_ADDR" in errors[0], errors
    assert f"pid {os.getpid()}" in errors[0], errors  # /proc tells who holds it: this test
    assert "stack ready" not in up.stdout and "Traceback" not in up.stderr
    assert not (state_dir / "logs").exists()  # nothing was started


def test_a_second_stack_on_the_ports_of_a_running_one_names_them(state_dir, tmp_path) -> None:
    up = base.stack("up", "--detach", "--state-dir", str(state_dir), env=base.stack_env(), timeout=240)
    assert up.returncode == 0, f"{up.stdout}{up.stderr}\n{base.logs(state_dir)}"
    first = read_state(state_dir)
    urls = {p["name"]: p.get("url", "") for p in first["processes"]}
    metrics = {name: url.removeprefix("http://").removesuffix("/metrics") for name, url in first["metrics"].items()}
    env = {
        **os.environ,
        "REPLICAPLANE_CONTROLLER_LISTEN_ADDR": first["controller"],
        "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": urls["loadbalancer"].removeprefix("http://"),
        "REPLICAPLANE_DASHBOARD_HTTP_ADDR": urls["dashboard"].removeprefix("http://"),
        **{f"REPLICAPLANE_{n.split('-')[0].upper()}_METRICS_ADDR": a for n, a in metrics.items()},
    }
    second = base.stack("up", "--state-dir", str(tmp_path / "second"), env=env, timeout=60)
    assert second.returncode != 0
    assert "stack ready" not in second.stdout
    errors = [line for line in second.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1, second.stdout
    assert first["controller"] in errors[0] and "REPLICAPLANE_CONTROLLER_LISTEN_ADDR" in errors[0], errors
    assert f"the stack of {state_dir}" in errors[0] and f"pid {first['pid']}" in errors[0], errors
    assert "Traceback" not in second.stderr


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("REPLICAPLANE_CONTROLLER_MAX_REPLICAS_TOTAL", "many"),
        ("REPLICAPLANE_LOADBALANCER_POLICY", "fastest"),
        ("REPLICAPLANE_LOG_LEVEL", "loud"),
        ("REPLICAPLANE_CONFIG", "/nonexistent/replicaplane.yaml"),
    ],
)
def test_a_bad_setting_is_one_line_that_names_it(state_dir, setting: str, value: str) -> None:
    env = {**base.stack_env(), setting: value}
    up = base.stack("up", "--state-dir", str(state_dir), env=env, timeout=120)
    assert up.returncode != 0
    assert "Traceback" not in up.stdout + up.stderr, up.stdout + up.stderr
    errors = [line for line in (up.stdout + up.stderr).splitlines() if "error" in line.lower()]
    assert len(errors) == 1, up.stdout + up.stderr
    assert setting in errors[0] or setting.removeprefix("REPLICAPLANE_").lower().replace("_", ".", 1) in errors[0]
    assert "stack ready" not in up.stdout


def test_a_bad_example_yaml_is_one_line(state_dir, tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [web\n")
    up = base.stack("up", "--state-dir", str(state_dir), "--example", str(bad), env=base.stack_env(), timeout=60)
    assert up.returncode != 0
    output = (up.stdout + up.stderr).strip().splitlines()
    assert len(output) == 1 and str(bad) in output[0] and "not valid YAML" in output[0], output
    assert "at line 2" in output[0] and "line 1" in output[0], output


def test_a_balancer_that_cannot_bind_names_its_http_port_and_log(state_dir, tmp_path) -> None:
    # Held all along, but not listening yet: the stack's check (which binds with SO_REUSEADDR, as
    # servers do) finds it free. It listens before the balancer starts: the stack starts the
    # balancer only once the controller serves, and is held (SIGSTOP) meanwhile.
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    env = {**base.stack_env(), "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": f"127.0.0.1:{port}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.stack", "up", "--state-dir", str(state_dir)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: (state_dir / "logs" / "provisioner.log").exists(), 60, "the stack started nothing")
        proc.send_signal(signal.SIGSTOP)
        try:
            assert not (state_dir / "logs" / "loadbalancer.log").exists(), "the balancer started already"
            holder.listen()
        finally:
            proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
    finally:
        holder.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, out
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1, out
    log = state_dir / "logs" / "loadbalancer.log"
    assert f"127.0.0.1:{port}" in errors[0] and "REPLICAPLANE_LOADBALANCER_HTTP_ADDR" in errors[0], errors
    assert str(log) in errors[0], errors
    assert "loadbalancer.sock" not in errors[0]  # not its admin API
    assert "Traceback" not in text(log)


def test_the_terminal_follows_every_service_created_through_the_api(state_dir, tmp_path) -> None:
    out = tmp_path / "up.txt"
    with out.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.stack", "up", "--state-dir", str(state_dir), "--example", EXAMPLE],
            cwd=REPO,
            env=base.stack_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: read_state(state_dir).get("ready"), 120, "stack not ready", lambda: text(out))
        state = read_state(state_dir)
        spec = (
            "service:\n  readiness_probe: /health\n  replicas: 1\nresources:\n  ports: 8080\n"
            f"run: {sys.executable} {APP} --port 8080\n"
        )
        with grpc.insecure_channel(state["controller"]) as channel:
            stub = controller_service_pb2_grpc.ControllerServiceStub(channel)
            meta = base.auth(state_dir)
            stub.CreateService(pb.CreateServiceRequest(service_name="web", yaml=spec), metadata=meta, timeout=30)
            wait_for(lambda: "web: replica 1 READY" in text(out), 120, "web not followed", lambda: text(out))
            stub.DeleteService(pb.DeleteServiceRequest(service_name="web"), metadata=meta, timeout=30)
            wait_for(lambda: "web: deleted" in text(out), 120, "web's deletion not shown", lambda: text(out))
            # The same name again is a new service: followed again.
            stub.CreateService(pb.CreateServiceRequest(service_name="web", yaml=spec), metadata=meta, timeout=30)
            wait_for(
                lambda: text(out).rpartition("web: deleted")[2].count("web: replica 1 READY") == 1,
                120,
                "the new web not followed",
                lambda: text(out),
            )
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = text(out)
    assert proc.returncode == 0, lines
    assert "services left: none (2 deleted)" in lines, lines
    # Each line once: one follower per service.
    assert len(re.findall(r"hello: replica 1 READY", lines)) == 1, lines

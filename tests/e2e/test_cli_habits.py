"""replicactl as a `sky serve` user runs it, against real processes: --env/--secret through the
API to a real replica (and the secret nowhere else), each launch retry printed by --wait, the
stop rule in plain status, and the local stack's logs (--controller, --load-balancer,
--sync-down, following)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.e2e.test_replicactl import ctl
from tests.e2e.test_stack import stack_env
from tests.helpers import cluster as cl
from tests.helpers import procs

pytestmark = pytest.mark.e2e

SECRET = "sk-live-0123456789abcdef-e2e"
EXAMPLE = os.path.join(procs.REPO, "examples", "hello", "service.yaml")


def checked_app(name: str, tag: str) -> str:
    """The test app, started only if its env and secret arrived with the right values."""
    digest = hashlib.sha256(SECRET.encode()).hexdigest()
    run = (
        'test "$GREETING" = "hello there" || { echo "GREETING missing"; exit 1; }\n'
        f'  test "$(printf %s "$API_KEY" | sha256sum | cut -d" " -f1)" = {digest}'
        ' || { echo "API_KEY wrong"; exit 1; }\n'
        f"  exec {sys.executable} {cl.APP} --port 8080 --tag {tag}\n"
    )
    text = cl.app_yaml(name, tag, replicas=1, run="RUN")
    return text.replace("run: RUN\n", "run: |\n  " + run) + "envs:\n  GREETING:\nsecrets:\n  API_KEY:\n"


def run_cli(addr: str, *args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "--controller", addr, *args],
        cwd=procs.REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


async def first_watch_message(addr: str, name: str, *, env: dict[str, str], timeout: float = 60) -> str:
    """What `replicactl watch NAME --json` printed up to its first message naming the service
    (one JSON message per line); the watch runs until the service goes, so it is stopped then."""
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "services.cli", "--controller", addr, "watch", name, "--json"),
        cwd=procs.REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    out = ""
    try:
        async with asyncio.timeout(timeout):
            while line := (await proc.stdout.readline()).decode(errors="replace"):
                out += line
                if f'"name": "{name}"' in line or f'"name":"{name}"' in line:
                    break
    finally:
        proc.kill()
        out += (await proc.communicate())[0].decode(errors="replace")
    return out


async def test_env_and_secret_flags_reach_the_replica_and_the_secret_is_shown_nowhere(
    cluster: cl.Cluster, tmp_path
) -> None:
    addr = cluster.controller.addr
    spec = tmp_path / "task.yaml"
    spec.write_text(checked_app("keyed", cluster.tag))
    env_file = tmp_path / "app.env"
    env_file.write_text("GREETING='hello there'\n")
    env = {**os.environ, "API_KEY": SECRET}

    refused = await asyncio.to_thread(run_cli, addr, "up", str(spec), env=env)
    assert refused.returncode == 2
    assert "envs.GREETING: needs a value" in refused.stderr and "--env GREETING=VALUE" in refused.stderr

    args = ("up", str(spec), "--env-file", str(env_file), "--secret", "API_KEY", "--wait", "--timeout", "90")
    up = await asyncio.to_thread(run_cli, addr, *args, env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "keyed is READY (1/1 ready)" in up.stdout

    shown = [up.stdout + up.stderr]
    # Commands that change nothing, run side by side (each is a Python process start).
    reads = (
        ("status", "--json"),
        ("status", "keyed", "-a", "-v"),
        ("logs", "keyed", "1", "--no-follow"),
        ("logs", "keyed", "1", "--launch", "--no-follow"),
    )
    results = await asyncio.gather(*(asyncio.to_thread(run_cli, addr, *argv, env=env, timeout=60) for argv in reads))
    shown += [r.stdout + r.stderr for r in results]
    shown.append(await first_watch_message(addr, "keyed", env=env))
    doc = json.loads(shown[1])
    assert doc["services"][0]["spec"]["envs"] == {"GREETING": "hello there"}
    assert doc["services"][0]["spec"]["secrets"] == {"API_KEY": "<redacted>"}
    assert shown[4].strip(), "the launch log is shown"
    assert '"name": "keyed"' in shown[5] or '"name":"keyed"' in shown[5]
    for log in ("controller/controller.log", "provisioner/provisioner.log"):
        shown.append(await asyncio.to_thread(pathlib.Path(cluster.tmp, log).read_text, errors="replace"))
    for n, text in enumerate(shown):
        assert SECRET not in text, n


async def test_wait_prints_each_launch_retry_and_status_shows_the_stop_rule(cluster: cl.Cluster, tmp_path) -> None:
    addr = cluster.controller.addr
    marker = tmp_path / "first-attempt-done"
    flaky = cl.app_yaml("flaky", cluster.tag, replicas=1) + (
        f"setup: test -f {marker} || {{ touch {marker}; echo 'first attempt fails'; exit 1; }}\n"
    )
    spec = tmp_path / "flaky.yaml"
    spec.write_text(flaky)
    up = await ctl(addr, "up", str(spec), "--wait", "--timeout", "90")
    assert up.returncode == 0, up.stdout + up.stderr
    assert re.search(r"flaky: replica 1 [A-Z_]+: launch attempt 1 failed: setup exited with code 1", up.stdout), (
        up.stdout
    )
    assert "flaky is READY (1/1 ready)" in up.stdout

    # A broken version: scaling stops while version 1 keeps serving, and plain status says so.
    broken = tmp_path / "broken.yaml"
    broken.write_text(cl.app_yaml("flaky", cluster.tag, replicas=1, run="exit 1"))
    update = await ctl(addr, "update", "flaky", str(broken), "--wait", "--timeout", "90")
    assert update.returncode == 1, update.stdout + update.stderr
    status = await ctl(addr, "status")
    assert status.returncode == 0
    assert re.search(r"^flaky: scaling stopped: version 2 failed before ever being ready", status.stdout, re.M), (
        status.stdout
    )
    assert "READY" in status.stdout.splitlines()[2]  # version 1 still serves


def _stack(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.stack", *args],
        cwd=procs.REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_logs_of_the_local_stack_follow_sync_down_and_the_endpoint(tmp_path) -> None:
    env = stack_env()
    state = tmp_path / "state"
    up = _stack("up", "--detach", "--state-dir", str(state), "--example", EXAMPLE, env=env)
    followers: list[subprocess.Popen[str]] = []
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        addr = json.loads((state / "stack.json").read_text())["controller"]
        env["REPLICAPLANE_API_TOKEN_FILE"] = str(state / "api-token")  # the stack's token

        def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
            return run_cli(addr, *args, "--state-dir", str(state), env=env, timeout=timeout)

        def start(*args: str) -> subprocess.Popen[str]:
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "--controller", addr, *args, "--state-dir", str(state)],
                cwd=procs.REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            followers.append(proc)
            return proc

        deadline = time.monotonic() + 120
        url = ""
        while time.monotonic() < deadline and not url:
            svc = json.loads(run_cli(addr, "status", "hello", "--json", env=env).stdout)["services"][0]
            if svc["status"] == "SERVICE_STATUS_READY" and svc.get("load_balancer_url"):
                url = run_cli(addr, "status", "--endpoint", "hello", env=env).stdout.strip()
            else:
                time.sleep(0.25)
        assert url == svc["load_balancer_url"], svc
        with urllib.request.urlopen(f"{url}/", timeout=10) as resp:
            assert json.loads(resp.read())["message"].startswith("hello from replica")

        # Another service, so the controller's log names more than one.
        other = tmp_path / "other.yaml"
        other.write_text(pathlib.Path(EXAMPLE).read_text().replace("name: hello", "name: other"))
        assert run_cli(addr, "up", str(other), env=env).returncode == 0

        controller = cli("logs", "hello", "--controller", "--no-follow")
        assert controller.returncode == 0, controller.stderr
        lines = [line for line in controller.stdout.splitlines() if re.match(r"\d{4}-\d\d-\d\d ", line)]
        assert lines and all(re.search(r"(?<![-a-z0-9_])hello(?![-a-z0-9_])", line) for line in lines), lines
        assert not [line for line in lines if "other" in line and "hello" not in line]
        balancer = cli("logs", "hello", "--load-balancer", "--no-follow")
        assert balancer.returncode == 0, balancer.stderr
        assert "following the endpoints of service hello" in balancer.stdout
        # The stack's balancer fleet serves every service: each one's lines from the same log.
        assert "following the endpoints of service other" not in balancer.stdout
        # The fleet starts serving "other" at its next look at the services (every second).
        deadline = time.monotonic() + 60
        while True:
            other_log = cli("logs", "other", "--load-balancer", "--no-follow")
            assert other_log.returncode == 0, other_log.stderr
            if "following the endpoints of service other" in other_log.stdout or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert "following the endpoints of service other" in other_log.stdout
        assert "service hello" not in other_log.stdout
        wrong = cli("logs", "nosuch", "--load-balancer", "--no-follow")
        assert wrong.returncode == 3

        replica = start("logs", "hello", "1")  # follows by default
        assert "replica 1: serving on" in replica.stdout.readline()  # type: ignore[union-attr]
        time.sleep(0.5)
        assert replica.poll() is None

        out = tmp_path / "synced"
        synced = cli("logs", "hello", "--sync-down", "--dir", str(out))
        assert synced.returncode == 0, synced.stdout + synced.stderr
        folder = next(out.iterdir())
        assert sorted(p.name for p in folder.iterdir()) == [
            "controller.log",
            "load-balancer.log",
            "replica-1.launch.log",
            "replica-1.log",
            "replica-2.launch.log",
            "replica-2.log",
        ]
        assert "replica 2: serving on" in (folder / "replica-2.log").read_text()
        assert str(folder) in synced.stdout

        follower = start("logs", "hello", "--controller")
        assert "starting controller" in follower.stdout.readline()  # type: ignore[union-attr]
        assert "hello" in follower.stdout.readline()  # type: ignore[union-attr]
        time.sleep(0.5)
        assert follower.poll() is None  # following while the controller runs
        down = _stack("down", "--state-dir", str(state), env=env)
        assert down.returncode == 0, down.stdout + down.stderr
        # The controller stopped with the stack: the follower prints what is left and ends.
        assert follower.wait(30) == 0
        replica.wait(30)  # its replica is gone too
    finally:
        _stack("down", "--state-dir", str(state), env=env)
        for proc in followers:
            proc.kill()
            proc.wait()

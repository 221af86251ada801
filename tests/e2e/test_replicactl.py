"""replicactl as a user runs it: a subprocess against a live local stack, through up, status,
logs, update (a dry run, then a broken version) and down, checking output and exit codes."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import subprocess
import sys
import urllib.request

import pytest

from tests.e2e.test_stack import stack_env
from tests.helpers import cluster as cl
from tests.helpers import procs, provisioner_procs

pytestmark = pytest.mark.e2e

EXAMPLES = os.path.join(procs.REPO, "examples")


def replicactl(addr: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "--controller", addr, *args],
        cwd=procs.REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def write_bigger(v1: str, dest: pathlib.Path) -> None:
    text = pathlib.Path(v1).read_text().replace("replicas: 2", "replicas: 3")
    dest.write_text(text.replace("workdir: examples/hello", f"workdir: {EXAMPLES}/hello"))


def start_cli(addr: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "--controller", addr, *args],
        cwd=procs.REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


async def ctl(addr: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(replicactl, addr, *args, timeout=timeout)


async def test_replicactl_up_status_update_down(cluster: cl.Cluster, tmp_path) -> None:
    addr = cluster.controller.addr
    v1 = os.path.join(EXAMPLES, "broken-v2", "v1.yaml")

    up = await ctl(addr, "up", v1, "--wait", "--timeout", "90")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "shop: created (version 1)" in up.stdout
    assert "shop is READY (2/2 ready)" in up.stdout

    status = await ctl(addr, "status", "--json")
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert [(s["name"], s["status"], s["ready_replicas"]) for s in doc["services"]] == [
        ("shop", "SERVICE_STATUS_READY", 2)
    ]
    replicas = doc["replicas"]
    assert [(r["replica_id"], r["status"]) for r in replicas] == [("1", "REPLICA_STATUS_READY")] * 1 + [
        ("2", "REPLICA_STATUS_READY")
    ]
    answer = await asyncio.to_thread(get, replicas[0]["endpoint"] + "/")
    assert answer["message"] == "hello from replica 1"

    table = await ctl(addr, "status", "shop")
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[0] == "Services"
    assert lines[1].split() == ["NAME", "VERSION", "UPTIME", "STATUS", "REPLICAS", "ENDPOINT"]
    assert lines[2].split()[:2] == ["shop", "1"] and "READY" in lines[2] and "2/2" in lines[2]
    assert "SERVICE  ID  VERSION  ENDPOINT" in table.stdout

    logs = await ctl(addr, "logs", "shop", "1", "--no-follow")
    assert logs.returncode == 0, logs.stderr
    assert "replica 1: serving on" in logs.stdout
    follower = start_cli(addr, "logs", "shop", "2")  # follows by default
    try:
        first = await asyncio.to_thread(follower.stdout.readline)  # type: ignore[union-attr]
        assert "replica 2: serving on" in first
        await asyncio.to_thread(get, replicas[1]["endpoint"] + "/")  # logged by the app; probes ask /health
        while '"GET / HTTP' not in (line := await asyncio.to_thread(follower.stdout.readline)):  # type: ignore[union-attr]
            assert line, "the log stream ended"
        assert follower.poll() is None  # still following
    finally:
        follower.kill()
        follower.wait()

    # A change planned but not applied (a workdir means new replicas, so nothing is in place).
    bigger = tmp_path / "v1-bigger.yaml"
    await asyncio.to_thread(write_bigger, v1, bigger)
    plan = await ctl(addr, "update", "shop", str(bigger), "--dry-run", "--json")
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)["plan"]
    assert planned["new_version"] == "2" and planned.get("in_place", False) is False
    assert planned["launch_count"] == 3
    still = json.loads((await ctl(addr, "status", "shop", "--json")).stdout)["services"][0]
    assert still["latest_version"] == "1"

    # The broken v2: the update is applied, the wait reports the stop rule and exits 1.
    broken = await ctl(addr, "update", "shop", os.path.join(EXAMPLES, "broken-v2", "v2.yaml"), "--wait")
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "shop: version 2" in broken.stdout
    assert "scaling stopped: version 2 failed before ever being ready" in broken.stderr
    after = json.loads((await ctl(addr, "status", "shop", "--json")).stdout)
    assert after["services"][0]["ready_replicas"] == 2  # v1 keeps serving
    failed = [r for r in after["replicas"] if r["status"] == "REPLICA_STATUS_FAILED"]
    assert failed, after["replicas"]
    why = await ctl(addr, "logs", "shop", failed[0]["replica_id"], "--no-follow")
    assert why.returncode == 0, why.stderr
    assert "cannot start: missing config file /etc/shop/v2.conf" in why.stdout

    # Roll forward to a good version (the quickstart's step): --wait ends when v3 alone serves.
    fixed = await ctl(addr, "update", "shop", v1, "--wait", "--timeout", "90")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "shop: version 3" in fixed.stdout and "shop is READY (2/" in fixed.stdout  # v1 may still drain
    now = json.loads((await ctl(addr, "status", "shop", "--json")).stdout)["services"][0]
    assert now["active_versions"] == ["3"]

    watcher = start_cli(addr, "watch", "shop")
    try:
        first = await asyncio.to_thread(watcher.stdout.readline)  # type: ignore[union-attr]
        down = await ctl(addr, "down", "shop", "--wait", "--timeout", "60")
        assert down.returncode == 0, down.stdout + down.stderr
        assert "shop: deleted" in down.stdout
        # Not communicate(): with a timeout it reads the pipe itself and loses what readline buffered.
        rest = await asyncio.wait_for(asyncio.to_thread(watcher.stdout.read), 30)  # type: ignore[union-attr]
        watcher.wait(30)
        watched = first + rest
    finally:
        watcher.kill()
    assert watcher.returncode == 0, watched
    assert re.search(r"shop: replica \d+ READY", watched) and "shop: service SHUTTING_DOWN" in watched
    assert watched.rstrip().endswith("shop: deleted")
    assert provisioner_procs.wait_no_replicas(cluster.provisioner_state_dir, timeout=15) == []


async def test_replicactl_errors_are_one_line_with_an_exit_code(cluster: cl.Cluster, tmp_path) -> None:
    addr = cluster.controller.addr
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nservice:\n  readiness_probe: /\n  replicas: -1\nresources:\n  ports: 8080\nrun: x\n")
    unparsable = tmp_path / "broken.yaml"
    unparsable.write_text("service: [\n")
    # Independent commands, run side by side (each is a Python process start).
    invalid, broken, status, down, logs, unreachable = await asyncio.gather(
        ctl(addr, "up", str(bad)),
        ctl(addr, "up", str(unparsable)),
        ctl(addr, "status", "nope"),
        ctl(addr, "down", "nope"),
        ctl(addr, "logs", "nope", "--replica-id", "0"),
        ctl("127.0.0.1:1", "--rpc-timeout", "2", "status"),
    )
    assert invalid.returncode == 2
    assert invalid.stderr.strip().splitlines() == ["error: service.replicas: must be >= 0, got -1"]
    assert broken.returncode == 2
    assert broken.stderr.startswith("error: yaml: ") and "Traceback" not in broken.stderr
    assert status.returncode == 3
    assert status.stderr.strip() == "error: service 'nope' not found"
    assert (down.returncode, down.stderr.strip()) == (3, "error: service 'nope' not found")
    assert logs.returncode == 2 and "replica_id: must be >= 1, got 0" in logs.stderr
    assert unreachable.returncode == 4
    assert unreachable.stderr.strip().startswith("error: cannot reach the controller at 127.0.0.1:1")
    assert (await ctl(addr, "status")).stdout.strip() == "No services."


def test_replicactl_stack_up_and_down(tmp_path) -> None:
    env = stack_env()
    state = str(tmp_path / "state")
    base = [sys.executable, "-m", "services.cli"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *args], cwd=procs.REPO, env=env, capture_output=True, text=True, timeout=200, check=False
        )

    up = run("stack", "up", "--detach", "--state-dir", state)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "stack running in the background" in up.stdout
        assert "controller metrics: http://127.0.0.1:" in up.stdout
        assert "dashboard metrics: http://127.0.0.1:" in up.stdout
        addr = json.loads(pathlib.Path(state, "stack.json").read_text())["controller"]
        env["REPLICAPLANE_API_TOKEN_FILE"] = os.path.join(state, "api-token")  # the stack's token
        status = run("--controller", addr, "status")
        assert (status.returncode, status.stdout.strip()) == (0, "No services.")
    finally:
        down = run("stack", "down", "--state-dir", state)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "services left: none" in down.stdout and "stack stopped" in down.stdout


async def test_replicactl_sends_the_api_token_and_says_when_it_is_refused(tmp_path) -> None:
    token = "cli-token-0123456789abcdef"
    c = cl.Cluster(str(tmp_path), controller_env={"REPLICAPLANE_CONTROLLER_AUTH_TOKEN": token}, api_token=token)
    try:
        base = [sys.executable, "-m", "services.cli", "--controller", c.controller.addr, "status"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("REPLICAPLANE_")}

        def run(extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                base, cwd=procs.REPO, env={**env, **extra_env}, capture_output=True, text=True, timeout=60
            )

        refused = await asyncio.to_thread(run, {})
        assert refused.returncode == 6
        assert refused.stderr.startswith("error: the controller refused the call (UNAUTHENTICATED)")
        wrong = await asyncio.to_thread(run, {"REPLICAPLANE_API_TOKEN": "not-the-token-at-all"})
        assert wrong.returncode == 6 and "not-the-token" not in wrong.stderr
        token_file = tmp_path / "token"
        token_file.write_text(f"me:{token}\n")
        allowed = await asyncio.to_thread(run, {"REPLICAPLANE_API_TOKEN_FILE": str(token_file)})
        assert (allowed.returncode, allowed.stdout.strip()) == (0, "No services.")
    finally:
        await c.close()

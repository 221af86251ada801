"""The README's grpcurl walk-through, run command by command against a real stack."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import AsyncIterator

import pytest

from tests.helpers import cluster as cl
from tests.helpers import procs, provisioner_procs

pytestmark = pytest.mark.e2e

README_ADDR = "127.0.0.1:50051"
README_TOKEN_FILE = ".state/api-token"
TOKEN = "grpcurl-docs-token-0123456789"


@pytest.fixture
async def guarded(tmp_path) -> AsyncIterator[tuple[cl.Cluster, str]]:
    """A cluster whose controller requires a token, as `make up`'s does, and a file holding it
    (put in place of the documented .state/api-token)."""
    token_file = tmp_path / "api-token"
    token_file.write_text(f"{TOKEN}\n")
    c = cl.Cluster(str(tmp_path), controller_env={"REPLICAPLANE_CONTROLLER_AUTH_TOKEN": TOKEN}, api_token=TOKEN)
    try:
        yield c, str(token_file)
    finally:
        await c.close()


def as_run(command: str, addr: str, token_file: str) -> str:
    """The documented command, aimed at the test's controller and token file."""
    return command.replace(README_ADDR, addr).replace(README_TOKEN_FILE, token_file)


def readme_commands() -> list[str]:
    with open(os.path.join(procs.REPO, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    block = re.search(r"<!-- grpcurl-demo:start -->\s*```bash\n(.*?)```", text, re.S)
    assert block, "README lost its grpcurl demo block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def without_token(command: str) -> str:
    """The command without its authorization header."""
    return re.sub(r' -H "authorization: [^"]*"', "", command)


def run(command: str, addr: str, token_file: str = README_TOKEN_FILE) -> str:
    done = subprocess.run(
        ["bash", "-c", as_run(command, addr, token_file)],
        cwd=procs.REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, f"{command}\n{done.stderr}"
    return done.stdout


def watch_until_ready(command: str, addr: str, token_file: str = README_TOKEN_FILE, timeout: float = 30.0) -> str:
    """Run the streaming watch until the service is READY with 2 replicas, then stop it."""
    proc = subprocess.Popen(
        ["bash", "-c", "exec " + as_run(command, addr, token_file)],
        cwd=procs.REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    out: list[str] = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        decoder, buffer = json.JSONDecoder(), ""
        for line in proc.stdout:  # type: ignore[union-attr]
            out.append(line)
            buffer += line
            try:
                msg, end = decoder.raw_decode(buffer.lstrip())
            except json.JSONDecodeError:
                continue
            buffer = buffer.lstrip()[end:]
            svc = msg.get("service", {})
            if svc.get("status") == "SERVICE_STATUS_READY" and svc.get("ready_replicas") == 2:
                return "".join(out)
        raise AssertionError("watch ended before READY:\n" + "".join(out))
    finally:
        timer.cancel()
        proc.kill()
        proc.wait()


async def test_readme_grpcurl_commands_work(guarded: tuple[cl.Cluster, str]) -> None:
    cluster, token_file = guarded
    commands = readme_commands()
    rpc = {c.split()[-1].rsplit("/", 1)[-1]: c for c in commands if "/" in c.split()[-1]}
    addr = cluster.controller.addr

    listing = run(commands[0], addr, token_file)
    assert "replicaplane.controller.v1.ControllerService.CreateService" in listing

    # Without the documented header the call is refused: the token is what makes it work.
    bare = await asyncio.to_thread(
        subprocess.run,
        ["bash", "-c", as_run(without_token(rpc["CreateService"]), addr, token_file)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert bare.returncode != 0 and "Unauthenticated" in bare.stderr, bare.stderr
    created = json.loads(run(rpc["CreateService"], addr, token_file))
    assert created["service"]["name"] == "web"

    started = time.monotonic()
    watched = watch_until_ready(rpc["WatchService"], addr, token_file)
    assert "REPLICA_STATUS_STARTING" in watched
    assert time.monotonic() - started < 30

    replicas = json.loads(run(rpc["ListReplicas"], addr, token_file))["replicas"]
    assert [r["status"] for r in replicas] == ["REPLICA_STATUS_READY"] * 2

    plan = json.loads(run(rpc["UpdateService"], addr, token_file))["plan"]
    assert plan["in_place"] is True
    assert sorted(plan["kept_replica_ids"]) == ["1", "2"]
    assert plan["launch_count"] == 1

    deleted = json.loads(run(rpc["DeleteService"], addr, token_file))
    assert deleted["service"]["status"] == "SERVICE_STATUS_SHUTTING_DOWN"
    assert provisioner_procs.wait_no_replicas(cluster.provisioner_state_dir, timeout=15) == []

"""The Node client (clients/node) against a live stack: installed with npm from the registry,
it lists services and follows a watch stream until the replicas are READY."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess

import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from tests.helpers import cluster as cl
from tests.helpers import ports, procs

pytestmark = pytest.mark.e2e

NODE_DIR = os.path.join(procs.REPO, "clients", "node")


def node_or_skip() -> str:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have node and npm for the Node client test")
        pytest.skip("node and npm are not installed")
    return node


@pytest.fixture(scope="module")
def node() -> str:
    """node, with the client's packages installed by `npm ci` (the pinned lock file)."""
    path = node_or_skip()
    done = subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return path


def run_node(node: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [node, "client.js", *args], cwd=NODE_DIR, capture_output=True, text=True, timeout=timeout, check=False
    )


def start_node(node: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([node, "client.js", *args], cwd=NODE_DIR, stdout=subprocess.PIPE, text=True)


async def test_node_client_lists_services_and_follows_a_watch(node: str, cluster: cl.Cluster) -> None:
    addr = cluster.controller.addr
    yaml_text = cl.app_yaml("node-demo", cluster.tag, replicas=2)
    await cluster.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text))

    watched = await asyncio.to_thread(
        run_node, node, "--controller", addr, "watch", "node-demo", "--until-ready", "2", "--timeout", "60"
    )
    assert watched.returncode == 0, watched.stdout + watched.stderr
    messages = [json.loads(line) for line in watched.stdout.splitlines()]
    assert messages[0]["snapshot"] is True
    statuses = [r["status"] for m in messages for r in m["replicas"]]
    assert statuses.count("REPLICA_STATUS_READY") >= 2

    listed = await asyncio.to_thread(run_node, node, "--controller", addr, "list")
    assert listed.returncode == 0, listed.stderr
    services = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(s["name"], s["status"], s["ready_replicas"]) for s in services] == [
        ("node-demo", "SERVICE_STATUS_READY", 2)
    ]

    # Changes arrive as they happen: a watch that is running sees the deletion, then ends.
    follower = start_node(node, "--controller", addr, "watch", "node-demo")
    try:
        first = json.loads(await asyncio.to_thread(follower.stdout.readline))  # type: ignore[union-attr]
        assert first["snapshot"] is True
        await cluster.stub.DeleteService(api.DeleteServiceRequest(service_name="node-demo"))
        # Not communicate(): with a timeout it reads the pipe itself and loses what readline buffered.
        rest = await asyncio.wait_for(asyncio.to_thread(follower.stdout.read), 60)  # type: ignore[union-attr]
        follower.wait(60)
    finally:
        follower.kill()
    changes = [json.loads(line) for line in rest.splitlines()]
    assert follower.returncode == 0
    assert any(m["service"]["status"] == "SERVICE_STATUS_SHUTTING_DOWN" for m in changes)
    assert changes[-1]["deleted"] is True

    missing = await asyncio.to_thread(run_node, node, "--controller", addr, "watch", "nope")
    assert missing.returncode == 3
    assert missing.stderr.startswith("error: NOT_FOUND")

    # Several controllers (one store, one leading): a call goes on to the next address when one
    # does not answer.
    with ports.Reserved() as dead:
        listed = await asyncio.to_thread(run_node, node, "--controller", f"{dead.addr},{addr}", "list")
    assert (listed.returncode, listed.stdout) == (0, ""), listed.stderr


async def test_node_client_sends_the_api_token(node: str, tmp_path) -> None:
    token = "node-token-0123456789abcdef"
    c = cl.Cluster(str(tmp_path), controller_env={"REPLICAPLANE_CONTROLLER_AUTH_TOKEN": token}, api_token=token)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REPLICAPLANE_")}

        def run(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [node, "client.js", "--controller", c.controller.addr, "list"],
                cwd=NODE_DIR,
                env={**env, **extra},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )

        refused = await asyncio.to_thread(run, {})
        assert refused.returncode == 1 and refused.stderr.startswith("error: UNAUTHENTICATED")
        allowed = await asyncio.to_thread(run, {"REPLICAPLANE_API_TOKEN": token})
        assert (allowed.returncode, allowed.stdout) == (0, "")
    finally:
        await c.close()

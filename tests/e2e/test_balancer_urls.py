"""Every service gets a load-balanced URL (issue 20 items 7-9), end to end: controller,
provisioner, prober and a balancer fleet as processes, real replica processes, the real CLI."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.helpers import balancer as lb
from tests.helpers import cluster as cl
from tests.helpers import procs

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TTL_S = 3.0


@pytest.fixture
async def cluster(tmp_path) -> AsyncIterator[cl.Cluster]:
    # A long drain, so that one ending early is plain; a short TTL, so that a dead URL goes quickly.
    c = cl.Cluster(
        str(tmp_path),
        controller_env={"REPLICAPLANE_CONTROLLER_DRAIN_S": "120", "REPLICAPLANE_CONTROLLER_BALANCER_TTL_S": str(TTL_S)},
    )
    try:
        yield c
    finally:
        await c.close()


def start_fleet(c: cl.Cluster) -> procs.ServiceProcess:
    os.makedirs(os.path.join(c.tmp, "fleet"), exist_ok=True)
    return procs.start_service(
        "loadbalancer",
        env={
            "REPLICAPLANE_LOADBALANCER_FLEET": "true",
            "REPLICAPLANE_LOADBALANCER_CONTROLLER_ADDR": c.controller.addr,
            "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": "127.0.0.1:0",
            "REPLICAPLANE_LOADBALANCER_FLEET_POLL_S": "0.2",
            "REPLICAPLANE_LOADBALANCER_REPORT_HEARTBEAT_S": "1",
        },
        workdir=os.path.join(c.tmp, "fleet"),
    )


def replicactl(c: cl.Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "--controller", c.controller.addr, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as s, s.get(url + "/whoami") as r:
        return r.status, await r.text()


async def service(c: cl.Cluster, name: str) -> res.Service:
    return (await c.stub.GetService(api.GetServiceRequest(service_name=name), timeout=5)).service


async def until(pred, timeout: float) -> float:  # type: ignore[no-untyped-def]
    """Seconds until `await pred()` held."""
    start = time.monotonic()
    while not await pred():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_a_service_made_with_replicactl_up_gets_a_url_scales_from_zero_and_drains_briefly(
    cluster: cl.Cluster, tmp_path
) -> None:
    fleet = await asyncio.to_thread(start_fleet, cluster)
    try:
        yaml_file = tmp_path / "web.yaml"
        yaml_file.write_text(lb.lb_app_yaml("web", cluster.tag, replicas=2))
        done = await asyncio.to_thread(replicactl, cluster, "up", str(yaml_file), "--wait", "--timeout", "90")
        assert done.returncode == 0, done.stdout + done.stderr
        await until(lambda: _has_url(cluster, "web"), 15)
        shown = await asyncio.to_thread(replicactl, cluster, "status", "--endpoint", "web")
        assert shown.returncode == 0, shown.stderr
        url = shown.stdout.strip()
        assert url == (await service(cluster, "web")).load_balancer_url and url.startswith("http://127.0.0.1:")
        assert (await get(url))[0] == 200

        # min_replicas 0: nothing runs until a request comes through the fleet's URL.
        zero = tmp_path / "zero.yaml"
        policy = (
            "  replica_policy:\n    min_replicas: 0\n    max_replicas: 1\n    target_qps_per_replica: 1\n"
            "    upscale_delay_seconds: 1\n    downscale_delay_seconds: 600\n"
        )
        zero.write_text(lb.lb_app_yaml("zero", cluster.tag, policy_yaml=policy))
        done = await asyncio.to_thread(replicactl, cluster, "up", str(zero))
        assert done.returncode == 0, done.stdout + done.stderr
        await until(lambda: _has_url(cluster, "zero"), 15)
        zero_url = (await service(cluster, "zero")).load_balancer_url
        assert zero_url != url and (await service(cluster, "zero")).total_replicas == 0
        assert await get(zero_url) == (200, "replica 1\n")

        # Scaled down with a 120 s drain: the fleet has nothing in flight for the victim, so it goes
        # at once; meanwhile REPLICAS does not count it.
        yaml_file.write_text(lb.lb_app_yaml("web", cluster.tag, replicas=1))
        done = await asyncio.to_thread(replicactl, cluster, "update", "web", str(yaml_file))
        assert done.returncode == 0, done.stdout + done.stderr

        async def one_left() -> bool:
            replicas = await cluster.stub.ListReplicas(api.ListReplicasRequest(service_name="web"), timeout=5)
            return len(replicas.replicas) == 1

        assert await until(one_left, 30) < 30
        svc = await service(cluster, "web")
        assert (svc.ready_replicas, svc.total_replicas) == (1, 1)

        # A killed fleet's URLs go once its reports stop for the TTL.
        fleet.kill()
        gone = await until(lambda: _no_url(cluster, "web"), TTL_S + 5)
        assert gone >= TTL_S - 1.5
        shown = await asyncio.to_thread(replicactl, cluster, "status", "--endpoint", "web")
        assert shown.returncode != 0 and "no URL" in shown.stderr
    finally:
        fleet.stop()


async def _has_url(c: cl.Cluster, name: str) -> bool:
    return bool((await service(c, name)).load_balancer_url)


async def _no_url(c: cl.Cluster, name: str) -> bool:
    return not (await service(c, name)).load_balancer_url

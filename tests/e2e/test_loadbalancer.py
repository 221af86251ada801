"""End to end through the load balancer: controller, provisioner, prober and balancer as processes,
real replica processes behind them."""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from tests.helpers import balancer as lb
from tests.helpers import cluster as cl

pytestmark = pytest.mark.e2e


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def create(c: cl.Cluster, yaml_text: str) -> None:
    await c.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text), timeout=10)


async def start_balancer(c: cl.Cluster, service: str, **env: str) -> lb.Balancer:
    return await lb.start(c.controller.addr, service, os.path.join(c.tmp, f"lb-{service}"), **env)


async def get_text(client: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with client.get(url) as resp:
        return resp.status, await resp.text()


async def test_round_robin_cycles_strictly_over_three_replicas(
    cluster: cl.Cluster, client: aiohttp.ClientSession
) -> None:
    await create(cluster, lb.lb_app_yaml("rr", cluster.tag, replicas=3, policy="round_robin"))
    b = await start_balancer(cluster, "rr")
    try:
        await b.until(lambda s: sum(r.ready for r in s.replicas) == 3)
        assert (await b.state()).policy == "round_robin"
        seen = []
        for _ in range(30):
            status, text = await get_text(client, b.url + "/whoami")
            assert status == 200
            seen.append(int(text.split()[1]))
        assert sorted(seen[:3]) == [1, 2, 3]
        assert seen == seen[:3] * 10
        # The controller shows the balancer as the service's endpoint and counts its requests.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            svc = (await cluster.stub.GetService(api.GetServiceRequest(service_name="rr"))).service
            if svc.load_balancer_url == b.url and (await b.state()).unreported_requests == 0:
                break
            await asyncio.sleep(0.1)
        assert svc.load_balancer_url == b.url
        assert (await b.state()).unreported_requests == 0
    finally:
        await b.close()


async def test_least_load_spreads_streams_and_stops_cancelled_work(
    cluster: cl.Cluster, client: aiohttp.ClientSession, tmp_path
) -> None:
    await create(cluster, lb.lb_app_yaml("ll", cluster.tag, replicas=2))
    b = await start_balancer(cluster, "ll")
    try:
        await b.until(lambda s: sum(r.ready for r in s.replicas) == 2)
        assert (await b.state()).policy == "least_load"

        # Concurrent slow requests are spread evenly.
        slow = [asyncio.create_task(get_text(client, b.url + "/slow?s=1")) for _ in range(6)]
        await b.until(lambda s: sum(r.in_flight for r in s.replicas) == 6)
        assert sorted(r.in_flight for r in (await b.state()).replicas) == [3, 3]
        answers = collections.Counter(text for _, text in await asyncio.gather(*slow))
        assert answers == {"replica 1\n": 3, "replica 2\n": 3}

        # Errors and client disconnects give their count back.
        assert (await get_text(client, b.url + "/status/500"))[0] == 500
        cut = asyncio.create_task(get_text(client, b.url + "/slow?s=5"))
        await b.until(lambda s: sum(r.in_flight for r in s.replicas) == 1)
        cut.cancel()
        await asyncio.gather(cut, return_exceptions=True)
        await b.until(lambda s: all(r.in_flight == 0 for r in s.replicas), timeout=10)

        # A streaming response arrives word by word.
        chunks = []
        async with client.get(b.url + "/stream?words=4&delay=0.3") as resp:
            async for chunk in resp.content.iter_any():
                chunks.append(chunk.decode())
        assert chunks == ["word0 ", "word1 ", "word2 ", "word3 "]

        # A cancelled request stops the replica's work.
        marker = tmp_path / "work"
        resp = await client.get(f"{b.url}/work?ticks=200&delay=0.05&marker={marker}")
        await resp.content.readline()
        resp.close()
        for _ in range(250):
            if marker.exists():
                break
            await asyncio.sleep(0.02)
        state, ticks = marker.read_text().split()
        assert state == "cancelled"
        assert int(ticks) < 100
        await b.until(lambda s: all(r.in_flight == 0 for r in s.replicas), timeout=10)
    finally:
        await b.close()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


async def test_large_uploads_stream_through_with_bounded_balancer_memory(
    cluster: cl.Cluster, client: aiohttp.ClientSession
) -> None:
    await create(cluster, lb.lb_app_yaml("upload", cluster.tag, replicas=2))
    b = await start_balancer(cluster, "upload")
    try:
        await b.until(lambda s: sum(r.ready for r in s.replicas) == 2)
        pid = b.process.proc.pid
        peak = base = rss_bytes(pid)
        chunk, size = b"u" * (1 << 20), 60 << 20

        async def body() -> AsyncIterator[bytes]:
            for _ in range(size // len(chunk)):
                yield chunk

        async def upload() -> tuple[int, int]:
            headers = {"Content-Length": str(size)}
            async with client.post(b.url + "/sink", data=body(), headers=headers) as resp:
                return resp.status, (await resp.json())["bytes"]

        uploads = asyncio.gather(*(upload() for _ in range(4)))
        while not uploads.done():
            peak = max(peak, rss_bytes(pid))
            await asyncio.sleep(0.01)
        assert await uploads == [(200, size)] * 4
        # Read whole, four 60 MiB bodies would add 240 MiB or more; streamed, a few chunks each.
        assert peak - base < 48 << 20, f"balancer RSS grew {(peak - base) >> 20} MiB"
    finally:
        await b.close()


async def test_no_ready_replica_answers_503_with_a_clear_message(
    cluster: cl.Cluster, client: aiohttp.ClientSession
) -> None:
    # The app never answers its probe, so no replica is ever READY.
    yaml_text = cl.app_yaml("mute", cluster.tag, replicas=1, app_args="--never-answer")
    await create(cluster, yaml_text)
    b = await start_balancer(cluster, "mute")
    try:
        await b.until(lambda s: s.controller_connected)
        status, text = await get_text(client, b.url + "/")
        assert status == 503
        assert "no ready replica for service 'mute'" in text
    finally:
        await b.close()


async def test_request_to_a_service_scaled_to_zero_is_held_and_served(
    cluster: cl.Cluster, client: aiohttp.ClientSession
) -> None:
    policy = (
        "  replica_policy:\n    min_replicas: 0\n    max_replicas: 1\n    target_qps_per_replica: 1\n"
        "    upscale_delay_seconds: 1\n    downscale_delay_seconds: 600\n"
    )
    await create(cluster, lb.lb_app_yaml("zero", cluster.tag, policy_yaml=policy))
    b = await start_balancer(cluster, "zero", hold_timeout_s="60")
    try:
        await b.until(lambda s: s.controller_connected)
        request = asyncio.create_task(get_text(client, b.url + "/whoami"))
        await b.until(lambda s: s.held_requests == 1)
        # Its arrival is reported at once; the autoscaler leaves target 0 on it, launches a
        # replica, and the held request is served when that replica is READY.
        status, text = await asyncio.wait_for(request, 60)
        assert (status, text) == (200, "replica 1\n")
        svc = (await cluster.stub.GetService(api.GetServiceRequest(service_name="zero"))).service
        assert svc.target_replicas == 1
        assert (await b.state()).held_requests == 0
    finally:
        await b.close()


async def test_controller_outage_keeps_routing_and_reports_the_load_later(
    cluster: cl.Cluster, client: aiohttp.ClientSession
) -> None:
    await create(cluster, lb.lb_app_yaml("steady", cluster.tag, replicas=2))
    b = await start_balancer(cluster, "steady")
    try:
        await b.until(lambda s: sum(r.ready for r in s.replicas) == 2 and s.unreported_requests == 0)
        cluster.controller.kill()
        await b.until(lambda s: not s.controller_connected, timeout=15)
        for _ in range(10):
            assert (await get_text(client, b.url + "/whoami"))[0] == 200  # the last known set
        await asyncio.sleep(1.5)  # a report interval passes: the reports fail, the counts stay
        assert (await b.state()).unreported_requests == 10
        await cluster.restart_controller()
        await b.until(lambda s: s.controller_connected and s.unreported_requests == 0, timeout=30)
        assert (await get_text(client, b.url + "/whoami"))[0] == 200
    finally:
        await b.close()

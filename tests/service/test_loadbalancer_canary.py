"""The real balancer (HTTP proxy, controller link, admin API) splitting traffic between versions by
weight, and reporting each version's outcomes once.

The controller cannot set weights yet (that comes with the rollout work), so a test-only stand-in
(tests/helpers/weighted_controller.py) serves GetService, WatchEndpoints with weights and
ReportLoad (with the real controller's exactly-once rule); everything else is real: replicas are
HTTP apps on port 0 and every request goes through the balancer's HTTP port.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest

from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2 as lb_api
from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2_grpc as lb_grpc
from services.common import latency
from services.loadbalancer import server as lb_server
from tests.helpers import ports
from tests.helpers import weighted_controller as wc

SERVICE = "web"


class Env:
    def __init__(self, stub: wc.WeightedController, replicas: wc.Replicas) -> None:
        self.stub = stub
        self.addr = stub.addr
        self._replicas = replicas

    async def replica(self, version: int, *, status: int = 200) -> res.Endpoint:
        return await self._replicas.start(version, status=status)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    replicas = wc.Replicas()
    try:
        async with wc.serving(SERVICE) as stub:
            yield Env(stub, replicas)
    finally:
        await replicas.close()


@contextlib.asynccontextmanager
async def balancer(
    env: Env, **settings: object
) -> AsyncIterator[tuple[lb_server.Running, lb_grpc.LoadBalancerServiceStub]]:
    values: dict[str, object] = {
        "service_name": SERVICE,
        "listen_addr": "127.0.0.1:0",
        "http_addr": "127.0.0.1:0",
        "controller_addr": env.addr,
        "report_interval_s": 0.1,
        "retry_backoff_initial_s": 0.01,
        **settings,
    }
    running = await lb_server.start(lb_server.load_settings(**values))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.built.port}")
    try:
        yield running, lb_grpc.LoadBalancerServiceStub(channel)
    finally:
        await channel.close()
        await running.stop(None)


async def until_view(admin: lb_grpc.LoadBalancerServiceStub, pred, timeout: float = 15.0) -> lb_api.GetBalancerResponse:  # type: ignore[no-untyped-def]
    view = None
    for _ in range(int(timeout / 0.05)):
        view = await admin.GetBalancer(lb_api.GetBalancerRequest(), timeout=5)
        if pred(view):
            return view
        await asyncio.sleep(0.05)
    raise AssertionError(f"balancer never got there; last view: {view}")


async def send(url: str, n: int, *, concurrency: int = 8) -> collections.Counter[tuple[int, str]]:
    """`n` GETs through the balancer, `concurrency` at a time: (status, body) -> count."""
    seen: collections.Counter[tuple[int, str]] = collections.Counter()
    left = iter(range(n))

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in left:
            async with session.get(url + "/x") as resp:
                seen[(resp.status, (await resp.text()).strip())] += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return seen


@pytest.mark.parametrize(("canary_weight", "stable_replicas"), [(100, 3), (500, 1), (900, 4)])
async def test_weights_are_honoured_within_3_points_over_2000_requests(
    env: Env, canary_weight: int, stable_replicas: int
) -> None:
    stable = [await env.replica(1) for _ in range(stable_replicas)]
    canary = await env.replica(2)
    env.stub.publish([*stable, canary], {1: 1000 - canary_weight, 2: canary_weight})
    async with balancer(env) as (running, admin):
        await until_view(
            admin, lambda v: v.split_by_version and sum(x.ready_replicas for x in v.versions) == len(stable) + 1
        )
        seen = await send(running.url, 2000)
        assert sum(seen.values()) == 2000
        assert set(seen) <= {(200, "version 1"), (200, "version 2")}
        share = 100 * seen[(200, "version 2")] / 2000
        assert abs(share - canary_weight / 10) <= 3, share
        view = await admin.GetBalancer(lb_api.GetBalancerRequest())
        by_version = {v.version: v for v in view.versions}
        assert by_version[2].share_per_mille == canary_weight
        assert by_version[2].requests_total == seen[(200, "version 2")]


async def test_a_weighted_version_without_ready_replicas_gives_its_share_to_the_others(env: Env) -> None:
    v1, v2 = await env.replica(1), await env.replica(2)
    env.stub.publish([v1, v2], {1: 600, 2: 200, 3: 200})  # v3 has no ready replica
    async with balancer(env) as (running, admin):
        await until_view(admin, lambda v: len(v.versions) == 3)
        seen = await send(running.url, 400)
        assert seen == {(200, "version 1"): 300, (200, "version 2"): 100}
        view = await admin.GetBalancer(lb_api.GetBalancerRequest())
        assert [(v.version, v.weight, v.share_per_mille, v.ready_replicas) for v in view.versions] == [
            (1, 600, 750, 1),
            (2, 200, 250, 1),
            (3, 200, 0, 0),
        ]
        # No weights: back to the policy over every replica, whatever its version.
        env.stub.publish([v1, v2], {})
        await until_view(admin, lambda v: not v.split_by_version)
        seen = await send(running.url, 100)
        assert seen == {(200, "version 1"): 50, (200, "version 2"): 50}


async def test_each_versions_errors_and_latency_are_reported_once(env: Env) -> None:
    stable = await env.replica(1)
    bad = await env.replica(2, status=500)
    with ports.Reserved() as refused:  # a v3 replica whose address refuses connections
        down = res.Endpoint(replica_id=99, url=refused.url, version=3)
        env.stub.publish([stable, bad, down], {1: 500, 2: 250, 3: 250})
        async with balancer(env) as (running, admin):
            await until_view(admin, lambda v: v.split_by_version)
            env.stub.lose_next_answer = True  # the first report with stats is applied, then resent
            seen = await send(running.url, 200, concurrency=4)
            # A refused attempt goes to another replica (v1 or v2 by weight), so the client never sees it.
            assert sum(seen.values()) == 200
            assert set(seen) == {(200, "version 1"), (500, "version 2")}

            # Each request got one answer, from v1 or v2; a refused v3 attempt is counted before the
            # retry that answered, so once every answer is reported, so is every v3 attempt.
            for _ in range(300):
                answered = sum(t[0] for v, t in env.stub.totals().items() if v != 3)
                if answered >= 200:
                    break
                await asyncio.sleep(0.05)
            totals = env.stub.totals()
            v3_attempts = totals[3][0]
            assert v3_attempts > 0
            assert totals[1] == (seen[(200, "version 1")], 0, 0, seen[(200, "version 1")])
            assert totals[2] == (seen[(500, "version 2")], seen[(500, "version 2")], 0, seen[(500, "version 2")])
            assert totals[3] == (v3_attempts, 0, v3_attempts, 0)
            # The report whose answer was lost came again, unchanged, and counted once.
            (dup,) = [d for d in env.stub.duplicates if d.version_stats]
            (first,) = [a for a in env.stub.applied if a.sequence == dup.sequence and a.balancer_id == dup.balancer_id]
            assert dup.version_stats == first.version_stats
            # Latencies landed in plausible buckets (a local answer takes well under 5 s).
            buckets = [k for r in env.stub.applied for s in r.version_stats for k in s.latency_buckets]
            assert buckets and max(buckets) <= latency.key_of(5.0)
            view = await admin.GetBalancer(lb_api.GetBalancerRequest())
            by_version = {v.version: v for v in view.versions}
            assert by_version[3].transport_errors_total == v3_attempts
            assert by_version[2].server_errors_total == seen[(500, "version 2")]

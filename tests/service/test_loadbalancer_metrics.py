"""The load balancer's own metrics: its proxy on port 0 in front of real replica HTTP servers, its
`/metrics` endpoint on port 0, scraped and parsed as Prometheus does. Each metric moves when the
thing it measures happens. (The endpoint set is fed directly; the whole process behind a real
controller is in tests/e2e/test_metrics.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from services.common import metrics as metrics_mod
from services.loadbalancer import balancer as bal
from services.loadbalancer import metrics as lb_metrics
from services.loadbalancer import policies, proxy
from tests.helpers import metrics
from tests.helpers.apps import lbapp

WEB = {"service": "web"}


@dataclasses.dataclass
class Front:
    balancer: bal.Balancer
    proxy: proxy.Proxy
    url: str
    metrics_url: str
    client: aiohttp.ClientSession


class Replicas:
    def __init__(self) -> None:
        self.runners: dict[int, web.AppRunner] = {}

    async def start(self, rid: int, version: int) -> policies.Replica:
        runner = web.AppRunner(lbapp.make_app(str(rid)), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.runners[rid] = runner
        return policies.Replica(replica_id=rid, url=f"http://127.0.0.1:{runner.addresses[0][1]}", version=version)

    async def stop(self, rid: int) -> None:
        await self.runners.pop(rid).cleanup()


@pytest.fixture
async def replicas() -> AsyncIterator[Replicas]:
    r = Replicas()
    yield r
    for rid in list(r.runners):
        await r.stop(rid)


async def _front(
    config: bal.Config, hold_timeout_s: float = 10.0
) -> tuple[Front, metrics_mod.Endpoint, web.BaseRunner]:
    registry = metrics_mod.Metrics("loadbalancer")
    stats = lb_metrics.BalancerMetrics(registry.registry, "web")
    b = bal.Balancer("web", hold_timeout_s=hold_timeout_s, hold_max=5, stats=stats)
    b.configure(config)
    px = proxy.Proxy(b, proxy.ProxySettings(backoff_initial_s=0.01))
    stats.watch(
        in_flight=lambda: b.in_flight,
        ready=lambda: len(b.policy.replicas),
        held=lambda: b.held,
        tracker=lambda: px.connections,
    )
    runner, port = await proxy.start_http(px, "127.0.0.1", 0, ssl_context=None)
    endpoint = await metrics_mod.serve(registry, "127.0.0.1:0")
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    return Front(b, px, f"http://127.0.0.1:{port}", endpoint.url, client), endpoint, runner


@pytest.fixture
async def front() -> AsyncIterator[Front]:
    f, endpoint, runner = await _front(bal.Config())
    yield f
    await f.client.close()
    await proxy.stop_http(runner, f.proxy)
    await endpoint.stop()


@pytest.fixture
async def zero_front() -> AsyncIterator[Front]:
    f, endpoint, runner = await _front(bal.Config(scales_from_zero=True), hold_timeout_s=10.0)
    yield f
    await f.client.close()
    await proxy.stop_http(runner, f.proxy)
    await endpoint.stop()


async def _get(front: Front, path: str, method: str = "GET") -> int:
    async with front.client.request(method, front.url + path) as resp:
        await resp.read()
        return resp.status


async def test_requests_are_counted_by_version_and_code_and_timed(front: Front, replicas: Replicas) -> None:
    front.balancer.set_endpoints([await replicas.start(1, version=1), await replicas.start(2, version=2)], version=1)
    for _ in range(6):
        assert await _get(front, "/whoami?token=secret") == 200
    assert await _get(front, "/status/500", "POST") == 500
    scrape = await metrics.ascrape(front.metrics_url)
    ok = scrape.value("replicaplane_loadbalancer_requests_total", **WEB, code="200")
    assert ok == 6
    by_version = {v: scrape.value("replicaplane_loadbalancer_requests_total", **WEB, version=v) for v in ("1", "2")}
    assert sum(by_version.values()) == 7 and all(by_version.values())  # least_load spreads over both
    assert scrape.value("replicaplane_loadbalancer_requests_total", **WEB, code="500") == 1
    assert scrape.value("replicaplane_loadbalancer_request_duration_seconds_count", **WEB) == 7
    assert scrape.value("replicaplane_loadbalancer_request_duration_seconds_sum", **WEB) > 0
    assert scrape.value("replicaplane_loadbalancer_in_flight_requests", **WEB) == 0
    assert scrape.value("replicaplane_loadbalancer_ready_replicas", **WEB) == 2
    per_replica = {r: scrape.value("replicaplane_loadbalancer_replica_requests_total", **WEB, replica=r) for r in "12"}
    assert sum(per_replica.values()) == 7
    assert scrape.value("replicaplane_loadbalancer_client_connections") >= 1
    assert scrape.value("replicaplane_loadbalancer_retries_total") == 0
    # No path, query or URL in any label: only bounded values.
    assert "whoami" not in scrape.text and "secret" not in scrape.text and "127.0.0.1:" not in scrape.text


async def test_in_flight_requests_show_while_they_run(front: Front, replicas: Replicas) -> None:
    front.balancer.set_endpoints([await replicas.start(1, version=1)], version=1)
    slow = asyncio.create_task(_get(front, "/slow?s=1.5"))
    scrape = await metrics.until(
        front.metrics_url, lambda s: s.value("replicaplane_loadbalancer_in_flight_requests", **WEB) == 1
    )
    assert scrape.value("replicaplane_loadbalancer_replica_in_flight_requests", **WEB, replica="1") == 1
    assert await slow == 200
    scrape = await metrics.ascrape(front.metrics_url)
    assert scrape.value("replicaplane_loadbalancer_in_flight_requests", **WEB) == 0
    assert scrape.value("replicaplane_loadbalancer_request_duration_seconds_bucket", **WEB, le="1.0") == 0
    assert scrape.value("replicaplane_loadbalancer_request_duration_seconds_bucket", **WEB, le="2.5") == 1


async def test_a_503_without_a_ready_replica_is_counted(front: Front) -> None:
    assert await _get(front, "/whoami") == 503
    scrape = await metrics.ascrape(front.metrics_url)
    assert scrape.value("replicaplane_loadbalancer_no_ready_replica_total", **WEB, reason="none_ready") == 1
    assert scrape.value("replicaplane_loadbalancer_requests_total", **WEB, version="none", code="503") == 1
    assert scrape.value("replicaplane_loadbalancer_ready_replicas", **WEB) == 0


async def test_retries_are_counted_by_reason(front: Front, replicas: Replicas) -> None:
    dead = await replicas.start(2, version=1)
    await replicas.stop(2)  # its port refuses connections now
    front.balancer.set_endpoints([dead], version=1)
    assert await _get(front, "/whoami") == 502
    scrape = await metrics.ascrape(front.metrics_url)
    assert scrape.value("replicaplane_loadbalancer_retries_total", **WEB, reason="not_reached") == 2
    assert scrape.value("replicaplane_loadbalancer_retries_total", **WEB, reason="connection_broken") == 0
    assert scrape.value("replicaplane_loadbalancer_requests_total", **WEB, version="1", code="502") == 1


async def test_a_client_that_goes_away_before_the_answer_is_counted_as_499(front: Front, replicas: Replicas) -> None:
    front.balancer.set_endpoints([await replicas.start(1, version=3)], version=1)
    slow = asyncio.create_task(_get(front, "/slow?s=5"))
    await metrics.until(front.metrics_url, lambda s: s.value("replicaplane_loadbalancer_in_flight_requests") == 1)
    slow.cancel()  # the client goes away while the replica works
    scrape = await metrics.until(
        front.metrics_url, lambda s: s.value("replicaplane_loadbalancer_requests_total", **WEB, code="499") == 1
    )
    assert scrape.value("replicaplane_loadbalancer_requests_total", **WEB, version="3", code="499") == 1
    assert scrape.value("replicaplane_loadbalancer_in_flight_requests", **WEB) == 0


async def test_a_stream_the_client_leaves_midway_counts_the_status_it_was_sent(
    front: Front, replicas: Replicas
) -> None:
    front.balancer.set_endpoints([await replicas.start(1, version=3)], version=1)
    resp = await front.client.get(f"{front.url}/stream?words=100&delay=0.05")
    await resp.content.readexactly(6)
    resp.close()
    scrape = await metrics.until(
        front.metrics_url, lambda s: s.value("replicaplane_loadbalancer_in_flight_requests", **WEB) == 0
    )
    assert scrape.value("replicaplane_loadbalancer_requests_total", **WEB, version="3", code="200") == 1


async def test_held_requests_during_scale_from_zero(zero_front: Front, replicas: Replicas) -> None:
    front = zero_front
    task = asyncio.create_task(_get(front, "/whoami"))
    scrape = await metrics.until(
        front.metrics_url, lambda s: s.value("replicaplane_loadbalancer_held_requests", **WEB) == 1
    )
    assert scrape.value("replicaplane_loadbalancer_holds_total", **WEB) == 0
    front.balancer.set_endpoints([await replicas.start(1, version=1)], version=1)
    assert await task == 200
    scrape = await metrics.ascrape(front.metrics_url)
    assert scrape.value("replicaplane_loadbalancer_held_requests", **WEB) == 0
    assert scrape.value("replicaplane_loadbalancer_holds_total", **WEB, outcome="released") == 1
    assert scrape.value("replicaplane_loadbalancer_hold_duration_seconds_count", **WEB, outcome="released") == 1
    assert scrape.value("replicaplane_loadbalancer_no_ready_replica_total", **WEB) == 0


async def test_a_hold_that_times_out_is_a_503_counted_as_such(replicas: Replicas) -> None:
    front, endpoint, runner = await _front(bal.Config(scales_from_zero=True), hold_timeout_s=0.2)
    try:
        assert await _get(front, "/whoami") == 503
        scrape = await metrics.ascrape(front.metrics_url)
        assert scrape.value("replicaplane_loadbalancer_holds_total", **WEB, outcome="timed_out") == 1
        assert scrape.value("replicaplane_loadbalancer_no_ready_replica_total", **WEB, reason="hold_timeout") == 1
    finally:
        await front.client.close()
        await proxy.stop_http(runner, front.proxy)
        await endpoint.stop()


async def test_a_gone_replicas_series_go_with_it(front: Front, replicas: Replicas) -> None:
    one, two = await replicas.start(1, version=1), await replicas.start(2, version=1)
    front.balancer.set_endpoints([one, two], version=1)
    for _ in range(4):
        await _get(front, "/whoami")
    front.balancer.set_endpoints([two], version=2)
    scrape = await metrics.ascrape(front.metrics_url)
    assert not scrape.has("replicaplane_loadbalancer_replica_requests_total", replica="1")
    assert scrape.has("replicaplane_loadbalancer_replica_requests_total", replica="2")
    # The service's own counts keep every request.
    assert scrape.value("replicaplane_loadbalancer_requests_total", **WEB, code="200") == 4

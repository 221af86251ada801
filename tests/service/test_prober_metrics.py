"""The prober's own metrics on a real server on port 0, scraped and parsed as Prometheus does:
each one moves when probes happen."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common import grpc_server
from services.prober import server
from tests.helpers import metrics, ports, prober_apps
from tests.helpers.prober_stream import ProbeSession, target


@pytest.fixture
async def prober() -> AsyncIterator[tuple[str, str]]:
    built = await server.build_server(server.Settings(listen_addr="127.0.0.1:0", metrics_addr="127.0.0.1:0"))
    endpoint = await grpc_server.serve_metrics(built, "127.0.0.1:0")
    assert endpoint is not None
    await built.start()
    yield f"127.0.0.1:{built.port}", endpoint.url
    await built.stop(0.5)
    await endpoint.stop()


@pytest.fixture
async def app() -> AsyncIterator[prober_apps.App]:
    a = await prober_apps.App().start()
    yield a
    await a.stop()


async def test_probes_are_counted_and_timed_by_outcome(prober: tuple[str, str], app: prober_apps.App) -> None:
    addr, url = prober
    before = await metrics.ascrape(url)
    assert before.value("replicaplane_prober_probes_total") == 0
    async with ProbeSession(addr) as session:
        await session.send([target("a", app.url, interval=0.05)])
        after = await metrics.until(url, lambda s: s.value("replicaplane_prober_probes_total", outcome="ready") >= 3)
    assert after.value("replicaplane_prober_probe_duration_seconds_count", outcome="ready") >= 3
    assert after.value("replicaplane_prober_probe_duration_seconds_sum", outcome="ready") > 0
    assert after.value("replicaplane_prober_probe_duration_seconds_bucket", outcome="ready", le="30.0") >= 3
    assert after.value("replicaplane_prober_probe_failures_total") == 0
    assert after.family("replicaplane_prober_probes").type == "counter"
    assert after.family("replicaplane_prober_probe_duration_seconds").type == "histogram"


async def test_failures_are_counted_by_kind(prober: tuple[str, str], app: prober_apps.App) -> None:
    addr, url = prober
    app.status = 503
    with ports.Reserved() as nowhere:
        async with ProbeSession(addr) as session:
            await session.send(
                [
                    target("http", app.url, interval=10),
                    target("refused", nowhere.url, interval=10),
                    target("bad", "ftp://127.0.0.1:21"),
                ]
            )
            scrape = await metrics.until(
                url, lambda s: s.value("replicaplane_prober_probe_failures_total") >= 3, what="three failures"
            )
    assert scrape.value("replicaplane_prober_probe_failures_total", kind="http_status") == 1
    assert scrape.value("replicaplane_prober_probe_failures_total", kind="connection_refused") == 1
    assert scrape.value("replicaplane_prober_probe_failures_total", kind="invalid_target") == 1
    assert scrape.value("replicaplane_prober_probes_total", outcome="replica_failure") == 2
    assert scrape.value("replicaplane_prober_probes_total", outcome="invalid_target") == 1
    assert scrape.value("replicaplane_prober_probe_duration_seconds_count", outcome="replica_failure") == 2
    # Bounded labels only: no target id, URL or path anywhere in the prober's metrics.
    for family in scrape.families.values():
        for sample in family.samples:
            assert not {"target_id", "url", "path", "endpoint"} & set(sample.labels), sample


async def test_a_timeout_is_its_own_kind(prober: tuple[str, str], app: prober_apps.App) -> None:
    addr, url = prober
    app.delay_s = 2.0
    async with ProbeSession(addr) as session:
        await session.send([target("slow", app.url, timeout=0.05, interval=10)])
        scrape = await metrics.until(url, lambda s: s.value("replicaplane_prober_probe_failures_total") >= 1)
    assert scrape.value("replicaplane_prober_probe_failures_total", kind="timeout") == 1


async def test_assigned_replicas_and_streams_follow_the_targets(prober: tuple[str, str], app: prober_apps.App) -> None:
    addr, url = prober
    scrape = await metrics.ascrape(url)
    assert scrape.value("replicaplane_prober_assigned_replicas") == 0
    assert scrape.value("replicaplane_prober_streams") == 0
    async with ProbeSession(addr) as session:
        await session.send([target(f"r{i}", app.url, interval=10) for i in range(3)])
        await metrics.until(url, lambda s: s.value("replicaplane_prober_assigned_replicas") == 3)
        async with ProbeSession(addr) as other:
            await other.send([target("x", app.url, interval=10)])
            scrape = await metrics.until(url, lambda s: s.value("replicaplane_prober_assigned_replicas") == 4)
            assert scrape.value("replicaplane_prober_streams") == 2
        await session.send(remove=["r0"])
        await metrics.until(url, lambda s: s.value("replicaplane_prober_assigned_replicas") == 2)
    scrape = await metrics.until(url, lambda s: s.value("replicaplane_prober_streams") == 0)
    assert scrape.value("replicaplane_prober_assigned_replicas") == 0

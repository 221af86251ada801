"""The web dashboard's own metrics: a real controller (scripted provisioner, real prober) and the
dashboard in-process on port 0, with its `/metrics` on port 0, scraped and parsed as Prometheus
does. Open pages, the controller streams behind them, events sent and pages turned away each
move when the thing they count happens."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replicaplane.controller.v1 import controller_service_pb2 as api
from services.common import errors, grpc_server
from services.dashboard import server as dash_server
from tests.helpers import metrics
from tests.service import test_controller as tc
from tests.service import test_dashboard as td

HEALTH = {"grpc_service": "grpc.health.v1.Health", "grpc_method": "Check"}


@contextlib.asynccontextmanager
async def metered(controller_addr: str, **settings: object) -> AsyncIterator[tuple[dash_server.Running, str]]:
    async with td.dashboard(controller_addr, metrics_addr="127.0.0.1:0", **settings) as dash:
        endpoint = await grpc_server.serve_metrics(dash.built, "127.0.0.1:0")
        assert endpoint is not None
        try:
            yield dash, endpoint.url
        finally:
            await endpoint.stop()


def followed(scrape: metrics.Scrape) -> float:
    """Tokens followed now, whatever their state."""
    return scrape.value("replicaplane_dashboard_bridges")


async def test_open_pages_controller_streams_and_events_are_counted(tmp_path) -> None:
    async with tc.started(tmp_path) as env, metered(env.addr, linger_s=0.0) as (dash, url):
        before = await metrics.ascrape(url)
        (build,) = before.samples("replicaplane_build_info")
        assert build.labels["component"] == "dashboard"
        assert before.value("replicaplane_dashboard_pages") == 0
        assert before.value("replicaplane_dashboard_controller_streams") == 0
        assert followed(before) == 0
        # Every kind and outcome is there from the start, at 0.
        for kind in ("snapshot", "change", "connection", "denied", "closing"):
            assert before.has("replicaplane_dashboard_events_sent_total", kind=kind), kind
            assert before.value("replicaplane_dashboard_events_sent_total", kind=kind) == 0
        for outcome in ("accepted", "bad_token", "denied", "full"):
            assert before.value("replicaplane_dashboard_page_connections_total", outcome=outcome) == 0
        for state in ("starting", "live", "unreachable", "denied"):
            assert before.has("replicaplane_dashboard_bridges", state=state), state

        await env.stub.CreateService(api.CreateServiceRequest(yaml=tc.spec("metered")))
        async with td.events(dash.url) as stream:
            assert (await stream.next())[0] == "snapshot"
            await stream.until(td.ready_row("metered"))
            during = await metrics.until(
                url,
                lambda s: (
                    s.value("replicaplane_dashboard_pages") == 1
                    and s.value("replicaplane_dashboard_controller_streams") == 1
                ),
                what="one page over one watch stream",
            )
            assert during.value("replicaplane_dashboard_bridges", state="live") == 1
            assert followed(during) == 1
            assert during.value("replicaplane_dashboard_page_connections_total", outcome="accepted") == 1
            assert during.value("replicaplane_dashboard_events_sent_total", kind="snapshot") == 1
            assert during.value("replicaplane_dashboard_events_sent_total", kind="change") >= 1

            # A second service: a second stream behind the same page.
            await env.stub.CreateService(api.CreateServiceRequest(yaml=tc.spec("second")))
            await metrics.until(
                url, lambda s: s.value("replicaplane_dashboard_controller_streams") == 2, what="two watch streams"
            )

        # The page closed; with no linger its token's streams close too.
        after = await metrics.until(
            url,
            lambda s: (
                s.value("replicaplane_dashboard_pages") == 0
                and s.value("replicaplane_dashboard_controller_streams") == 0
                and followed(s) == 0
            ),
            what="no page and no stream",
        )
        assert after.family("replicaplane_dashboard_events_sent").type == "counter"
        assert after.family("replicaplane_dashboard_pages").type == "gauge"

        # Its gRPC side (health only) is counted like every service's.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{dash.built.port}") as channel:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        await metrics.until(url, lambda s: s.value("grpc_server_handled_total", **HEALTH, grpc_code="OK") == 1)


async def test_pages_turned_away_are_counted_by_reason(tmp_path) -> None:
    async with (
        tc.started(tmp_path, auth_token=td.TOKEN) as env,
        metered(env.addr, max_pages=1) as (dash, url),
        aiohttp.ClientSession() as session,
    ):
        async with session.get(f"{dash.url}api/events", headers={"Authorization": "Basic eDp5"}) as resp:
            assert resp.status == 401
        async with session.get(f"{dash.url}api/events") as resp:
            assert resp.status == 401  # the controller wants a token
        async with td.events(dash.url, td.TOKEN) as stream:
            await stream.next()
            async with session.get(f"{dash.url}api/events", headers={"Authorization": f"Bearer {td.TOKEN}"}) as resp:
                assert resp.status == 503
        scrape = await metrics.ascrape(url)
        assert {
            outcome: scrape.value("replicaplane_dashboard_page_connections_total", outcome=outcome)
            for outcome in ("accepted", "bad_token", "denied", "full")
        } == {"accepted": 1, "bad_token": 1, "denied": 1, "full": 1}
        assert td.TOKEN not in scrape.text


async def test_metrics_can_be_turned_off(tmp_path) -> None:
    async with tc.started(tmp_path) as env, td.dashboard(env.addr, metrics_addr="") as dash:
        assert dash.built.metrics is None
        assert await grpc_server.serve_metrics(dash.built, "127.0.0.1:0") is None
        async with td.events(dash.url) as stream:
            assert (await stream.next())[0] == "snapshot"


def test_metrics_addr_setting_is_checked() -> None:
    with pytest.raises(errors.ValidationError) as err:
        dash_server.load_settings(environ={}, metrics_addr="nowhere")
    assert [v.field for v in err.value.violations] == ["dashboard.metrics_addr"]
    assert dash_server.load_settings(environ={}).metrics_addr == "127.0.0.1:9459"
    assert dash_server.load_settings(environ={"REPLICAPLANE_DASHBOARD_METRICS_ADDR": ""}).metrics_addr == ""

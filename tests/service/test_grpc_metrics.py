"""The shared metrics of every service, on a real server (the prober's) on port 0: the `/metrics`
endpoint, process and build info, and the gRPC interceptor's per-method, per-code metrics."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replicaplane.prober.v1 import prober_service_pb2_grpc
from services.common import errors, grpc_server, security
from services.common import metrics as metrics_mod
from services.prober import probing, server, servicer, streams
from tests.helpers import metrics
from tests.helpers.prober_stream import ProbeSession

HEALTH = "grpc.health.v1.Health"
PROBER = "replicaplane.prober.v1.ProberService"


@pytest.fixture
async def prober() -> AsyncIterator[tuple[server.Built, str]]:
    built = await server.build_server(server.Settings(listen_addr="127.0.0.1:0", metrics_addr="127.0.0.1:0"))
    endpoint = await grpc_server.serve_metrics(built, "127.0.0.1:0")
    assert endpoint is not None
    await built.start()
    yield built, endpoint.url
    await built.stop(0.5)
    await endpoint.stop()


async def test_endpoint_serves_process_python_and_build_info(prober: tuple[server.Built, str]) -> None:
    _, url = prober
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    scrape = await metrics.ascrape(url)
    assert scrape.value("process_resident_memory_bytes") > 0
    assert scrape.has("process_cpu_seconds_total")
    assert scrape.has("process_open_fds")
    assert scrape.has("python_info")
    assert scrape.has("python_gc_collections_total")
    (build,) = scrape.samples("replicaplane_build_info")
    assert build.value == 1
    assert build.labels["component"] == "prober"
    assert build.labels["version"] == metrics_mod.version() != ""
    assert build.labels["git_commit"] == metrics_mod.git_commit()


async def test_endpoint_answers_only_its_path_and_negotiates_openmetrics(prober: tuple[server.Built, str]) -> None:
    _, url = prober
    with pytest.raises(urllib.error.HTTPError) as err:
        await asyncio.to_thread(urllib.request.urlopen, url.replace("/metrics", "/other"), timeout=5)
    assert err.value.code == 404
    request = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with await asyncio.to_thread(urllib.request.urlopen, request, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
        assert resp.read().decode().rstrip().endswith("# EOF")


async def test_grpc_calls_are_counted_timed_by_method_and_code(prober: tuple[server.Built, str]) -> None:
    built, url = prober
    async with grpc.aio.insecure_channel(f"127.0.0.1:{built.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(2):
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    check = {"grpc_service": HEALTH, "grpc_method": "Check", "grpc_type": "unary"}
    # The server counts a call once its answer is sent: the client may see it a moment before.
    scrape = await metrics.until(
        url,
        lambda s: (
            s.value("grpc_server_handled_total", **check, grpc_code="OK") >= 2
            and s.value("grpc_server_handled_total", **check, grpc_code="NOT_FOUND") >= 1
        ),
        what="the three calls counted",
    )
    assert scrape.value("grpc_server_started_total", **check) == 3
    assert scrape.value("grpc_server_handled_total", **check, grpc_code="OK") == 2
    assert scrape.value("grpc_server_handled_total", **check, grpc_code="NOT_FOUND") == 1
    assert scrape.value("grpc_server_handling_seconds_count", **check, grpc_code="OK") == 2
    assert scrape.value("grpc_server_handling_seconds_bucket", **check, grpc_code="OK", le="+Inf") == 2
    assert scrape.value("grpc_server_handling_seconds_sum", **check) > 0
    assert scrape.value("grpc_server_msg_received_total", **check) == 3
    assert scrape.value("grpc_server_msg_sent_total", **check) == 2
    assert scrape.value("grpc_server_in_flight_rpcs", **check) == 0


async def test_an_open_stream_is_in_flight_until_it_ends(prober: tuple[server.Built, str]) -> None:
    built, url = prober
    probe = {"grpc_service": PROBER, "grpc_method": "Probe", "grpc_type": "bidi_stream"}
    async with ProbeSession(f"127.0.0.1:{built.port}") as session:
        await session.send([])
        scrape = await metrics.until(url, lambda s: s.value("grpc_server_in_flight_rpcs", **probe) == 1)
        assert scrape.value("grpc_server_started_total", **probe) == 1
        assert scrape.value("grpc_server_msg_received_total", **probe) >= 1
    scrape = await metrics.until(url, lambda s: s.value("grpc_server_in_flight_rpcs", **probe) == 0)
    assert scrape.value("grpc_server_handled_total", **probe) == 1
    (ended,) = scrape.samples("grpc_server_handled_total", **probe)
    assert ended.labels["grpc_code"] in ("OK", "CANCELLED")


async def test_health_watch_streams_through_every_interceptor(prober: tuple[server.Built, str]) -> None:
    # Health's Watch streams with context.write() rather than as a generator.
    built, url = prober
    async with grpc.aio.insecure_channel(f"127.0.0.1:{built.port}") as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5)
        first = await call.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        call.cancel()
    watch = {"grpc_service": HEALTH, "grpc_method": "Watch", "grpc_type": "server_stream"}
    scrape = await metrics.until(url, lambda s: s.value("grpc_server_handled_total", **watch) == 1)
    assert scrape.value("grpc_server_handled_total", **watch, grpc_code="CANCELLED") == 1
    assert scrape.value("grpc_server_in_flight_rpcs", **watch) == 0


async def test_metrics_are_off_without_an_address() -> None:
    built = await server.build_server(server.Settings(listen_addr="127.0.0.1:0", metrics_addr=""))
    try:
        assert built.metrics is None
        assert await grpc_server.serve_metrics(built, "") is None
    finally:
        await built.stop(None)


async def test_a_bad_metrics_address_stops_the_service_naming_the_setting() -> None:
    built = await server.build_server(server.Settings(listen_addr="127.0.0.1:0"))
    try:
        with pytest.raises(errors.ValidationError) as bad:
            await grpc_server.serve_metrics(built, "no-port-here")
        assert bad.value.violations[0].field == "prober.metrics_addr"
        taken = await grpc_server.serve_metrics(built, "127.0.0.1:0")
        assert taken is not None
        with pytest.raises(RuntimeError, match=r"prober\.metrics_addr"):
            await grpc_server.serve_metrics(built, f"127.0.0.1:{taken.port}")
        await taken.stop()
    finally:
        await built.stop(None)


async def test_calls_refused_by_the_token_check_are_counted() -> None:
    # The metrics interceptor is outermost: a call the token check refuses still counts.
    registry = metrics_mod.Metrics("prober")
    server_ = grpc_server.new_server(
        domain="test", interceptors=[security.TokenInterceptor({"s3cret-token": "ops"})], metrics=registry
    )
    engine = streams.Engine(probing.HttpProber(), probing.Defaults(), streams.StreamSettings())
    prober_service_pb2_grpc.add_ProberServiceServicer_to_server(servicer.ProberServicer(engine, "p"), server_)
    built = grpc_server.finish(server_, "127.0.0.1:0", [PROBER], metrics=registry)
    endpoint = await grpc_server.serve_metrics(built, "127.0.0.1:0")
    assert endpoint is not None
    await built.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{built.port}") as channel:
            call = prober_service_pb2_grpc.ProberServiceStub(channel).Probe(timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        probe = {"grpc_service": PROBER, "grpc_method": "Probe", "grpc_type": "bidi_stream"}
        scrape = await metrics.until(
            endpoint.url, lambda s: s.value("grpc_server_handled_total", **probe, grpc_code="UNAUTHENTICATED") == 1
        )
        assert "s3cret-token" not in scrape.text
    finally:
        await built.stop(None)
        await endpoint.stop()
        await engine.close()

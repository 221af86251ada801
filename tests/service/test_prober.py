"""Service tests of the prober: a real server on port 0 probing real tiny HTTP apps."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replicaplane.prober.v1 import prober_service_pb2 as pb
from services.prober import server
from tests.helpers import ports, prober_apps
from tests.helpers.prober_stream import ProbeSession, target

SECRET = "Bearer hunter2-very-secret"


@pytest.fixture
async def prober() -> AsyncIterator[server.Built]:
    built = await server.build_server(server.Settings(listen_addr="127.0.0.1:0", prober_id="prober-test"))
    await built.start()
    yield built
    await built.stop(0.5)


@pytest.fixture
async def app() -> AsyncIterator[prober_apps.App]:
    a = await prober_apps.App().start()
    yield a
    await a.stop()


def addr(built: server.Built) -> str:
    return f"127.0.0.1:{built.port}"


def of(target_id: str, outcome: int | None = None) -> object:
    return lambda r: r.target_id == target_id and (outcome is None or r.outcome == outcome)


async def test_get_probe_of_a_healthy_app_is_ready(prober: server.Built, app: prober_apps.App) -> None:
    async with ProbeSession(addr(prober)) as session:
        assert session.initial_metadata["x-prober-id"] == "prober-test"
        before = time.time()
        await session.send([target("a", app.url, "/health", interval=10)])
        result = await session.wait_for(of("a"))
    assert result.ready
    assert result.outcome == pb.PROBE_OUTCOME_READY
    assert result.http_code == 200
    assert result.error == ""
    assert result.prober_id == "prober-test"
    assert session.responses[0].prober_id == "prober-test"
    assert result.latency.ToNanoseconds() > 0
    assert before - 1 <= result.probe_time.ToNanoseconds() / 1e9 <= time.time()
    assert [(r.method, r.path) for r in app.requests] == [("GET", "/health")]


async def test_post_probe_sends_the_json_body_and_headers(prober: server.Built, app: prober_apps.App) -> None:
    body = json.dumps({"model": "x", "prompt": "hi"})
    probe = target(
        "p",
        app.url,
        "/v1/ready",
        method=pb.PROBE_METHOD_POST,
        post_data_json=body,
        headers={"Authorization": SECRET, "X-Extra": "1"},
        interval=10,
    )
    async with ProbeSession(addr(prober)) as session:
        await session.send([probe])
        result = await session.wait_for(of("p"))
    assert result.ready
    (request,) = app.requests
    assert request.method == "POST"
    assert request.path == "/v1/ready"
    assert json.loads(request.body) == {"model": "x", "prompt": "hi"}
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers["Authorization"] == SECRET
    assert request.headers["X-Extra"] == "1"


async def test_http_500_is_a_replica_failure_with_the_code(prober: server.Built, app: prober_apps.App) -> None:
    app.status = 500
    async with ProbeSession(addr(prober)) as session:
        await session.send([target("a", app.url, headers={"Authorization": SECRET}, interval=10)])
        result = await session.wait_for(of("a"))
    assert not result.ready
    assert result.outcome == pb.PROBE_OUTCOME_REPLICA_FAILURE
    assert result.http_code == 500
    assert result.error == "HTTP 500"


@pytest.mark.parametrize("status", [201, 204, 301, 404, 503])
async def test_only_200_counts_as_ready(prober: server.Built, app: prober_apps.App, status: int) -> None:
    app.status = status
    async with ProbeSession(addr(prober)) as session:
        await session.send([target("a", app.url, interval=10)])
        result = await session.wait_for(of("a"))
    assert not result.ready
    assert result.outcome == pb.PROBE_OUTCOME_REPLICA_FAILURE


async def test_timeout_is_a_replica_failure_that_says_so(prober: server.Built, app: prober_apps.App) -> None:
    app.delay_s = 2.0
    async with ProbeSession(addr(prober)) as session:
        await session.send([target("slow", app.url, timeout=0.2, interval=10, headers={"X-Key": SECRET})])
        result = await session.wait_for(of("slow"))
    assert result.outcome == pb.PROBE_OUTCOME_REPLICA_FAILURE
    assert result.http_code == 0
    assert result.error == "timeout after 0.2s"
    assert 0.15 <= result.latency.ToNanoseconds() / 1e9 < 1.5


async def test_refused_connection_is_a_replica_failure(prober: server.Built) -> None:
    with ports.Reserved() as nowhere:
        async with ProbeSession(addr(prober)) as session:
            await session.send([target("gone", nowhere.url, interval=10)])
            result = await session.wait_for(of("gone"))
    assert result.outcome == pb.PROBE_OUTCOME_REPLICA_FAILURE
    assert result.error == "connection refused"


async def test_non_http_targets_are_refused_and_the_stream_goes_on(prober: server.Built, app: prober_apps.App) -> None:
    async with ProbeSession(addr(prober)) as session:
        await session.send(
            [
                target("ftp", "ftp://127.0.0.1:21", headers={"Authorization": SECRET}),
                target("nourl", "not a url"),
                target("ok", app.url, interval=10),
            ]
        )
        ftp = await session.wait_for(of("ftp"))
        nourl = await session.wait_for(of("nourl"))
        ok = await session.wait_for(of("ok"))
    for refused in (ftp, nourl):
        assert refused.outcome == pb.PROBE_OUTCOME_INVALID_TARGET
        assert not refused.ready
        assert "url" in refused.error
        assert "hunter2" not in refused.error
    assert ok.ready
    assert session.ended is None


async def test_config_change_on_a_live_stream_takes_effect_at_once(prober: server.Built, app: prober_apps.App) -> None:
    other = await prober_apps.App(status=503).start()
    try:
        async with ProbeSession(addr(prober)) as session:
            await session.send([target("a", other.url, "/old", interval=10)])
            first = await session.wait_for(of("a"))
            assert first.http_code == 503
            changed = time.perf_counter()
            await session.send([target("a", app.url, "/new", interval=10)])
            second = await session.wait_for(of("a"), since=changed, timeout=1.0)
            assert second.ready
            assert [r.path for r in app.requests] == ["/new"]
            assert len(other.requests) == 1
    finally:
        await other.stop()


async def test_interval_change_and_removal_on_a_live_stream(prober: server.Built, app: prober_apps.App) -> None:
    async with ProbeSession(addr(prober)) as session:
        await session.send([target("a", app.url, interval=10)])
        await session.wait_for(of("a"))
        await asyncio.sleep(0.3)
        assert len(session.matching(of("a"))) == 1
        await session.send([target("a", app.url, interval=0.05)])
        await asyncio.sleep(0.5)
        assert len(session.matching(of("a"))) >= 5
        await session.send(remove=["a"])
        await asyncio.sleep(0.1)
        removed_at = time.perf_counter()
        await asyncio.sleep(0.3)
        assert session.matching(of("a"), since=removed_at) == []


async def test_starting_replica_is_seen_ready_within_150_ms_of_answering(prober: server.Built) -> None:
    """The latency bound the fast startup interval exists for (default fast interval 100 ms)."""
    # Addresses that refuse connections until each app listens on its reserved socket.
    reserved = [ports.Reserved() for _ in range(5)]
    apps: list[prober_apps.App] = []
    async with ProbeSession(addr(prober)) as session:
        await session.send([target(f"s{i}", r.url, starting=True, interval=10) for i, r in enumerate(reserved)])
        for i in range(len(reserved)):
            await session.wait_for(of(f"s{i}", pb.PROBE_OUTCOME_REPLICA_FAILURE))
        delays = []
        for i, port in enumerate(reserved):
            await asyncio.sleep(0.037 * (i + 1))  # different phases of the fast interval
            app = prober_apps.App()
            answering = time.perf_counter()
            apps.append(await app.start(sock=port.take()))
            await session.wait_for(of(f"s{i}", pb.PROBE_OUTCOME_READY), since=answering, timeout=2)
            seen = next(t for t, r in session.results if r.target_id == f"s{i}" and r.ready)
            delays.append(seen - answering)
        # After the first success the target falls back to its 10 s interval.
        settled = time.perf_counter()
        await asyncio.sleep(0.3)
        assert session.matching(lambda r: True, since=settled) == []
    for app in apps:
        await app.stop()
    assert max(delays) < 0.150, delays


async def test_slow_replica_never_delays_other_replicas(prober: server.Built, app: prober_apps.App) -> None:
    slow = await prober_apps.App(delay_s=3.0).start()
    try:
        async with ProbeSession(addr(prober)) as session:
            await session.send(
                [target(f"slow{i}", slow.url, timeout=5, interval=0.05) for i in range(20)]
                + [target("fast", app.url, interval=0.05)]
            )
            await asyncio.sleep(0.6)
            fast = session.matching(of("fast"))
            assert len(fast) >= 8
            assert all(r.ready for r in fast)
            assert session.matching(lambda r: r.target_id.startswith("slow")) == []
    finally:
        await slow.stop()


async def test_header_values_never_reach_logs_or_results(
    prober: server.Built, app: prober_apps.App, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    app.status = 401
    with ports.Reserved() as gone:
        async with ProbeSession(addr(prober)) as session:
            await session.send(
                [
                    target("a", app.url, headers={"Authorization": SECRET}, interval=10),
                    target("b", gone.url, headers={"Authorization": SECRET}, interval=10),
                    target("c", "ftp://x", headers={"Authorization": SECRET}),
                    target("d", app.url, headers={"Authorization": SECRET + "\r\nX: y"}),
                ]
            )
            for name in "abcd":
                await session.wait_for(of(name))
    assert all("hunter2" not in r.SerializeToString().decode("latin-1") for _, r in session.results)
    assert "hunter2" not in caplog.text


async def test_health_reports_serving(prober: server.Built) -> None:
    async with grpc.aio.insecure_channel(addr(prober)) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=server.SERVICE_NAME), timeout=5
        )
    assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_stopping_the_prober_ends_its_streams_at_once(app: prober_apps.App) -> None:
    built = await server.build_server(server.Settings(listen_addr="127.0.0.1:0"))
    await built.start()
    async with ProbeSession(addr(built)) as session:
        await session.send([target("a", app.url, interval=10)])
        await session.wait_for(of("a"))
        started = time.monotonic()
        stopping = asyncio.get_running_loop().create_task(built.stop(5.0))
        code = await session.wait_for_end(timeout=3)
        assert code is not None
        assert time.monotonic() - started < 1.0
        await stopping


async def test_half_closed_stream_keeps_probing(prober: server.Built, app: prober_apps.App) -> None:
    async with ProbeSession(addr(prober)) as session:
        await session.send([target("a", app.url, interval=0.05)])
        await session._call.done_writing()
        await asyncio.sleep(0.4)
        assert len(session.matching(of("a"))) >= 4


async def test_a_client_leaving_stops_its_probes(prober: server.Built, app: prober_apps.App) -> None:
    assert prober.engine is not None
    async with ProbeSession(addr(prober)) as session:
        await session.send([target("a", app.url, interval=0.02)])
        await session.wait_for(of("a"))
        assert prober.engine.stream_count == 1
    deadline = time.monotonic() + 2
    while prober.engine.stream_count and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert prober.engine.stream_count == 0
    count = len(app.requests)
    await asyncio.sleep(0.1)
    assert len(app.requests) == count

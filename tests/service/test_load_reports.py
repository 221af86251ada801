"""Load reports from a balancer to a real controller (scripted provisioner, real prober), all
in-process on port 0: each report counted exactly once, whatever the clocks say, and a bad entry
or a refused report never stops later load from being counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from services.common import pbtime
from services.loadbalancer import balancer as bal
from services.loadbalancer import link as ctl_link
from tests.helpers import grpc_proxy
from tests.service import test_controller as tc

STREAMS = {"WatchService", "WatchEndpoints", "StreamReplicaLogs"}
URL = "http://127.0.0.1:30001"
WINDOW_S = 60.0  # the controller's default load window


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[tc.Env]:
    async with tc.started(tmp_path) as e:
        await tc.create(e, tc.spec())
        yield e


def balancer_and_link(
    stub: api_grpc.ControllerServiceStub, clock: Callable[[], float] = time.time
) -> tuple[bal.Balancer, ctl_link.ControllerLink]:
    balancer = bal.Balancer("svc", hold_timeout_s=0, hold_max=1, clock=clock)
    link = ctl_link.ControllerLink(stub, balancer, url=URL, report_interval_s=60, heartbeat_s=60, clock=clock)
    return balancer, link


async def qps_now(env: tc.Env) -> float:
    """The controller's QPS, read with an empty report (which counts nothing)."""
    return (await env.stub.ReportLoad(api.ReportLoadRequest(service_name="svc"))).qps


async def test_a_report_applied_after_the_balancer_deadline_and_resent_is_counted_once(env: tc.Env) -> None:
    async with (
        grpc_proxy.serving(env.addr, streaming=STREAMS) as (proxy, addr),
        grpc.aio.insecure_channel(addr) as channel,
    ):
        balancer, link = balancer_and_link(api_grpc.ControllerServiceStub(channel))
        balancer.record_arrival()
        proxy.slow("ReportLoad", 2.0)  # the controller applies it; the answer comes too late
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await link.report_once(timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: proxy.forwarded["ReportLoad"] == 1)  # the controller applied it
        assert link.unreported == 1  # kept: the balancer cannot know it was applied
        await link.report_once(timeout=5)  # the retry reaches the controller too
        assert proxy.forwarded["ReportLoad"] == 2
    assert link.unreported == 0
    assert link.last_qps == pytest.approx(1 / WINDOW_S)
    assert await qps_now(env) == pytest.approx(1 / WINDOW_S)  # not 2 / 60


async def until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_the_report_loop_resends_a_slow_report_once_then_sends_newer_arrivals(env: tc.Env) -> None:
    async with (
        grpc_proxy.serving(env.addr, streaming=STREAMS) as (proxy, addr),
        grpc.aio.insecure_channel(addr) as channel,
    ):
        balancer = bal.Balancer("svc", hold_timeout_s=0, hold_max=1)
        link = ctl_link.ControllerLink(
            api_grpc.ControllerServiceStub(channel),
            balancer,
            url=URL,
            report_interval_s=0.05,
            heartbeat_s=60,
            call_timeout_s=0.3,
        )
        balancer.record_arrival()
        proxy.slow("ReportLoad", 1.0)
        link.start()
        try:
            await until(lambda: proxy.forwarded["ReportLoad"] == 1)
            for _ in range(2):
                balancer.record_arrival()  # while the first report's answer is late
            await until(lambda: link.unreported == 0 and proxy.forwarded["ReportLoad"] >= 3)
        finally:
            await link.stop()
    assert await qps_now(env) == pytest.approx(3 / WINDOW_S)  # 1 + 2, each once


async def test_arrivals_after_a_failed_report_go_in_the_next_one_and_are_counted(env: tc.Env) -> None:
    async with (
        grpc_proxy.serving(env.addr, streaming=STREAMS) as (proxy, addr),
        grpc.aio.insecure_channel(addr) as channel,
    ):
        balancer, link = balancer_and_link(api_grpc.ControllerServiceStub(channel))
        balancer.record_arrival()
        proxy.refuse("ReportLoad", grpc.StatusCode.UNAVAILABLE, "controller restarting")
        with pytest.raises(grpc.aio.AioRpcError):
            await link.report_once(timeout=5)
        for _ in range(2):
            balancer.record_arrival()  # while the first report waits to go again
        assert link.unreported == 3
        await link.report_once(timeout=5)
        await link.report_once(timeout=5)
    assert link.unreported == 0
    assert await qps_now(env) == pytest.approx(3 / WINDOW_S)


@pytest.mark.parametrize("skew_s", [-90.0, 90.0], ids=["behind", "ahead"])
async def test_a_balancer_clock_90s_off_still_gives_the_right_qps(env: tc.Env, skew_s: float) -> None:
    balancer, link = balancer_and_link(env.stub, clock=lambda: time.time() + skew_s)
    for _ in range(6):
        balancer.record_arrival()
    await link.report_once(timeout=5)
    assert link.last_qps == pytest.approx(6 / WINDOW_S)
    for _ in range(3):
        balancer.record_arrival()
    await link.report_once(timeout=5)  # and every later report too
    assert await qps_now(env) == pytest.approx(9 / WINDOW_S)


async def test_a_refused_report_is_dropped_and_later_load_is_still_counted(env: tc.Env) -> None:
    async with (
        grpc_proxy.serving(env.addr, streaming=STREAMS) as (proxy, addr),
        grpc.aio.insecure_channel(addr) as channel,
    ):
        balancer, link = balancer_and_link(api_grpc.ControllerServiceStub(channel))
        balancer.record_arrival()
        proxy.refuse("ReportLoad", grpc.StatusCode.INVALID_ARGUMENT, "invalid load report")
        with pytest.raises(grpc.aio.AioRpcError):
            await link.report_once(timeout=5)
        assert link.unreported == 0  # sending it again could only be refused again
        assert link.dropped_requests == 1
        for _ in range(2):
            balancer.record_arrival()
        await link.report_once(timeout=5)
    assert await qps_now(env) == pytest.approx(2 / WINDOW_S)


async def test_a_time_far_ahead_does_not_stop_the_rest_of_the_report_being_counted(env: tc.Env) -> None:
    now = time.time()
    times = [pbtime.timestamp(t) for t in (now - 1, now, now + 3600, now - 3600)]
    response = await env.stub.ReportLoad(api.ReportLoadRequest(service_name="svc", request_times=times))
    # Ahead of the controller's clock: counted at arrival; older than the window: nothing.
    assert response.qps == pytest.approx(3 / WINDOW_S)
    response = await env.stub.ReportLoad(api.ReportLoadRequest(service_name="svc", request_count=1))
    assert response.qps == pytest.approx(4 / WINDOW_S)


async def test_a_thousand_bad_times_answer_invalid_argument_with_a_short_list(env: tc.Env) -> None:
    bad = [timestamp_pb2.Timestamp(seconds=1, nanos=1_000_000_000)] * 1000
    err = await tc.rpc_error(env.stub.ReportLoad(api.ReportLoadRequest(service_name="svc", request_times=bad)))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT  # not RESOURCE_EXHAUSTED
    fields = [field for field, _ in err.field_violations]
    assert 1 <= len(fields) <= 10
    assert fields == [f"request_times[{i}]" for i in range(len(fields))]
    assert "1000 violations" in err.message
    assert await qps_now(env) == 0.0


@pytest.mark.parametrize(
    "stamp",
    [
        timestamp_pb2.Timestamp(seconds=-(2**62)),
        timestamp_pb2.Timestamp(seconds=2**62),
        timestamp_pb2.Timestamp(seconds=int(time.time()), nanos=-1),
        timestamp_pb2.Timestamp(seconds=int(time.time()), nanos=1_000_000_000),
    ],
    ids=["seconds -2^62", "seconds 2^62", "nanos -1", "nanos 1e9"],
)
async def test_an_out_of_range_time_is_refused_and_changes_nothing(env: tc.Env, stamp: timestamp_pb2.Timestamp) -> None:
    times = [pbtime.timestamp(time.time()), stamp]
    err = await tc.rpc_error(
        env.stub.ReportLoad(api.ReportLoadRequest(service_name="svc", request_times=times, request_count=1))
    )
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [field for field, _ in err.field_violations] == ["request_times[1]"]
    assert await qps_now(env) == 0.0


@pytest.mark.parametrize(
    "age",
    [
        duration_pb2.Duration(seconds=-1),
        duration_pb2.Duration(nanos=-5),
        duration_pb2.Duration(seconds=1, nanos=-1),
        duration_pb2.Duration(seconds=1, nanos=1_000_000_000),
        duration_pb2.Duration(seconds=2**62),
    ],
    ids=["negative", "negative nanos", "mixed signs", "nanos 1e9", "seconds 2^62"],
)
async def test_a_malformed_age_is_refused_and_changes_nothing(env: tc.Env, age: duration_pb2.Duration) -> None:
    ages = [duration_pb2.Duration(seconds=1), age]
    err = await tc.rpc_error(env.stub.ReportLoad(api.ReportLoadRequest(service_name="svc", request_ages=ages)))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [field for field, _ in err.field_violations] == ["request_ages[1]"]
    assert await qps_now(env) == 0.0


@pytest.mark.parametrize(
    ("balancer_id", "sequence", "field"),
    [
        ("lb-1", 0, "sequence"),
        ("lb-1", -3, "sequence"),
        ("", 4, "balancer_id"),
        ("lb 1", 1, "balancer_id"),
        ("x" * 129, 1, "balancer_id"),
        ("lb-\n1", 1, "balancer_id"),
    ],
)
async def test_a_bad_balancer_identity_is_refused(env: tc.Env, balancer_id: str, sequence: int, field: str) -> None:
    request = api.ReportLoadRequest(service_name="svc", balancer_id=balancer_id, sequence=sequence, request_count=1)
    err = await tc.rpc_error(env.stub.ReportLoad(request))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in err.field_violations] == [field]
    assert await qps_now(env) == 0.0


async def test_a_report_is_applied_once_per_sequence_even_across_a_controller_restart(tmp_path) -> None:
    def report(sequence: int, balancer_id: str = "lb-1") -> api.ReportLoadRequest:
        ages = [duration_pb2.Duration(nanos=100_000_000)] * 2
        return api.ReportLoadRequest(
            service_name="svc", balancer_id=balancer_id, sequence=sequence, request_ages=ages, request_count=1
        )

    async with tc.started(tmp_path) as env:
        await tc.create(env, tc.spec())
        first = await env.stub.ReportLoad(report(1))
        assert (first.qps, first.already_applied, first.counted_requests) == (pytest.approx(3 / WINDOW_S), False, 3)
        again = await env.stub.ReportLoad(report(1))
        assert (again.qps, again.already_applied, again.counted_requests) == (pytest.approx(3 / WINDOW_S), True, 0)
    async with tc.started(tmp_path) as env:  # the same store: the ledger was saved with the window
        again = await env.stub.ReportLoad(report(1))
        assert (again.qps, again.already_applied) == (pytest.approx(3 / WINDOW_S), True)
        assert (await env.stub.ReportLoad(report(2))).qps == pytest.approx(6 / WINDOW_S)
        # Another balancer (or this one restarted, with a new id) starts its own sequence.
        assert (await env.stub.ReportLoad(report(1, "lb-2"))).qps == pytest.approx(9 / WINDOW_S)


async def test_a_balancer_whose_id_was_used_by_another_sender_takes_a_new_one(env: tc.Env) -> None:
    balancer, link = balancer_and_link(env.stub)
    taken = api.ReportLoadRequest(service_name="svc", balancer_id=link.balancer_id, sequence=2**62, request_count=1)
    await env.stub.ReportLoad(taken)  # e.g. a client that copied the id, far ahead in sequence
    old_id = link.balancer_id
    for _ in range(2):
        balancer.record_arrival()
    await link.report_once(timeout=5)
    assert link.balancer_id != old_id
    assert link.unreported == 0
    balancer.record_arrival()
    await link.report_once(timeout=5)
    assert await qps_now(env) == pytest.approx(4 / WINDOW_S)  # 1 + 2 + 1: nothing lost


async def test_the_link_stops_when_news_come_in_the_same_turn_as_the_stop(env: tc.Env) -> None:
    # Python 3.11's asyncio.wait_for returns the inner result when it is cancelled in the turn
    # that result came, swallowing the cancel: the report loop went on and stop() never returned.
    _, link = balancer_and_link(env.stub)
    link.start()
    try:
        await until(lambda: link.connected and link.unreported == 0 and not link._report_now.is_set())
        await asyncio.sleep(0.05)  # the report loop waits for news again
        link._tell()  # new endpoints, or a drained replica, as the balancer stops
        async with asyncio.timeout(10):
            await link.stop()
    finally:
        for task in link._tasks:
            task.cancel()
        await asyncio.gather(*link._tasks, return_exceptions=True)

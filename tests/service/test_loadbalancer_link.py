"""The balancer against a real controller (scripted provisioner, real prober), all in-process on
port 0: endpoints come from WatchEndpoints, load goes out with ReportLoad, and the controller
shows the balancer's URL as the service's endpoint."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2 as lb_api
from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2_grpc as lb_grpc
from services.common import errors
from services.loadbalancer import server as lb_server
from tests.service import test_controller as tc


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[tc.Env]:
    async with tc.started(tmp_path) as e:
        yield e


async def start_balancer(env: tc.Env, service: str, **settings: object) -> lb_server.Running:
    values: dict[str, object] = {
        "service_name": service,
        "listen_addr": "127.0.0.1:0",
        "http_addr": "127.0.0.1:0",
        "controller_addr": env.addr,
        "report_interval_s": 0.1,
        **settings,
    }
    return await lb_server.start(lb_server.load_settings(**values))


async def until(pred, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.05)):
        if await pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def test_balancer_follows_endpoints_reports_load_and_is_shown_as_the_endpoint(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec(replicas=2))
    running = await start_balancer(env, "svc")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.built.port}")
    admin = lb_grpc.LoadBalancerServiceStub(channel)
    try:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=lb_server.SERVICE_NAME)
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING

        async def two_ready() -> bool:
            view = await admin.GetBalancer(lb_api.GetBalancerRequest())
            return view.controller_connected and sum(r.ready for r in view.replicas) == 2

        await until(two_ready)
        async with aiohttp.ClientSession() as client:
            for _ in range(4):
                async with client.get(running.url + "/anything") as resp:
                    assert resp.status == 200
        view = await admin.GetBalancer(lb_api.GetBalancerRequest())
        assert (view.service_name, view.policy, view.url) == ("svc", "least_load", running.url)
        assert sorted(r.requests_total for r in view.replicas) == [2, 2]
        assert all(r.in_flight == 0 for r in view.replicas)
        await w.until(lambda w: w.service.load_balancer_url == running.url)

        async def reported() -> bool:
            # The requests may go in two reports: wait for the answer to the one with the last.
            return running.balancer.unreported == 0 and running.link.last_qps >= 4 / 60 - 1e-9

        await until(reported)
        assert running.link.last_qps == pytest.approx(4 / 60)

        # A replica leaving the ready set leaves the balancer's set at once (a push, no polling).
        await env.stub.TerminateReplica(api.TerminateReplicaRequest(service_name="svc", replica_id=1))

        async def one_gone() -> bool:
            view = await admin.GetBalancer(lb_api.GetBalancerRequest())
            return 1 not in [r.replica_id for r in view.replicas if r.ready]

        await until(one_gone)
    finally:
        w.cancel()
        await channel.close()
        await running.stop(None)


async def test_controller_refuses_a_bad_balancer_url_and_keeps_the_last_one(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec())
    good = "http://127.0.0.1:30001"
    await env.stub.ReportLoad(api.ReportLoadRequest(service_name="svc", request_count=1, load_balancer_url=good))
    for bad in ("ftp://x", "http://a b", "x" * 3000):
        err = await tc.rpc_error(
            env.stub.ReportLoad(api.ReportLoadRequest(service_name="svc", request_count=50, load_balancer_url=bad))
        )
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in err.field_violations] == ["load_balancer_url"]
    err = await tc.rpc_error(
        env.stub.ReportLoad(api.ReportLoadRequest(service_name="svc", request_count=-1, load_balancer_url="ftp://x"))
    )
    assert [f for f, _ in err.field_violations] == ["request_count", "load_balancer_url"]  # all at once
    svc = (await env.stub.GetService(api.GetServiceRequest(service_name="svc"))).service
    assert svc.load_balancer_url == good
    qps = (await env.stub.ReportLoad(api.ReportLoadRequest(service_name="svc"))).qps
    assert qps == pytest.approx(1 / 60)  # the refused reports changed nothing
    w.cancel()


def test_settings_name_every_bad_value() -> None:
    with pytest.raises(errors.ValidationError) as err:
        lb_server.load_settings(environ={}, service_name="", policy="random", attempts=0, tls_keyfile="k.pem")
    fields = [v.field for v in err.value.violations]
    assert fields == [
        "loadbalancer.service_name",
        "loadbalancer.policy",
        "loadbalancer.attempts",
        "loadbalancer.tls_certfile",
    ]

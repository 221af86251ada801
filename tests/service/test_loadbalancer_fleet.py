"""A balancer fleet against a real controller (scripted provisioner, real prober), in-process on
port 0: every service gets its own port and URL, the URL goes when its balancer stops reporting,
and a drain ends as soon as the fleet has nothing in flight for the replica (issue 20 items 7-9)."""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator
from typing import cast

import aiohttp
import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2 as lb_api
from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2_grpc as lb_grpc
from services.loadbalancer import fleet
from services.loadbalancer import server as lb_server
from tests.service import test_controller as tc


async def start_fleet(env: tc.Env, **settings: object) -> lb_server.Running:
    values: dict[str, object] = {
        "fleet": True,
        "listen_addr": "127.0.0.1:0",
        "http_addr": "127.0.0.1:0",
        "controller_addr": env.addr,
        "report_interval_s": 0.1,
        "fleet_poll_s": 0.1,
        **settings,
    }
    return await lb_server.start(lb_server.load_settings(**values))


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[tc.Env]:
    async with tc.started(tmp_path, drain_s=60.0, balancer_ttl_s=1.0) as e:
        yield e


async def get(url: str) -> int:
    async with aiohttp.ClientSession() as client, client.get(url + "/x") as resp:
        return resp.status


async def test_a_fleet_gives_every_service_its_own_url(env: tc.Env) -> None:
    running = await start_fleet(env)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.built.port}")
    admin = lb_grpc.LoadBalancerServiceStub(channel)
    try:
        wa = await tc.create(env, tc.spec("a", replicas=1))
        wb = await tc.create(env, tc.spec("b", replicas=1))
        await wa.until(lambda w: bool(w.service.load_balancer_url) and w.service.ready_replicas == 1)
        await wb.until(lambda w: bool(w.service.load_balancer_url) and w.service.ready_replicas == 1)
        url_a, url_b = wa.service.load_balancer_url, wb.service.load_balancer_url
        assert url_a != url_b and url_a.startswith("http://127.0.0.1:")
        for url in (url_a, url_b):
            for _ in range(100):
                if await get(url) == 200:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"{url} never answered 200")

        view = await admin.GetBalancer(lb_api.GetBalancerRequest(service_name="b"))
        assert (view.service_name, view.url, view.fleet, list(view.served_services)) == ("b", url_b, True, ["a", "b"])
        err = await tc.rpc_error(admin.GetBalancer(lb_api.GetBalancerRequest()))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and [f for f, _ in err.field_violations] == ["service_name"]
        err = await tc.rpc_error(admin.GetBalancer(lb_api.GetBalancerRequest(service_name="nope")))
        assert err.code == grpc.StatusCode.NOT_FOUND

        # Gone with its service: the port closes, and the other service keeps its URL.
        await env.stub.DeleteService(api.DeleteServiceRequest(service_name="b"))
        for _ in range(100):
            if "b" not in running.units():
                break
            await asyncio.sleep(0.05)
        with pytest.raises(aiohttp.ClientConnectionError):
            await get(url_b)
        assert await get(url_a) == 200
    finally:
        await channel.close()
        await running.stop(None)
    # A fleet that stops says so: the controller drops its URL at once, not after the TTL.
    await wa.until(lambda w: w.service.load_balancer_url == "", timeout=0.9)


async def test_a_balancer_that_stops_reporting_loses_its_url_after_the_ttl(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec("svc", replicas=1))
    report = api.ReportLoadRequest(
        service_name="svc", balancer_id="b1", sequence=1, load_balancer_url="http://127.0.0.1:1234"
    )
    await env.stub.ReportLoad(report)
    await w.until(lambda w: w.service.load_balancer_url == "http://127.0.0.1:1234")
    loop = asyncio.get_running_loop()
    silent_since = loop.time()
    await w.until(lambda w: w.service.load_balancer_url == "", timeout=5)
    assert 0.9 <= loop.time() - silent_since < 3  # the TTL is 1 s
    # A malformed in-flight entry refuses the report, naming the field.
    bad = api.ReportLoadRequest(
        service_name="svc",
        balancer_id="b1",
        sequence=2,
        in_flight_reported=True,
        in_flight=[api.ReplicaInFlight(replica_id=0, requests=1), api.ReplicaInFlight(replica_id=3, requests=0)],
    )
    err = await tc.rpc_error(env.stub.ReportLoad(bad))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in err.field_violations] == ["in_flight[0].replica_id", "in_flight[1].requests"]


async def test_a_drain_ends_once_the_fleet_has_nothing_in_flight_for_the_replica(env: tc.Env) -> None:
    env.provisioner.honour_drain = True
    w = await tc.create(env, tc.spec("svc", replicas=2))
    await w.until(lambda w: w.count(res.REPLICA_STATUS_READY) == 2)
    # No balancer reports: the drain takes its full time (60 s here), and the replica is not
    # counted in REPLICAS meanwhile.
    await env.stub.UpdateService(api.UpdateServiceRequest(service_name="svc", yaml=tc.spec("svc", replicas=1)))
    await w.until(lambda w: w.count(res.REPLICA_STATUS_SHUTTING_DOWN) == 1)
    await asyncio.sleep(1.0)
    assert w.count(res.REPLICA_STATUS_SHUTTING_DOWN) == 1, w.describe()
    assert (w.service.ready_replicas, w.service.total_replicas) == (1, 1)
    # A fleet starts and reports nothing in flight for it: the drain ends now.
    loop = asyncio.get_running_loop()
    started = loop.time()
    running = await start_fleet(env)
    try:
        await w.until(lambda w: len(w.replicas) == 1, timeout=10)
        assert loop.time() - started < 10
    finally:
        await running.stop(None)


async def test_a_canary_replica_drained_by_an_abort_goes_once_the_fleet_has_nothing_in_flight(env: tc.Env) -> None:
    env.provisioner.honour_drain = True
    running = await start_fleet(env)
    try:
        w = await tc.create(env, tc.spec("svc", replicas=2))
        await w.until(lambda w: w.count(res.REPLICA_STATUS_READY) == 2)
        canary = tc.spec("svc", replicas=2, run="serve --v2").replace(
            "  replicas:", "  rollout: {strategy: canary, steps: [{weight: 10, pause_seconds: 600}]}\n  replicas:"
        )
        await env.stub.UpdateService(
            api.UpdateServiceRequest(service_name="svc", yaml=canary, mode=res.UPDATE_MODE_CANARY)
        )
        await w.until(lambda w: w.count(res.REPLICA_STATUS_READY) == 3)
        (canary_id,) = [r.replica_id for r in w.replicas.values() if r.version == 2]
        # Aborted: the canary's replica drains (60 s here) but the fleet routes nothing to it.
        loop = asyncio.get_running_loop()
        aborted = loop.time()
        await env.stub.AbortRollout(api.AbortRolloutRequest(service_name="svc"))
        await w.until(lambda w: canary_id not in w.replicas, timeout=15)
        assert loop.time() - aborted < 15
    finally:
        await running.stop(None)


async def test_a_fleet_serves_no_pool(env: tc.Env) -> None:
    running = await start_fleet(env)
    try:
        pool = "name: batch\npool: {min_workers: 0, max_workers: 1}\nsetup: echo ready\n"
        await env.stub.CreateService(api.CreateServiceRequest(yaml=pool))
        w = await tc.create(env, tc.spec("svc", replicas=1))
        await w.until(lambda w: bool(w.service.load_balancer_url))
        assert set(running.units()) == {"svc"}
        batch = (await env.stub.GetService(api.GetServiceRequest(service_name="batch"))).service
        assert batch.load_balancer_url == "" and list(batch.endpoints) == []
    finally:
        await running.stop(None)


async def test_a_fleet_gives_the_port_the_controller_shows_to_its_service_and_no_other(tmp_path) -> None:
    # Another fleet replica serves "b" on the first port (its report says so); a fleet starting
    # with no port file must give that port to "b", not to "a" (sorted first). Units are recorded,
    # not served: the ports are the fleet's choice, whoever may hold them on this machine.
    async with tc.started(tmp_path, balancer_ttl_s=60.0) as env:
        await tc.create(env, tc.spec("b", replicas=1))
        await tc.create(env, tc.spec("a", replicas=1))
        other = api.ReportLoadRequest(
            service_name="b", balancer_id="other", sequence=1, load_balancer_url="http://127.0.0.1:30001"
        )
        await env.stub.ReportLoad(other)

        async def record(service: str, port: int) -> fleet.Unit:
            unit = types.SimpleNamespace(service=service, http_port=port, link=types.SimpleNamespace(url=""))
            return cast(fleet.Unit, unit)

        async with grpc.aio.insecure_channel(env.addr) as channel:
            f = fleet.Fleet(
                api_grpc.ControllerServiceStub(channel),
                ports=fleet.Ports(30001, 30003),
                start_unit=record,
                advertise_host="127.0.0.1",
            )
            await f.sync()
        assert {name: u.http_port for name, u in f.units.items()} == {"a": 30002, "b": 30001}


async def test_get_balancer_of_a_balancer_of_one_service(env: tc.Env) -> None:
    await tc.create(env, tc.spec("svc", replicas=1))
    running = await lb_server.start(
        lb_server.load_settings(
            service_name="svc", listen_addr="127.0.0.1:0", http_addr="127.0.0.1:0", controller_addr=env.addr
        )
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.built.port}")
    admin = lb_grpc.LoadBalancerServiceStub(channel)
    try:
        for name in ("", "svc"):
            view = await admin.GetBalancer(lb_api.GetBalancerRequest(service_name=name))
            assert (view.service_name, view.fleet, list(view.served_services)) == ("svc", False, ["svc"])
        err = await tc.rpc_error(admin.GetBalancer(lb_api.GetBalancerRequest(service_name="other")))
        assert err.code == grpc.StatusCode.NOT_FOUND
    finally:
        await channel.close()
        await running.stop(None)

"""Two controllers on one PostgreSQL store, in this process: one leads, the other forwards the
API to it and takes over when the leader stops or is deposed; a deposed leader changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import grpc_errors
from services.controller import server as controller_server
from services.controller import store as store_mod
from services.prober import server as prober_server
from tests.helpers import cluster as cl
from tests.helpers import fake_provisioner
from tests.helpers import postgres as pg_helper
from tests.service.test_controller import spec

READY = res.REPLICA_STATUS_READY
LEASE_S = 1.0


@dataclasses.dataclass
class Member:
    running: controller_server.Running
    channel: grpc.aio.Channel
    stub: api_grpc.ControllerServiceStub

    @property
    def leading(self) -> bool:
        return self.running.leading


@dataclasses.dataclass
class Pair:
    url: str
    fake: fake_provisioner.FakeProvisioner
    settings: dict[str, object]
    members: list[Member]

    async def add(self, name: str) -> Member:
        values = {**self.settings, "state_dir": str(self.settings["state_dir"]) + "-" + name}
        running = await controller_server.start(controller_server.Settings(**values))  # type: ignore[arg-type]
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
        member = Member(running, channel, api_grpc.ControllerServiceStub(channel))
        self.members.append(member)
        return member


@contextlib.asynccontextmanager
async def pair(tmp_path, url: str) -> AsyncIterator[Pair]:
    async with fake_provisioner.serving() as (fake, provisioner_addr):
        prober = await prober_server.build_server(prober_server.load_settings(listen_addr="127.0.0.1:0"))
        await prober.start()
        settings: dict[str, object] = {
            "listen_addr": "127.0.0.1:0",
            "state_dir": str(tmp_path / "ctl"),
            "store_url": url,
            "leader_election": True,
            "lease_duration_s": LEASE_S,
            "provisioner_addr": provisioner_addr,
            "prober_addrs": f"127.0.0.1:{prober.port}",
            "drain_s": 0.05,
            "allow_open_internal": True,
        }
        p = Pair(url, fake, settings, [])
        try:
            yield p
        finally:
            for m in p.members:
                await m.channel.close()
                await m.running.stop(None)
            await prober.stop(None)


@pytest.fixture
def url(postgres_server: pg_helper.Server):
    made = postgres_server.database()
    yield made
    postgres_server.drop(made)


async def until(pred, timeout: float = 10.0, what: str = "") -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out waiting for {what or pred}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def leader_and_standby(p: Pair) -> tuple[Member, Member]:
    a = await p.add("a")
    await until(lambda: a.leading, what="a to lead")
    b = await p.add("b")
    await until(lambda: b.running.leadership is not None and b.running.leadership.leader_address() != "")
    return a, b


async def test_a_standby_forwards_every_call_to_the_leader(tmp_path, url: str) -> None:
    async with pair(tmp_path, url) as p:
        a, b = await leader_and_standby(p)
        assert not b.leading
        created = (await b.stub.CreateService(api.CreateServiceRequest(yaml=spec(replicas=1)))).service
        assert created.name == "svc"
        w = cl.Watch(b.stub, "svc")  # a stream, through the standby
        await w.until(lambda w: w.count(READY) == 1)
        got = (await b.stub.GetService(api.GetServiceRequest(service_name="svc"))).service
        assert got.name == "svc" and got.latest_version == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:  # the leader's errors come back as they are
            await b.stub.GetService(api.GetServiceRequest(service_name="nope"))
        err = grpc_errors.RpcError(info.value)
        assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, "SERVICE_NOT_FOUND")
        w.cancel()
        assert a.leading and not b.leading


async def test_a_stopped_leader_hands_over_at_once_and_nothing_is_launched_again(tmp_path, url: str) -> None:
    async with pair(tmp_path, url) as p:
        a, b = await leader_and_standby(p)
        await a.stub.CreateService(api.CreateServiceRequest(yaml=spec(replicas=2)))
        w = cl.Watch(a.stub, "svc")
        await w.until(lambda w: w.count(READY) == 2)
        w.cancel()
        p.members.remove(a)
        await a.channel.close()
        await a.running.stop(None)  # a clean stop releases the lease
        took = await until(lambda: b.leading, what="b to lead")
        assert took < LEASE_S  # did not wait for the lease to lapse
        w = cl.Watch(b.stub, "svc")
        await w.until(lambda w: w.count(READY) == 2)
        await asyncio.sleep(0.5)  # time for a wrong relaunch to show
        assert sorted(p.fake.launches.values()) == [1, 1]
        await b.stub.UpdateService(api.UpdateServiceRequest(service_name="svc", yaml=spec(replicas=3)))
        await w.until(lambda w: w.count(READY) == 3)
        w.cancel()


async def test_a_deposed_leader_writes_nothing_and_steps_down(tmp_path, url: str) -> None:
    async with pair(tmp_path, url) as p:
        a = await p.add("a")
        await until(lambda: a.leading)
        await a.stub.CreateService(api.CreateServiceRequest(yaml=spec(replicas=1)))
        # Another controller takes the lease under a's feet (as after a pause longer than the lease).
        with store_mod.Store(url) as other:
            other._db.execute("UPDATE leases SET expires = 0")
            assert other.acquire_lease("intruder", "", 30.0).holder == "intruder"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await a.stub.UpdateService(api.UpdateServiceRequest(service_name="svc", yaml=spec(replicas=2)))
            err = grpc_errors.RpcError(info.value)
            assert err.code == grpc.StatusCode.UNAVAILABLE
            assert a.running.leadership is not None
            await until(lambda: a.running.leadership.deposed.is_set(), what="a to step down")  # type: ignore[union-attr]
            row = other.get_service("svc")
            assert row is not None and row.latest_version == 1  # the update was not written


async def test_with_no_leader_a_standby_says_so_and_clients_may_retry(tmp_path, url: str) -> None:
    with store_mod.Store(url) as other:
        other.acquire_lease("ghost", "", 30.0)  # leads, but nobody can reach it
        async with pair(tmp_path, url) as p:
            b = await p.add("b")
            await until(lambda: b.running.leadership is not None and b.running.leadership.lease is not None)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await b.stub.ListServices(api.ListServicesRequest())
            err = grpc_errors.RpcError(info.value)
            assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "NO_LEADER")
            other.release_lease("ghost", 1)
            await until(lambda: b.leading, what="b to lead")
            await b.stub.ListServices(api.ListServicesRequest())

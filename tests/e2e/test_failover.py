"""The failover drill: two controller processes on one PostgreSQL store, under churn.

- kill -9 the leader: the standby leads within 5 s, no acknowledged write is lost, no READY
  replica is launched again and no replica is launched twice;
- SIGSTOP the leader for 30 s, then SIGCONT: it steps down (exit code 3) and writes nothing
  (every row write is audited with the writing process's id by a trigger).

Marked `drill` (about a minute): `make drill` runs it, `make test` does not.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from tests.helpers import cluster as cl
from tests.helpers import ha
from tests.helpers import postgres as pg_helper

pytestmark = pytest.mark.drill

FAILOVER_LIMIT_S = 5.0


@pytest.fixture
def url(postgres_server: pg_helper.Server):
    made = postgres_server.database()
    yield made
    postgres_server.drop(made)


async def services(stub: api_grpc.ControllerServiceStub) -> dict[str, res.Service]:
    listed = await stub.ListServices(api.ListServicesRequest(page_size=1000), timeout=10)
    return {s.name: s for s in listed.services}


async def ready_names(stub: api_grpc.ControllerServiceStub, name: str) -> set[str]:
    listed = await stub.ListReplicas(api.ListReplicasRequest(service_name=name), timeout=10)
    return {r.replica_name for r in listed.replicas if r.status == res.REPLICA_STATUS_READY}


async def test_kill_9_the_leader_under_churn(url: str, tmp_path) -> None:
    async with ha.plane(url, str(tmp_path)) as p, grpc.aio.insecure_channel(p.target) as channel:
        first = await p.wait_leader()
        stub = api_grpc.ControllerServiceStub(channel)
        await stub.CreateService(api.CreateServiceRequest(yaml=ha.spec("steady", 3)), timeout=10)
        watch = cl.Watch(stub, "steady")
        await watch.until(lambda w: w.count(res.REPLICA_STATUS_READY) == 3)
        watch.cancel()
        steady = await ready_names(stub, "steady")

        churn = ha.Churn(p.target)
        churning = asyncio.create_task(churn.run())
        await asyncio.sleep(2)
        killed = time.monotonic()
        first.kill()
        second = await p.wait_leader(other_than=first, timeout=20)
        failover_s = time.monotonic() - killed
        await asyncio.sleep(3)  # churn goes on against the new leader
        churn.stop()
        await churning

        assert failover_s <= FAILOVER_LIMIT_S, f"the standby led after {failover_s:.1f} s"
        assert not churn.errors, churn.errors
        assert len(churn.created) > 5
        async with grpc.aio.insecure_channel(second.addr) as direct:
            now = api_grpc.ControllerServiceStub(direct)
            stored = await services(now)
            for name in churn.created:  # every acknowledged create, update and delete is there
                if name in churn.deleted:
                    assert name not in stored or stored[name].status == res.SERVICE_STATUS_SHUTTING_DOWN
                else:
                    assert name in stored, f"acknowledged create of {name} lost"
            for name in churn.updated:
                assert stored[name].latest_version >= 2, f"acknowledged update of {name} lost"
            assert await ready_names(now, "steady") == steady  # the same replicas, still READY
        assert p.fake.launches, "nothing was launched"
        twice = {name: n for name, n in p.fake.launches.items() if n > 1}
        assert not twice, f"launched more than once: {twice}"


async def test_a_leader_stopped_for_30_s_steps_down_and_writes_nothing(url: str, tmp_path) -> None:
    async with ha.plane(url, str(tmp_path)) as p:
        first = await p.wait_leader()
        standby = next(c for c in p.controllers if c is not first)
        await asyncio.to_thread(p.install_audit)
        # Clients of the standby: it forwards to whoever leads (the stopped one never answers).
        churn = ha.Churn(standby.addr)
        churning = asyncio.create_task(churn.run())
        await asyncio.sleep(2)
        os.kill(first.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        await p.wait_leader(other_than=first, timeout=20)
        await asyncio.sleep(max(0.0, 30 - (time.monotonic() - stopped)))
        resumed = time.time()
        os.kill(first.proc.pid, signal.SIGCONT)
        code = await asyncio.to_thread(first.proc.wait, 20)
        await asyncio.sleep(1)
        churn.stop()
        await churning

        assert code == 3, first.log()[-3000:]
        assert "stepping down" in first.log()
        assert await asyncio.to_thread(p.writes_by, first.proc.pid) > 0  # the audit saw it write while leading
        assert await asyncio.to_thread(p.writes_by, first.proc.pid, since=resumed) == 0
        assert await asyncio.to_thread(p.writes_by, standby.proc.pid, since=resumed) > 0
        assert len(churn.created) > 5

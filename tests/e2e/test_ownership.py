"""Two controllers on one provisioner: each reaps only the orphans it owns."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.controller import store as store_mod
from tests.helpers import cluster as cl

pytestmark = pytest.mark.e2e

READY = res.REPLICA_STATUS_READY


def _pids(tag: str, env_name: str) -> set[int]:
    return {pid for pid, (svc, _) in cl.replica_processes(tag).items() if svc == env_name}


async def _ready_count(stub: api_grpc.ControllerServiceStub, name: str) -> int:
    """READY replicas of `name`; any failure reason (another controller's events) fails."""
    replicas = (await stub.ListReplicas(api.ListReplicasRequest(service_name=name), timeout=10)).replicas
    assert not [r.failure_reason for r in replicas if r.failure_reason]
    return sum(1 for r in replicas if r.status == READY)


async def test_second_controller_leaves_first_replicas_and_reaps_its_own(cluster: cl.Cluster) -> None:
    c = cluster
    # Both controllers run a service named "web": events must not cross by service name and id.
    first_yaml = cl.app_yaml("web", c.tag, replicas=2, extra="envs:\n  SERVICE_NAME: first\n")
    await c.stub.CreateService(api.CreateServiceRequest(yaml=first_yaml))
    w = cl.Watch(c.stub, "web")
    await w.until(lambda w: w.count(READY) == 2, timeout=60)
    w.cancel()
    first_pids = _pids(c.tag, "first")
    assert len(first_pids) == 2

    other = c.start_other_controller("ctl2")
    channel = grpc.aio.insecure_channel(other.addr)
    try:
        stub2 = api_grpc.ControllerServiceStub(channel)
        second_yaml = cl.app_yaml("web", c.tag, replicas=1, extra="envs:\n  SERVICE_NAME: second\n")
        await stub2.CreateService(api.CreateServiceRequest(yaml=second_yaml))
        w2 = cl.Watch(stub2, "web")
        await w2.until(lambda w: w.count(READY) == 1, timeout=60)
        w2.cancel()
        second_pids = _pids(c.tag, "second")
        assert len(second_pids) == 1
        assert _pids(c.tag, "first") == first_pids
        assert await _ready_count(c.stub, "web") == 2

        # The second controller loses its record of the replica it launched (its store keeps
        # its identity), so on restart that replica is its own orphan.
        other.kill()
        with store_mod.Store.in_state_dir(os.path.join(c.tmp, "ctl2")) as db:
            db.delete_service("web")
        other = c.start_other_controller("ctl2", port=other.port)
        for _ in range(300):
            if not _pids(c.tag, "second"):
                break
            await asyncio.sleep(0.1)
        assert not _pids(c.tag, "second"), "the second controller did not reap its own orphan"

        # The first cluster never noticed: same processes, still READY.
        await asyncio.sleep(0.5)
        assert _pids(c.tag, "first") == first_pids
        assert await _ready_count(c.stub, "web") == 2
    finally:
        await channel.close()
        other.stop()

"""Controller restart recovery (spec.md section 10): kill -9 at a busy moment, then restart."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.helpers import cluster as cl

pytestmark = pytest.mark.e2e

READY = res.REPLICA_STATUS_READY
S = res.ReplicaStatus


@pytest.fixture
async def slow_cluster(tmp_path) -> AsyncIterator[cl.Cluster]:
    # Two launches in flight at a time, so the rest of a burst waits as PENDING.
    c = cl.Cluster(
        str(tmp_path),
        provisioner_env={"REPLICAPLANE_PROVISIONER_MAX_IN_FLIGHT": "2"},
        controller_env={"REPLICAPLANE_CONTROLLER_DRAIN_S": "30"},
    )
    try:
        yield c
    finally:
        await c.close()


async def test_kill_controller_mid_flight_then_recover(slow_cluster: cl.Cluster) -> None:
    c = slow_cluster
    ready_yaml = cl.app_yaml("steady", c.tag, replicas=2, extra="envs:\n  SERVICE_NAME: steady\n")
    await c.stub.CreateService(api.CreateServiceRequest(yaml=ready_yaml))
    w = cl.Watch(c.stub, "steady")
    await w.until(lambda w: w.count(READY) == 2)
    # A long drain keeps replica 1 SHUTTING_DOWN across the crash.
    await c.stub.TerminateReplica(api.TerminateReplicaRequest(service_name="steady", replica_id=1))
    w.cancel()

    slow_yaml = cl.app_yaml("burst", c.tag, replicas=4, extra="setup: sleep 1.5\nenvs:\n  SERVICE_NAME: burst\n")
    await c.stub.CreateService(api.CreateServiceRequest(yaml=slow_yaml))
    wb = cl.Watch(c.stub, "burst")
    await wb.until(lambda w: w.count(res.REPLICA_STATUS_PROVISIONING) == 2 and w.count(res.REPLICA_STATUS_PENDING) == 2)
    wb.cancel()
    steady = {
        r.replica_id: r.status
        for r in (await c.stub.ListReplicas(api.ListReplicasRequest(service_name="steady"))).replicas
    }
    assert S.Name(steady[1]) == "REPLICA_STATUS_SHUTTING_DOWN"
    ids_before = {"steady": set(steady), "burst": {1, 2, 3, 4}}

    await c.restart_controller(kill=True)

    for name, size in (("steady", 2), ("burst", 4)):
        w = cl.Watch(c.stub, name)
        await w.until(lambda w, size=size: w.count(READY) == size and len(w.replicas) == size, timeout=40)
        w.cancel()
    burst = (await c.stub.ListReplicas(api.ListReplicasRequest(service_name="burst"))).replicas
    assert sorted(r.replica_id for r in burst) == [1, 2, 3, 4]  # re-attached, not relaunched anew
    steady_now = (await c.stub.ListReplicas(api.ListReplicasRequest(service_name="steady"))).replicas
    assert {r.replica_id for r in steady_now} == ids_before["steady"] - {1}  # 1 finished its teardown
    await asyncio.sleep(0.5)
    processes = sorted(cl.replica_processes(c.tag).values())
    expected = sorted([("burst", i) for i in (1, 2, 3, 4)] + [("steady", r.replica_id) for r in steady_now])
    assert processes == expected  # none leaked, none duplicated

    # The id counter survived the crash: the next replacement gets a fresh id.
    victim = max(r.replica_id for r in steady_now)
    pid = next(p for p, key in cl.replica_processes(c.tag).items() if key == ("steady", victim))
    os.kill(pid, signal.SIGKILL)
    w = cl.Watch(c.stub, "steady")
    await w.until(lambda w: any(rid > victim and r.status == READY for rid, r in w.replicas.items()), timeout=30)
    assert max(w.replicas) == max(ids_before["steady"]) + 1
    w.cancel()

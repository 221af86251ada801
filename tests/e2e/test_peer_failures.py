"""The controller under peer failures: provisioner restarts, prober outages, spot preemption."""

from __future__ import annotations

import asyncio

import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from services.common import clients
from tests.helpers import cluster as cl

pytestmark = pytest.mark.e2e

READY = res.REPLICA_STATUS_READY


async def test_provisioner_restart_under_a_running_controller(cluster: cl.Cluster) -> None:
    await cluster.stub.CreateService(api.CreateServiceRequest(yaml=cl.app_yaml("steady", cluster.tag)))
    steady = cl.Watch(cluster.stub, "steady")
    await steady.until(lambda w: w.count(READY) == 2)
    slow_yaml = cl.app_yaml("slow", cluster.tag, replicas=1, extra="setup: sleep 1\n")
    await cluster.stub.CreateService(api.CreateServiceRequest(yaml=slow_yaml))
    slow = cl.Watch(cluster.stub, "slow")
    await slow.until(lambda w: w.count(res.REPLICA_STATUS_PROVISIONING) == 1)

    steady.seen_statuses.clear()
    cluster.restart_provisioner(kill=True)

    await slow.until(lambda w: w.count(READY) == 1, timeout=30)
    assert list(slow.replicas) == [1]  # the same replica, re-attached
    await asyncio.sleep(0.5)
    await steady.until(lambda w: w.count(READY) == 2)
    assert all(set(seen) <= {READY} for seen in steady.seen_statuses.values()), steady.seen_statuses
    assert len(cl.replica_pids(cluster.tag)) == 3
    steady.cancel()
    slow.cancel()


async def test_prober_outage_never_fails_a_replica(cluster: cl.Cluster, tmp_path) -> None:
    args = f"--stop-file {tmp_path}/stop"
    await cluster.stub.CreateService(api.CreateServiceRequest(yaml=cl.app_yaml("web", cluster.tag, app_args=args)))
    w = cl.Watch(cluster.stub, "web")
    await w.until(lambda w: w.count(READY) == 2)

    w.seen_statuses.clear()
    cluster.stop_prober(0)
    await w.until(lambda w: w.service.probing_stale)
    assert "probing is stale" in w.service.status_message
    await asyncio.sleep(2.0)  # twice the failure window: nothing may be torn down for it
    svc = (await cluster.stub.GetService(api.GetServiceRequest(service_name="web"))).service
    assert svc.ready_replicas == 2
    assert all(set(seen) <= {READY} for seen in w.seen_statuses.values()), w.seen_statuses

    cluster.start_prober(0)
    await w.until(lambda w: not w.service.probing_stale, timeout=15)
    (tmp_path / "stop").write_text("stop")  # probing works again: failures are seen
    await w.until(lambda w: w.count(res.REPLICA_STATUS_NOT_READY) + w.count(res.REPLICA_STATUS_SHUTTING_DOWN) > 0)
    w.cancel()


async def test_preempted_spot_replica_is_removed_and_replaced(cluster: cl.Cluster) -> None:
    yaml_text = cl.app_yaml("spot", cluster.tag).replace("  ports: 8080\n", "  ports: 8080\n  use_spot: true\n")
    await cluster.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text))
    w = cl.Watch(cluster.stub, "spot")
    await w.until(lambda w: w.count(READY) == 2)
    assert all(r.is_spot for r in w.replicas.values())

    prov = prov_grpc.ProvisionerServiceStub(clients.channel(cluster.provisioner.addr))
    await prov.PreemptReplica(prov_pb.PreemptReplicaRequest(name=w.replicas[1].replica_name), timeout=10)

    await w.until(lambda w: 1 not in w.replicas and w.count(READY) == 2)
    assert res.REPLICA_STATUS_PREEMPTED in w.seen_statuses[1]
    assert sorted(w.replicas) == [2, 3]
    w.cancel()


async def test_a_launch_cancelled_at_the_provisioner_ends_and_is_replaced(cluster: cl.Cluster, tmp_path) -> None:
    hold = tmp_path / "hold"
    hold.write_text("")
    setup = f"setup: 'while [ -f {hold} ]; do sleep 0.05; done'\n"
    yaml_text = cl.app_yaml("cancelled", cluster.tag, replicas=1, extra=setup)
    await cluster.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text))
    w = cl.Watch(cluster.stub, "cancelled")
    await w.until(lambda w: 1 in w.replicas and w.replicas[1].status == res.REPLICA_STATUS_PROVISIONING)
    channel = clients.channel(cluster.provisioner.addr)
    try:
        stub = prov_grpc.ProvisionerServiceStub(channel)
        reply = await stub.CancelLaunch(prov_pb.CancelLaunchRequest(name=w.replicas[1].replica_name), timeout=20)
        assert reply.cancelled
    finally:
        await channel.close()
    hold.unlink()
    # The cancelled launch is over: replica 1 is no longer PROVISIONING, and a replacement serves.
    await w.until(lambda w: w.count(READY) == 1, timeout=30)
    assert 1 not in w.replicas or w.replicas[1].status == res.REPLICA_STATUS_FAILED_PROVISION
    w.cancel()

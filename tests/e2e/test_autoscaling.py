"""End to end autoscaling: the three services as processes and real replica processes, with
small delays and a 1 s load window (controller settings) so each scenario takes seconds."""

from __future__ import annotations

import sys
from typing import Any

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from tests.helpers import cluster as cl

pytestmark = pytest.mark.e2e

READY = res.REPLICA_STATUS_READY
FAST = {
    "REPLICAPLANE_CONTROLLER_QPS_WINDOW_S": "1",
    "REPLICAPLANE_CONTROLLER_AUTOSCALER_INTERVAL_S": "0.2",
    "REPLICAPLANE_CONTROLLER_AUTOSCALER_ZERO_INTERVAL_S": "0.2",
}


@pytest.fixture(scope="module")
def cluster_settings() -> dict[str, Any]:
    """The module's tests share one cluster with these settings (tests/e2e/conftest.py)."""
    return {"controller_env": FAST}


def policy_yaml(name: str, tag: str, policy: str, *, spot: bool = False, setup: str = "") -> str:
    return (
        f"name: {name}\n"
        "service:\n"
        "  readiness_probe:\n"
        "    path: /health\n"
        "    endpoint_probe_interval_seconds: 0.2\n"
        "  replica_policy:\n"
        f"{policy}"
        "resources:\n"
        "  ports: 8080\n"
        f"  use_spot: {'true' if spot else 'false'}\n"
        f"envs:\n  SERVICE_NAME: {name}\n"
        f"{setup}"
        f"run: {sys.executable} {cl.APP} --port 8080 --tag {tag}\n"
    )


def rate_policy(lo: int, hi: int, up: float, down: float) -> str:
    return (
        f"    min_replicas: {lo}\n    max_replicas: {hi}\n    target_qps_per_replica: 1\n"
        f"    upscale_delay_seconds: {up}\n    downscale_delay_seconds: {down}\n"
    )


async def load(c: cl.Cluster, name: str, count: int) -> None:
    await c.stub.ReportLoad(api.ReportLoadRequest(service_name=name, request_count=count), timeout=10)


async def test_load_scales_one_to_three_and_back_to_one(cluster: cl.Cluster) -> None:
    c = cluster
    await c.stub.CreateService(api.CreateServiceRequest(yaml=policy_yaml("rate", c.tag, rate_policy(1, 3, 0.5, 1))))
    w = cl.Watch(c.stub, "rate")
    await w.until(lambda w: w.count(READY) == 1)
    await load(c, "rate", 3)  # 3 QPS over the 1 s window at 1 QPS per replica: 3 replicas
    await w.until(lambda w: w.count(READY) == 3)
    assert sorted(cl.replica_processes(c.tag).values()) == [("rate", 1), ("rate", 2), ("rate", 3)]
    await w.until(lambda w: len(w.replicas) == 1 and w.count(READY) == 1, timeout=30)
    assert list(w.replicas) == [1]
    assert w.service.target_replicas == 1
    w.cancel()


async def test_min_zero_scales_from_zero_on_the_first_load_report(cluster: cl.Cluster) -> None:
    c = cluster
    await c.stub.CreateService(api.CreateServiceRequest(yaml=policy_yaml("zero", c.tag, rate_policy(0, 2, 60, 60))))
    w = cl.Watch(c.stub, "zero")
    await w.until(lambda w: w.service is not None and w.service.status == res.SERVICE_STATUS_NO_REPLICA)
    assert not w.replicas
    await load(c, "zero", 1)  # leaving 0 ignores the 60 s upscale delay
    await w.until(lambda w: w.count(READY) == 1)
    w.cancel()


async def test_spot_with_base_fallback_runs_one_ondemand_beside_spot(cluster: cl.Cluster) -> None:
    c = cluster
    policy = "    min_replicas: 3\n    base_ondemand_fallback_replicas: 1\n    spot_placer: dynamic_fallback\n"
    await c.stub.CreateService(api.CreateServiceRequest(yaml=policy_yaml("base", c.tag, policy, spot=True)))
    w = cl.Watch(c.stub, "base")
    await w.until(lambda w: w.count(READY) == 3)
    assert sorted(r.is_spot for r in w.replicas.values()) == [False, True, True]
    spot_zones = sorted(r.zone for r in w.replicas.values() if r.is_spot)
    assert spot_zones == ["zone-a", "zone-b"]  # cheapest zones, one spot replica each
    # As in SkyPilot, the on-demand replica is not spread away from spot ones: the cheapest zone.
    assert [r.zone for r in w.replicas.values() if not r.is_spot] == ["zone-a"]
    assert len(cl.replica_processes(c.tag)) == 3
    w.cancel()


async def test_dynamic_fallback_covers_a_preempted_spot_replica(cluster: cl.Cluster) -> None:
    c = cluster
    policy = "    min_replicas: 2\n    dynamic_ondemand_fallback: true\n    spot_placer: dynamic_fallback\n"
    await c.stub.CreateService(api.CreateServiceRequest(yaml=policy_yaml("dyn", c.tag, policy, spot=True)))
    w = cl.Watch(c.stub, "dyn")
    ondemand: set[int] = set()

    def spot_ready_only(w: cl.Watch) -> bool:
        ondemand.update(r.replica_id for r in w.replicas.values() if not r.is_spot)
        return len(w.replicas) == 2 and all(r.is_spot and r.status == READY for r in w.replicas.values())

    # On-demand replicas stand in while spot ones start, and go once the spot ones are READY.
    await w.until(spot_ready_only)
    assert len(ondemand) == 2
    victim = next(r for r in w.replicas.values() if r.zone == "zone-a")
    async with grpc.aio.insecure_channel(c.provisioner.addr) as ch:
        await prov_grpc.ProvisionerServiceStub(ch).PreemptReplica(
            prov_pb.PreemptReplicaRequest(name=victim.replica_name), timeout=10
        )
    ondemand.clear()
    await w.until(lambda w: victim.replica_id not in w.replicas and spot_ready_only(w))
    assert res.REPLICA_STATUS_PREEMPTED in w.seen_statuses[victim.replica_id]  # then the record went
    assert len(ondemand) == 1  # one stand-in while the replacement spot replica started
    replacement = max(w.replicas.values(), key=lambda r: r.replica_id)
    assert replacement.zone == "zone-c"  # not the preempting zone, nor the other spot replica's
    w.cancel()


async def test_spec_region_and_zone_bound_spot_and_ondemand_placement(tmp_path) -> None:
    zones = "us-west-2a:0.90,us-east-1a:1.00,us-east-1b:1.10,us-east-1c:1.30"
    c = cl.Cluster(str(tmp_path), controller_env=FAST, provisioner_env={"REPLICAPLANE_PROVISIONER_ZONES": zones})
    try:
        from services.common import grpc_errors

        policy = "    min_replicas: 3\n    base_ondemand_fallback_replicas: 1\n    spot_placer: dynamic_fallback\n"
        base = policy_yaml("geo", c.tag, policy, spot=True)
        # A zone the provisioner does not have is refused at create, naming the field.
        bad = base.replace("  use_spot: true\n", "  use_spot: true\n  zone: us-east-1x\n")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.stub.CreateService(api.CreateServiceRequest(yaml=bad), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in grpc_errors.RpcError(info.value).field_violations] == ["resources.zone"]
        assert not (await c.stub.ListServices(api.ListServicesRequest(), timeout=10)).services

        regional = base.replace("  use_spot: true\n", "  use_spot: true\n  region: us-east-1\n")
        await c.stub.CreateService(api.CreateServiceRequest(yaml=regional), timeout=10)
        w = cl.Watch(c.stub, "geo")
        await w.until(lambda w: w.count(READY) == 3)
        # us-west-2a is the cheapest zone but outside the region: no replica goes there.
        spot_zones = sorted(r.zone for r in w.replicas.values() if r.is_spot)
        assert spot_zones == ["us-east-1a", "us-east-1b"]
        assert [r.zone for r in w.replicas.values() if not r.is_spot] == ["us-east-1a"]
        w.cancel()
    finally:
        await c.close()


async def test_controller_kill_mid_scale_up_neither_stops_nor_repeats_it(cluster: cl.Cluster) -> None:
    c = cluster
    setup = "setup: sleep 1.5\n"
    yaml_text = policy_yaml("grow", c.tag, rate_policy(1, 3, 0.2, 60), setup=setup)
    await c.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text))
    w = cl.Watch(c.stub, "grow")
    await w.until(lambda w: w.count(READY) == 1, timeout=30)
    await load(c, "grow", 3)
    await w.until(lambda w: w.count(res.REPLICA_STATUS_PROVISIONING) + w.count(res.REPLICA_STATUS_PENDING) == 2)
    w.cancel()

    await c.restart_controller(kill=True)

    w = cl.Watch(c.stub, "grow")
    await w.until(lambda w: w.count(READY) == 3, timeout=40)
    assert sorted(w.replicas) == [1, 2, 3]  # re-attached, not launched anew
    assert w.service.target_replicas == 3  # the load left the window; the 60 s downscale delay holds
    assert sorted(cl.replica_processes(c.tag).values()) == [("grow", 1), ("grow", 2), ("grow", 3)]
    w.cancel()

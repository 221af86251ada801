"""The controller's API edge for canaries: the spec's `service.rollout.strategy` is the default
update mode, and per-version statistics in load reports are validated field by field (rollouts
themselves: test_rollouts_api.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import duration_pb2

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.service import test_controller as tc

READY = res.REPLICA_STATUS_READY


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[tc.Env]:
    async with tc.started(tmp_path) as e:
        yield e


def with_rollout(rollout: str, *, replicas: int = 1, run: str = "serve") -> str:
    return tc.spec(replicas=replicas, run=run).replace("  replicas:", f"  rollout: {rollout}\n  replicas:")


async def service(env: tc.Env) -> res.Service:
    return (await env.stub.GetService(api.GetServiceRequest(service_name="svc"))).service


async def test_the_specs_strategy_is_the_default_update_mode_and_a_requested_mode_wins(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec(replicas=2))
    await w.until(lambda w: w.count(READY) == 2)
    # No mode asked: the new spec's strategy says blue-green.
    await env.stub.UpdateService(
        api.UpdateServiceRequest(service_name="svc", yaml=with_rollout("{strategy: blue_green}", replicas=2, run="v2"))
    )
    assert (await service(env)).update_mode == res.UPDATE_MODE_BLUE_GREEN
    # A mode in the request wins over the spec's canary.
    await env.stub.UpdateService(
        api.UpdateServiceRequest(
            service_name="svc",
            yaml=with_rollout("{strategy: canary}", replicas=2, run="v3"),
            mode=res.UPDATE_MODE_ROLLING,
        )
    )
    svc = await service(env)
    assert (svc.latest_version, svc.update_mode) == (3, res.UPDATE_MODE_ROLLING)
    # No rollout section at all: rolling, as before.
    await env.stub.UpdateService(api.UpdateServiceRequest(service_name="svc", yaml=tc.spec(replicas=2, run="v4")))
    assert (await service(env)).update_mode == res.UPDATE_MODE_ROLLING
    w.cancel()


async def test_per_version_stats_in_a_load_report_are_checked_field_by_field(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec())
    good = res.VersionStats(
        version=1,
        requests=10,
        server_errors=2,
        transport_errors=1,
        latency_buckets={-40: 1, 0: 3, 96: 3},
        latency_sum=duration_pb2.Duration(nanos=5_000_000),
    )
    ok = await env.stub.ReportLoad(
        api.ReportLoadRequest(service_name="svc", request_count=1, balancer_id="b1", sequence=1, version_stats=[good])
    )
    assert ok.counted_requests == 1
    bad = [
        res.VersionStats(version=0, requests=1),
        res.VersionStats(version=2, requests=-1),
        res.VersionStats(version=3, requests=2, server_errors=2, transport_errors=1),
        res.VersionStats(version=4, requests=5, latency_buckets={97: 1, 3: -2}),
        res.VersionStats(version=5, requests=1, latency_sum=duration_pb2.Duration(seconds=-1)),
        res.VersionStats(version=1, requests=1),
        good,  # version 1 again
    ]
    err = await tc.rpc_error(
        env.stub.ReportLoad(
            api.ReportLoadRequest(service_name="svc", request_count=50, balancer_id="b1", sequence=2, version_stats=bad)
        )
    )
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in err.field_violations] == [
        "version_stats[0].version",
        "version_stats[1].requests",
        "version_stats[2].server_errors",
        "version_stats[3].latency_buckets[3]",
        "version_stats[3].latency_buckets[97]",
        "version_stats[4].latency_sum",
        "version_stats[6].version",
    ]
    # Refused whole: the 50 requests were not counted, and the sequence is still free.
    again = await env.stub.ReportLoad(
        api.ReportLoadRequest(service_name="svc", request_count=1, balancer_id="b1", sequence=2, version_stats=[good])
    )
    assert (again.already_applied, again.counted_requests) == (False, 1)
    w.cancel()


async def test_too_many_entries_are_refused(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec())
    many = [res.VersionStats(version=v, requests=1) for v in range(1, 66)]
    err = await tc.rpc_error(env.stub.ReportLoad(api.ReportLoadRequest(service_name="svc", version_stats=many)))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in err.field_violations] == ["version_stats"]
    buckets = {k: 1 for k in range(-100, 100)}  # 200 keys: more than there are valid ones
    err = await tc.rpc_error(
        env.stub.ReportLoad(
            api.ReportLoadRequest(
                service_name="svc", version_stats=[res.VersionStats(version=1, requests=136, latency_buckets=buckets)]
            )
        )
    )
    assert [f for f, _ in err.field_violations] == ["version_stats[0].latency_buckets"]
    w.cancel()

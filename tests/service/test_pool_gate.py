"""Until the controller's pool side lands, creating a pool (or updating a service into one) is
refused as not available yet, with FAILED_PRECONDITION, and changes nothing: a parsed pool must
never be run as if it were a service."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.service import test_controller as tc

POOLS = {
    "top_level": "pool: {min_workers: 0, max_workers: 3}\nsetup: echo ready\n",
    "wrapped": "service:\n  pool: {workers: 2}\nsetup: echo ready\n",
}


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[tc.Env]:
    async with tc.started(tmp_path) as e:
        yield e


@pytest.mark.parametrize("text", list(POOLS.values()), ids=list(POOLS))
async def test_creating_a_pool_is_refused_as_not_available_yet(env: tc.Env, text: str) -> None:
    err = await tc.rpc_error(env.stub.CreateService(api.CreateServiceRequest(service_name="batch", yaml=text)))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.reason == "POOLS_NOT_AVAILABLE"
    assert "pools are not available yet" in err.message
    assert not (await env.stub.ListServices(api.ListServicesRequest())).services


async def test_a_bad_pool_spec_is_still_invalid_argument(env: tc.Env) -> None:
    err = await tc.rpc_error(
        env.stub.CreateService(api.CreateServiceRequest(service_name="batch", yaml="pool: {min_workers: 1}\n"))
    )
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [field for field, _ in err.field_violations] == ["pool.max_workers"]


async def test_updating_a_service_into_a_pool_is_refused_and_changes_nothing(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec())
    await w.until(lambda w: w.count(res.REPLICA_STATUS_READY) == 1)
    for dry_run in (True, False):
        err = await tc.rpc_error(
            env.stub.UpdateService(
                api.UpdateServiceRequest(service_name="svc", yaml=POOLS["top_level"], dry_run=dry_run)
            )
        )
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        assert err.reason == "POOLS_NOT_AVAILABLE"
    svc = (await env.stub.GetService(api.GetServiceRequest(service_name="svc"))).service
    assert svc.latest_version == 1
    w.cancel()

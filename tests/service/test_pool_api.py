"""The job RPCs' bad input through a real controller: an unknown pool is NOT_FOUND, a service named
as a pool, an empty pool name or a job id below 1 is INVALID_ARGUMENT naming the field; nothing is
queued."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from tests.service import test_controller as tc


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[tc.Env]:
    async with tc.started(tmp_path) as e:
        yield e


def _calls(stub, pool: str, job_id: int = 1) -> dict[str, object]:  # type: ignore[no-untyped-def]
    return {
        "SubmitJob": stub.SubmitJob(api.SubmitJobRequest(pool=pool, run="true")),
        "GetJob": stub.GetJob(api.GetJobRequest(pool=pool, job_id=job_id)),
        "ListJobs": stub.ListJobs(api.ListJobsRequest(pool=pool)),
        "CancelJob": stub.CancelJob(api.CancelJobRequest(pool=pool, job_id=job_id)),
    }


async def _watch_error(stub, pool: str, job_id: int = 1):  # type: ignore[no-untyped-def]
    async def drain() -> None:
        async for _ in stub.WatchJob(api.WatchJobRequest(pool=pool, job_id=job_id)):
            pass

    return await tc.rpc_error(drain())


async def test_an_unknown_pool_is_not_found(env: tc.Env) -> None:
    for rpc, call in _calls(env.stub, "nope").items():
        err = await tc.rpc_error(call)
        assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, "POOL_NOT_FOUND"), rpc
        assert "pool 'nope' not found" in err.message
    assert (await _watch_error(env.stub, "nope")).code == grpc.StatusCode.NOT_FOUND


async def test_a_service_is_not_a_pool(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec())
    for rpc, call in _calls(env.stub, "svc").items():
        err = await tc.rpc_error(call)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, rpc
        assert [f for f, _ in err.field_violations] == ["pool"], rpc
        assert "is a service, not a pool" in err.field_violations[0][1]
    assert [f for f, _ in (await _watch_error(env.stub, "svc")).field_violations] == ["pool"]
    w.cancel()


async def test_an_empty_pool_or_a_bad_job_id_names_the_field(env: tc.Env) -> None:
    for rpc, call in _calls(env.stub, "").items():
        err = await tc.rpc_error(call)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, rpc
        assert next(f for f, _ in err.field_violations) == "pool", rpc
    for rpc in ("GetJob", "CancelJob"):
        err = await tc.rpc_error(_calls(env.stub, "x", job_id=0)[rpc])
        assert [f for f, _ in err.field_violations] == ["job_id"], rpc
    assert [f for f, _ in (await _watch_error(env.stub, "x", 0)).field_violations] == ["job_id"]

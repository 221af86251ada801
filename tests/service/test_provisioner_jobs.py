"""Jobs on pool workers, on the local backend: every error code of RunJob, CancelJob, GetJob and
DeleteLogs for jobs, the worker's venv, what a job leaves behind, a worker torn down or preempted
mid-job, a job that ends while no provisioner runs, and how long job records and logs are kept.
The scenarios every backend shares are in test_backend_contract.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import resources_pb2
from services.common import grpc_errors
from services.provisioner import local
from tests.helpers import provisioner_client as client
from tests.helpers import provisioner_procs
from tests.service import test_backend_contract as contract

INFRA = resources_pb2.FAILURE_CAUSE_INFRASTRUCTURE


@pytest.fixture
async def b(tmp_path) -> AsyncIterator[contract.LocalBackend]:
    backend = contract.LocalBackend(str(tmp_path))
    try:
        await backend.start()
        yield backend
    finally:
        await backend.close()


async def _worker(b: contract.Backend, replica_id: int = 1, setup: str = "") -> None:
    events = await client.collect(b.stub.Launch(client.worker_request(replica_id, setup=setup)))
    assert client.types(events)[-1] == "SETUP_DONE"


async def _error(call) -> grpc_errors.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = await call if not hasattr(call, "read") else await client.collect(call)
        raise AssertionError(f"no error: {result}")
    return grpc_errors.RpcError(info.value)


async def test_bad_job_requests_are_refused_naming_the_field_and_change_nothing(b: contract.LocalBackend) -> None:
    await _worker(b)
    await client.collect(b.stub.Launch(client.launch_request(1, "svc", spec_=client.spec("sleep 30"))))
    cases = {
        "job_id": client.job_request("Bad_Id", "pool-1", "true"),
        "run": client.job_request("j-1", "pool-1", "   "),
        "envs.1X": client.job_request("j-1", "pool-1", "true", envs={"1X": "y"}),
        "envs.REPLICAPLANE_REPLICA_TOKEN": client.job_request(
            "j-1", "pool-1", "true", envs={"REPLICAPLANE_REPLICA_TOKEN": "t"}
        ),
        "replica": client.job_request("j-1", "svc-1", "true"),  # a service's replica, not a worker
    }
    for field, request in cases.items():
        err = await _error(b.stub.RunJob(request))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, field
        assert [f for f, _ in err.field_violations] == [field]
    missing = await _error(b.stub.RunJob(client.job_request("j-1", "pool-9", "true")))
    assert (missing.code, missing.reason) == (grpc.StatusCode.NOT_FOUND, "REPLICA_NOT_FOUND")
    attach = await _error(b.stub.RunJob(client.job_request("j-1", "", "", attach_only=True)))
    assert (attach.code, attach.reason) == (grpc.StatusCode.NOT_FOUND, "JOB_NOT_FOUND")
    for call in (
        b.stub.GetJob(pb.GetJobRequest(job_id="j-1")),
        b.stub.CancelJob(pb.CancelJobRequest(job_id="j-1")),
    ):
        assert (await _error(call)).code == grpc.StatusCode.NOT_FOUND
    assert (await b.stub.GetReplica(pb.GetReplicaRequest(name="pool-1"))).replica.job_id == ""


async def test_a_job_id_is_one_job_and_a_worker_in_setup_is_not_ready(b: contract.LocalBackend) -> None:
    await _worker(b, 1)
    await client.collect(b.stub.RunJob(client.job_request("j-1", "pool-1", "true")))
    await _worker(b, 2)
    other = await _error(b.stub.RunJob(client.job_request("j-1", "pool-2", "true")))
    assert (other.code, other.reason) == (grpc.StatusCode.ALREADY_EXISTS, "JOB_EXISTS")
    launching = asyncio.create_task(client.collect(b.stub.Launch(client.worker_request(3, setup="sleep 30"))))
    async with asyncio.timeout(10):
        while (await b.stub.ListReplicas(pb.ListReplicasRequest(service="pool"))).replicas[-1].state != (
            resources_pb2.REPLICA_STATE_PROVISIONING
        ):
            await asyncio.sleep(0.02)
    busy = await _error(b.stub.RunJob(client.job_request("j-2", "pool-3", "true")))
    assert (busy.code, busy.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "WORKER_NOT_READY")
    await b.stub.CancelLaunch(pb.CancelLaunchRequest(name="pool-3"))
    await launching


async def test_a_job_runs_in_the_workers_venv_and_leaves_nothing_running(b: contract.LocalBackend) -> None:
    await _worker(b)
    run = "python -c \"import os, sys; print(sys.prefix == os.environ['VIRTUAL_ENV'])\"; sleep 30 & echo left"
    await client.collect(b.stub.RunJob(client.job_request("j-1", "pool-1", run)))
    assert await contract._job_log(b, "j-1") == "True\nleft\n"
    token = await _job_token(b, "pool-1")
    async with asyncio.timeout(5):
        while [p for p in provisioner_procs.replica_pids(b.state_dir) if _job_of(p) == token]:
            await asyncio.sleep(0.02)


async def _job_token(b: contract.LocalBackend, worker: str) -> str:
    import os

    jobs = os.path.join(b.state_dir, "local", worker, "jobs")
    (token,) = os.listdir(jobs)
    return token


def _job_of(pid: int) -> str | None:
    from services.provisioner import procs

    return procs.env_value(pid, local.JOB_ENV)


@pytest.mark.parametrize("how", ["teardown", "preempt"])
async def test_a_worker_torn_down_or_preempted_mid_job_fails_the_job_and_kills_it(
    b: contract.LocalBackend, how: str
) -> None:
    await _worker(b)
    call = b.stub.RunJob(client.job_request("j-1", "pool-1", "sleep 30"))
    await contract._started(call)
    if how == "teardown":
        teardown = asyncio.create_task(client.collect(b.stub.Terminate(pb.TerminateRequest(name="pool-1"))))
    else:
        await b.stub.PreemptReplica(pb.PreemptReplicaRequest(name="pool-1"))
    events = await contract._rest(call)
    assert client.types(events) == ["FAILED"] and events[-1].cause == INFRA
    expected = "its worker was torn down" if how == "teardown" else "worker died"
    assert expected in events[-1].message
    if how == "teardown":
        await teardown
    else:
        await client.collect(b.stub.Terminate(pb.TerminateRequest(name="pool-1")))
    assert await b.left_running() == []


async def test_a_job_that_ends_while_no_provisioner_runs_is_reported_after_the_restart(
    b: contract.LocalBackend,
) -> None:
    await _worker(b)
    call = b.stub.RunJob(client.job_request("j-1", "pool-1", "sleep 0.5; exit 4"))
    await contract._started(call)
    await b.stop()
    await asyncio.sleep(1.0)  # it ends meanwhile
    await b.start()
    events = await client.collect(b.stub.RunJob(client.job_request("j-1", "", "", attach_only=True)))
    assert client.types(events) == ["STARTED", "EXITED"] and events[-1].exit_code == 4
    assert (await b.stub.GetReplica(pb.GetReplicaRequest(name="pool-1"))).replica.job_id == ""


async def test_job_logs_and_records_go_with_delete_logs_or_the_workers_teardown(b: contract.LocalBackend) -> None:
    await _worker(b)
    call = b.stub.RunJob(client.job_request("j-1", "pool-1", "echo one; sleep 30"))
    await contract._started(call)
    running = await _error(b.stub.DeleteLogs(pb.DeleteLogsRequest(job_id="j-1")))
    assert running.code == grpc.StatusCode.FAILED_PRECONDITION
    await b.stub.CancelJob(pb.CancelJobRequest(job_id="j-1", grace=client.duration(0)))
    assert (await b.stub.DeleteLogs(pb.DeleteLogsRequest(job_id="j-1"))).deleted
    assert not (await b.stub.DeleteLogs(pb.DeleteLogsRequest(job_id="j-1"))).deleted
    assert (await _error(b.stub.GetJob(pb.GetJobRequest(job_id="j-1")))).code == grpc.StatusCode.NOT_FOUND
    log_request = pb.StreamLogsRequest(kind=resources_pb2.LOG_KIND_JOB, job_id="j-1")
    assert (await _error(b.stub.StreamLogs(log_request))).code == grpc.StatusCode.NOT_FOUND
    # Forgotten, the id is free: it names a new job.
    assert client.types(await client.collect(b.stub.RunJob(client.job_request("j-1", "pool-1", "echo two")))) == [
        "STARTED",
        "EXITED",
    ]
    assert await contract._job_log(b, "j-1") == "two\n"
    # Kept with the worker's logs, and gone with them.
    await client.collect(b.stub.Terminate(pb.TerminateRequest(name="pool-1", keep_logs=True)))
    assert (await b.stub.GetJob(pb.GetJobRequest(job_id="j-1"))).job.state == resources_pb2.JOB_STATE_EXITED
    assert await contract._job_log(b, "j-1") == "two\n"
    assert (await b.stub.DeleteLogs(pb.DeleteLogsRequest(name="pool-1"))).deleted
    assert (await _error(b.stub.GetJob(pb.GetJobRequest(job_id="j-1")))).code == grpc.StatusCode.NOT_FOUND
    # A teardown without keep_logs forgets the worker's jobs at once.
    await _worker(b, 2)
    await client.collect(b.stub.RunJob(client.job_request("j-2", "pool-2", "true")))
    await client.collect(b.stub.Terminate(pb.TerminateRequest(name="pool-2")))
    assert (await _error(b.stub.GetJob(pb.GetJobRequest(job_id="j-2")))).code == grpc.StatusCode.NOT_FOUND


async def test_a_job_accepted_but_not_started_when_the_provisioner_died_starts_after_the_restart(
    b: contract.LocalBackend,
) -> None:
    import os

    await _worker(b)
    await b.stop()
    # What a kill -9 between the job's records and its process leaves: the provisioner's record
    # (STARTING) and the backend's handle without a pid.
    token = "0123456789abcdef0123456789abcdef"
    record = {
        "request": {"job_id": "j-1", "replica": "pool-1", "run": "echo ran >> runs.txt", "envs": {}},
        "job": {
            "job_id": "j-1",
            "replica": "pool-1",
            "service": "pool",
            "state": "STARTING",
            "exit_code": 0,
            "failure_reason": "",
            "cause": "UNSPECIFIED",
            "create_time": 1.0,
            "start_time": 0.0,
            "end_time": 0.0,
        },
        "token": token,
        "events": [],
    }
    handle_dir = os.path.join(b.state_dir, "local", "pool-1", "jobs", token)
    os.makedirs(handle_dir)
    _write_json(os.path.join(b.state_dir, "jobs", "j-1.json"), record)
    _write_json(os.path.join(handle_dir, "job.json"), {"token": token, "job_id": "j-1", "worker": "pool-1"})
    await b.start()
    events = await client.collect(b.stub.RunJob(client.job_request("j-1", "", "", attach_only=True)))
    assert client.types(events) == ["STARTED", "EXITED"], [e.message for e in events]
    assert events[-1].exit_code == 0
    await client.collect(b.stub.RunJob(client.job_request("j-2", "pool-1", "cat runs.txt")))
    assert await contract._job_log(b, "j-2") == "ran\n"


def _write_json(path: str, data: object) -> None:
    import json

    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh)

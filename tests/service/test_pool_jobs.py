"""The job runtime of a pool against a real provisioner (local backend) and a real store: submit,
run, finish, fail, cancel (queued and running), a worker killed mid-job (the job runs again on
another worker), one job per worker, a controller restart that attaches instead of running a job
twice, and a watch that streams states and output."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable

import pytest

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors
from services.controller import jobs, store
from tests.helpers import provisioner_client as client
from tests.service import test_backend_contract as contract


@pytest.fixture
async def b(tmp_path) -> AsyncIterator[contract.LocalBackend]:
    backend = contract.LocalBackend(str(tmp_path))
    try:
        await backend.start()
        yield backend
    finally:
        await backend.close()


@pytest.fixture
def db(tmp_path) -> store.Store:
    s = store.Store(os.path.join(str(tmp_path), "controller", "state.db"))
    s.create_service("pool", spec_pb2.ServiceSpec(kind=spec_pb2.FLEET_KIND_POOL), now=0)
    yield s
    s.close()


@pytest.fixture
async def pj(b: contract.LocalBackend, db: store.Store) -> AsyncIterator[jobs.PoolJobs]:
    p = jobs.PoolJobs("pool", "u1", db=db, provisioner=b.stub)
    p.start()
    yield p
    await p.stop()


async def _workers(b: contract.Backend, *ids: int) -> list[jobs.WorkerInfo]:
    for rid in ids:
        events = await client.collect(b.stub.Launch(client.worker_request(rid)))
        assert client.types(events)[-1] == "SETUP_DONE"
    return [jobs.WorkerInfo(rid, f"pool-{rid}", ready=True) for rid in ids]


async def _until(p: jobs.PoolJobs, job_id: int, check: Callable[[res.Job], bool], timeout: float = 20) -> res.Job:
    async with asyncio.timeout(timeout):
        while not check(job := p.get(job_id)):
            await asyncio.sleep(0.02)
    return job


def _ended(job: res.Job) -> bool:
    return job.state in (res.JOB_STATE_SUCCEEDED, res.JOB_STATE_FAILED, res.JOB_STATE_CANCELLED)


async def test_a_job_waits_for_a_worker_then_runs_and_succeeds_or_fails(
    b: contract.LocalBackend, pj: jobs.PoolJobs, db: store.Store
) -> None:
    ok = pj.submit('echo "job $SKYPILOT_JOB_ID $SEED"', {"SEED": "7"}, "first")
    bad = pj.submit("exit 3", {}, "")
    pj.set_workers([])
    assert (ok.job_id, ok.state, pj.queued) == (1, res.JOB_STATE_PENDING, 2)
    pj.set_workers(await _workers(b, 1))
    done = await _until(pj, 1, _ended)
    assert (done.state, done.replica_id, done.attempts, done.exit_code) == (res.JOB_STATE_SUCCEEDED, 1, 1, 0)
    assert done.HasField("start_time") and done.HasField("end_time")
    failed = await _until(pj, bad.job_id, _ended)
    assert (failed.state, failed.exit_code, failed.message) == (res.JOB_STATE_FAILED, 3, "exited with code 3")
    assert db.list_jobs("pool") == [pj.get(1), pj.get(2)]  # what the store holds is what is shown


async def test_one_job_per_worker_in_submission_order(b: contract.LocalBackend, pj: jobs.PoolJobs) -> None:
    pj.set_workers(await _workers(b, 1, 2))
    ids = [pj.submit("sleep 0.3", {}, f"j{i}").job_id for i in range(5)]
    seen_busy = []
    async with asyncio.timeout(30):
        while not all(_ended(pj.get(i)) for i in ids):
            busy = pj.busy()
            seen_busy.append(len(busy))
            assert len(busy) <= 2 and set(busy) <= {1, 2}
            await asyncio.sleep(0.01)
    assert max(seen_busy) == 2
    starts = [pj.get(i).start_time.ToNanoseconds() for i in ids]
    assert max(starts[:2]) <= min(starts[2:]) and max(starts[2:4]) <= starts[4]  # FIFO
    assert {pj.get(i).state for i in ids} == {res.JOB_STATE_SUCCEEDED}


async def test_cancel_a_queued_job_and_a_running_job(b: contract.LocalBackend, pj: jobs.PoolJobs) -> None:
    pj.set_workers([])
    queued = pj.submit("sleep 30", {}, "")
    cancelled = await pj.cancel(queued.job_id)
    assert (cancelled.state, cancelled.message) == (res.JOB_STATE_CANCELLED, "cancelled while queued")
    running = pj.submit("sleep 30", {}, "")
    pj.set_workers(await _workers(b, 1))
    await _until(pj, running.job_id, lambda j: j.HasField("start_time"))
    after = await pj.cancel(running.job_id)
    job = await _until(pj, running.job_id, _ended)
    assert job.state == res.JOB_STATE_CANCELLED and after.cancel_requested
    assert (await pj.cancel(running.job_id)) == job  # a finished job is left as it is
    assert queued.job_id not in pj.busy().values()
    with pytest.raises(errors.NotFoundError):
        await pj.cancel(99)


async def test_a_worker_killed_mid_job_queues_the_job_again_and_it_succeeds_elsewhere(
    b: contract.LocalBackend, pj: jobs.PoolJobs
) -> None:
    workers = await _workers(b, 1, 2)
    pj.set_workers(workers[:1])
    job = pj.submit("sleep 2; echo finished", {}, "")
    await _until(pj, job.job_id, lambda j: j.HasField("start_time"))
    pj.set_workers(workers)
    await b.vanish("pool-1")
    done = await _until(pj, job.job_id, _ended)
    assert (done.state, done.replica_id, done.attempts, done.recoveries) == (res.JOB_STATE_SUCCEEDED, 2, 2, 1)


async def test_a_restarted_controller_attaches_to_running_jobs_and_never_runs_one_twice(
    b: contract.LocalBackend, db: store.Store
) -> None:
    first = jobs.PoolJobs("pool", "u1", db=db, provisioner=b.stub)
    first.start()
    first.set_workers(await _workers(b, 1))
    job = first.submit("sleep 1; echo once >> ../../runs.txt", {}, "")
    queued = first.submit("true", {}, "")
    await _until(first, job.job_id, lambda j: j.HasField("start_time"))
    await first.stop()  # the controller goes away mid-job
    second = jobs.PoolJobs("pool", "u1", db=db, provisioner=b.stub)
    second.start()
    assert second.get(queued.job_id).state == res.JOB_STATE_PENDING
    second.set_workers([jobs.WorkerInfo(1, "pool-1", ready=True)])
    done = await _until(second, job.job_id, _ended)
    assert (done.state, done.attempts) == (res.JOB_STATE_SUCCEEDED, 1)
    assert (await _until(second, queued.job_id, _ended)).state == res.JOB_STATE_SUCCEEDED
    await second.stop()


async def test_watch_streams_states_and_output(b: contract.LocalBackend, pj: jobs.PoolJobs) -> None:
    pj.set_workers(await _workers(b, 1))
    job = pj.submit("for i in 1 2 3; do echo line $i; sleep 0.1; done", {}, "")
    states, output = [], b""
    async with asyncio.timeout(20):
        async for msg in pj.watch(job.job_id, states_only=False):
            if msg.HasField("job"):
                states.append(msg.job.state)
            output += msg.output
    assert states[-1] == res.JOB_STATE_SUCCEEDED
    assert output == b"line 1\nline 2\nline 3\n"


@pytest.mark.parametrize(
    ("run", "envs", "name", "field"),
    [
        ("  ", {}, "", "run"),
        ("a\x00b", {}, "", "run"),
        ("x" * (jobs.MAX_RUN_BYTES + 1), {}, "", "run"),
        ("true", {"1X": "y"}, "", "envs.1X"),
        ("true", {"REPLICAPLANE_JOB_ID": "y"}, "", "envs.REPLICAPLANE_JOB_ID"),
        ("true", {}, "n" * 129, "name"),
    ],
)
async def test_bad_job_requests_name_the_field_and_queue_nothing(
    pj: jobs.PoolJobs, run: str, envs: dict[str, str], name: str, field: str
) -> None:
    with pytest.raises(errors.ValidationError) as info:
        pj.submit(run, envs, name)
    assert [v.field for v in info.value.violations] == [field]
    assert pj.page(0, "") == ([], "")

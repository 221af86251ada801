"""Jobs on pool workers in the provisioner core, against the scripted fake backend: request
validation, one job per worker, cancel while a start is in flight, a restart that must never
start a job twice, a worker lost mid-job, and how a job killed from outside is reported."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.common import errors
from services.provisioner import jobs, logstore, manager, model, store
from tests.helpers.provisioner_fakes import FakeBackend

J = model.JobEventType
FAST = manager.Options(
    launch_backoff_initial_s=0.01,
    launch_backoff_max_s=0.02,
    cancel_timeout_s=2,
    kill_grace_s=0,
    job_kill_settle_s=0.2,
)


def _worker(replica_id: int = 1) -> model.LaunchRequest:
    return model.LaunchRequest(
        name=f"pool-{replica_id}",
        service="pool",
        replica_id=replica_id,
        version=1,
        spec=model.ReplicaSpec(setup="echo ready", worker=True),
    )


def _job(job_id: str = "j-1", replica: str = "pool-1", run: str = "work") -> model.JobRequest:
    return model.JobRequest(job_id=job_id, replica=replica, run=run)


async def _events(stream: AsyncIterator[model.JobEvent], count: int) -> list[model.JobEvent]:
    out: list[model.JobEvent] = []
    async with asyncio.timeout(5):
        async for event in stream:
            out.append(event)
            if len(out) == count:
                break
    return out


def _provisioner(fake: FakeBackend, tmp_path) -> manager.Provisioner:  # type: ignore[no-untyped-def]
    return manager.Provisioner(
        backend=fake,
        records=store.RecordStore(str(tmp_path)),
        logs=logstore.LogStore(str(tmp_path)),
        options=FAST,
    )


@pytest.fixture
async def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
async def prov(fake: FakeBackend, tmp_path) -> AsyncIterator[manager.Provisioner]:
    p = _provisioner(fake, tmp_path)
    await p.start()
    events = [e async for e in p.launch(_worker())]
    assert events[-1].type == model.LaunchEventType.SETUP_DONE
    yield p
    await p.close()


BAD = {
    "job_id": model.JobRequest("J_1", "pool-1", "work"),
    "replica": model.JobRequest("j-1", "", "work"),
    "run": model.JobRequest("j-1", "pool-1", " \n "),
    "envs.1A": model.JobRequest("j-1", "pool-1", "work", {"1A": "x"}),
    "envs.REPLICAPLANE_JOB_TOKEN": model.JobRequest("j-1", "pool-1", "work", {"REPLICAPLANE_JOB_TOKEN": "x"}),
}


@pytest.mark.parametrize("field, request_", list(BAD.items()), ids=list(BAD))
def test_bad_job_requests_name_their_field(field: str, request_: model.JobRequest) -> None:
    with pytest.raises(errors.ValidationError) as info:
        jobs.validate(request_)
    assert [v.field for v in info.value.violations] == [field]


def test_every_problem_of_a_job_request_is_reported_at_once() -> None:
    with pytest.raises(errors.ValidationError) as info:
        jobs.validate(model.JobRequest("", "", "", {"A B": "1"}))
    assert {v.field for v in info.value.violations} == {"job_id", "replica", "run", "envs.A B"}


async def test_a_worker_launch_ends_with_setup_done_and_no_endpoint(prov: manager.Provisioner) -> None:
    replica = prov.get("pool-1")
    assert replica.worker and replica.endpoint == "" and replica.state == model.ReplicaState.RUNNING


async def test_a_job_runs_once_and_frees_its_worker(prov: manager.Provisioner, fake: FakeBackend) -> None:
    stream = prov.run_job(_job())
    (started,) = await _events(stream, 1)
    assert started.type == J.STARTED and started.job.start_time == 2.0
    assert prov.get("pool-1").job_id == "j-1"
    with pytest.raises(errors.FailedPreconditionError, match="already runs job j-1"):
        await _events(prov.run_job(_job("j-2")), 1)
    token = fake.job_starts[0].token
    fake.end_job(token, 0)
    (exited,) = await _events(stream, 1)
    assert (exited.type, exited.exit_code, exited.job.state) == (J.EXITED, 0, model.JobState.EXITED)
    assert prov.get("pool-1").job_id == ""
    assert [e.type for e in await _events(prov.run_job(_job()), 2)] == [J.STARTED, J.EXITED]
    assert len(fake.job_starts) == 1  # attaching again never starts it


async def test_cancel_while_the_start_is_in_flight_kills_it_once_it_starts(
    prov: manager.Provisioner, fake: FakeBackend
) -> None:
    fake.job_gate = asyncio.Event()
    stream = prov.run_job(_job())
    reader = asyncio.ensure_future(_events(stream, 1))
    async with asyncio.timeout(5):
        while not fake.job_starts:
            await asyncio.sleep(0.01)
    cancel = asyncio.ensure_future(prov.cancel_job("j-1"))
    await asyncio.sleep(0.05)
    fake.job_gate.set()
    cancelled, job = await cancel
    assert cancelled and job.state == model.JobState.CANCELLED
    assert [e.type for e in await reader] == [J.CANCELLED]  # never reported started
    assert fake.job_cancels == [(fake.job_starts[0].token, 0)]
    assert prov.get("pool-1").job_id == ""


async def test_a_restart_attaches_to_an_accepted_job_by_its_token_and_never_starts_another(
    fake: FakeBackend, tmp_path
) -> None:
    first = _provisioner(fake, tmp_path)
    await first.start()
    [e async for e in first.launch(_worker())]
    fake.job_gate = asyncio.Event()  # the start is in flight when the provisioner goes
    stream = first.run_job(_job())
    reader = asyncio.ensure_future(_events(stream, 1))
    async with asyncio.timeout(5):
        while not fake.job_starts:
            await asyncio.sleep(0.01)
    await first.close()
    reader.cancel()
    fake.job_gate.set()
    second = _provisioner(fake, tmp_path)
    await second.start()
    try:
        (started,) = await _events(second.run_job(_job(), attach_only=True), 1)
        assert started.type == J.STARTED
        tokens = [s.token for s in fake.job_starts]
        assert len(tokens) == 2 and tokens[0] == tokens[1]  # the same job, never a new one
        assert len(fake.jobs) == 1
    finally:
        await second.close()


async def test_a_worker_that_exits_mid_job_fails_the_job_as_the_infrastructures(
    prov: manager.Provisioner, fake: FakeBackend
) -> None:
    stream = prov.run_job(_job())
    await _events(stream, 1)
    fake.exit("pool-1", 137)
    (failed,) = await _events(stream, 1)
    assert (failed.type, failed.cause) == (J.FAILED, model.FailureCause.INFRASTRUCTURE)
    assert failed.message.startswith("worker died")
    assert fake.job_cancels == [(fake.job_starts[0].token, 0)]  # what was left of it is killed


async def test_a_job_killed_while_its_worker_stays_up_is_reported_killed(
    prov: manager.Provisioner, fake: FakeBackend
) -> None:
    stream = prov.run_job(_job())
    await _events(stream, 1)
    fake.end_job(fake.job_starts[0].token, None)
    (failed,) = await _events(stream, 1)
    assert failed.type == J.FAILED and failed.message == "its processes were killed without an exit code"


async def test_a_job_whose_backend_says_its_worker_is_gone_says_worker_died(
    prov: manager.Provisioner, fake: FakeBackend
) -> None:
    stream = prov.run_job(_job())
    await _events(stream, 1)
    fake.end_job(fake.job_starts[0].token, None, worker_gone=True)
    (failed,) = await _events(stream, 1)
    assert failed.type == J.FAILED and failed.message == "worker died (ended)"


async def test_jobs_need_a_ready_worker(prov: manager.Provisioner, fake: FakeBackend) -> None:
    gate = fake.gates["pool-2"] = asyncio.Event()
    launch = asyncio.ensure_future(_events(prov.launch(_worker(2)), 10))  # type: ignore[arg-type]
    async with asyncio.timeout(5):
        while len(fake.creates) < 2:
            await asyncio.sleep(0.01)
    with pytest.raises(errors.FailedPreconditionError, match="not ready for jobs"):
        await _events(prov.run_job(_job(replica="pool-2")), 1)
    gate.set()
    await launch
    with pytest.raises(errors.NotFoundError):
        await _events(prov.run_job(_job(replica="pool-9")), 1)


def test_a_pool_spec_launches_a_worker_that_serves_no_port() -> None:
    from replicaplane.common.v1 import spec_pb2
    from services.provisioner import convert

    spec = spec_pb2.ServiceSpec(
        kind=spec_pb2.FLEET_KIND_POOL, setup="s", run="ignored", resources=spec_pb2.Resources(ports=[8080])
    )
    replica = convert.replica_spec(spec)
    assert replica.worker and replica.ports == () and replica.serving_port == 0
    assert not convert.replica_spec(spec_pb2.ServiceSpec(run="serve")).worker


async def test_an_end_reported_before_the_start_was_answered_is_not_lost(
    prov: manager.Provisioner, fake: FakeBackend
) -> None:
    from services.provisioner import backend

    fake.job_gate = asyncio.Event()
    stream = prov.run_job(_job())
    reader = asyncio.ensure_future(_events(stream, 2))
    async with asyncio.timeout(5):
        while not fake.job_starts:
            await asyncio.sleep(0.01)
    token = fake.job_starts[0].token
    fake.jobs[token] = backend.BackendJob(token, "pool-1", running=True, start_time=2.0)
    fake.end_job(token, 5)  # consumed while the start is still in flight
    await asyncio.sleep(0.05)
    fake.jobs[token] = backend.BackendJob(token, "pool-1", running=True, start_time=2.0)  # a stale answer
    fake.job_gate.set()
    started, exited = await reader
    assert (started.type, exited.type, exited.exit_code) == (J.STARTED, J.EXITED, 5)

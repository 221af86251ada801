"""Following a pool's jobs: one attempt of a job run (or re-attached) on the provisioner and its
events applied, and a job watched with its output. The state they change is `jobs.PoolJobs`'s."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.controller.domain import jobs as rules

if TYPE_CHECKING:
    from services.controller.jobs import PoolJobs

log = logging.getLogger(__name__)

_RETRY_S = (0.2, 5.0)  # first and longest pause before re-attaching to a job's stream


def rule_view(job: res.Job) -> rules.Job:
    return rules.Job(
        job_id=job.job_id,
        state=rules.JobState(job.state),
        worker=job.replica_id,
        attempt=job.attempts,
        recoveries=job.recoveries,
        cancel_requested=job.cancel_requested,
        exit_code=job.exit_code,
        message=job.message,
    )


def copy(job: res.Job) -> res.Job:
    """A copy of a job record."""
    out = res.Job()
    out.CopyFrom(job)
    return out


def with_view(job: res.Job, view: rules.Job) -> res.Job:
    """A copy of a job record with the rules' view of it applied."""
    out = copy(job)
    out.state = res.JobState.Value(f"JOB_STATE_{view.state.name}")
    out.replica_id = view.worker
    out.attempts = view.attempt
    out.recoveries = view.recoveries
    out.cancel_requested = view.cancel_requested
    out.exit_code = view.exit_code
    out.message = view.message
    return out


async def follow(pj: PoolJobs, job_id: int, attempt: int) -> None:
    """Run (or attach to) one attempt of a job and apply its events until it ends.

    The worker's name comes from the fleet side, or (a worker it no longer lists, after a
    restart) from the naming rule: the provisioner, not the controller's view, says
    whether the worker and the job are still there.
    """
    after, pause = 0, _RETRY_S[0]
    while (job := pj.current(job_id, attempt)) is not None:
        worker = pj.workers.get(job.replica_id)
        name = worker.name if worker is not None else f"{pj.pool}-{job.replica_id}-{pj.uid}"
        request = prov_pb.RunJobRequest(
            job_id=pj.run_id(job, attempt), replica=name, run=job.run, envs=job.envs, after_sequence=after
        )
        try:
            async for response in pj.provisioner.RunJob(request):
                after = max(after, response.event.sequence)
                pause = _RETRY_S[0]
                if on_event(pj, job_id, attempt, response.event):
                    return
        except grpc.aio.AioRpcError as exc:
            if on_refusal(pj, job_id, attempt, exc):
                return
            log.info("job %s/%d: stream broke (%s); attaching again", pj.pool, job_id, exc.code().name)
        await asyncio.sleep(pause)
        pause = min(pause * 2, _RETRY_S[1])


def on_refusal(pj: PoolJobs, job_id: int, attempt: int, exc: grpc.aio.AioRpcError) -> bool:
    """A refused RunJob: True when it decided the attempt's end."""
    job = pj.current(job_id, attempt)
    if job is None:
        return True
    code, detail = exc.code(), exc.details() or exc.code().name
    view = rule_view(job)
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
        # Unknown worker, worker not ready, or busy: the job waits for another worker.
        pj.unusable(job.replica_id)
        after = rules.refused(view, f"worker {job.replica_id} could not take it: {detail}")
    elif code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS):
        after = rules.could_not_run(view, f"could not run: {detail}")
    else:
        return False
    pj.apply_end(job_id, attempt, after)
    return True


def on_event(pj: PoolJobs, job_id: int, attempt: int, ev: prov_res.JobEvent) -> bool:
    """Apply one job event; True once the attempt has ended."""
    job = pj.current(job_id, attempt)
    if job is None:
        return True
    view = rule_view(job)
    if ev.type == prov_res.JOB_EVENT_TYPE_STARTED:
        updated = copy(job)
        updated.start_time.CopyFrom(ev.time)
        pj.store([updated])
        if job.cancel_requested:  # asked before the job reached its worker
            pj.spawn(cancel_on_worker(pj, updated))
        return False
    if ev.type == prov_res.JOB_EVENT_TYPE_EXITED:
        after = rules.exited(view, ev.exit_code)
    elif ev.type == prov_res.JOB_EVENT_TYPE_FAILED:
        why = ev.message or ev.job.failure_reason or "its worker died"
        if ev.cause == prov_res.FAILURE_CAUSE_INFRASTRUCTURE:
            pj.unusable(job.replica_id)
            after = rules.worker_lost(view, why, max_recoveries=pj.max_recoveries)
        else:
            after = rules.could_not_run(view, why)
    elif ev.type == prov_res.JOB_EVENT_TYPE_CANCELLED:
        after = rules.cancelled(view)
    else:
        return False
    pj.apply_end(job_id, attempt, after, when=ev.time)
    return True


async def watch(pj: PoolJobs, job_id: int, *, states_only: bool) -> AsyncIterator[api.WatchJobResponse]:
    """The job now and after every change, with its output unless `states_only`; ends after
    the job has ended and its output was sent.

    Raises:
        errors.NotFoundError: no such job.
    """
    job = pj.get(job_id)
    changes: asyncio.Queue[res.Job] = asyncio.Queue()
    pj.watchers.setdefault(job_id, set()).add(changes)
    output: asyncio.Queue[bytes | None] = asyncio.Queue()
    logs: asyncio.Task[None] | None = None
    streamed = 0
    try:
        yield api.WatchJobResponse(job=job)
        while True:
            if not states_only and job.attempts > streamed and job.state != res.JOB_STATE_PENDING:
                streamed = job.attempts
                if logs is not None:
                    await logs
                logs = asyncio.create_task(stream_output(pj, job, output))
            if job.state not in (res.JOB_STATE_PENDING, res.JOB_STATE_RUNNING) and (logs is None or logs.done()):
                while not output.empty():
                    chunk = output.get_nowait()
                    if chunk:
                        yield api.WatchJobResponse(output=chunk)
                return
            got_change = asyncio.ensure_future(changes.get())
            got_output = asyncio.ensure_future(output.get())
            done, pending = await asyncio.wait({got_change, got_output}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if got_output in done and (chunk := got_output.result()):
                yield api.WatchJobResponse(output=chunk)
            if got_change in done:
                job = got_change.result()
                yield api.WatchJobResponse(job=job)
    finally:
        pj.watchers.get(job_id, set()).discard(changes)
        if logs is not None:
            logs.cancel()


async def stream_output(pj: PoolJobs, job: res.Job, out: asyncio.Queue[bytes | None]) -> None:
    request = prov_pb.StreamLogsRequest(kind=prov_res.LOG_KIND_JOB, job_id=pj.run_id(job, job.attempts), follow=True)
    for _ in range(50):  # the job may not have reached the provisioner yet
        try:
            async for chunk in pj.provisioner.StreamLogs(request):
                out.put_nowait(chunk.data)
            break
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                log.info("job output of %s/%d stopped: %s", pj.pool, job.job_id, exc.code().name)
                break
            current = pj.jobs.get(job.job_id)
            if current is None or current.attempts != job.attempts or current.state != res.JOB_STATE_RUNNING:
                break
            await asyncio.sleep(0.1)
    out.put_nowait(None)


async def cancel_on_worker(pj: PoolJobs, job: res.Job) -> None:
    """Stop a job on its worker; CANCELLED once the provisioner says its processes are gone."""
    try:
        answer = await pj.provisioner.CancelJob(
            prov_pb.CancelJobRequest(job_id=pj.run_id(job, job.attempts)), timeout=60
        )
    except grpc.aio.AioRpcError as exc:
        # NOT_FOUND: RunJob has not reached the provisioner yet; STARTED cancels it then.
        log.info("cancel of job %s/%d: %s", pj.pool, job.job_id, exc.code().name)
        return
    if answer.job.state == prov_res.JOB_STATE_CANCELLED:
        pj.apply_end(job.job_id, job.attempts, rules.cancelled(rule_view(job)), when=answer.job.end_time)


async def delete_logs(pj: PoolJobs) -> None:
    """Forget every job's log and record on the provisioner (the pool is going)."""
    for job in list(pj.jobs.values()):
        for attempt in range(1, job.attempts + 1):
            try:
                await pj.provisioner.DeleteLogs(prov_pb.DeleteLogsRequest(job_id=pj.run_id(job, attempt)), timeout=10)
            except grpc.aio.AioRpcError as exc:
                log.debug("could not delete the log of %s: %s", pj.run_id(job, attempt), exc.code().name)

"""One pool's jobs at run time: the queue, dispatch to free READY workers, and each job followed
on the provisioner until it ends.

The rules (states, FIFO order, which worker takes which job, recovery, cancel) are in
`domain/jobs.py`; this module applies them to the stored records and drives the provisioner's
`RunJob`, `CancelJob`, `StreamLogs` and `DeleteLogs`. It knows workers only through
`set_workers` (the fleet side says which workers exist and which are READY) and tells the fleet
side when the queue changed (`on_change`), so a pool's size and its watchers follow.

- Every change is written to the store before anything acts on it: a job is stored RUNNING on
  its worker before `RunJob` is sent, so a controller killed at any point finds it and attaches
  to it again under the same run id (`{pool}-{uid}-{job}-{attempt}`), which the provisioner never
  starts twice.
- Dispatch is event-driven: a submit, a job's end and a worker turning READY each dispatch at
  once, in the same loop turn. Nothing polls.
- A job goes back to the queue only on the provisioner's word that its worker died (a FAILED
  event with cause INFRASTRUCTURE, or an unknown worker), never because the controller lost
  sight of the worker: so a job never runs twice at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from typing import Any, Protocol

import grpc
from google.protobuf import timestamp_pb2

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.common import errors, pagetoken, pbtime
from services.controller.domain import jobs as rules

log = logging.getLogger(__name__)

MAX_RUN_BYTES = 1 << 20
MAX_NAME = 128
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_PAGE = 1000
_RETRY_S = (0.2, 5.0)  # first and longest pause before re-attaching to a job's stream


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """A pool worker as the fleet side reports it: its replica id and name, and whether it is READY."""

    replica_id: int
    name: str
    ready: bool


def check_submit(pool: str, run: str, envs: Mapping[str, str], name: str) -> None:
    """Check a job request: every problem at once, each naming its field.

    Raises:
        errors.ValidationError: the request is malformed.
    """
    violations = []
    if not pool:
        violations.append(errors.FieldViolation("pool", "the pool to run on is required"))
    if not run.strip():
        violations.append(errors.FieldViolation("run", "a job needs a command"))
    elif "\x00" in run:
        violations.append(errors.FieldViolation("run", "must not contain a NUL character"))
    elif len(run.encode("utf-8", "surrogatepass")) > MAX_RUN_BYTES:
        violations.append(errors.FieldViolation("run", f"must be at most {MAX_RUN_BYTES} bytes"))
    for key, value in envs.items():
        shown = key if len(key) <= 64 else key[:61] + "..."
        if not _ENV_NAME.fullmatch(key):
            violations.append(errors.FieldViolation(f"envs.{shown}", "must be an environment variable name"))
        elif key.startswith("REPLICAPLANE_"):
            violations.append(errors.FieldViolation(f"envs.{shown}", "REPLICAPLANE_* variables are set for the job"))
        elif "\x00" in value:
            violations.append(errors.FieldViolation(f"envs.{shown}", "must not contain a NUL character"))
    if len(name) > MAX_NAME or not name.isprintable():
        violations.append(errors.FieldViolation("name", f"at most {MAX_NAME} printable characters"))
    errors.require(violations, subject="job")


def _rule_view(job: res.Job) -> rules.Job:
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


class PoolJobs:
    """The jobs of one pool: queue, dispatch, following, cancel, watch."""

    def __init__(
        self,
        pool: str,
        uid: str,
        *,
        db: JobStore,
        provisioner: prov_grpc.ProvisionerServiceStub,
        on_change: Callable[[], None] = lambda: None,
        max_recoveries: int = rules.MAX_RECOVERIES,
    ) -> None:
        self.pool = pool
        self._uid = uid
        self._db = db
        self._prov = provisioner
        self._on_change = on_change
        self._max_recoveries = max_recoveries
        self._jobs: dict[int, res.Job] = {j.job_id: j for j in db.list_jobs(pool)}
        self._workers: dict[int, WorkerInfo] = {}
        self._workers_known = asyncio.Event()
        self._follows: dict[int, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._watchers: dict[int, set[asyncio.Queue[res.Job]]] = {}
        self._closed = False

    # ---- reading -------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Jobs waiting for a worker."""
        return sum(1 for j in self._jobs.values() if j.state == res.JOB_STATE_PENDING)

    @property
    def running(self) -> int:
        """Jobs on a worker."""
        return sum(1 for j in self._jobs.values() if j.state == res.JOB_STATE_RUNNING)

    def busy(self) -> dict[int, int]:
        """Worker replica id -> the id of the job it runs."""
        return {j.replica_id: j.job_id for j in self._jobs.values() if j.state == res.JOB_STATE_RUNNING}

    def unfinished(self) -> int:
        """Jobs queued or running."""
        return self.queued + self.running

    def get(self, job_id: int) -> res.Job:
        """One job.

        Raises:
            errors.NotFoundError: no such job in this pool.
        """
        job = self._jobs.get(job_id)
        if job is None:
            raise errors.NotFoundError(
                f"job {job_id} of pool {self.pool!r} not found", reason="JOB_NOT_FOUND", pool=self.pool, job_id=job_id
            )
        return job

    def page(self, page_size: int, page_token: str) -> tuple[list[res.Job], str]:
        """A page of jobs in id order; the token holds the last id of the page.

        Raises:
            errors.ValidationError: a negative page size or a token of another listing.
        """
        if page_size < 0:
            raise errors.ValidationError([errors.FieldViolation("page_size", f"must be >= 0, got {page_size}")])
        after = int(pagetoken.decode(page_token, "jobs", self.pool, position_type=int)) if page_token else 0
        size = min(page_size or 100, _MAX_PAGE)
        ids = sorted(i for i in self._jobs if i > after)
        page = ids[:size]
        token = pagetoken.encode("jobs", self.pool, page[-1]) if len(ids) > size else ""
        return [self._jobs[i] for i in page], token

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Follow every job that was running when the controller stopped (attaching to it on the
        provisioner), and dispatch the queue once workers are known."""
        for job in self._jobs.values():
            if job.state == res.JOB_STATE_RUNNING:
                self._follow(job.job_id)

    async def stop(self) -> None:
        """Stop following (controller shutdown); jobs keep running on their workers."""
        self._closed = True
        tasks = [*self._follows.values(), *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def set_workers(self, workers: Iterable[WorkerInfo]) -> None:
        """The pool's live workers now; READY ones without a job take queued jobs at once."""
        self._workers = {w.replica_id: w for w in workers}
        self._workers_known.set()
        self.dispatch()

    # ---- changes -------------------------------------------------------------------------

    def submit(self, run: str, envs: Mapping[str, str], name: str, *, now: float | None = None) -> res.Job:
        """Queue a job and dispatch it if a worker is free.

        Raises:
            errors.ValidationError: a malformed field.
            errors.UnavailableError: the store did not take the job; nothing was queued.
        """
        check_submit(self.pool, run, envs, name)
        job = res.Job(pool=self.pool, run=run, envs=dict(envs), name=name, state=res.JOB_STATE_PENDING)
        job.submit_time.CopyFrom(pbtime.timestamp(time.time() if now is None else now))
        job = self._db.add_job(job)
        self._jobs[job.job_id] = job
        self._publish(job)
        self.dispatch()
        self._on_change()
        return self._jobs[job.job_id]

    def dispatch(self) -> None:
        """Give the oldest queued jobs to free READY workers (stored RUNNING before RunJob)."""
        if self._closed or not self._workers_known.is_set():
            return
        views = [_rule_view(j) for j in self._jobs.values()]
        workers = [rules.Worker(w.replica_id, w.ready) for w in self._workers.values()]
        pairs = rules.assign(views, workers)
        if not pairs:
            return
        changed = []
        for job_id, rid in pairs:
            job = self._with(self._jobs[job_id], rules.dispatched(_rule_view(self._jobs[job_id]), rid))
            job.ClearField("start_time")
            changed.append(job)
        self._store(changed)
        for job in changed:
            self._follow(job.job_id)
        self._on_change()

    async def cancel(self, job_id: int) -> res.Job:
        """Cancel a job: a queued one at once, a running one on its worker.

        Raises:
            errors.NotFoundError: no such job.
        """
        job = self.get(job_id)
        after, tell = rules.cancel(_rule_view(job))
        if after == _rule_view(job) and not tell:
            return job
        updated = self._with(job, after)
        if after.terminal:
            updated.end_time.CopyFrom(pbtime.timestamp(time.time()))
        self._store([updated])
        self._on_change()
        if tell:
            await self._cancel_on_worker(updated)
        return self._jobs[job_id]

    async def delete_logs(self) -> None:
        """Forget every job's log and record on the provisioner (the pool is going)."""
        for job in list(self._jobs.values()):
            for attempt in range(1, job.attempts + 1):
                try:
                    await self._prov.DeleteLogs(
                        prov_pb.DeleteLogsRequest(job_id=self._run_id(job, attempt)), timeout=10
                    )
                except grpc.aio.AioRpcError as exc:
                    log.debug("could not delete the log of %s: %s", self._run_id(job, attempt), exc.code().name)

    async def cancel_all(self) -> None:
        """Cancel every unfinished job (the pool is being deleted)."""
        for job in list(self._jobs.values()):
            if job.state in (res.JOB_STATE_PENDING, res.JOB_STATE_RUNNING):
                await self.cancel(job.job_id)

    # ---- watching ------------------------------------------------------------------------

    async def watch(self, job_id: int, *, states_only: bool) -> AsyncIterator[api.WatchJobResponse]:
        """The job now and after every change, with its output unless `states_only`; ends after
        the job has ended and its output was sent.

        Raises:
            errors.NotFoundError: no such job.
        """
        job = self.get(job_id)
        changes: asyncio.Queue[res.Job] = asyncio.Queue()
        self._watchers.setdefault(job_id, set()).add(changes)
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
                    logs = asyncio.create_task(self._stream_output(job, output))
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
            self._watchers.get(job_id, set()).discard(changes)
            if logs is not None:
                logs.cancel()

    async def _stream_output(self, job: res.Job, out: asyncio.Queue[bytes | None]) -> None:
        request = prov_pb.StreamLogsRequest(
            kind=prov_res.LOG_KIND_JOB, job_id=self._run_id(job, job.attempts), follow=True
        )
        for _ in range(50):  # the job may not have reached the provisioner yet
            try:
                async for chunk in self._prov.StreamLogs(request):
                    out.put_nowait(chunk.data)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    log.info("job output of %s/%d stopped: %s", self.pool, job.job_id, exc.code().name)
                    break
                current = self._jobs.get(job.job_id)
                if current is None or current.attempts != job.attempts or current.state != res.JOB_STATE_RUNNING:
                    break
                await asyncio.sleep(0.1)
        out.put_nowait(None)

    # ---- following a job on the provisioner ----------------------------------------------

    def _run_id(self, job: res.Job, attempt: int) -> str:
        return f"{self.pool}-{self._uid}-{job.job_id}-{attempt}"

    def _follow(self, job_id: int) -> None:
        old = self._follows.get(job_id)
        if old is not None and not old.done():
            old.cancel()
        task = asyncio.create_task(self._run(job_id, self._jobs[job_id].attempts), name=f"job {self.pool}/{job_id}")
        self._follows[job_id] = task
        task.add_done_callback(lambda t: self._followed(job_id, t))

    def _followed(self, job_id: int, task: asyncio.Task[None]) -> None:
        if self._follows.get(job_id) is task:
            del self._follows[job_id]

    def _current(self, job_id: int, attempt: int) -> res.Job | None:
        job = self._jobs.get(job_id)
        if job is None or job.state != res.JOB_STATE_RUNNING or job.attempts != attempt:
            return None
        return job

    async def _run(self, job_id: int, attempt: int) -> None:
        """Run (or attach to) one attempt of a job and apply its events until it ends.

        The worker's name comes from the fleet side, or (a worker it no longer lists, after a
        restart) from the naming rule: the provisioner, not the controller's view, says
        whether the worker and the job are still there.
        """
        after, pause = 0, _RETRY_S[0]
        while (job := self._current(job_id, attempt)) is not None:
            worker = self._workers.get(job.replica_id)
            name = worker.name if worker is not None else f"{self.pool}-{job.replica_id}-{self._uid}"
            request = prov_pb.RunJobRequest(
                job_id=self._run_id(job, attempt), replica=name, run=job.run, envs=job.envs, after_sequence=after
            )
            try:
                async for response in self._prov.RunJob(request):
                    after = max(after, response.event.sequence)
                    pause = _RETRY_S[0]
                    if self._on_event(job_id, attempt, response.event):
                        return
            except grpc.aio.AioRpcError as exc:
                if self._on_refusal(job_id, attempt, exc):
                    return
                log.info("job %s/%d: stream broke (%s); attaching again", self.pool, job_id, exc.code().name)
            await asyncio.sleep(pause)
            pause = min(pause * 2, _RETRY_S[1])

    def _on_refusal(self, job_id: int, attempt: int, exc: grpc.aio.AioRpcError) -> bool:
        """A refused RunJob: True when it decided the attempt's end."""
        job = self._current(job_id, attempt)
        if job is None:
            return True
        code, detail = exc.code(), exc.details() or exc.code().name
        view = _rule_view(job)
        if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
            # Unknown worker, worker not ready, or busy: the job waits for another worker.
            self._unusable(job.replica_id)
            after = rules.refused(view, f"worker {job.replica_id} could not take it: {detail}")
        elif code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS):
            after = rules.could_not_run(view, f"could not run: {detail}")
        else:
            return False
        self._apply_end(job_id, attempt, after)
        return True

    def _on_event(self, job_id: int, attempt: int, ev: prov_res.JobEvent) -> bool:
        """Apply one job event; True once the attempt has ended."""
        job = self._current(job_id, attempt)
        if job is None:
            return True
        view = _rule_view(job)
        if ev.type == prov_res.JOB_EVENT_TYPE_STARTED:
            updated = self._copy(job)
            updated.start_time.CopyFrom(ev.time)
            self._store([updated])
            if job.cancel_requested:  # asked before the job reached its worker
                self._spawn(self._cancel_on_worker(updated))
            return False
        if ev.type == prov_res.JOB_EVENT_TYPE_EXITED:
            after = rules.exited(view, ev.exit_code)
        elif ev.type == prov_res.JOB_EVENT_TYPE_FAILED:
            why = ev.message or ev.job.failure_reason or "its worker died"
            if ev.cause == prov_res.FAILURE_CAUSE_INFRASTRUCTURE:
                self._unusable(job.replica_id)
                after = rules.worker_lost(view, why, max_recoveries=self._max_recoveries)
            else:
                after = rules.could_not_run(view, why)
        elif ev.type == prov_res.JOB_EVENT_TYPE_CANCELLED:
            after = rules.cancelled(view)
        else:
            return False
        self._apply_end(job_id, attempt, after, when=ev.time)
        return True

    def _apply_end(
        self, job_id: int, attempt: int, after: rules.Job, *, when: timestamp_pb2.Timestamp | None = None
    ) -> None:
        job = self._current(job_id, attempt)
        if job is None:
            return
        updated = self._with(job, after)
        if after.terminal:
            updated.end_time.CopyFrom(when if when is not None and when.seconds else pbtime.timestamp(time.time()))
        self._store([updated])
        if after.state is rules.JobState.PENDING:
            log.info("job %s/%d queued again: %s", self.pool, job_id, after.message)
        self.dispatch()
        self._on_change()

    def _unusable(self, replica_id: int) -> None:
        """The provisioner says this worker cannot run jobs: take no job to it until the fleet
        side reports it again (`set_workers`), so a requeued job goes to another worker."""
        worker = self._workers.get(replica_id)
        if worker is not None:
            self._workers[replica_id] = dataclasses.replace(worker, ready=False)

    async def _cancel_on_worker(self, job: res.Job) -> None:
        try:
            answer = await self._prov.CancelJob(
                prov_pb.CancelJobRequest(job_id=self._run_id(job, job.attempts)), timeout=60
            )
        except grpc.aio.AioRpcError as exc:
            # NOT_FOUND: RunJob has not reached the provisioner yet; STARTED cancels it then.
            log.info("cancel of job %s/%d: %s", self.pool, job.job_id, exc.code().name)
            return
        if answer.job.state == prov_res.JOB_STATE_CANCELLED:
            self._apply_end(job.job_id, job.attempts, rules.cancelled(_rule_view(job)), when=answer.job.end_time)

    # ---- records -------------------------------------------------------------------------

    def _copy(self, job: res.Job) -> res.Job:
        out = res.Job()
        out.CopyFrom(job)
        return out

    def _with(self, job: res.Job, view: rules.Job) -> res.Job:
        out = self._copy(job)
        out.state = res.JobState.Value(f"JOB_STATE_{view.state.name}")
        out.replica_id = view.worker
        out.attempts = view.attempt
        out.recoveries = view.recoveries
        out.cancel_requested = view.cancel_requested
        out.exit_code = view.exit_code
        out.message = view.message
        return out

    def _store(self, jobs: list[res.Job]) -> None:
        """Write, then let memory and watchers follow (a failed write changes nothing)."""
        self._db.put_jobs(jobs)
        for job in jobs:
            self._jobs[job.job_id] = job
            self._publish(job)

    def _publish(self, job: res.Job) -> None:
        for q in self._watchers.get(job.job_id, ()):
            q.put_nowait(job)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class JobStore(Protocol):
    """What PoolJobs needs of the store (store.Store has it)."""

    def list_jobs(self, pool: str) -> list[res.Job]: ...
    def add_job(self, job: res.Job) -> res.Job: ...
    def put_jobs(self, jobs: Iterable[res.Job]) -> None: ...

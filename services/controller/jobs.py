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

from google.protobuf import timestamp_pb2

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from services.common import errors, pagetoken, pbtime
from services.controller import job_runs
from services.controller.domain import jobs as rules

log = logging.getLogger(__name__)

MAX_RUN_BYTES = 1 << 20
MAX_NAME = 128
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_PAGE = 1000


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
        self.uid = uid
        self._db = db
        self.provisioner = provisioner
        self._on_change = on_change
        self.max_recoveries = max_recoveries
        self.jobs: dict[int, res.Job] = {j.job_id: j for j in db.list_jobs(pool)}
        self.workers: dict[int, WorkerInfo] = {}
        self._workers_known = asyncio.Event()
        self._follows: dict[int, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self.watchers: dict[int, set[asyncio.Queue[res.Job]]] = {}
        self._closed = False

    # ---- reading -------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Jobs waiting for a worker."""
        return sum(1 for j in self.jobs.values() if j.state == res.JOB_STATE_PENDING)

    @property
    def running(self) -> int:
        """Jobs on a worker."""
        return sum(1 for j in self.jobs.values() if j.state == res.JOB_STATE_RUNNING)

    def busy(self) -> dict[int, int]:
        """Worker replica id -> the id of the job it runs."""
        return {j.replica_id: j.job_id for j in self.jobs.values() if j.state == res.JOB_STATE_RUNNING}

    def unfinished(self) -> int:
        """Jobs queued or running."""
        return self.queued + self.running

    def get(self, job_id: int) -> res.Job:
        """One job.

        Raises:
            errors.NotFoundError: no such job in this pool.
        """
        job = self.jobs.get(job_id)
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
        ids = sorted(i for i in self.jobs if i > after)
        page = ids[:size]
        token = pagetoken.encode("jobs", self.pool, page[-1]) if len(ids) > size else ""
        return [self.jobs[i] for i in page], token

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Follow every job that was running when the controller stopped (attaching to it on the
        provisioner), and dispatch the queue once workers are known."""
        for job in self.jobs.values():
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
        self.workers = {w.replica_id: w for w in workers}
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
        self.jobs[job.job_id] = job
        self._publish(job)
        self.dispatch()
        self._on_change()
        return self.jobs[job.job_id]

    def dispatch(self) -> None:
        """Give the oldest queued jobs to free READY workers (stored RUNNING before RunJob)."""
        if self._closed or not self._workers_known.is_set():
            return
        views = [job_runs.rule_view(j) for j in self.jobs.values()]
        workers = [rules.Worker(w.replica_id, w.ready) for w in self.workers.values()]
        pairs = rules.assign(views, workers)
        if not pairs:
            return
        changed = []
        for job_id, rid in pairs:
            job = job_runs.with_view(self.jobs[job_id], rules.dispatched(job_runs.rule_view(self.jobs[job_id]), rid))
            job.ClearField("start_time")
            changed.append(job)
        self.store(changed)
        for job in changed:
            self._follow(job.job_id)
        self._on_change()

    async def cancel(self, job_id: int) -> res.Job:
        """Cancel a job: a queued one at once, a running one on its worker.

        Raises:
            errors.NotFoundError: no such job.
        """
        job = self.get(job_id)
        after, tell = rules.cancel(job_runs.rule_view(job))
        if after == job_runs.rule_view(job) and not tell:
            return job
        updated = job_runs.with_view(job, after)
        if after.terminal:
            updated.end_time.CopyFrom(pbtime.timestamp(time.time()))
        self.store([updated])
        self._on_change()
        if tell:
            await job_runs.cancel_on_worker(self, updated)
        return self.jobs[job_id]

    def cancel_all(self) -> None:
        """Cancel every unfinished job (the pool is being deleted): queued ones at once, running
        ones on their workers, without waiting."""
        changed, running = [], []
        for job in self.jobs.values():
            after, tell = rules.cancel(job_runs.rule_view(job))
            if after == job_runs.rule_view(job) and not tell:
                continue
            updated = job_runs.with_view(job, after)
            if after.terminal:
                updated.end_time.CopyFrom(pbtime.timestamp(time.time()))
            changed.append(updated)
            if tell:
                running.append(updated)
        if changed:
            self.store(changed)
        for job in running:
            self.spawn(job_runs.cancel_on_worker(self, job))

    def watch(self, job_id: int, *, states_only: bool) -> AsyncIterator[api.WatchJobResponse]:
        """The job now and after every change, with its output unless `states_only`; ends after
        the job has ended and its output was sent (see `job_runs.watch`).

        Raises:
            errors.NotFoundError: no such job (when iterated).
        """
        return job_runs.watch(self, job_id, states_only=states_only)

    # ---- following a job on the provisioner ----------------------------------------------

    def run_id(self, job: res.Job, attempt: int) -> str:
        return f"{self.pool}-{self.uid}-{job.job_id}-{attempt}"

    def _follow(self, job_id: int) -> None:
        old = self._follows.get(job_id)
        if old is not None and not old.done():
            old.cancel()
        task = asyncio.create_task(
            job_runs.follow(self, job_id, self.jobs[job_id].attempts), name=f"job {self.pool}/{job_id}"
        )
        self._follows[job_id] = task
        task.add_done_callback(lambda t: self._followed(job_id, t))

    def _followed(self, job_id: int, task: asyncio.Task[None]) -> None:
        if self._follows.get(job_id) is task:
            del self._follows[job_id]

    def current(self, job_id: int, attempt: int) -> res.Job | None:
        job = self.jobs.get(job_id)
        if job is None or job.state != res.JOB_STATE_RUNNING or job.attempts != attempt:
            return None
        return job

    def apply_end(
        self, job_id: int, attempt: int, after: rules.Job, *, when: timestamp_pb2.Timestamp | None = None
    ) -> None:
        job = self.current(job_id, attempt)
        if job is None:
            return
        updated = job_runs.with_view(job, after)
        if after.terminal:
            updated.end_time.CopyFrom(when if when is not None and when.seconds else pbtime.timestamp(time.time()))
        self.store([updated])
        if after.state is rules.JobState.PENDING:
            log.info("job %s/%d queued again: %s", self.pool, job_id, after.message)
        self.dispatch()
        self._on_change()

    def unusable(self, replica_id: int) -> None:
        """The provisioner says this worker cannot run jobs: take no job to it until the fleet
        side reports it again (`set_workers`), so a requeued job goes to another worker."""
        worker = self.workers.get(replica_id)
        if worker is not None:
            self.workers[replica_id] = dataclasses.replace(worker, ready=False)

    # ---- records -------------------------------------------------------------------------

    def store(self, jobs: list[res.Job]) -> None:
        """Write, then let memory and watchers follow (a failed write changes nothing)."""
        self._db.put_jobs(jobs)
        for job in jobs:
            self.jobs[job.job_id] = job
            self._publish(job)

    def _publish(self, job: res.Job) -> None:
        for q in self.watchers.get(job.job_id, ()):
            q.put_nowait(job)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class JobStore(Protocol):
    """What PoolJobs needs of the store (store.Store has it)."""

    def list_jobs(self, pool: str) -> list[res.Job]: ...
    def add_job(self, job: res.Job) -> res.Job: ...
    def put_jobs(self, jobs: Iterable[res.Job]) -> None: ...

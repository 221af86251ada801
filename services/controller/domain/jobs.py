"""A pool's jobs: their states, the queue order, which worker takes which job, recovery and cancel.

Plain rules over plain values; the job runtime (`services/controller/jobs.py`) applies them to
the stored records and drives the provisioner.

- A job is PENDING while queued, RUNNING once given to a worker (one job per worker at a time),
  then SUCCEEDED (exit 0), FAILED (another exit code, or it could not run) or CANCELLED.
- The queue is FIFO by job id. A job whose worker died goes back to PENDING in its old place
  (its id is older than every job submitted after it), counted in `recoveries`; past
  `max_recoveries` it is FAILED instead.
- A queued job starts the moment a worker is free or READY: `assign` pairs the oldest queued
  jobs with the free READY workers, lowest replica id first.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence

MAX_RECOVERIES = 3
"""Times a job is queued again after its worker died before it is FAILED."""


class JobState(enum.IntEnum):
    """Where a job stands. Values match replicaplane.controller.v1.JobState."""

    UNSPECIFIED = 0
    PENDING = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4
    CANCELLED = 5


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


@dataclasses.dataclass(frozen=True)
class Job:
    """What the rules need to know of one job.

    Attributes:
        job_id: per pool, from 1, in submission order.
        state: where it stands.
        worker: the replica id running it (RUNNING), else the last one that ran it, else 0.
        attempt: how many times it was given to a worker.
        recoveries: how many times it went back to the queue because its worker died.
        cancel_requested: a cancel was asked while it ran; it ends CANCELLED.
        exit_code: its command's exit code, once it exited.
        message: why it is in its state (a failure, a cancel, a recovery), for the user.
    """

    job_id: int
    state: JobState = JobState.PENDING
    worker: int = 0
    attempt: int = 0
    recoveries: int = 0
    cancel_requested: bool = False
    exit_code: int = 0
    message: str = ""

    @property
    def terminal(self) -> bool:
        """SUCCEEDED, FAILED or CANCELLED: nothing changes it any more."""
        return self.state in TERMINAL


@dataclasses.dataclass(frozen=True)
class Worker:
    """A pool worker as the dispatcher sees it.

    Attributes:
        replica_id: the worker's replica id.
        ready: READY: its setup finished with exit 0 and it is alive.
    """

    replica_id: int
    ready: bool


def queue(jobs: Iterable[Job]) -> list[Job]:
    """The queued jobs, oldest first (a recovered job keeps its place)."""
    return sorted((j for j in jobs if j.state is JobState.PENDING), key=lambda j: j.job_id)


def busy_workers(jobs: Iterable[Job]) -> set[int]:
    """Replica ids of the workers running a job."""
    return {j.worker for j in jobs if j.state is JobState.RUNNING and j.worker}


def assign(jobs: Sequence[Job], workers: Iterable[Worker]) -> list[tuple[int, int]]:
    """Pair queued jobs with free READY workers.

    Args:
        jobs: every job of the pool.
        workers: every worker of the pool.

    Returns:
        (job id, replica id) pairs: the oldest queued jobs, each on a READY worker that runs
        no job, lowest replica id first. One job per worker.
    """
    busy = busy_workers(jobs)
    free = sorted(w.replica_id for w in workers if w.ready and w.replica_id not in busy)
    return [(j.job_id, rid) for j, rid in zip(queue(jobs), free, strict=False)]


def dispatched(job: Job, worker: int) -> Job:
    """The job given to `worker`: RUNNING there, one more attempt."""
    return dataclasses.replace(job, state=JobState.RUNNING, worker=worker, attempt=job.attempt + 1, message="")


def exited(job: Job, code: int) -> Job:
    """Its command exited: SUCCEEDED with 0, else FAILED with the code. A cancel that was asked
    while it ran and came too late still reports the exit as it was."""
    if job.terminal:
        return job
    if code == 0:
        return dataclasses.replace(job, state=JobState.SUCCEEDED, exit_code=0, message="")
    return dataclasses.replace(job, state=JobState.FAILED, exit_code=code, message=f"exited with code {code}")


def worker_lost(job: Job, why: str, *, max_recoveries: int = MAX_RECOVERIES) -> Job:
    """Its worker died, was preempted or went away before the job ended.

    Returns:
        The job back in the queue (PENDING, one more recovery), or FAILED once it has been
        recovered `max_recoveries` times; CANCELLED if a cancel was asked meanwhile.
    """
    if job.terminal:
        return job
    if job.cancel_requested:
        return dataclasses.replace(job, state=JobState.CANCELLED, message=f"cancelled ({why})")
    if job.recoveries >= max_recoveries:
        return dataclasses.replace(
            job, state=JobState.FAILED, message=f"{why}; gave up after {job.recoveries} recoveries"
        )
    return dataclasses.replace(
        job, state=JobState.PENDING, recoveries=job.recoveries + 1, message=f"queued again: {why}"
    )


def refused(job: Job, why: str) -> Job:
    """The worker refused the job before it started (gone, not ready, busy): back to the queue,
    not counted as a recovery (its command never ran); CANCELLED if a cancel was asked."""
    if job.terminal:
        return job
    if job.cancel_requested:
        return dataclasses.replace(job, state=JobState.CANCELLED, message="cancelled before it started")
    return dataclasses.replace(job, state=JobState.PENDING, message=f"queued again: {why}")


def could_not_run(job: Job, why: str) -> Job:
    """The worker refused the job for a reason another worker would share (a bad request): FAILED."""
    if job.terminal:
        return job
    return dataclasses.replace(job, state=JobState.FAILED, message=why)


def cancelled(job: Job, why: str = "cancelled") -> Job:
    """The job's processes are gone after a cancel: CANCELLED."""
    if job.terminal:
        return job
    return dataclasses.replace(job, state=JobState.CANCELLED, message=why)


def cancel(job: Job) -> tuple[Job, bool]:
    """A cancel asked by the user.

    Returns:
        The job after the request, and whether its worker must be told to stop it: a queued
        job is CANCELLED at once; a running one is marked and ends CANCELLED when its worker
        has stopped it; a finished job is left as it is.
    """
    if job.state is JobState.PENDING:
        return cancelled(job, "cancelled while queued"), False
    if job.state is JobState.RUNNING:
        return dataclasses.replace(job, cancel_requested=True), True
    return job, False

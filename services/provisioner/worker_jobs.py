"""Jobs on pool workers, the provisioner core's part (mixed into `manager.Provisioner`).

Keyed by job id, one task per start, events in a log that RunJob streams follow, records
persisted after every step; one job per worker at a time. A job whose worker dies, is preempted
or is torn down ends FAILED with cause INFRASTRUCTURE ("worker died"), so the controller runs it
again elsewhere; a job is never started twice (the backend keys starts by the job's token, and a
restart starts only what never started).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from services.common import errors
from services.provisioner import backend as backend_mod
from services.provisioner import entries, events, jobs, logstore, model, store

if TYPE_CHECKING:
    from services.provisioner import manager

log = logging.getLogger(__name__)


class WorkerJobs:
    """The job operations of `manager.Provisioner`, which owns the state declared here."""

    _backend: backend_mod.Backend
    _logs: logstore.LogStore
    _opts: manager.Options
    _clock: Callable[[], float]
    _entries: dict[str, entries.Entry]
    _job_records: store.RecordStore
    _jobs: dict[str, jobs.Entry]
    _job_tokens: dict[str, str]  # backend token -> job id
    _job_tasks: set[asyncio.Task[None]]
    _closing: bool
    _streams_ended: bool

    if TYPE_CHECKING:

        def _get_entry(self, name: str) -> entries.Entry: ...

    async def run_job(
        self, request: model.JobRequest, *, after_sequence: int = 0, attach_only: bool = False
    ) -> AsyncIterator[model.JobEvent]:
        """Start (or attach to) job `request.job_id` on its worker and yield its events.

        Args:
            request: what to run; only `replica` is looked at when the job is known.
            after_sequence: yield only events after this one.
            attach_only: never start a job.

        Raises:
            errors.ValidationError: a malformed request for a new job, or a replica that is not a
                pool worker.
            errors.NotFoundError: no such worker (`attach_only`: no such job).
            errors.AlreadyExistsError: the job id is known on another worker.
            errors.FailedPreconditionError: the worker is not ready, or runs another job.
        """
        jobs.check_id(request.job_id)
        entry = self._jobs.get(request.job_id)
        if entry is None:
            if attach_only:
                message = f"job {request.job_id} not found"
                raise errors.NotFoundError(message, reason="JOB_NOT_FOUND", job=request.job_id)
            jobs.validate(request)
            worker = self._ready_worker(request)
            entry = self._new_job(request, worker)
            self._start_job(entry)
        elif request.replica and request.replica != entry.request.replica:
            raise errors.AlreadyExistsError(
                f"job {request.job_id} exists on worker {entry.request.replica}, not {request.replica}",
                reason="JOB_EXISTS",
                job=request.job_id,
                replica=entry.request.replica,
            )
        async for event in entry.log.follow(after_sequence):
            yield event

    def _ready_worker(self, request: model.JobRequest) -> entries.Entry:
        """The worker a new job runs on, checked: a pool worker, ready, free."""
        entry = self._get_entry(request.replica)
        replica = entry.replica
        if not replica.worker:
            raise errors.ValidationError(
                [errors.FieldViolation("replica", f"replica {replica.name} is not a pool worker: it serves a service")],
                subject="job",
            )
        ready = replica.state == model.ReplicaState.RUNNING and replica.app_state == model.AppState.RUNNING
        if not ready:
            where = replica.state.value.lower()
            if replica.state == model.ReplicaState.RUNNING:
                where = f"its process {replica.app_state.value.lower()}"
            raise errors.FailedPreconditionError(
                f"worker {replica.name} is not ready for jobs ({where})",
                reason="WORKER_NOT_READY",
                subject=replica.name,
                replica=replica.name,
            )
        if replica.job_id:
            raise errors.FailedPreconditionError(
                f"worker {replica.name} already runs job {replica.job_id} (one job per worker at a time)",
                reason="WORKER_BUSY",
                subject=replica.name,
                replica=replica.name,
                job=replica.job_id,
            )
        return entry

    def _new_job(self, request: model.JobRequest, worker: entries.Entry) -> jobs.Entry:
        job = model.Job(
            job_id=request.job_id,
            replica=request.replica,
            service=worker.replica.service,
            create_time=self._clock(),
        )
        entry = jobs.Entry(request=request, job=job, log=events.EventLog(), token=uuid.uuid4().hex)
        self._jobs[job.job_id] = entry
        self._job_tokens[entry.token] = job.job_id
        self._logs.prepare_job(request.replica, request.job_id)
        # Not saved with the worker's record: a restart reads it off the job records (faster).
        worker.replica.job_id = job.job_id
        self._save_job(entry)  # before it starts: a restart then knows it was accepted
        log.info("job %s accepted on worker %s", job.job_id, request.replica)
        return entry

    def _start_job(self, entry: jobs.Entry) -> None:
        entry.log.set_active(True)
        entry.task = asyncio.get_running_loop().create_task(self._run_job_start(entry))
        self._job_tasks.add(entry.task)
        entry.task.add_done_callback(self._job_tasks.discard)

    async def _run_job_start(self, entry: jobs.Entry) -> None:
        job = entry.job
        worker = self._entries.get(entry.request.replica)
        if worker is None or not worker.replica.worker:
            self._end_job(entry, model.JobState.FAILED, "its worker is gone", cause=model.FailureCause.INFRASTRUCTURE)
            return
        start = backend_mod.JobStart(
            job=entry.request,
            token=entry.token,
            worker=worker.request,
            worker_token=worker.token,
            log=self._logs.prepare_job(entry.request.replica, job.job_id),  # again after a restart: no harm
            grace_s=self._opts.kill_grace_s,
        )
        try:
            found = await self._backend.run_job(start)
        except backend_mod.JobStartError as exc:
            self._end_job(entry, model.JobState.FAILED, exc.message, cause=exc.cause)
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("starting job %s failed unexpectedly", job.job_id)
            self._end_job(
                entry,
                model.JobState.FAILED,
                "internal error in the provisioner while starting the job",
                cause=model.FailureCause.INFRASTRUCTURE,
            )
            return
        if job.ended:
            # Cancelled, or its worker died, while it started: nothing of it may run on.
            if found.running:
                await self._backend.cancel_job(entry.token, grace_s=0)
            return
        if job.state == model.JobState.STARTING:
            job.state = model.JobState.RUNNING
            job.start_time = found.start_time or self._clock()
            self._emit_job(entry, model.JobEventType.STARTED, message=f"started on worker {job.replica}")
        if not found.running:
            self._job_finished(entry, found.exit_code)
        elif entry.early_end is not None:
            self._job_finished(entry, entry.early_end[0])

    async def _consume_jobs(self) -> None:
        """Apply the backend's job ends; an error on one never ends the stream."""
        while True:
            try:
                async for ended in self._backend.watch_jobs():
                    job_id = self._job_tokens.get(ended.token, "")
                    entry = self._jobs.get(job_id)
                    if entry is None or entry.token != ended.token:
                        continue
                    if ended.worker_gone and not entry.lost:
                        entry.lost = f"worker died ({ended.message})"
                    try:
                        self._job_finished(entry, ended.exit_code)
                    except Exception:
                        log.exception("could not apply the end of job %s", job_id)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the backend's job stream failed; following it again")
                await asyncio.sleep(1.0)

    def _job_finished(self, entry: jobs.Entry, exit_code: int | None, *, settled: bool = False) -> None:
        """The job's processes ended: with `exit_code`, or killed (None)."""
        if entry.job.ended:
            return
        if entry.cancel_grace_s is not None:
            self._end_job(entry, model.JobState.CANCELLED, "cancelled")
        elif entry.job.state == model.JobState.STARTING:
            entry.early_end = (exit_code,)  # its start reports it once the backend answered
        elif exit_code is not None:
            self._end_job(entry, model.JobState.EXITED, f"exited with code {exit_code}", exit_code=exit_code)
        elif entry.lost:
            self._end_job(entry, model.JobState.FAILED, entry.lost, cause=model.FailureCause.INFRASTRUCTURE)
        elif not settled and self._worker_up(entry.request.replica):
            self._in_background(self._settle_kill(entry))
        else:
            worker = self._entries.get(entry.request.replica)
            replica = worker.replica if worker else None
            if replica is None or replica.state != model.ReplicaState.RUNNING:
                reason = f"worker died ({entry.request.replica} is gone)"
            elif replica.app_state != model.AppState.RUNNING:
                reason = f"worker died ({entry.request.replica} {replica.app_state.value.lower()})"
            else:
                reason = "its processes were killed without an exit code"
            self._end_job(entry, model.JobState.FAILED, reason, cause=model.FailureCause.INFRASTRUCTURE)

    def _worker_up(self, name: str) -> bool:
        worker = self._entries.get(name)
        replica = worker.replica if worker else None
        return (
            replica is not None
            and replica.state == model.ReplicaState.RUNNING
            and replica.app_state == model.AppState.RUNNING
        )

    async def _settle_kill(self, entry: jobs.Entry) -> None:
        """A job killed while its worker looks up: most often the worker is dying and its news is on
        the way; wait for it (bounded), then say which it was."""
        deadline = time.monotonic() + self._opts.job_kill_settle_s
        while time.monotonic() < deadline and not entry.lost and self._worker_up(entry.request.replica):
            await asyncio.sleep(0.05)
        self._job_finished(entry, None, settled=True)

    async def _end_worker_job(self, worker: entries.Entry, reason: str, *, grace_s: float) -> None:
        """The worker's job cannot go on (the worker died or is torn down): kill what is left of
        it and end it FAILED, the infrastructure's fault, so it is run again elsewhere."""
        entry = self._jobs.get(worker.replica.job_id)
        if entry is None or entry.job.ended:
            return
        entry.lost = entry.lost or reason
        try:
            await self._backend.cancel_job(entry.token, grace_s=grace_s)
        except Exception:
            log.exception("could not stop job %s of worker %s", entry.job.job_id, worker.replica.name)
        if not entry.job.ended:
            self._end_job(entry, model.JobState.FAILED, entry.lost, cause=model.FailureCause.INFRASTRUCTURE)

    def _end_job(
        self,
        entry: jobs.Entry,
        state: model.JobState,
        message: str,
        *,
        exit_code: int = 0,
        cause: model.FailureCause = model.FailureCause.UNSPECIFIED,
    ) -> None:
        job = entry.job
        if job.ended:
            return
        job.state = state
        job.exit_code = exit_code
        job.cause = cause
        job.end_time = self._clock()
        if state != model.JobState.EXITED:
            job.failure_reason = message
        type_ = {
            model.JobState.EXITED: model.JobEventType.EXITED,
            model.JobState.FAILED: model.JobEventType.FAILED,
            model.JobState.CANCELLED: model.JobEventType.CANCELLED,
        }[state]
        worker = self._entries.get(entry.request.replica)
        if worker is not None and worker.replica.job_id == job.job_id:
            worker.replica.job_id = ""  # free for the next job
        self._emit_job(entry, type_, message=message, exit_code=exit_code, cause=cause)
        if not self._closing:
            entry.log.set_active(False)

    def _emit_job(self, entry: jobs.Entry, type_: model.JobEventType, **fields: Any) -> None:
        event = model.JobEvent(
            sequence=entry.log.last_sequence + 1, time=self._clock(), type=type_, job=entry.job.copy(), **fields
        )
        entry.log.append(event)
        self._save_job(entry)
        detail = f": {event.message}" if event.message else ""
        self._logs.note(entry.request.replica, f"job {entry.job.job_id} {type_.value.lower()}{detail}")
        log.info("job %s on %s: %s%s", entry.job.job_id, entry.request.replica, type_.value, detail)

    async def cancel_job(self, job_id: str, *, grace_s: float | None = None) -> tuple[bool, model.Job]:
        """Cancel job `job_id`; returns once its processes are gone (bounded by the grace).

        Returns:
            Whether it was starting or running, and the job after the call.

        Raises:
            errors.ValidationError: `job_id` is not a job id.
            errors.NotFoundError: no such job.
        """
        entry = self._job_entry(job_id)
        if entry.job.ended:
            return False, entry.job.copy()
        grace = self._opts.kill_grace_s if grace_s is None else max(0.0, grace_s)
        if entry.cancel_grace_s is None:
            entry.cancel_grace_s = grace
        if entry.job.state == model.JobState.STARTING and entry.task is not None and not entry.task.done():
            # Its start kills it once the backend answered; no process of it may outlive this.
            self._end_job(entry, model.JobState.CANCELLED, "cancelled before it started")
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(entry.task), self._opts.cancel_timeout_s)
            return True, entry.job.copy()
        await self._backend.cancel_job(entry.token, grace_s=grace)
        self._end_job(entry, model.JobState.CANCELLED, "cancelled")
        return True, entry.job.copy()

    def get_job(self, job_id: str) -> model.Job:
        """Job `job_id`.

        Raises:
            errors.ValidationError: `job_id` is not a job id.
            errors.NotFoundError: no such job.
        """
        return self._job_entry(job_id).job.copy()

    def _job_entry(self, job_id: str) -> jobs.Entry:
        jobs.check_id(job_id)
        entry = self._jobs.get(job_id)
        if entry is None:
            raise errors.NotFoundError(f"job {job_id} not found", reason="JOB_NOT_FOUND", job=job_id)
        return entry

    async def _stream_job_log(self, name: str, job_id: str, *, follow: bool) -> AsyncIterator[bytes]:
        if not job_id:
            raise errors.ValidationError(
                [errors.FieldViolation("job_id", "a JOB log needs the job's id")], subject="log request"
            )
        jobs.check_id(job_id)
        if name:
            entries.check_name(name)
        entry = self._jobs.get(job_id)
        if entry is None or (name and name != entry.request.replica):
            raise errors.NotFoundError(f"no log for job {job_id}", reason="LOG_NOT_FOUND", job=job_id)

        def live() -> bool:
            return not (entry.job.ended or self._closing or self._streams_ended)

        path = self._logs.job_path(entry.request.replica, job_id)
        async for chunk in self._logs.stream_file(path, live=live if follow else None):
            yield chunk

    def _delete_job(self, job_id: str) -> bool:
        entry = self._job_entry_or_none(job_id)
        if entry is None:
            return False
        if not entry.job.ended:
            raise errors.FailedPreconditionError(
                f"job {job_id} is {entry.job.state.value.lower()}; cancel it first",
                subject=job_id,
                job=job_id,
            )
        self._forget_job(entry)
        return True

    def _job_entry_or_none(self, job_id: str) -> jobs.Entry | None:
        jobs.check_id(job_id)
        return self._jobs.get(job_id)

    def _forget_job(self, entry: jobs.Entry) -> None:
        job_id = entry.job.job_id
        self._logs.delete_job(entry.request.replica, job_id)
        self._job_records.delete(job_id)
        self._job_tokens.pop(entry.token, None)
        if self._jobs.get(job_id) is entry:
            del self._jobs[job_id]

    def _forget_jobs_of(self, worker: str) -> bool:
        """Forget every ended job of a worker that is gone (its logs went with the worker's)."""
        gone = [e for e in self._jobs.values() if e.request.replica == worker and e.job.ended]
        for entry in gone:
            self._forget_job(entry)
        return bool(gone)

    def _save_job(self, entry: jobs.Entry) -> None:
        try:
            self._job_records.save(entry.job.job_id, entry.to_record())
        except Exception:
            log.exception("could not persist job %s", entry.job.job_id)

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._job_tasks.add(task)
        task.add_done_callback(self._job_tasks.discard)

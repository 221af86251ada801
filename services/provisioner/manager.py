"""The provisioner's core: launch and teardown operations, retries, slots, watch and re-attach.

Plain Python (no gRPC). Every replica is keyed by its name. A launch or teardown runs as its
own task and appends events to the replica's event log; RPC streams only follow those logs,
so a client that goes away never stops the work, and a later call replays from any point.
Records are persisted after every step, so a restarted provisioner finds its replicas again:
running ones are watched, launches and teardowns that were in flight are resumed.

Pool workers launch like replicas but end their launch with SETUP_DONE (no endpoint). Mixed into
`Provisioner`: teardowns (`teardowns.Teardowns`) and the jobs that run on workers
(`worker_jobs.WorkerJobs`); what is kept of a replica is `entries.Entry`.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import prometheus_client
import tenacity

from services.common import errors, pagetoken
from services.provisioner import backend as backend_mod
from services.provisioner import (
    capability,
    causes,
    entries,
    events,
    jobs,
    logstore,
    metrics,
    model,
    retries,
    slots,
    store,
    teardowns,
    worker_jobs,
)

log = logging.getLogger(__name__)

_SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_MAX_OWNER = 128
MAX_PAGE_SIZE = 10_000
_RESTARTED = "a provisioner restart"
DEFAULT_PAGE_SIZE = 1_000


@dataclasses.dataclass(frozen=True)
class Options:
    """Tuning of the provisioner core (see server.Settings for each field's meaning)."""

    max_in_flight: float = 8
    launch_attempts: int = 3
    launch_backoff_initial_s: float = 60.0
    launch_backoff_multiplier: float = 1.6
    launch_backoff_max_s: float = 300.0
    teardown_attempts: int = 3
    teardown_backoff_initial_s: float = 5.0
    teardown_backoff_multiplier: float = 1.6
    teardown_backoff_max_s: float = 25.0
    backoff_jitter: float = retries.DEFAULT_JITTER
    cancel_timeout_s: float = 15.0
    kill_grace_s: float = 5.0
    watch_history: int = 10_000
    sweep_interval_s: float = 5.0
    # How long a job killed from outside waits for news of its worker (the Pod watch may lag
    # behind the exec session) before it is reported killed rather than "worker died".
    job_kill_settle_s: float = 1.0


def validate(request: model.LaunchRequest) -> None:
    """Check the shape of a launch request.

    Raises:
        errors.ValidationError: every problem found, each naming its field.
    """
    violations = []
    if not _SERVICE_NAME.match(request.service) or len(request.service) > 63:
        violations.append(errors.FieldViolation("service", "must match [a-z]([-a-z0-9]*[a-z0-9])?, at most 63 chars"))
    if request.replica_id < 1:
        violations.append(errors.FieldViolation("replica_id", "must be at least 1"))
    prefix = f"{request.service}-{request.replica_id}"
    suffix = request.name[len(prefix) :]
    if not request.name.startswith(prefix) or not (suffix == "" or re.fullmatch(r"-[a-z0-9]{1,16}", suffix)):
        violations.append(errors.FieldViolation("name", "must be {service}-{replica_id}[-{suffix}]"))
    if len(request.owner) > _MAX_OWNER or not request.owner.isprintable():
        violations.append(errors.FieldViolation("owner", f"must be at most {_MAX_OWNER} printable characters"))
    errors.require(violations, subject="launch request")


class Provisioner(teardowns.Teardowns, worker_jobs.WorkerJobs):
    """Launches and tears down replicas through a backend; see the module docstring."""

    def __init__(
        self,
        *,
        backend: backend_mod.Backend,
        records: store.RecordStore,
        logs: logstore.LogStore,
        options: Options | None = None,
        clock: Callable[[], float] = time.time,
        stats: metrics.ProvisionerMetrics | None = None,
        job_records: store.RecordStore | None = None,
    ) -> None:
        self._backend = backend
        self._stats = stats or metrics.ProvisionerMetrics(prometheus_client.CollectorRegistry(), backend.name)
        self._stats.watch(self._count_states)
        backend.report_api_errors(self._stats.api_error)
        self._records = records
        self._logs = logs
        self._opts = options or Options()
        self._clock = clock
        self._slots = slots.Slots(self._opts.max_in_flight)
        self._entries: dict[str, entries.Entry] = {}
        self._job_records = job_records or records.sibling("jobs")
        self._jobs: dict[str, jobs.Entry] = {}
        self._job_tokens: dict[str, str] = {}  # backend token -> job id
        self._job_tasks: set[asyncio.Task[None]] = set()
        self._hub = events.WatchHub(self._snapshot, history=self._opts.watch_history, clock=clock)
        self._consumer: asyncio.Task[None] | None = None
        self._job_consumer: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = False
        self._streams_ended = False

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load records, re-find replicas through the backend, resume interrupted operations."""
        await self._backend.start()
        for data in self._records.load_all():
            try:
                entry = entries.Entry.from_record(data)
            except (KeyError, TypeError, ValueError):
                log.warning("ignoring a malformed replica record")
                continue
            self._entries[entry.request.name] = entry
        for data in self._job_records.load_all():
            try:
                job = jobs.Entry.from_record(data)
            except (KeyError, TypeError, ValueError):
                log.warning("ignoring a malformed job record")
                continue
            self._jobs[job.job.job_id] = job
            self._job_tokens[job.token] = job.job.job_id
        # Which job a worker runs is the job records' fact (a replica record may be older).
        for entry in self._entries.values():
            entry.replica.job_id = ""
        for job in self._jobs.values():
            worker = self._entries.get(job.request.replica)
            if worker is not None and not job.job.ended:
                worker.replica.job_id = job.job.job_id
        for found in self._backend.list():
            if found.name not in self._entries:
                log.warning("tearing down replica %s: the backend runs it but no record exists", found.name)
                try:
                    await self._backend.delete(found.name, grace_s=self._opts.kill_grace_s)
                except backend_mod.TeardownError as exc:
                    log.warning("could not tear down unknown replica %s: %s", found.name, exc)
        self._consumer = asyncio.get_running_loop().create_task(self._consume())
        self._job_consumer = asyncio.get_running_loop().create_task(self._consume_jobs())
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        for entry in list(self._entries.values()):
            self._resume(entry)
        for job in list(self._jobs.values()):
            if not job.job.ended:
                # Started again through the backend, which never starts one twice: a job that
                # runs is re-attached, one that never started starts now.
                self._start_job(job)

    def _resume(self, entry: entries.Entry) -> None:
        replica = entry.replica
        if replica.state in (model.ReplicaState.QUEUED, model.ReplicaState.PROVISIONING):
            self._logs.note(replica.name, "provisioner restarted during the launch; starting it again")
            self._start_launch(entry, resumed=_RESTARTED)
        elif replica.state == model.ReplicaState.TERMINATING:
            last = entry.teardown.last
            if last is None or not last.terminal:
                self._start_teardown(entry, drain_s=0.0, keep_logs=entry.keep_logs)
        elif replica.state == model.ReplicaState.RUNNING and replica.app_state == model.AppState.RUNNING:
            found = self._backend.get(replica.name)
            if found is None or found.token != entry.token:
                self._app_changed(
                    entry, model.AppState.VANISHED, 0, "the replica was gone when the provisioner restarted"
                )

    def end_streams(self) -> None:
        """End every open stream (shutdown), so a graceful server stop does not wait on them.

        Clients see their stream end without a terminal event and re-attach with
        `after_sequence`, as after any cut stream; the work itself goes on.
        """
        self._streams_ended = True
        for entry in self._entries.values():
            entry.launch.close()
            entry.teardown.close()
        for job in self._jobs.values():
            job.log.close()
        self._hub.close()

    async def close(self) -> None:
        """Stop operations (they resume on the next start) and watchers; replicas keep running."""
        self._closing = True
        tasks = [t for e in self._entries.values() for t in (e.launch_task, e.teardown_task) if t and not t.done()]
        tasks += [t for t in (self._consumer, self._job_consumer, self._sweeper) if t is not None]
        tasks += list(self._job_tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        for entry in self._entries.values():
            entry.launch.close()
            entry.teardown.close()
        for job in self._jobs.values():
            job.log.close()
        self._hub.close()
        await self._backend.close()

    # ---- launch ----------------------------------------------------------------------------

    async def launch(
        self, request: model.LaunchRequest, *, after_sequence: int = 0, attach_only: bool = False
    ) -> AsyncIterator[model.LaunchEvent]:
        """Start (or attach to) the launch of `request.name` and yield its events.

        Args:
            request: what to launch; ignored when the name is already known.
            after_sequence: yield only events after this one.
            attach_only: never start a launch.

        Raises:
            errors.NotFoundError: `attach_only` and no such replica.
            errors.ValidationError: a malformed request for a new replica.
            errors.FailedPreconditionError: the replica is being torn down.
        """
        entry = self._entries.get(request.name)
        if entry is None:
            if attach_only:
                raise errors.NotFoundError(
                    f"replica {request.name} not found", reason="REPLICA_NOT_FOUND", replica=request.name
                )
            validate(request)
            entry = self._new_entry(request)
            self._start_launch(entry)
        elif entry.replica.state == model.ReplicaState.TERMINATING:
            raise errors.FailedPreconditionError(
                f"replica {request.name} is being torn down", subject=request.name, replica=request.name
            )
        async for event in entry.launch.follow(after_sequence):
            yield event

    def _new_entry(self, request: model.LaunchRequest) -> entries.Entry:
        replica = model.Replica(
            name=request.name,
            service=request.service,
            replica_id=request.replica_id,
            version=request.version,
            is_spot=request.use_spot,
            zone=request.zone,
            backend=self._backend.name,
            create_time=self._clock(),
            owner=request.owner,
            worker=request.spec.worker,
        )
        entry = entries.Entry(request=request, replica=replica, launch=events.EventLog(), teardown=events.EventLog())
        self._entries[request.name] = entry
        self._logs.prepare(request.name)
        self._logs.note(request.name, f"launch of replica {request.name} (version {request.version}) requested")
        return entry

    def _start_launch(self, entry: entries.Entry, *, resumed: str = "") -> None:
        """Run the launch of `entry`; `resumed` says why an interrupted one starts again."""
        entry.launch.set_active(True)
        entry.launch_started = time.monotonic()
        if not resumed:
            self._emit_queued(entry, "accepted")  # at once: the caller's first event
        entry.launch_task = asyncio.get_running_loop().create_task(self._run_launch(entry, resumed=resumed))

    def _emit_queued(self, entry: entries.Entry, message: str) -> None:
        entry.replica.state = model.ReplicaState.QUEUED
        if self._slots.would_wait(slots.LAUNCH):
            message += f"; waiting for a launch slot ({self._slots.waiting} queued ahead)"
        self._emit_launch(entry, model.LaunchEventType.QUEUED, message=message)

    async def _run_launch(self, entry: entries.Entry, *, resumed: str) -> None:
        name = entry.request.name
        try:
            if resumed:
                if entry.replica.state == model.ReplicaState.PROVISIONING:
                    # The attempt in progress is lost, through no fault of the spec.
                    lost = entry.replica.attempt
                    entry.replica.failure_reason = f"attempt {lost} was interrupted by {resumed}"
                    self._emit_launch(
                        entry,
                        model.LaunchEventType.ATTEMPT_FAILED,
                        attempt=lost,
                        message=entry.replica.failure_reason,
                        cause=model.FailureCause.INFRASTRUCTURE,
                    )
                await self._remove_leftovers(entry, grace_s=0)
                self._emit_queued(entry, f"resumed after {resumed}")
            retrying = tenacity.AsyncRetrying(
                stop=tenacity.stop_after_attempt(max(1, self._opts.launch_attempts)),
                wait=retries.wait_jittered_exponential(
                    self._opts.launch_backoff_initial_s,
                    self._opts.launch_backoff_multiplier,
                    self._opts.launch_backoff_max_s,
                    self._opts.backoff_jitter,
                ),
                # Never again once a teardown owns the replica (a cancel that timed out).
                retry=tenacity.retry_if_exception(
                    lambda exc: (
                        retries.launch_retryable(exc, zone=entry.request.zone)
                        and entry.replica.state != model.ReplicaState.TERMINATING
                    )
                ),
                before_sleep=lambda state: self._launch_retrying(entry, state),
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    await self._launch_attempt(entry, attempt.retry_state.attempt_number)
            self._launch_finished(entry, "succeeded")
        except backend_mod.LaunchError as exc:
            self._launch_finished(entry, "failed")
            entry.replica.state = model.ReplicaState.FAILED
            entry.replica.failure_reason = exc.message
            self._emit_launch(
                entry,
                model.LaunchEventType.FAILED,
                message=exc.message,
                permanent=exc.permanent,
                capacity_unavailable=exc.capacity_unavailable,
                cause=exc.cause,
            )
        except asyncio.CancelledError:
            if self._closing:
                raise
            self._launch_finished(entry, "cancelled")
            await self._remove_leftovers(entry, grace_s=0)
            entry.replica.state = model.ReplicaState.TERMINATED
            entry.replica.failure_reason = "launch cancelled"
            self._emit_launch(entry, model.LaunchEventType.CANCELLED, message="launch cancelled; leftovers torn down")
        except Exception:
            log.exception("launch of %s failed unexpectedly", name)
            self._launch_finished(entry, "failed")
            entry.replica.state = model.ReplicaState.FAILED
            entry.replica.failure_reason = "internal error in the provisioner"
            self._emit_launch(
                entry,
                model.LaunchEventType.FAILED,
                message=entry.replica.failure_reason,
                cause=model.FailureCause.INFRASTRUCTURE,
            )
        finally:
            if not self._closing:
                entry.launch.set_active(False)

    async def _launch_attempt(self, entry: entries.Entry, attempt: int) -> None:
        if attempt > 1 and self._slots.would_wait(slots.LAUNCH):
            entry.replica.state = model.ReplicaState.QUEUED
            self._emit_launch(
                entry,
                model.LaunchEventType.QUEUED,
                attempt=attempt,
                message=f"waiting for a launch slot ({self._slots.waiting} queued ahead)",
            )
        async with self._slots.hold(slots.LAUNCH):
            entry.replica.state = model.ReplicaState.PROVISIONING
            entry.replica.attempt = attempt
            entry.pending.clear()
            self._emit_launch(
                entry,
                model.LaunchEventType.PROVISIONING,
                attempt=attempt,
                message=f"attempt {attempt} of {self._opts.launch_attempts}",
            )
            request = backend_mod.CreateRequest(
                launch=entry.request,
                attempt=attempt,
                launch_log=self._logs.path(entry.request.name, model.LogKind.LAUNCH),
                app_log=self._logs.path(entry.request.name, model.LogKind.APP),
            )
            try:
                created = await self._backend.create(request)
            except backend_mod.LaunchError as exc:
                await self._attempt_failed(entry, attempt, exc)
                raise
            except Exception as exc:
                log.exception("backend error launching %s", entry.request.name)
                failure = backend_mod.LaunchError(
                    f"backend error: {type(exc).__name__}", cause=model.FailureCause.INFRASTRUCTURE
                )
                await self._attempt_failed(entry, attempt, failure)
                raise failure from exc
            self._stats.attempt_finished("succeeded")
            replica = entry.replica
            entry.token = created.token
            replica.state = model.ReplicaState.RUNNING
            replica.app_state = model.AppState.RUNNING
            replica.endpoint = created.endpoint
            replica.zone = created.zone
            replica.price_per_hour = created.price_per_hour
            replica.is_spot = created.is_spot
            replica.start_time = created.start_time or self._clock()
            replica.failure_reason = ""
            replica.accelerator = created.accelerator
            replica.resources_path = created.resources_path
            # Which alternative runs, when the spec had several: `, on resources.any_of[1] (H100:1)`.
            on = created.resources_path if created.resources_path not in ("", "resources") else ""
            if created.accelerator:
                on = f"{on} ({created.accelerator})" if on else created.accelerator
            where = (f" in zone {created.zone}" if created.zone else "") + (f", on {on}" if on else "")
            if replica.worker:
                # Nothing to probe: a worker is ready the moment its setup exited 0.
                replica.endpoint = ""
                self._emit_launch(
                    entry,
                    model.LaunchEventType.SETUP_DONE,
                    attempt=attempt,
                    message=f"setup done; worker ready for jobs{where}",
                )
                self._hub.publish(model.ReplicaEventType.APP_RUNNING, replica, "worker ready (setup done)")
            else:
                self._emit_launch(
                    entry,
                    model.LaunchEventType.RUNNING,
                    attempt=attempt,
                    endpoint=created.endpoint,
                    message=f"running at {created.endpoint}{where}",
                )
                self._hub.publish(model.ReplicaEventType.APP_RUNNING, replica, "app started")
            early = entry.pending.pop(created.token, None)
            entry.pending.clear()
            if early is not None:
                self._app_changed(entry, early.app_state, early.exit_code, early.message, cause=early.cause)

    async def _attempt_failed(self, entry: entries.Entry, attempt: int, exc: backend_mod.LaunchError) -> None:
        self._stats.attempt_finished("capacity_unavailable" if exc.capacity_unavailable else "failed")
        entry.replica.failure_reason = exc.message
        self._emit_launch(
            entry,
            model.LaunchEventType.ATTEMPT_FAILED,
            attempt=attempt,
            message=exc.message,
            permanent=exc.permanent,
            capacity_unavailable=exc.capacity_unavailable,
            cause=exc.cause,
        )
        await self._remove_leftovers(entry, grace_s=self._opts.kill_grace_s)

    def _launch_finished(self, entry: entries.Entry, outcome: str) -> None:
        self._stats.launch_finished(outcome, time.monotonic() - entry.launch_started)

    def _launch_retrying(self, entry: entries.Entry, state: tenacity.RetryCallState) -> None:
        delay = state.next_action.sleep if state.next_action else 0.0
        self._emit_launch(
            entry,
            model.LaunchEventType.RETRYING,
            attempt=state.attempt_number,
            retry_delay_s=delay,
            message=f"retrying in {delay:.1f} s",
        )

    async def _remove_leftovers(self, entry: entries.Entry, *, grace_s: float) -> None:
        try:
            await self._backend.delete(entry.request.name, grace_s=grace_s)
        except Exception as exc:  # the next attempt or the teardown tries again
            log.warning("could not remove leftovers of %s: %s", entry.request.name, exc)
            self._logs.note(entry.request.name, f"could not remove leftovers: {exc}")

    def _emit_launch(self, entry: entries.Entry, type_: model.LaunchEventType, **fields: Any) -> None:
        event = model.LaunchEvent(
            sequence=entry.launch.last_sequence + 1,
            time=self._clock(),
            type=type_,
            replica=entry.replica.copy(),
            **fields,
        )
        entry.launch.append(event)
        self._save(entry)
        detail = f": {event.message}" if event.message else ""
        self._logs.note(entry.request.name, f"launch {type_.value.lower()}{detail}")
        log.log(
            logging.INFO if event.terminal else logging.DEBUG,
            "%s: launch %s%s",
            entry.request.name,
            type_.value,
            detail,
        )

    async def cancel_launch(self, name: str) -> bool:
        """Cancel the in-flight launch of `name` and wait (bounded) for its leftovers to go.

        Returns:
            True if a launch was in flight.
        """
        entry = self._entries.get(name)
        if entry is None or entry.launch_task is None or entry.launch_task.done():
            return False
        await self._cancel_and_wait(entry)
        return True

    async def _cancel_and_wait(self, entry: entries.Entry) -> None:
        task = entry.launch_task
        if task is None or task.done():
            return
        task.cancel()
        try:
            await asyncio.wait_for(asyncio.shield(task), self._opts.cancel_timeout_s)
        except TimeoutError:
            log.warning("launch of %s did not stop within %.0f s", entry.request.name, self._opts.cancel_timeout_s)

    # ---- app state -------------------------------------------------------------------------

    async def _consume(self) -> None:
        """Apply the backend's app events; an error on one event never ends the stream."""
        while True:
            try:
                async for event in self._backend.watch():
                    try:
                        self._on_backend_event(event)
                    except Exception:
                        log.exception("could not apply a backend event of %s", event.name)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the backend's event stream failed; following it again")
                await asyncio.sleep(1.0)

    def _on_backend_event(self, event: backend_mod.BackendEvent) -> None:
        entry = self._entries.get(event.name)
        if entry is None:
            return
        if event.token != entry.token:
            if entry.replica.state == model.ReplicaState.PROVISIONING:
                entry.pending[event.token] = event  # the launch has not recorded RUNNING yet
            return
        self._app_changed(entry, event.app_state, event.exit_code, event.message, cause=event.cause)

    async def _sweep(self) -> None:
        """The level-triggered pass: an operation whose task died is started again, and an app
        whose end was missed is reported, every `sweep_interval_s`."""
        while True:
            await asyncio.sleep(self._opts.sweep_interval_s)
            for entry in list(self._entries.values()):
                try:
                    self._resync(entry)
                except Exception:
                    log.exception("resync of %s failed", entry.request.name)

    def _resync(self, entry: entries.Entry) -> None:
        replica = entry.replica
        if self._closing or self._entries.get(replica.name) is not entry:
            return
        launching = replica.state in (model.ReplicaState.QUEUED, model.ReplicaState.PROVISIONING)
        if launching and (entry.launch_task is None or entry.launch_task.done()):
            log.warning("%s: its launch had stopped without an end; starting it again", replica.name)
            self._start_launch(entry, resumed="an internal error (the launch task ended early)")
        elif replica.state == model.ReplicaState.TERMINATING and (
            entry.teardown_task is None or entry.teardown_task.done()
        ):
            last = entry.teardown.last
            if last is None or not last.terminal:
                log.warning("%s: its teardown had stopped without an end; starting it again", replica.name)
                self._start_teardown(entry, drain_s=0.0, keep_logs=entry.keep_logs)
        elif replica.state == model.ReplicaState.RUNNING and replica.app_state == model.AppState.RUNNING:
            found = self._backend.get(replica.name)
            if found is not None and found.token == entry.token and found.app_state != model.AppState.RUNNING:
                self._app_changed(entry, found.app_state, found.exit_code, f"app {found.app_state.value.lower()}")

    def _app_changed(
        self,
        entry: entries.Entry,
        app_state: model.AppState,
        exit_code: int,
        message: str,
        *,
        preempted: bool = False,
        cause: model.FailureCause = model.FailureCause.UNSPECIFIED,
    ) -> None:
        replica = entry.replica
        if replica.state != model.ReplicaState.RUNNING:
            return  # being torn down: the teardown reports the end
        if replica.app_state != model.AppState.RUNNING and not preempted:
            return  # already reported
        replica.app_state = app_state
        replica.exit_code = exit_code
        self._save(entry)
        type_ = {
            model.AppState.EXITED: model.ReplicaEventType.APP_EXITED,
            model.AppState.VANISHED: model.ReplicaEventType.VANISHED,
            model.AppState.PREEMPTED: model.ReplicaEventType.PREEMPTED,
        }[app_state]
        if cause == model.FailureCause.UNSPECIFIED:
            cause = causes.of_app_state(app_state)
        self._hub.publish(type_, replica, message, cause)
        self._logs.note(replica.name, message)
        log.info("%s: %s", replica.name, message)
        if replica.job_id:
            self._in_background(self._end_worker_job(entry, f"worker died ({message})", grace_s=0))

    async def preempt(self, name: str) -> model.Replica:
        """Simulate a preemption of replica `name`: kill it and report PREEMPTED.

        Raises:
            errors.NotFoundError: no such replica.
            errors.FailedPreconditionError: the replica is not running (or being torn down).
        """
        entry = self._get_entry(name)
        replica = entry.replica
        if replica.app_state == model.AppState.PREEMPTED:
            return replica.copy()
        if replica.state != model.ReplicaState.RUNNING:
            raise errors.FailedPreconditionError(
                f"replica {name} is {replica.state.value.lower()}, not running", subject=name, replica=name
            )
        job = self._jobs.get(replica.job_id)
        if job is not None:
            job.lost = "worker died (replica preempted)"  # its processes die with the worker's
        await self._backend.preempt(name)
        self._app_changed(
            entry,
            model.AppState.PREEMPTED,
            replica.exit_code,
            "replica preempted (simulated)",
            preempted=True,
            cause=model.FailureCause.INFRASTRUCTURE,
        )
        return replica.copy()

    # ---- reads -----------------------------------------------------------------------------

    def _get_entry(self, name: str) -> entries.Entry:
        entry = self._entries.get(name)
        if entry is None:
            message = f"replica {name} not found"
            # A bare `{service}-{id}` (as older docs showed) names the replicas it could mean:
            # the controller's names end in the service's uid.
            service, _, rid = name.rpartition("-")
            if service and rid.isascii() and rid.isdigit() and len(rid) <= 18:
                meant = sorted(
                    n
                    for n, e in self._entries.items()
                    if e.replica.service == service and e.replica.replica_id == int(rid)
                )
                if meant:
                    message += (
                        f"; replica names are {{service}}-{{replica_id}}-{{uid}}: did you mean {', '.join(meant[:3])}?"
                    )
            raise errors.NotFoundError(message, reason="REPLICA_NOT_FOUND", replica=name)
        return entry

    def get(self, name: str) -> model.Replica:
        """The replica `name`.

        Raises:
            errors.NotFoundError: no such replica.
        """
        return self._get_entry(name).replica.copy()

    def list(self, *, service: str = "", page_size: int = 0, page_token: str = "") -> tuple[list[model.Replica], str]:
        """One page of replicas in name order, and the token of the next page ("" at the end).

        Raises:
            errors.ValidationError: a negative page size or a malformed page token.
        """
        if page_size < 0:
            raise errors.ValidationError([errors.FieldViolation("page_size", "must not be negative")])
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        start = str(pagetoken.decode(page_token, "replicas", service, position_type=str)) if page_token else ""
        names = sorted(
            n for n, e in self._entries.items() if (not service or e.replica.service == service) and n > start
        )
        page = names[:size]
        token = pagetoken.encode("replicas", service, page[-1]) if len(names) > size else ""
        return [self._entries[n].replica.copy() for n in page], token

    def _count_states(self) -> dict[str, int]:
        """Replicas by the metrics' state names (see metrics.STATES)."""
        counts: dict[str, int] = {}
        for entry in self._entries.values():
            replica = entry.replica
            state = replica.state.value.lower()
            if replica.state == model.ReplicaState.RUNNING and replica.app_state != model.AppState.RUNNING:
                state = "app_ended"
            counts[state] = counts.get(state, 0) + 1
        return counts

    def _snapshot(self) -> builtins.list[model.Replica]:
        return [self._entries[n].replica.copy() for n in sorted(self._entries)]

    def watch(self, after_sequence: int = 0) -> AsyncIterator[model.ReplicaEvent]:
        """Replica changes after `after_sequence`, a snapshot first when needed (see WatchHub)."""
        return self._hub.follow(after_sequence)

    def zones(self) -> builtins.list[model.Zone]:
        """The backend's zones, cheapest first."""
        return self._backend.zones()

    def set_zone_availability(self, zone: str, refuse_for_s: float) -> model.Zone:
        """Make `zone` refuse launches for `refuse_for_s` seconds; 0 accepts again."""
        return self._backend.set_zone_availability(zone, refuse_for_s)

    async def stream_logs(
        self, name: str, kind: model.LogKind, *, follow: bool, job_id: str = ""
    ) -> AsyncIterator[bytes]:
        """The bytes of a replica's log, or (kind JOB) of a job's output; with `follow`, new output
        while the replica (the job) lives.

        Raises:
            errors.ValidationError: `name` is not a replica name (never a path), or a JOB log
                without a valid `job_id`.
            errors.NotFoundError: no such log (never launched, or removed at teardown).
        """
        if kind == model.LogKind.JOB:
            async for chunk in self._stream_job_log(name, job_id, follow=follow):
                yield chunk
            return
        entries.check_name(name)
        if not self._logs.exists(name, kind):
            raise errors.NotFoundError(f"no {kind.value} log for replica {name}", reason="LOG_NOT_FOUND", replica=name)
        live = (lambda: self._live(name, kind)) if follow else None
        async for chunk in self._logs.stream(name, kind, live=live):
            yield chunk

    async def check_spec(self, needs: capability.Needs) -> builtins.list[errors.FieldViolation]:
        """What of a spec this provisioner's backend cannot run; empty if it can."""
        backend = self._backend
        problems = capability.accelerator_problems(needs, backend.offered_accelerators(), hint=backend.accelerator_hint)
        problems += capability.relative_problems(needs)
        return problems + await backend.path_problems(needs)

    def offered_accelerators(self) -> dict[str, float] | None:
        """The backend's accelerators; None when it places no limit."""
        return self._backend.offered_accelerators()

    def delete_logs(self, name: str, *, job_id: str = "") -> bool:
        """Delete the logs kept for replica `name`, which must be gone, with its jobs' logs and
        records; or, with `job_id`, one ended job's log and record. True if there were any.

        Raises:
            errors.ValidationError: `name` is not a replica name (`job_id` not a job id).
            errors.FailedPreconditionError: the replica still exists (tear it down first), or
                the job has not ended.
        """
        if job_id:
            return self._delete_job(job_id)
        entries.check_name(name)
        if name in self._entries:
            raise errors.FailedPreconditionError(
                f"replica {name} still exists; its logs go with its teardown", subject=name, replica=name
            )
        existed = any(self._logs.exists(name, kind) for kind in model.REPLICA_LOGS)
        self._logs.delete(name)
        existed = self._forget_jobs_of(name) or existed
        return existed

    def _live(self, name: str, kind: model.LogKind) -> bool:
        entry = self._entries.get(name)
        if entry is None or self._closing or self._streams_ended:
            return False
        if kind == model.LogKind.LAUNCH:
            return entry.launch.active or entry.teardown.active
        return entry.replica.state == model.ReplicaState.RUNNING and entry.replica.app_state == model.AppState.RUNNING

    def _save(self, entry: entries.Entry) -> None:
        # Memory is the truth while the provisioner runs; a record that could not be written
        # only matters after a restart, which re-finds replicas through the backend anyway.
        try:
            self._records.save(entry.request.name, entry.to_record())
        except Exception:
            log.exception("could not persist replica %s", entry.request.name)

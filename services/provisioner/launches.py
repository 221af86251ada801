"""Launches, the provisioner core's part (mixed into `manager.Provisioner`), and the shape of a launch request.

A launch runs as its own task: it waits for a launch slot, creates through the backend with
retries (jittered exponential backoff), and appends each step to the replica's launch log,
which Launch streams follow and replay. A cancelled launch removes its leftovers.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import tenacity

from services.common import errors
from services.provisioner import backend as backend_mod
from services.provisioner import entries, events, logstore, metrics, model, retries, slots

if TYPE_CHECKING:
    from services.provisioner import manager

log = logging.getLogger(__name__)

_SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_MAX_OWNER = 128


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


class Launches:
    """The launch operations of `manager.Provisioner`, which owns the state declared here."""

    _backend: backend_mod.Backend
    _logs: logstore.LogStore
    _opts: manager.Options
    _clock: Callable[[], float]
    _slots: slots.Slots
    _stats: metrics.ProvisionerMetrics
    _entries: dict[str, entries.Entry]
    _hub: events.WatchHub
    _closing: bool

    if TYPE_CHECKING:

        def _app_changed(
            self,
            entry: entries.Entry,
            app_state: model.AppState,
            exit_code: int,
            message: str,
            *,
            preempted: bool = False,
            cause: model.FailureCause = model.FailureCause.UNSPECIFIED,
        ) -> None: ...

        def _save(self, entry: entries.Entry) -> None: ...

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

"""Teardowns, the provisioner core's part (mixed into `manager.Provisioner`).

A teardown runs as its own task: it cancels the launch in flight, ends the worker's job, drains
(cut short by a later call with a shorter drain), waits for a teardown slot, deletes through the
backend with retries, and appends each step to the replica's teardown log, which Terminate
streams follow and replay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import tenacity

from services.common import waits
from services.provisioner import backend as backend_mod
from services.provisioner import entries, events, logstore, metrics, model, retries, slots, store

if TYPE_CHECKING:
    from services.provisioner import manager

log = logging.getLogger(__name__)


class Teardowns:
    """The teardown operations of `manager.Provisioner`, which owns the state declared here."""

    _backend: backend_mod.Backend
    _records: store.RecordStore
    _logs: logstore.LogStore
    _opts: manager.Options
    _clock: Callable[[], float]
    _slots: slots.Slots
    _stats: metrics.ProvisionerMetrics
    _entries: dict[str, entries.Entry]
    _hub: events.WatchHub
    _closing: bool

    if TYPE_CHECKING:

        async def _cancel_and_wait(self, entry: entries.Entry) -> None: ...

        async def _end_worker_job(self, worker: entries.Entry, reason: str, *, grace_s: float) -> None: ...

        def _forget_jobs_of(self, worker: str) -> bool: ...

        def _save(self, entry: entries.Entry) -> None: ...

    async def terminate(
        self, name: str, *, drain_s: float = 0.0, keep_logs: bool = False, after_sequence: int = 0
    ) -> AsyncIterator[model.TerminateEvent]:
        """Start (or attach to) the teardown of `name` and yield its events.

        A replica that does not exist yields one TERMINATED event. A call with
        `after_sequence` inside a finished, failed teardown replays its end; otherwise a new
        teardown starts when none is in progress. A call that attaches to a teardown still
        draining with a shorter `drain_s` ends the drain early (a service deleted while one of
        its replicas drains is torn down without waiting out the drain).
        """
        entry = self._entries.get(name)
        if entry is None:
            yield model.TerminateEvent(
                sequence=after_sequence + 1,
                time=self._clock(),
                type=model.TerminateEventType.TERMINATED,
                message="no such replica",
            )
            return
        log_ = entry.teardown
        if log_.active and drain_s < entry.drain_s:
            entry.drain_s = max(0.0, drain_s)
            entry.drain_cut.set()
        if not log_.active:
            last = log_.last
            replaying = last is not None and entry.teardown_start <= after_sequence < last.sequence
            if not replaying:
                self._start_teardown(entry, drain_s=drain_s, keep_logs=keep_logs)
        after = max(after_sequence, entry.teardown_start - 1) if log_.active else after_sequence
        async for event in log_.follow(after):
            yield event

    def _start_teardown(self, entry: entries.Entry, *, drain_s: float, keep_logs: bool) -> None:
        entry.teardown_start = entry.teardown.last_sequence + 1
        entry.drain_s = max(0.0, drain_s)
        entry.drain_cut = asyncio.Event()
        entry.keep_logs = keep_logs
        entry.teardown.set_active(True)
        entry.teardown_task = asyncio.get_running_loop().create_task(self._run_teardown(entry))

    async def _run_teardown(self, entry: entries.Entry) -> None:
        name = entry.request.name
        try:
            await self._cancel_and_wait(entry)
            if entry.replica.job_id:
                await self._end_worker_job(entry, "its worker was torn down", grace_s=self._opts.kill_grace_s)
            replica = entry.replica
            app_up = replica.state == model.ReplicaState.RUNNING and replica.app_state == model.AppState.RUNNING
            replica.state = model.ReplicaState.TERMINATING
            self._save(entry)
            if entry.drain_s > 0 and app_up:
                self._emit_teardown(
                    entry,
                    model.TerminateEventType.DRAINING,
                    delay_s=entry.drain_s,
                    message=f"draining {entry.drain_s:g} s",
                )
                await waits.wait_event(entry.drain_cut, entry.drain_s)
            entry.teardown_started = time.monotonic()
            if self._slots.would_wait(slots.TEARDOWN):
                self._emit_teardown(
                    entry,
                    model.TerminateEventType.QUEUED,
                    message=f"waiting for a teardown slot ({self._slots.waiting} queued ahead)",
                )
            async with self._slots.hold(slots.TEARDOWN):
                self._emit_teardown(entry, model.TerminateEventType.TERMINATING, attempt=1)
                retrying = tenacity.AsyncRetrying(
                    stop=tenacity.stop_after_attempt(max(1, self._opts.teardown_attempts)),
                    wait=retries.wait_jittered_exponential(
                        self._opts.teardown_backoff_initial_s,
                        self._opts.teardown_backoff_multiplier,
                        self._opts.teardown_backoff_max_s,
                        self._opts.backoff_jitter,
                    ),
                    retry=tenacity.retry_if_exception_type(backend_mod.TeardownError),
                    before_sleep=lambda state: self._teardown_retrying(entry, state),
                    reraise=True,
                )
                async for attempt in retrying:
                    with attempt:
                        await self._teardown_attempt(entry)
            replica.state = model.ReplicaState.TERMINATED
            self._teardown_finished(entry, "succeeded")
            self._emit_teardown(entry, model.TerminateEventType.TERMINATED, message="torn down")
            self._hub.publish(model.ReplicaEventType.TERMINATED, replica, "torn down")
            if self._entries.get(name) is entry:
                del self._entries[name]
            self._records.delete(name)
            if not entry.keep_logs:
                self._logs.delete(name)
                self._forget_jobs_of(name)
        except backend_mod.TeardownError as exc:
            self._teardown_finished(entry, "failed")
            entry.replica.failure_reason = f"teardown failed: {exc}"
            self._emit_teardown(entry, model.TerminateEventType.FAILED, message=entry.replica.failure_reason)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("teardown of %s failed unexpectedly", name)
            self._teardown_finished(entry, "failed")
            entry.replica.failure_reason = "teardown failed: internal error in the provisioner"
            self._emit_teardown(entry, model.TerminateEventType.FAILED, message=entry.replica.failure_reason)
        finally:
            if not self._closing:
                entry.teardown.set_active(False)

    def _teardown_finished(self, entry: entries.Entry, outcome: str) -> None:
        # A teardown that failed before its drain ended has no start: it took no time of its own.
        started = entry.teardown_started or time.monotonic()
        self._stats.teardown_finished(outcome, time.monotonic() - started)
        entry.teardown_started = 0.0

    async def _teardown_attempt(self, entry: entries.Entry) -> None:
        try:
            await self._backend.delete(entry.request.name, grace_s=self._opts.kill_grace_s)
        except backend_mod.TeardownError:
            raise
        except Exception as exc:
            log.exception("backend error tearing down %s", entry.request.name)
            raise backend_mod.TeardownError(f"backend error: {type(exc).__name__}") from exc

    def _teardown_retrying(self, entry: entries.Entry, state: tenacity.RetryCallState) -> None:
        delay = state.next_action.sleep if state.next_action else 0.0
        outcome = state.outcome.exception() if state.outcome else None
        self._emit_teardown(
            entry,
            model.TerminateEventType.RETRYING,
            attempt=state.attempt_number + 1,
            delay_s=delay,
            message=f"attempt {state.attempt_number} failed: {outcome}; retrying in {delay:.1f} s",
        )

    def _emit_teardown(self, entry: entries.Entry, type_: model.TerminateEventType, **fields: Any) -> None:
        event = model.TerminateEvent(
            sequence=entry.teardown.last_sequence + 1, time=self._clock(), type=type_, **fields
        )
        entry.teardown.append(event)
        self._save(entry)
        detail = f": {event.message}" if event.message else ""
        self._logs.note(entry.request.name, f"teardown {type_.value.lower()}{detail}")
        level = logging.INFO if event.terminal else logging.DEBUG
        log.log(level, "%s: teardown %s%s", entry.request.name, type_.value, detail)

"""Running apps, the provisioner core's part (mixed into `manager.Provisioner`).

The backend's app events (exits, disappearances) are applied as they come; a level-triggered
sweep restarts operations whose task died and reports app ends that were missed; preemption is
simulated here. Each app change is published on the watch once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from services.common import errors
from services.provisioner import backend as backend_mod
from services.provisioner import causes, entries, events, jobs, logstore, model

if TYPE_CHECKING:
    from services.provisioner import manager

log = logging.getLogger(__name__)


class AppEvents:
    """The app-state handling of `manager.Provisioner`, which owns the state declared here."""

    _backend: backend_mod.Backend
    _logs: logstore.LogStore
    _opts: manager.Options
    _entries: dict[str, entries.Entry]
    _jobs: dict[str, jobs.Entry]
    _hub: events.WatchHub
    _closing: bool

    if TYPE_CHECKING:

        def _start_launch(self, entry: entries.Entry, *, resumed: str = "") -> None: ...

        def _start_teardown(self, entry: entries.Entry, *, drain_s: float, keep_logs: bool) -> None: ...

        async def _end_worker_job(self, worker: entries.Entry, reason: str, *, grace_s: float) -> None: ...

        def _in_background(self, work: Coroutine[Any, Any, None]) -> None: ...

        def _get_entry(self, name: str) -> entries.Entry: ...

        def _save(self, entry: entries.Entry) -> None: ...

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

"""The controller's side of versions: the history and rollbacks, each service's event log and
canary rollout, attached to the service loops (issue 22).

`Versions` holds every service's `rollouts.Rollout` and the event log; the controller calls it
when a loop starts or goes, around updates, on load reports, and for the history, rollback,
promote and abort calls. Writes go through the core's single writer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors, spec
from services.controller import (
    actions,
    autoscaling,
    convert,
    event_log,
    reconciler,
    rollout_api,
    rollouts,
    store,
    store_history,
    writer,
)
from services.controller.budget import Budget
from services.controller.domain import history, load
from services.controller.domain import rollout as ro
from services.controller.domain import status as st

log = logging.getLogger(__name__)


class Versions:
    """History, rollbacks, events and canary rollouts of every service."""

    def __init__(
        self,
        db: store.Store,
        db_writer: writer.Writer,
        loops: dict[str, reconciler.ServiceReconciler],
        check: Callable[[spec_pb2.ServiceSpec], Coroutine[Any, Any, None]],
        budget: Budget,
    ) -> None:
        self._db = db  # reads only
        self._writer = db_writer
        self._loops = loops
        self._check = check
        self._budget = budget
        self.event_log = event_log.Events(db=db, db_writer=db_writer)
        self._rollouts: dict[str, rollouts.Rollout] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def close(self) -> None:
        """Stop the timers; hand the events not yet written to the writer (close it after)."""
        for rollout in self._rollouts.values():
            rollout.close()
        self.event_log.close()

    def attach(self, rec: reconciler.ServiceReconciler, *, created: bool) -> None:
        """Give a service loop its event log and rollout (a new service, or one recovered)."""
        name = rec.name
        # Recovered: the records as stored are the starting point, so they make no events.
        self.event_log.open(name, {} if created else dict(rec.replicas), None if created else rec.service())
        rec.hub.observe(self.event_log.observe)
        rec.hub.observe(lambda change: self.forget(name) if change.deleted else None)
        rollout = rollouts.Rollout(
            name,
            db=self._db,
            log_=self.event_log,
            kick=rec.kick,
            on_action=lambda action, state: self._on_action(name, action, state),
            save=lambda data: self._write(lambda db: db.put_rollout_state(name, data)),
        )
        latest = rec.row.latest_version
        rollout.latest_version = latest
        if latest in rec.specs:
            rollout.set_spec(rec.specs[latest])
        rec.rollout = rollout
        self._rollouts[name] = rollout
        if created:
            self.record(name, "ServiceCreated", "created with version 1")

    def forget(self, name: str) -> None:
        """The service is gone."""
        rollout = self._rollouts.pop(name, None)
        if rollout is not None:
            rollout.close()
        self.event_log.forget(name)

    def _get(self, name: str) -> reconciler.ServiceReconciler:
        rec = self._loops.get(name)
        if rec is None:
            raise errors.NotFoundError(f"service {name!r} not found", reason="SERVICE_NOT_FOUND", service=name)
        return rec

    def record(self, name: str, reason: str, message: str, obj: str = "service", *, warning: bool = False) -> None:
        """Add an event to a service's log."""
        kind = event_log.WARNING if warning else event_log.NORMAL
        self.event_log.record(name, event_log.Draft(kind, reason, message, obj))

    def _write(self, fn: Callable[[store.Store], object]) -> None:
        """A write through the core's writer, not waited for (it keeps their order)."""
        fut = self._writer.submit(fn)
        fut.add_done_callback(_log_failure)

    # ---- updates -------------------------------------------------------------------------

    async def update(
        self, rec: reconciler.ServiceReconciler, parsed: spec_pb2.ServiceSpec, *, mode: int, dry_run: bool
    ) -> res.UpdatePlan:
        """Apply (or plan) an update; a canary update starts a rollout, another mode ends one."""
        rollout = self._rollouts[rec.name]
        if dry_run:
            return await actions.update(rec, parsed, mode=mode, dry_run=True)
        live = [r for r in rec.replicas.values() if not st.is_terminal(convert.status_of(r))]
        in_place = all(spec.is_in_place_update(rec.spec(r.version), parsed) for r in live)
        canary = mode == res.UPDATE_MODE_CANARY and not in_place
        previous = (rollout.state, rollout.config)
        expected = rec.row.latest_version + 1
        stable = rec.row.latest_version
        if canary:
            # Begun before the new version exists, so no pass ever plans it rolling; from the
            # stable version of a rollout still going, else from the latest before.
            state = rollout.state
            stable = state.stable_version if rollout.active and state else stable
            rollout.set_spec(parsed)
            rollout.begin(stable, expected, now=time.time())
        ended = not canary and not rollout.active
        if ended:
            # A rolled-back rollout is forgotten before the new version exists: its split names
            # the latest version, and the new one has no replica yet.
            rollout.end()
        try:
            plan = await actions.update(rec, parsed, mode=mode, dry_run=False)
        except BaseException:
            if canary or ended:
                rollout.restore(*previous)
            raise
        await self._noted(rec.name, plan, mode=mode)
        if not canary:
            rollout.end()
        elif plan.new_version != expected:  # another update came first
            rollout.begin(stable, plan.new_version, now=time.time())
        rec.kick()
        return plan

    async def _noted(self, name: str, plan: res.UpdatePlan, *, mode: int, rollback_of: int = 0) -> None:
        """Note an applied update in the history and the event log."""
        mode = mode or res.UPDATE_MODE_ROLLING
        version = plan.new_version
        await self._writer.submit(lambda db: db.note_version(name, version, mode=mode, rollback_of=rollback_of))
        mode_name = res.UpdateMode.Name(mode)  # type: ignore[arg-type]
        how = "in place" if plan.in_place else mode_name.removeprefix("UPDATE_MODE_").lower()
        if rollback_of:
            message = f"rolled back to the spec of version {rollback_of} as version {version} ({how})"
            self.record(name, "RolledBack", message, f"version/{version}", warning=True)
        else:
            self.record(name, "ServiceUpdated", f"updated to version {version} ({how})", f"version/{version}")

    async def rollback(self, name: str, to_version: int, *, dry_run: bool) -> tuple[res.Service, res.UpdatePlan, int]:
        """Update a service to an earlier version's spec (a new version), or plan it on a dry run.

        Raises:
            errors.ValidationError: a negative `to_version`.
            errors.NotFoundError: no such service, or `to_version` is not in the history.
            errors.FailedPreconditionError: no earlier version to go back to; shutting down.
        """
        if to_version < 0:
            raise errors.ValidationError([errors.FieldViolation("to_version", f"must be >= 0, got {to_version}")])
        rec = self._get(name)
        latest = rec.row.latest_version
        kept = self._db.list_history(name)
        try:
            target = history.rollback_target([history.Kept(h.version, h.outcome) for h in kept], latest, to_version)
        except history.NoTarget as exc:
            if to_version and to_version != latest:
                raise errors.NotFoundError(
                    str(exc), reason="VERSION_NOT_FOUND", service=name, version=to_version
                ) from None
            raise errors.FailedPreconditionError(
                str(exc), reason="NO_ROLLBACK_TARGET", subject=f"services/{name}", service=name
            ) from None
        old = next(h.spec for h in kept if h.version == target)
        await self._check(old)
        rec = self._get(name)  # it may have gone while the check ran
        with self._budget.reserve(name, old):
            if dry_run:
                plan = await actions.update(rec, old, mode=res.UPDATE_MODE_ROLLING, dry_run=True)
                return rec.service(), plan, target
            rollout = self._rollouts[name]
            previous = (rollout.state, rollout.config)
            ended = not rollout.active
            if ended:
                rollout.end()  # before the new version exists, as in update()
            try:
                plan = await actions.update(rec, old, mode=res.UPDATE_MODE_ROLLING, dry_run=False)
            except BaseException:
                if ended:
                    rollout.restore(*previous)
                raise
        rollout.end()
        await self._restored(name, latest, target, plan, f"rolled back to version {target} by a user")
        return rec.service(), plan, target

    async def _restored(self, name: str, left: int, target: int, plan: res.UpdatePlan, reason: str) -> None:
        now = time.time()
        await self._writer.submit(
            lambda db: db.set_version_outcome(name, left, res.VERSION_OUTCOME_ROLLED_BACK, reason, now=now)
        )
        await self._noted(name, plan, mode=res.UPDATE_MODE_ROLLING, rollback_of=target)

    def list(self, name: str) -> list[res.ServiceVersion]:
        """A service's version history, oldest first."""
        self._get(name)
        return [store_history.version_proto(h) for h in self._db.list_history(name)]

    # ---- rollouts ------------------------------------------------------------------------

    def report(
        self, rec: reconciler.ServiceReconciler, request: api.ReportLoadRequest, report: load.Report
    ) -> api.ReportLoadResponse:
        """Apply a load report (autoscaling.py), and its per-version outcomes to the rollout once.

        Raises:
            errors.ValidationError: a malformed `version_stats` entry; nothing is recorded.
        """
        samples = rollout_api.version_samples(request)
        answer = autoscaling.report_request(rec, request, report)
        rollout = self._rollouts.get(rec.name)
        if rollout is not None and not answer.already_applied:
            rollout.add_samples(samples, time.time())
        return answer

    def promote(self, name: str, *, full: bool) -> res.Service:
        """The next step now, or with `full` all the traffic.

        Raises:
            errors.FailedPreconditionError: no rollout progressing or held.
        """
        rec = self._get(name)
        rollout = self._rollouts[name]
        if not rollout.active:
            raise _no_rollout(name, rec.row.latest_version)
        rollout.promote(full=full, now=time.time())
        rec.kick()
        return rec.service()

    def abort(self, name: str) -> res.Service:
        """All the traffic back to the stable version now, then its spec restored.

        Raises:
            errors.FailedPreconditionError: no rollout progressing or held.
        """
        rec = self._get(name)
        rollout = self._rollouts[name]
        if not rollout.active:
            raise _no_rollout(name, rec.row.latest_version)
        rollout.abort_now(time.time())
        rec.show()
        return rec.service()

    def _on_action(self, name: str, action: ro.Action, state: ro.State) -> None:
        if action is ro.Action.ROLLBACK:
            task = asyncio.get_running_loop().create_task(self._auto_rollback(name, state))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _auto_rollback(self, name: str, state: ro.State) -> None:
        """Restore the stable version's spec after a failed rollout."""
        try:
            rec = self._get(name)
            stable = self._db.get_history(name, state.stable_version)
            if stable is None:
                log.error("%s: cannot roll back: the spec of version %d is not kept", name, state.stable_version)
                return
            plan = await actions.update(rec, stable.spec, mode=res.UPDATE_MODE_ROLLING, dry_run=False)
            reason = state.message.removeprefix("rolled back: ")
            await self._restored(name, state.canary_version, state.stable_version, plan, reason)
        except errors.ReplicaplaneError:
            log.exception("%s: the rollback to version %d failed", name, state.stable_version)


def _log_failure(fut: asyncio.Future[object]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("could not keep a rollout's state: %s", fut.exception())


def _no_rollout(name: str, latest: int) -> errors.FailedPreconditionError:
    return errors.FailedPreconditionError(
        f"service {name!r} has no canary rollout in progress",
        reason="NO_ROLLOUT_IN_PROGRESS",
        subject=f"services/{name}",
        service=name,
        latest_version=latest,
    )

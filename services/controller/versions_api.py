"""The version history, rollbacks and the event log through the controller's API (issue 22):
calls of `Controller`, kept here so the controller class stays small."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors
from services.controller import actions, admission, event_log, store, store_history
from services.controller.domain import history

if TYPE_CHECKING:
    from services.controller.reconciler import ServiceReconciler, Tuning


class VersionCalls:
    """History, rollback and event calls; the controller provides the attributes below."""

    _db: store.Store
    _services: dict[str, ServiceReconciler]
    _tuning: Tuning
    event_log: event_log.Events

    def _get(self, name: str) -> ServiceReconciler:
        raise NotImplementedError

    async def _check_runnable(self, parsed: spec_pb2.ServiceSpec) -> None:
        raise NotImplementedError

    def _updated(self, name: str, plan: res.UpdatePlan, *, mode: int, rollback_of: int = 0) -> None:
        """Note an applied update in the history and the event log."""
        mode = mode or res.UPDATE_MODE_ROLLING
        version = plan.new_version
        self._db.note_version(name, version, mode=mode, rollback_of=rollback_of)
        mode_name = res.UpdateMode.Name(mode)  # type: ignore[arg-type]
        how = "in place" if plan.in_place else mode_name.removeprefix("UPDATE_MODE_").lower()
        if rollback_of:
            message = f"rolled back to the spec of version {rollback_of} as version {version} ({how})"
            self.event_log.record(name, event_log.Draft(event_log.WARNING, "RolledBack", message, f"version/{version}"))
        else:
            message = f"updated to version {version} ({how})"
            draft = event_log.Draft(event_log.NORMAL, "ServiceUpdated", message, f"version/{version}")
            self.event_log.record(name, draft)

    async def rollback_service(
        self, name: str, to_version: int, *, dry_run: bool
    ) -> tuple[res.Service, res.UpdatePlan, int]:
        """Update a service to an earlier version's spec (a new version), or plan it on a dry run.

        The version rolled back from is marked rolled back in the history.

        Raises:
            errors.ValidationError: a negative `to_version`.
            errors.NotFoundError: no such service, or `to_version` is not in the history.
            errors.FailedPreconditionError: no earlier version to go back to; shutting down.
        """
        if to_version < 0:
            raise errors.ValidationError([errors.FieldViolation("to_version", f"must be >= 0, got {to_version}")])
        rec = self._get(name)
        latest = rec.service().latest_version
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
        await self._check_runnable(old)
        rec = self._get(name)
        admission.budget_of(self._services, name, old, limit=self._tuning.max_replicas_total)
        plan = await actions.update(rec, old, mode=res.UPDATE_MODE_ROLLING, dry_run=dry_run)
        if not dry_run:
            self._db.set_version_outcome(
                name,
                latest,
                res.VERSION_OUTCOME_ROLLED_BACK,
                f"rolled back to version {target} by a user",
                now=time.time(),
            )
            self._updated(name, plan, mode=res.UPDATE_MODE_ROLLING, rollback_of=target)
        return rec.service(), plan, target

    def list_versions(self, name: str) -> list[res.ServiceVersion]:
        """A service's version history, oldest first."""
        self._get(name)
        return [store_history.version_proto(h) for h in self._db.list_history(name)]

    def list_events(self, name: str, page_size: int, page_token: str) -> tuple[list[res.Event], str]:
        """A page of a service's events, oldest first."""
        return self.event_log.list(name, page_size, page_token)

    async def watch_events(self, name: str, after_sequence: int) -> AsyncIterator[res.Event]:
        """A service's events after `after_sequence`, then each new one."""
        async for event in self.event_log.watch(name, after_sequence):
            yield event

    def promote_rollout(self, name: str, *, full: bool) -> res.Service:
        """Move a canary rollout on.

        Raises:
            errors.FailedPreconditionError: no canary rollout in progress (none can run yet).
        """
        rec = self._get(name)
        raise _no_rollout(name, rec.service())

    def abort_rollout(self, name: str) -> res.Service:
        """Abort a canary rollout.

        Raises:
            errors.FailedPreconditionError: no canary rollout in progress (none can run yet).
        """
        rec = self._get(name)
        raise _no_rollout(name, rec.service())


def _no_rollout(name: str, service: res.Service) -> errors.FailedPreconditionError:
    return errors.FailedPreconditionError(
        f"service {name!r} has no canary rollout in progress",
        reason="NO_ROLLOUT_IN_PROGRESS",
        subject=f"services/{name}",
        service=name,
        latest_version=service.latest_version,
    )

"""The pass of one service's loop: coalesced kicks, one plan from the whole state, one batch
to the writer, and once it is stored: publish to watchers, then drive the effects."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from replicaplane.controller.v1 import resources_pb2 as res
from services.controller import actions, autoscaling, book, convert, events, facts, planner, pools, retries, view
from services.controller.domain import autoscaler
from services.controller.wiring import Checkpoint, parse

if TYPE_CHECKING:
    from services.controller.reconciler import ServiceReconciler

log = logging.getLogger(__name__)

TP = res.TeardownPhase

# Passes run at once when the service is quiet and at most this often under a burst of events,
# plus 20 us per replica, so a pass stays a small share of the loop however large the service.
_MIN_PASS_GAP_S = 0.005


class Passes:
    """Schedules and runs the passes of one service; one batch in flight at a time."""

    def __init__(self, rec: ServiceReconciler) -> None:
        self.rec = rec
        self._scheduled = self._rerun = self.show_pending = self._running = False
        self._last = 0.0
        self._inflight: asyncio.Future[list[int]] | None = None
        self._write_failures = 0

    @property
    def due(self) -> bool:
        """A pass is scheduled and has not run yet (the queue depth)."""
        return self._scheduled

    def kick(self, *, at_once: bool = False) -> None:
        """Plan again soon; kicks coalesce into one pass. `at_once`: skip the gap (a batch was
        just stored: the writer already spaced the passes)."""
        rec = self.rec
        if self._scheduled or self._running or rec.gone:
            return  # a running pass stores what it changes itself
        self._scheduled = True
        wait = self._last + _MIN_PASS_GAP_S + len(rec.replicas) * 20e-6 - time.monotonic()
        if at_once:
            wait = 0.0
        loop = asyncio.get_running_loop()
        if wait > 0:
            loop.call_later(wait, self._pass)
        else:
            loop.call_soon(self._pass)

    def _pass(self) -> None:
        rec = self.rec

        self._scheduled = False
        self._last = time.monotonic()
        if rec.gone or rec.stopping:
            return
        if self._inflight is not None:
            self._rerun = True  # one batch at a time per service: run again once it is stored
            return
        started = time.perf_counter()
        self._running = True
        try:
            if rec.started and rec.row.deleting:
                actions.continue_delete(rec)
            elif rec.started:
                self._apply(self._plan())
            view.store_status(rec)
        except Exception:
            log.exception("%s: a pass failed; retrying", rec.name)
            asyncio.get_running_loop().call_later(retries.PASS.delay(1), self.kick)
        finally:
            self._running = False
        self._commit()
        rec.deps.hooks.call("on_pass", rec.name, time.perf_counter() - started)

    def _plan(self) -> planner.Plan:
        rec = self.rec
        latest = rec.row.latest_version
        canary = None
        if rec.rollout is not None:
            weights = rec.rollout.weights(latest)
            canary = rec.rollout.scale(
                list(rec.views.values()),
                target=rec.final_target(),
                latest_version=latest,
                stopped=rec.state.stopped.get(str(latest), ""),
            )
            if rec.rollout.weights(latest) != weights:
                self.show_pending = True  # the split is published even when no record changes
        return planner.plan(
            list(rec.views.values()),
            policy=rec.policy(),
            adopted_target=max(rec.state.target, 0),
            latest_version=latest,
            stopped=str(latest) in rec.state.stopped,
            blue_green=rec.row.update_mode == res.UPDATE_MODE_BLUE_GREEN,
            backoff=rec.backoff,
            now=time.monotonic(),
            torn_down=rec.views.torn_down,
            ready_by_version=rec.views.ready_by_version,
            busy=None if rec.pool is None else frozenset(rec.pool.jobs.busy()),
            rollout=canary,
        )

    def _apply(self, plan: planner.Plan) -> None:
        rec = self.rec

        if plan.launch_wanted != rec.launch_wanted:
            rec.launch_wanted = plan.launch_wanted
            self.show_pending = True
        drain = 0.0 if rec.pool is not None else rec.tuning.drain_s  # a worker serves no traffic
        for rid in plan.teardown:
            events.ask_teardown(rec, rid, drain_s=drain, scale_down=True, reason="scale-down")
        for _ in range(plan.launch):
            autoscaling.launch_new(rec, spot=rec.policy().use_spot)
        for _ in range(plan.launch_ondemand):
            autoscaling.launch_new(rec, spot=False)
        for rid in plan.remove:
            rec.remove(rid)
        if plan.again_in_s is not None:
            asyncio.get_running_loop().call_later(max(plan.again_in_s, 0.001), self.kick)

    def _commit(self) -> asyncio.Future[list[int]] | None:
        rec = self.rec
        if rec.book.empty():
            if self.show_pending:
                self._publish(None)
            return None
        batch = rec.book.take(rec.replicas)
        fut = rec.deps.writer.submit(batch.apply)
        self._inflight = fut
        submitted = time.perf_counter()
        fut.add_done_callback(lambda f: self._committed(batch, f, submitted))
        return fut

    def _committed(self, batch: book.Batch, fut: asyncio.Future[list[int]], submitted: float) -> None:
        rec = self.rec
        self._inflight = None
        if fut.cancelled() or fut.exception() is not None:
            self._write_failures += 1
            rec.book.restore(batch)
            if self._write_failures == 1:
                log.warning("%s: the store did not take a batch; it stays pending and goes again", rec.name)
            if not rec.gone:
                asyncio.get_running_loop().call_later(retries.WRITE.delay(self._write_failures), self.kick)
            return
        self._write_failures = 0
        for r in batch.puts:
            rec.shown[r.replica_id] = r
            torn_down = r.facts.teardown_phase == TP.TEARDOWN_PHASE_SUCCEEDED
            rec.shown_views.set(r.replica_id, convert.view_of(r), torn_down=torn_down)
        for rid in batch.deletes:
            rec.shown.pop(rid, None)
            rec.shown_views.pop(rid)
        rec.endpoints.stored(batch.puts, batch.deletes)
        if rec.stopping:
            return  # shutting down: stored, nothing more starts
        for version in fut.result():
            rec.specs.pop(version, None)
        rec.deps.hooks.call(
            "on_commit", rec.name, len(batch.puts) + len(batch.deletes), time.perf_counter() - submitted
        )
        for name in batch.logs:
            rec.logs.delete(name)
        self._publish(batch)
        pools.stored(rec)
        rec.drive(batch.replica_ids)
        if self._rerun or not rec.book.empty():
            self._rerun = False
            self.kick(at_once=True)

    def _publish(self, batch: book.Batch | None) -> None:
        rec = self.rec
        self.show_pending = False
        if rec.gone:
            return
        svc = rec.service()
        changed = pools.busy_changes(rec, sorted(batch.puts, key=lambda r: r.replica_id) if batch else [])
        rec.hub.publish(rec.view_cache.without_unchanged_spec(svc), changed, batch.deletes if batch else [])
        weights = rec.rollout.weights(rec.row.latest_version) if rec.rollout else None
        if rec.pool is None:  # the endpoints `svc` was built with
            ep = rec.endpoints
            rec.hub.set_endpoints(ep.watch_part.endpoints, weights, key=ep.generation, message=ep.watch_part)
        else:
            rec.hub.set_endpoints([], weights)

    async def flush(self) -> None:
        """Store whatever is pending now and wait for it (shutdown)."""
        await self.idle()
        fut = self._commit()
        if fut is not None:
            await fut

    async def idle(self) -> None:
        """Wait until no batch of this service is being written."""
        while self._inflight is not None:
            await asyncio.wait([self._inflight])

    async def write_now(self, undo: Checkpoint) -> None:
        """Store everything pending now: an API call's changes, made after `idle()` and
        `checkpoint()` with no await in between.

        Raises:
            errors.UnavailableError: the store did not take it; memory goes back to `undo`, so
                the call changed nothing (events applied before it stay pending).
        """
        fut = self._commit()
        if fut is None:
            return
        await asyncio.wait([fut])
        exc = fut.exception()
        if exc is not None:
            self.rollback(undo)
            raise exc

    def checkpoint(self) -> Checkpoint:
        """Memory as it is, to go back to if an API call's write fails."""
        rec = self.rec
        return Checkpoint(
            row=rec.row,
            state=rec.state.dump(),
            specs=dict(rec.specs),
            next_id=rec.next_id,
            replicas={rid: r.SerializeToString() for rid, r in rec.replicas.items()},
            book=rec.book.copy(),
            logs_kept=set(rec.logs_kept),
        )

    def rollback(self, undo: Checkpoint) -> None:
        rec = self.rec
        rec.row, rec.specs, rec.next_id = undo.row, undo.specs, undo.next_id
        rec.state = facts.ScalerState.load_from(undo.state)
        rec.replicas = {rid: parse(data) for rid, data in undo.replicas.items()}
        rec.views = convert.tally_of(rec.replicas)
        rec.deps.held_changed(rec.name)
        rec.book = undo.book
        rec.logs_kept = undo.logs_kept
        rec.policy_cache = (0, autoscaler.Policy())
        self.kick()

"""One loop per service, level-triggered (docs/controller.md has the picture).

Events (provisioner, prober, API, timers) only change the working copy of the records (through
`events`, which calls the domain's `lifecycle.step`) and mark the service dirty. A pass then
plans from the whole state (`planner`), applies the plan to memory, and hands everything that
changed to the writer as one batch (`book`). Once the batch is stored, watchers see the change
and the drivers act on it (`drive`): a launch, a teardown, a probe target. Passes coalesce; a
periodic resync calls `drive` for every record, so a lost event only delays a decision.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors
from services.controller import (
    autoscaling,
    balancers,
    book,
    convert,
    events,
    facts,
    hub,
    passes,
    pools,
    retries,
    rollouts,
    store,
    view,
)
from services.controller.domain import autoscaler, failures, lifecycle
from services.controller.domain import status as st
from services.controller.drivers import launches, logs, probes, teardowns
from services.controller.wiring import Checkpoint, Deps, Loaded, Tuning, copy

__all__ = ["Checkpoint", "Deps", "Loaded", "ServiceReconciler", "Tuning"]

log = logging.getLogger(__name__)

TP = res.TeardownPhase


class ServiceReconciler:
    """The loop of one service: its working records, its book, its drivers."""

    def __init__(self, loaded: Loaded, deps: Deps) -> None:
        self.name = loaded.row.name
        self.deps = deps
        self.tuning = deps.tuning
        self.hub = hub.ServiceHub()
        self.book = book.Book(self.name)
        slots = deps.launch_slots or asyncio.Semaphore(deps.tuning.max_launches_in_flight)
        policy = retries.STREAM.with_times(deps.tuning.reconnect_initial_s, deps.tuning.reconnect_max_s)
        self.launches = launches.Launches(deps.provisioner, slots, policy=policy, mux=deps.launch_mux)
        self.teardowns = teardowns.Teardowns(deps.provisioner, policy=policy, mux=deps.teardown_mux)
        self.logs = logs.Logs(deps.provisioner)
        self.probes = probes.Probes(self.name, deps.probes)
        self.backoff = failures.Backoff()
        self.started = self.stopping = self.gone = self.probing_stale = False
        # Balancers alive by their reports: the URL shown, and drains they confirm idle.
        self.balancers = balancers.ServiceBalancers(deps.tuning.balancer_ttl_s, on_change=self.show)
        self.launch_wanted = False
        self.decision: asyncio.TimerHandle | None = None
        self.launched_in: dict[int, int] = {}  # replica id -> provisioner watch generation
        self.view_cache = view.Cache()
        # The canary rollout the controller attaches (rollouts.py): while one is active it
        # scales the canary, splits the traffic and adds its status to the service.
        self.rollout: rollouts.Rollout | None = None
        self.passes = passes.Passes(self)
        self.finishing = False
        self.api_lock = asyncio.Lock()  # one API change of this service at a time
        self._background: set[asyncio.Task[None]] = set()
        self._set(loaded)
        self.pool = pools.attach(self)  # the pool side of a pool; None for a service

    @property
    def row(self) -> store.ServiceRow:
        return self._row

    @row.setter
    def row(self, row: store.ServiceRow) -> None:
        self._row = row  # a new version, a delete or new records change what the service holds
        self.deps.held_changed(self.name)

    def _set(self, loaded: Loaded) -> None:
        self.row = loaded.row
        self.specs = dict(loaded.specs)
        self.state = facts.ScalerState.load_from(loaded.state)
        # Two copies of each record: `replicas` is what the controller knows now (decisions use
        # it), `shown` what the store holds (the API shows it: memory never runs ahead).
        # Each copy has its views (status, version) with their counts kept in step (`tally`).
        self.shown = {r.replica_id: r for r in loaded.replicas}
        self.shown_views = convert.tally_of(self.shown)
        self.replicas = {rid: copy(r) for rid, r in self.shown.items()}
        self.views = convert.tally_of(self.replicas)  # `row` told the budget already
        self.endpoints = view.Endpoints(self.shown)
        self.extra: dict[int, facts.Extra] = {}
        self.next_id = loaded.row.next_replica_id
        self.policy_cache: tuple[int, autoscaler.Policy] = (0, autoscaler.Policy())
        # Replicas whose teardown kept their logs (failures): the logs go when the record goes.
        self.logs_kept = {
            rid
            for rid, r in self.replicas.items()
            if r.facts.teardown_phase != TP.TEARDOWN_PHASE_UNSPECIFIED and not r.facts.is_scale_down
        }

    # ---- reading ---------------------------------------------------------------------------

    def spec(self, version: int) -> spec_pb2.ServiceSpec:
        found = self.specs.get(version)
        if found is None:
            raise errors.NotFoundError(f"version {version} of service {self.name!r} not found", service=self.name)
        return found

    def policy(self) -> autoscaler.Policy:
        version = self.row.latest_version
        if self.policy_cache[0] != version:
            self.policy_cache = (version, convert.policy_of(self.spec(version)))
        return self.policy_cache[1]

    def final_target(self) -> int:
        return self.policy().final(max(self.state.target, 0))

    def replica(self, replica_id: int) -> res.Replica:
        """A replica record as stored, or NotFoundError."""
        r = self.shown.get(replica_id)
        if r is None:
            raise errors.NotFoundError(
                f"replica {replica_id} of service {self.name!r} not found",
                reason="REPLICA_NOT_FOUND",
                service=self.name,
                replica_id=replica_id,
            )
        return r

    def service(self) -> res.Service:
        return view.service(self)

    def most_replicas(self) -> int:
        """The most replicas the latest policy can run; none once the service is being deleted."""
        return 0 if self.row.deleting else autoscaler.most_replicas(self.policy())

    def reserved_replicas(self) -> int:
        """What the service holds of the replica budget: most_replicas(), or the replicas it
        still has if more (an update in flight, teardowns not done or failed)."""
        return max(self.most_replicas(), self.views.held)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Resume every replica from its stored facts (spec.md section 10), then reconcile."""

        self.started = True
        if self.state.target < 0 and not self.row.deleting:
            self.state.target = self.policy().min_replicas
            self.save_state()
        self.drive(self.replicas, resumed=True)
        if self.pool is not None:
            self.pool.jobs.start()
            pools.stored(self)
        self.show()
        autoscaling.decide(self)

    async def stop(self) -> None:
        """Stop following the service (controller shutdown); replicas stay as they are. What is
        pending is stored first (a failure here is fine: the next start resumes from the store)."""
        self.stopping = True
        self.balancers.close()
        if self.decision is not None:
            self.decision.cancel()
        try:
            await self.passes.flush()
        except Exception:
            log.info("%s: could not store the last changes before stopping", self.name)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(
            self.launches.tasks.stop(),
            self.teardowns.tasks.stop(),
            self.logs.stop(),
            *([self.pool.jobs.stop()] if self.pool is not None else []),
            *self._background,
            return_exceptions=True,
        )
        self.probes.clear()

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def forget(self) -> None:
        """The service is deleted from the store: tell watchers and leave the controller."""
        self.gone = True
        self.balancers.close()
        if self.decision is not None:
            self.decision.cancel()
        self.probes.clear()
        svc = self.view_cache.without_unchanged_spec(self.service())
        svc.status = res.SERVICE_STATUS_SHUTTING_DOWN
        self.hub.publish(svc, [], [], deleted=True)
        self.deps.on_gone(self.name)

    # ---- memory changes --------------------------------------------------------------------

    def touch(self, r: res.Replica) -> None:
        """A record changed in memory: store it with the next batch and plan again."""
        rid = r.replica_id
        r.status = convert.status_of(r)  # type: ignore[assignment]
        self.replicas[rid] = r
        self.views.set(rid, convert.view_of(r), torn_down=r.facts.teardown_phase == TP.TEARDOWN_PHASE_SUCCEEDED)
        self.deps.held_changed(self.name)
        self.book.put(rid)
        if r.status == res.REPLICA_STATUS_READY and r.version not in self.state.ever_ready_versions:
            # The stop rule's "ever ready": any READY replica of a version.
            self.state.ever_ready_versions = [*self.state.ever_ready_versions[-15:], r.version]
            self.save_state()
        self.kick()

    def remove(self, rid: int) -> None:
        r = self.replicas.pop(rid, None)
        if r is None:
            return
        logs_name = r.replica_name if rid in self.logs_kept else ""
        self.logs_kept.discard(rid)
        self.book.delete(rid, logs=logs_name)
        self.views.pop(rid)
        self.deps.held_changed(self.name)
        for table in (self.extra, self.launched_in):
            table.pop(rid, None)
        self.probes.set(rid, None)
        self.balancers.forget(rid)
        self.kick()

    @property
    def load_balancer_url(self) -> str:
        """The URL of a live balancer of the service ("" while none reports)."""
        return self.balancers.url

    def save_state(self) -> None:
        self.book.state(self.state.dump())
        self.kick()

    # ---- the loop (passes.py) --------------------------------------------------------------

    def kick(self) -> None:
        """Plan again soon; kicks coalesce into one pass."""
        self.passes.kick()

    def show(self) -> None:
        """Publish the service again (something shown but not stored changed)."""
        self.passes.show_pending = True
        self.passes.kick()

    async def idle(self) -> None:
        await self.passes.idle()

    def checkpoint(self) -> Checkpoint:
        return self.passes.checkpoint()

    async def write_now(self, undo: Checkpoint) -> None:
        await self.passes.write_now(undo)

    # ---- effects ---------------------------------------------------------------------------

    def drive(self, rids: Iterable[int], *, resumed: bool = False) -> None:
        """Put in motion what the stored facts of these records ask for (`lifecycle.wanted_motion`):
        follow a launch, run a teardown, probe. `resumed`: after a restart, without drain."""
        for rid in list(rids):
            r = self.replicas.get(rid)
            if r is None:
                self.launches.tasks.cancel(rid)
                self.probes.set(rid, None)
                continue
            life = facts.life_of(r, self.extra.get(rid))
            motion = lifecycle.wanted_motion(life)
            if motion is lifecycle.Motion.TEARDOWN:
                self.launches.tasks.cancel(rid)
                if rid not in self.teardowns.tasks:
                    events.start_teardown(self, r, drain_s=0.0 if resumed else life.drain_s)
            elif motion is lifecycle.Motion.FOLLOW_LAUNCH:
                events.follow_launch(self, rid)
            elif motion is lifecycle.Motion.FAILED_TEARDOWN:
                events.ask_teardown(self, rid, drain_s=0.0, keep_logs=True, reason="a failure whose teardown was lost")
            target = None
            if st.should_probe(life.facts()) and r.endpoint and not self.gone:
                if resumed and rid in self.probes:
                    continue  # a resync: probed already (changes rebuild the target when stored)
                target = view.probe_target(self, r)
            self.probes.set(rid, target)

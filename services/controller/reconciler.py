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
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors
from services.controller import book, convert, events, facts, hooks, hub, planner, retries, store, view, writer
from services.controller.domain import autoscaler, failures, lifecycle
from services.controller.domain import status as st
from services.controller.drivers import launches, logs, probes, teardowns

log = logging.getLogger(__name__)

TP = res.TeardownPhase


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Controller knobs a service loop needs."""

    drain_s: float = 120.0
    probe_fast_interval_s: float = 0.1
    reconnect_initial_s: float = 0.1
    reconnect_max_s: float = 2.0
    sweep_interval_s: float = 5.0
    max_replicas_per_service: int = 1000
    max_replicas_total: int = 5000
    max_launches_in_flight: int = 128
    decision_interval_s: float = autoscaler.DECISION_INTERVAL_S
    zero_decision_interval_s: float = autoscaler.ZERO_DECISION_INTERVAL_S
    qps_window_s: float = autoscaler.QPS_WINDOW_S


@dataclasses.dataclass
class Loaded:
    """A service as stored."""

    row: store.ServiceRow
    specs: dict[int, spec_pb2.ServiceSpec]
    state: bytes | None
    replicas: list[res.Replica]

    @classmethod
    def read(cls, db: store.Store, name: str) -> Loaded:
        row = db.get_service(name)
        if row is None:
            raise errors.NotFoundError(f"service {name!r} not found", service=name)
        specs = {v: s for v in db.list_versions(name) if (s := db.get_version(name, v)) is not None}
        return cls(row, specs, db.get_autoscaler_state(name), db.list_replicas(name))


@dataclasses.dataclass
class Deps:
    """What every service loop shares."""

    writer: writer.Writer
    reader: store.Store
    provisioner: launches.prov_grpc.ProvisionerServiceStub
    probes: probes.ProbeSink
    tuning: Tuning
    on_gone: Callable[[str], None]
    hooks: hooks.Hooks = dataclasses.field(default_factory=hooks.Hooks)
    watch_generation: Callable[[], int] = lambda: 0
    zones: Callable[[], list[tuple[str, float]]] = list
    owner: str = ""
    launch_slots: asyncio.Semaphore | None = None


@dataclasses.dataclass
class Checkpoint:
    """Memory before an API call changed it."""

    row: store.ServiceRow
    state: bytes
    specs: dict[int, spec_pb2.ServiceSpec]
    next_id: int
    replicas: dict[int, bytes]
    book: book.Book
    logs_kept: set[int]


def _copy(r: res.Replica) -> res.Replica:
    out = res.Replica()
    out.CopyFrom(r)
    return out


def _parse(data: bytes) -> res.Replica:
    out = res.Replica()
    out.ParseFromString(data)
    return out


# Passes run at once when the service is quiet and at most this often under a burst of events,
# plus 20 us per replica, so a pass stays a small share of the loop however large the service.
_MIN_PASS_GAP_S = 0.005


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
        self.launches = launches.Launches(deps.provisioner, slots, policy=policy)
        self.teardowns = teardowns.Teardowns(deps.provisioner, policy=policy)
        self.logs = logs.Logs(deps.provisioner)
        self.probes = probes.Probes(self.name, deps.probes)
        self.backoff = failures.Backoff()
        self.started = self.stopping = self.gone = self.probing_stale = False
        self.load_balancer_url = ""
        self.launch_wanted = False
        self.decision: asyncio.TimerHandle | None = None
        self.launched_in: dict[int, int] = {}  # replica id -> provisioner watch generation
        self.view_cache = view.Cache()
        self._pass_scheduled = self._rerun = self._show = False
        self._last_pass = 0.0
        self._inflight: asyncio.Future[list[int]] | None = None
        self._write_failures = 0
        self.finishing = False
        self.api_lock = asyncio.Lock()  # one API change of this service at a time
        self._background: set[asyncio.Task[None]] = set()
        self._set(loaded)

    def _set(self, loaded: Loaded) -> None:
        self.row = loaded.row
        self.specs = dict(loaded.specs)
        self.state = facts.ScalerState.load_from(loaded.state)
        # Two copies of each record: `replicas` is what the controller knows now (decisions use
        # it), `shown` what the store holds (the API shows it: memory never runs ahead).
        self.shown = {r.replica_id: r for r in loaded.replicas}
        self.shown_views = {rid: convert.view_of(r) for rid, r in self.shown.items()}
        self.replicas = {rid: _copy(r) for rid, r in self.shown.items()}
        self.views = dict(self.shown_views)
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
        live = sum(1 for r in self.replicas.values() if r.facts.teardown_phase != TP.TEARDOWN_PHASE_SUCCEEDED)
        return max(self.most_replicas(), live)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Resume every replica from its stored facts (spec.md section 10), then reconcile."""
        from services.controller import autoscaling

        self.started = True
        if self.state.target < 0 and not self.row.deleting:
            self.state.target = self.policy().min_replicas
            self.save_state()
        self.drive(self.replicas, resumed=True)
        self.show()
        autoscaling.decide(self)

    async def stop(self) -> None:
        """Stop following the service (controller shutdown); replicas stay as they are."""
        self.stopping = True
        if self.decision is not None:
            self.decision.cancel()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(
            self.launches.tasks.stop(),
            self.teardowns.tasks.stop(),
            self.logs.stop(),
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
        self.views[rid] = convert.view_of(r)
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
        for table in (self.views, self.extra, self.launched_in):
            table.pop(rid, None)  # type: ignore[attr-defined]
        self.probes.set(rid, None)
        self.kick()

    def save_state(self) -> None:
        self.book.state(self.state.dump())
        self.kick()

    def show(self) -> None:
        """Publish the service again (something shown but not stored changed)."""
        self._show = True
        self.kick()

    # ---- the pass --------------------------------------------------------------------------

    def kick(self) -> None:
        """Plan again soon; kicks coalesce into one pass."""
        if self._pass_scheduled or self.gone:
            return
        self._pass_scheduled = True
        wait = self._last_pass + _MIN_PASS_GAP_S + len(self.replicas) * 20e-6 - time.monotonic()
        loop = asyncio.get_running_loop()
        if wait > 0:
            loop.call_later(wait, self._pass)
        else:
            loop.call_soon(self._pass)

    def _pass(self) -> None:
        from services.controller import actions

        self._pass_scheduled = False
        self._last_pass = time.monotonic()
        if self.gone or self.stopping:
            return
        if self._inflight is not None:
            self._rerun = True  # one batch at a time per service: run again once it is stored
            return
        started = time.perf_counter()
        try:
            if self.started and self.row.deleting:
                actions.continue_delete(self)
            elif self.started:
                self._apply(self._plan())
            view.store_status(self)
        except Exception:
            log.exception("%s: a pass failed; retrying", self.name)
            asyncio.get_running_loop().call_later(retries.PASS.delay(1), self.kick)
        self._commit()
        self.deps.hooks.call("on_pass", self.name, time.perf_counter() - started)

    def _plan(self) -> planner.Plan:
        latest = self.row.latest_version
        return planner.plan(
            list(self.views.values()),
            policy=self.policy(),
            adopted_target=max(self.state.target, 0),
            latest_version=latest,
            stopped=str(latest) in self.state.stopped,
            blue_green=self.row.update_mode == res.UPDATE_MODE_BLUE_GREEN,
            backoff=self.backoff,
            now=time.monotonic(),
            torn_down={
                rid: r.version
                for rid, r in self.replicas.items()
                if r.facts.teardown_phase == TP.TEARDOWN_PHASE_SUCCEEDED
            },
        )

    def _apply(self, plan: planner.Plan) -> None:
        from services.controller import autoscaling

        if plan.launch_wanted != self.launch_wanted:
            self.launch_wanted = plan.launch_wanted
            self._show = True
        for rid in plan.teardown:
            events.ask_teardown(self, rid, drain_s=self.tuning.drain_s, scale_down=True, reason="scale-down")
        for _ in range(plan.launch):
            autoscaling.launch_new(self, spot=self.policy().use_spot)
        for _ in range(plan.launch_ondemand):
            autoscaling.launch_new(self, spot=False)
        for rid in plan.remove:
            self.remove(rid)
        if plan.again_in_s is not None:
            asyncio.get_running_loop().call_later(max(plan.again_in_s, 0.001), self.kick)

    def _commit(self) -> asyncio.Future[list[int]] | None:
        if self.book.empty():
            if self._show:
                self._publish(None)
            return None
        batch = self.book.take(self.replicas)
        fut = self.deps.writer.submit(batch.apply)
        self._inflight = fut
        submitted = time.perf_counter()
        fut.add_done_callback(lambda f: self._committed(batch, f, submitted))
        return fut

    def _committed(self, batch: book.Batch, fut: asyncio.Future[list[int]], submitted: float) -> None:
        self._inflight = None
        if fut.cancelled() or fut.exception() is not None:
            self._write_failures += 1
            self.book.restore(batch)
            if self._write_failures == 1:
                log.warning("%s: the store did not take a batch; it stays pending and goes again", self.name)
            if not self.gone:
                asyncio.get_running_loop().call_later(retries.WRITE.delay(self._write_failures), self.kick)
            return
        self._write_failures = 0
        for r in batch.puts:
            self.shown[r.replica_id] = r
            self.shown_views[r.replica_id] = convert.view_of(r)
        for rid in batch.deletes:
            self.shown.pop(rid, None)
            self.shown_views.pop(rid, None)
        for version in fut.result():
            self.specs.pop(version, None)
        self.deps.hooks.call(
            "on_commit", self.name, len(batch.puts) + len(batch.deletes), time.perf_counter() - submitted
        )
        for name in batch.logs:
            self.logs.delete(name)
        self._publish(batch)
        self.drive(batch.replica_ids)
        if self._rerun or not self.book.empty():
            self._rerun = False
            self.kick()

    def _publish(self, batch: book.Batch | None) -> None:
        self._show = False
        if self.gone:
            return
        svc = self.service()
        changed = sorted(batch.puts, key=lambda r: r.replica_id) if batch else []
        self.hub.publish(self.view_cache.without_unchanged_spec(svc), changed, batch.deletes if batch else [])
        self.hub.set_endpoints(list(svc.endpoints))

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
        return Checkpoint(
            row=self.row,
            state=self.state.dump(),
            specs=dict(self.specs),
            next_id=self.next_id,
            replicas={rid: r.SerializeToString() for rid, r in self.replicas.items()},
            book=self.book.copy(),
            logs_kept=set(self.logs_kept),
        )

    def rollback(self, undo: Checkpoint) -> None:
        self.row, self.specs, self.next_id = undo.row, undo.specs, undo.next_id
        self.state = facts.ScalerState.load_from(undo.state)
        self.replicas = {rid: _parse(data) for rid, data in undo.replicas.items()}
        self.views = {rid: convert.view_of(r) for rid, r in self.replicas.items()}
        self.book = undo.book
        self.logs_kept = undo.logs_kept
        self.policy_cache = (0, autoscaler.Policy())
        self.kick()

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
                target = view.probe_target(self, r)
            self.probes.set(rid, target)

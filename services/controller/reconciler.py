"""One reconciler per service: turns decisions into provisioner calls and events into facts.

Everything here runs on the controller's single event loop, so a read-modify-write of a replica
never interleaves with another as long as it does not await in between. Each fact change is
written to the store before anything acts on it, which is what makes recovery after kill -9
possible.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import grpc

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.prober.v1 import prober_service_pb2 as prober_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.common import errors, pbtime, spec
from services.controller import convert, hub, store
from services.controller import traces as replica_traces
from services.controller.domain import autoscaler, load, placer, scaling
from services.controller.domain import status as st

log = logging.getLogger(__name__)

LP = res.LaunchPhase
TP = res.TeardownPhase
LE = prov_res.LaunchEventType
TE = prov_res.TerminateEventType
RE = prov_res.ReplicaEventType

# Provisioner answers that retrying the same launch cannot fix.
_PERMANENT_CODES = frozenset(
    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}
)


class ProbeSink(Protocol):
    """The part of the probe fleet a reconciler uses."""

    def upsert(self, target: prober_pb.ProbeTarget) -> None: ...
    def remove(self, target_id: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Controller knobs a reconciler needs."""

    drain_s: float = 120.0
    """Drain before a scale-down or manual termination."""
    probe_fast_interval_s: float = 0.1
    """Probe interval while a replica is starting."""
    reconnect_initial_s: float = 0.1
    """First wait before re-opening a broken provisioner stream."""
    reconnect_max_s: float = 2.0
    """Longest wait between re-opens."""
    sweep_interval_s: float = 5.0
    """Period of the level-triggered pass (resync)."""
    max_replicas_per_service: int = 1000
    """Specs asking for more replicas (or min/max) than this are refused."""
    max_replicas_total: int = 5000
    """What every service may run at most, added up, stays within this; more is refused."""
    max_launches_in_flight: int = 128
    """Launch streams followed at once over every service; further launches wait their turn."""
    decision_interval_s: float = autoscaler.DECISION_INTERVAL_S
    """Autoscaler decisions are made at least this often."""
    zero_decision_interval_s: float = autoscaler.ZERO_DECISION_INTERVAL_S
    """... and this often while the target is 0."""
    qps_window_s: float = autoscaler.QPS_WINDOW_S
    """Load reports count over this window."""


# Passes over every replica (publishing a change, reconciling) run at once when the service is
# quiet, and at most this often under a burst of events, so a large service stays linear.
_MIN_PASS_GAP_S = 0.005
# New replicas one pass starts at most (two store writes each); a larger scale-up takes several
# passes, so the event loop keeps answering (health, API calls) while a big service starts.
_LAUNCH_BATCH = 50


def _soon(callback: Callable[[], None], last_run: float, size: int) -> None:
    # The gap grows with the service (5 ms + 20 us per replica): a pass costs about 1 us per
    # replica, so passes stay a small share of the loop however large the service is.
    wait = last_run + _MIN_PASS_GAP_S + size * 20e-6 - time.monotonic()
    loop = asyncio.get_running_loop()
    if wait > 0:
        loop.call_later(wait, callback)
    else:
        loop.call_soon(callback)


def target_id(service: str, replica_id: int) -> str:
    """Probe target id of a replica: keyed by id, never by URL."""
    return f"{service}/{replica_id}"


@dataclasses.dataclass
class _ScalerState:
    """Autoscaler state, persisted so a restart resumes without churn (SkyPilot issue 8562)."""

    target: int = -1  # adopted target without overprovision; -1 until the first start
    ever_ready_versions: list[int] = dataclasses.field(default_factory=list)
    stopped: dict[str, str] = dataclasses.field(default_factory=dict)
    load: dict[str, int] = dataclasses.field(default_factory=dict)  # second -> request count
    # [balancer id, last sequence applied], oldest report first (a list: JSON keeps its order).
    reports: list[list[str | int]] = dataclasses.field(default_factory=list)
    upscale_since: float | None = None  # wall-clock time a higher candidate first held
    downscale_since: float | None = None
    reason: str = ""  # why the last decision changed something
    decided_at: float = 0.0
    zones: dict[str, str] = dataclasses.field(default_factory=dict)  # spot placer marks

    @property
    def hysteresis(self) -> autoscaler.Hysteresis:
        return autoscaler.Hysteresis(max(self.target, 0), self.upscale_since, self.downscale_since)

    def window(self) -> dict[int, int]:
        return {int(k): v for k, v in self.load.items()}

    def ledger(self) -> dict[str, int]:
        return {str(b): int(s) for b, s in self.reports}

    @classmethod
    def load_from(cls, data: bytes | None) -> _ScalerState:
        if not data:
            return cls()
        raw = json.loads(data)
        return cls(**{k: v for k, v in raw.items() if k in {f.name for f in dataclasses.fields(cls)}})

    def dump(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()


class ServiceReconciler:
    """Owns one service's replicas: launches, teardowns, probe results, and what watchers see."""

    def __init__(
        self,
        name: str,
        *,
        db: store.Store,
        provisioner: prov_grpc.ProvisionerServiceStub,
        probes: ProbeSink,
        tuning: Tuning,
        on_gone: Callable[[str], None],
        watch_generation: Callable[[], int] = lambda: 0,
        zones: Callable[[], list[tuple[str, float]]] = list,
        owner: str = "",
        launch_slots: asyncio.Semaphore | None = None,
        traces: replica_traces.ReplicaTraces | None = None,
        on_pass: Callable[[float], None] | None = None,
    ) -> None:
        self.name = name
        self._on_pass = on_pass  # metrics: the seconds each pass took
        self._traces = traces or replica_traces.ReplicaTraces()
        # Shared by every service of the controller: bounds the launch streams followed at once.
        self._launch_slots = launch_slots or asyncio.Semaphore(tuning.max_launches_in_flight)
        self._owner = owner
        self._zones = zones
        self._decision: asyncio.TimerHandle | None = None
        self._watch_generation = watch_generation
        self.hub = hub.ServiceHub()
        self._db = db
        self._prov = provisioner
        self._probes = probes
        self._tuning = tuning
        self._on_gone = on_gone
        row = db.get_service(name)
        if row is None:
            raise errors.NotFoundError(f"service {name!r} not found", service=name)
        self._row: store.ServiceRow = row
        self._state_stored = db.get_autoscaler_state(name)
        self._state = _ScalerState.load_from(self._state_stored)
        self.replicas: dict[int, res.Replica] = {r.replica_id: r for r in db.list_replicas(name)}
        # Each record as last written, to put memory back when a write fails.
        self._stored = {rid: r.SerializeToString() for rid, r in self.replicas.items()}
        self._views = {rid: convert.view_of(r) for rid, r in self.replicas.items()}
        self._endpoint_key: tuple[tuple[int, str, int], ...] = ()
        self._endpoint_list: list[res.Endpoint] = []
        self._specs: dict[int, spec_pb2.ServiceSpec] = {}
        self._redacted: tuple[int, spec_pb2.ServiceSpec] = (0, spec_pb2.ServiceSpec())
        self._policy_cache: tuple[int, autoscaler.Policy] = (0, autoscaler.Policy())
        self._launches: dict[int, asyncio.Task[None]] = {}
        self._teardowns: dict[int, asyncio.Task[None]] = {}
        self._probed: dict[int, prober_pb.ProbeTarget] = {}
        self._pending_exit: dict[int, int] = {}
        self._changed: dict[int, res.Replica] = {}
        self._removed: list[int] = []
        self._flush_scheduled = False
        self._reconcile_scheduled = False
        self._last_flush = self._last_reconcile = 0.0
        self._probing_stale = False
        self._published_version = 0
        self._started = False
        self._stopping = False
        self._gone = False
        self.load_balancer_url = ""
        self._launched_in: dict[int, int] = {}  # replica id -> provisioner watch generation
        self._capacity_backoff_s = 0.0
        self._launch_not_before = 0.0  # monotonic time; launches wait after capacity failures
        self._background: set[asyncio.Task[None]] = set()
        # Replicas whose teardown kept their logs (failures): the logs go when the record goes.
        self._logs_kept = {
            rid
            for rid, r in self.replicas.items()
            if r.facts.teardown_phase != TP.TEARDOWN_PHASE_UNSPECIFIED and not r.facts.is_scale_down
        }

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Resume every replica from its persisted facts (spec.md section 10), then reconcile."""
        self._started = True
        if self._state.target < 0 and not self._row.deleting:
            self._state.target = self._policy().min_replicas
            self._persist_state()
        for rid, r in list(self.replicas.items()):
            f = r.facts
            if f.teardown_phase in (TP.TEARDOWN_PHASE_SCHEDULED, TP.TEARDOWN_PHASE_RUNNING):
                # Drain already happened or is moot after a crash: resume without it.
                self._start_teardown(rid, drain=0.0, keep_logs=not (f.is_scale_down or f.purged))
            elif f.teardown_phase != TP.TEARDOWN_PHASE_UNSPECIFIED:
                continue  # a kept record
            elif f.launch_phase in (LP.LAUNCH_PHASE_SCHEDULED, LP.LAUNCH_PHASE_RUNNING):
                self._start_launch(rid)
            elif f.launch_phase == LP.LAUNCH_PHASE_SUCCEEDED and not f.user_app_failed:
                self._sync_probe(r)
            else:
                self.teardown(rid, drain=0.0, keep_logs=True)
        if self._row.deleting:
            self._continue_delete()
        self.kick()
        self._schedule_flush()
        self.decide()

    async def stop(self) -> None:
        """Stop following the service (controller shutdown); replicas stay as they are."""
        self._stopping = True
        self._cancel_decision()
        tasks = [*self._launches.values(), *self._teardowns.values(), *self._background]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rid in list(self._probed):
            self._probes.remove(target_id(self.name, rid))
        self._probed.clear()

    # ---- reading -------------------------------------------------------------------------

    def spec(self, version: int) -> spec_pb2.ServiceSpec:
        """The stored spec of a version (cached)."""
        found = self._specs.get(version)
        if found is None:
            found = self._db.get_version(self.name, version)
            if found is None:
                raise errors.NotFoundError(f"version {version} of service {self.name!r} not found", service=self.name)
            self._specs[version] = found
        return found

    def _shown_spec(self) -> spec_pb2.ServiceSpec:
        # Probe headers and secrets never leave the controller in full.
        version = self._row.latest_version
        if self._redacted[0] != version:
            self._redacted = (version, spec.redacted(self.spec(version)))
        return self._redacted[1]

    def replica(self, replica_id: int) -> res.Replica:
        """A replica record, or NotFoundError."""
        r = self.replicas.get(replica_id)
        if r is None:
            raise errors.NotFoundError(
                f"replica {replica_id} of service {self.name!r} not found",
                reason="REPLICA_NOT_FOUND",
                service=self.name,
                replica_id=replica_id,
            )
        return r

    def service(self) -> res.Service:
        """The service as the API shows it."""
        views = list(self._views.values())
        statuses = [v.status for v in views]
        ready, total = st.ready_and_total(statuses)
        active = self._active_versions(views)
        status: int
        if self._row.deleting:
            status = res.ServiceStatus.Value(
                "SERVICE_STATUS_FAILED_CLEANUP"
                if self._row.status == res.SERVICE_STATUS_FAILED_CLEANUP
                else "SERVICE_STATUS_SHUTTING_DOWN"
            )
        elif not self._started:
            status = res.SERVICE_STATUS_CONTROLLER_INIT
        else:
            launching = self._final_target() > 0 and str(self._row.latest_version) not in self._state.stopped
            status = int(st.service_status(statuses, launching=launching))
        svc = res.Service(
            name=self.name,
            status=status,  # type: ignore[arg-type]
            status_message=self._status_message(ready, total),
            ready_replicas=ready,
            total_replicas=total,
            active_versions=active,
            latest_version=self._row.latest_version,
            spec=self._shown_spec(),
            create_time=pbtime.timestamp(self._row.create_time),
            target_replicas=self._final_target(),
            probing_stale=self._probing_stale,
            update_mode=self._row.update_mode,  # type: ignore[arg-type]
            endpoints=self._endpoints(views, active),
            uid=self._row.uid,
            load_balancer_url=self.load_balancer_url,
        )
        if self._row.uptime_start is not None:
            svc.uptime_start_time.CopyFrom(pbtime.timestamp(self._row.uptime_start))
        svc.autoscaler.CopyFrom(self._autoscaler_status())
        return svc

    def _autoscaler_status(self) -> res.AutoscalerStatus:
        policy = self._policy()
        out = res.AutoscalerStatus(
            kind=policy.kind,
            target_replicas=self._final_target(),
            min_replicas=policy.min_replicas,
            max_replicas=policy.max_replicas,
            qps=self._qps(time.time()),
            last_decision_reason=self._state.reason,
        )
        if self._state.decided_at:
            out.last_decision_time.CopyFrom(pbtime.timestamp(self._state.decided_at))
        return out

    def most_replicas(self) -> int:
        """The most replicas the latest policy can run; none once the service is being deleted."""
        return 0 if self._row.deleting else autoscaler.most_replicas(self._policy())

    def reserved_replicas(self) -> int:
        """What the service holds of the controller's replica budget: most_replicas(), or the
        replicas it still has if more (an update in flight, teardowns not done or failed)."""
        live = sum(1 for r in self.replicas.values() if r.facts.teardown_phase != TP.TEARDOWN_PHASE_SUCCEEDED)
        return max(self.most_replicas(), live)

    def snapshot(self) -> api.WatchServiceResponse:
        """The whole service for a new watcher."""
        return api.WatchServiceResponse(
            service=self.service(), replicas=[self.replicas[i] for i in sorted(self.replicas)]
        )

    def _endpoints(self, views: list[st.ReplicaView], active: list[int]) -> list[res.Endpoint]:
        ids = sorted(v.replica_id for v in views if v.status is st.ReplicaStatus.READY and v.version in active)
        key = tuple((i, self.replicas[i].endpoint, self.replicas[i].version) for i in ids)
        if key != self._endpoint_key:  # built once per change of the ready set, not per flush
            self._endpoint_key = key
            self._endpoint_list = [
                res.Endpoint(
                    replica_id=i, url=url, version=version, accelerator=self.replicas[i].accelerator or "unknown"
                )
                for i, url, version in key
            ]
        return self._endpoint_list

    def _status_message(self, ready: int, total: int) -> str:
        if self._row.deleting:
            if self._row.status == res.SERVICE_STATUS_FAILED_CLEANUP:
                return self._row.status_message
            return f"shutting down: {len(self.replicas)} replica(s) left"
        stopped = self._state.stopped.get(str(self._row.latest_version))
        if stopped:
            return stopped
        if self._probing_stale:
            return "probing is stale: no prober reachable, readiness may be out of date"
        return f"{ready}/{total} ready, target {self._final_target()}"

    def _reload(self) -> None:
        """Make memory follow the store again, after a transaction of several writes failed."""
        row = self._db.get_service(self.name)
        if row is None:
            return
        self._row = row
        # A rolled-back version number may come back with another spec: forget cached ones.
        self._specs.clear()
        self._policy_cache = (0, autoscaler.Policy())
        self._state_stored = self._db.get_autoscaler_state(self.name)
        self._state = _ScalerState.load_from(self._state_stored)
        self.replicas = {r.replica_id: r for r in self._db.list_replicas(self.name)}
        self._stored = {rid: r.SerializeToString() for rid, r in self.replicas.items()}
        self._views = {rid: convert.view_of(r) for rid, r in self.replicas.items()}
        self._changed = dict(self.replicas)
        for r in self.replicas.values():
            self._sync_probe(r)
        self._schedule_flush()

    def resync(self) -> None:
        """The level-triggered pass: a launch, teardown or probe that should be in motion and is
        not (its task died, an event was lost to a failed write) gets going again."""
        if self._gone or self._stopping or not self._started:
            return
        for rid, r in list(self.replicas.items()):
            f = r.facts
            if f.teardown_phase in (TP.TEARDOWN_PHASE_SCHEDULED, TP.TEARDOWN_PHASE_RUNNING):
                if rid not in self._teardowns:
                    log.warning("%s/%d: a teardown was not in motion; resuming it", self.name, rid)
                    self._start_teardown(rid, drain=0.0, keep_logs=not (f.is_scale_down or f.purged))
            elif f.teardown_phase == TP.TEARDOWN_PHASE_UNSPECIFIED:
                if f.launch_phase in (LP.LAUNCH_PHASE_SCHEDULED, LP.LAUNCH_PHASE_RUNNING):
                    if rid not in self._launches:
                        log.warning("%s/%d: a launch was not followed; re-attaching", self.name, rid)
                        self._start_launch(rid)
                elif f.launch_phase == LP.LAUNCH_PHASE_FAILED or f.user_app_failed:
                    self.teardown(rid, drain=0.0, keep_logs=True)  # a failure whose teardown was lost
                else:
                    self._sync_probe(r)
        if self._row.deleting:
            self._continue_delete()
        self.kick()
        self._schedule_flush()

    # ---- decisions -----------------------------------------------------------------------

    def _policy(self) -> autoscaler.Policy:
        version = self._row.latest_version
        if self._policy_cache[0] != version:
            self._policy_cache = (version, convert.policy_of(self.spec(version)))
        return self._policy_cache[1]

    def _final_target(self) -> int:
        return self._policy().final(max(self._state.target, 0))

    def _qps(self, now: float) -> float:
        return autoscaler.qps(self._state.window(), now, window_s=self._tuning.qps_window_s)

    def _cancel_decision(self) -> None:
        if self._decision is not None:
            self._decision.cancel()
            self._decision = None

    def decide(self) -> None:
        """Make one autoscaler decision now and schedule the next (spec.md section 6)."""
        self._cancel_decision()
        if self._gone or self._stopping or self._row.deleting or not self._started:
            return
        now = time.time()
        policy = self._policy()
        views = list(self._views.values()) if policy.target_qps_per_accelerator else []
        wanted = autoscaler.candidate(policy, self._qps(now), views)
        before = self._state.hysteresis
        d = autoscaler.decide(
            policy,
            before,
            wanted,
            now,
            interval_s=self._tuning.decision_interval_s,
            zero_interval_s=self._tuning.zero_decision_interval_s,
        )
        if d.state != before:
            self._state.target = d.state.target
            self._state.upscale_since = d.state.upscale_since
            self._state.downscale_since = d.state.downscale_since
            self._state.reason = d.reason
            self._state.decided_at = now
            self._persist_state()
            if d.state.target != before.target:
                log.info("%s: %s", self.name, d.reason)
                self.kick()
            self._schedule_flush()
        self._decision = asyncio.get_running_loop().call_later(max(d.next_in_s, 0.001), self._decide_safely)

    def _decide_safely(self) -> None:
        self._decision = None
        try:
            self.decide()
        except Exception:
            log.exception("%s: autoscaler decision failed; retrying", self.name)
            self._decision = asyncio.get_running_loop().call_later(self._tuning.reconnect_max_s, self._decide_safely)

    def kick(self) -> None:
        """Reconcile soon; kicks coalesce into one pass, at most one per _MIN_PASS_GAP_S."""
        if not self._reconcile_scheduled and not self._gone:
            self._reconcile_scheduled = True
            _soon(self._reconcile, self._last_reconcile, len(self.replicas))

    def _reconcile(self) -> None:
        self._reconcile_scheduled = False
        self._last_reconcile = time.monotonic()
        if self._row.deleting or self._gone:
            return
        started = time.perf_counter()
        try:
            self._reconcile_once()
        except Exception:
            log.exception("%s: reconcile failed; retrying", self.name)
            asyncio.get_running_loop().call_later(self._tuning.reconnect_max_s, self.kick)
        if self._on_pass is not None:
            self._on_pass(time.perf_counter() - started)

    @property
    def pass_due(self) -> bool:
        """A pass is scheduled and has not run yet (the queue depth)."""
        return self._reconcile_scheduled

    def _reconcile_once(self) -> None:
        views = list(self._views.values())
        latest = self._row.latest_version
        policy = self._policy()
        target = max(self._state.target, 0)
        plan = scaling.plan(
            views,
            target=policy.final(target),
            latest_version=latest,
            stopped=str(latest) in self._state.stopped,
            blue_green=self._blue_green,
            fallback=(policy, target) if policy.kind == autoscaler.FALLBACK else None,
        )
        for rid in plan.teardown:
            self.teardown(rid, drain=self._tuning.drain_s, is_scale_down=True)
        wait = self._launch_not_before - time.monotonic()
        if (plan.launch or plan.launch_ondemand) and wait > 0:
            # Capacity ran out: retry after a pause instead of a tight launch-fail loop.
            asyncio.get_running_loop().call_later(wait, self.kick)
        else:
            spot = min(plan.launch, _LAUNCH_BATCH)
            ondemand = min(plan.launch_ondemand, _LAUNCH_BATCH - spot)
            for _ in range(spot):
                self._launch_new(spot=policy.use_spot)
            for _ in range(ondemand):
                self._launch_new(spot=False)
            if spot + ondemand < plan.launch + plan.launch_ondemand:
                self.kick()  # the rest in the next pass
        if self._blue_green and self._active_versions(views) == [latest]:
            # Blue-green switched: older failed records go with the old version.
            for rid, r in list(self.replicas.items()):
                if r.version != latest and r.facts.teardown_phase == TP.TEARDOWN_PHASE_SUCCEEDED:
                    self._remove(rid)

    @property
    def _blue_green(self) -> bool:
        return self._row.update_mode == res.UPDATE_MODE_BLUE_GREEN

    def _active_versions(self, views: list[st.ReplicaView]) -> list[int]:
        return scaling.active_versions(
            views, latest_version=self._row.latest_version, target=self._final_target(), blue_green=self._blue_green
        )

    def update(self, new: spec_pb2.ServiceSpec, *, mode: int, dry_run: bool) -> res.UpdatePlan:
        """Plan (and unless `dry_run`, apply) an update to `new` (spec.md section 7).

        Replicas whose version differs from `new` only in the service section are kept and
        bumped in place; the others are replaced, rolling or blue-green.
        """
        if self._row.deleting:
            raise errors.FailedPreconditionError(
                f"service {self.name!r} is shutting down",
                reason="SERVICE_SHUTTING_DOWN",
                subject=f"services/{self.name}",
                service=self.name,
            )
        live = [r for r in self.replicas.values() if not st.is_terminal(convert.status_of(r))]
        kept = [r for r in live if spec.is_in_place_update(self.spec(r.version), new)]
        # As SkyPilot: the new policy's target is adopted at once, from the load seen so far;
        # the rest of the autoscaler state (load window, clocks' meaning) carries over.
        policy = convert.policy_of(new)
        adopted = autoscaler.candidate(policy, self._qps(time.time()), list(self._views.values()))
        target = policy.final(adopted)
        victims = st.scale_down_victims([convert.view_of(r) for r in kept], len(kept) - target)
        victim_ids = {v.replica_id for v in victims}
        plan = res.UpdatePlan(
            new_version=self._row.latest_version + 1,
            kept_replica_ids=sorted(r.replica_id for r in kept if r.replica_id not in victim_ids),
            launch_count=max(target - len(kept), 0),
            teardown_replica_ids=sorted(victim_ids),
            replaced_replica_ids=sorted(r.replica_id for r in live if r not in kept),
            in_place=len(kept) == len(live),
        )
        if dry_run:
            return plan
        try:
            with self._db.transaction():  # all of the update, or none of it
                version = self._db.add_version(self.name, new)
                self._row = self._db.update_service(
                    self.name, update_mode=mode or res.UPDATE_MODE_ROLLING, status_message=""
                )
                self._state.target = adopted
                self._state.upscale_since = self._state.downscale_since = None
                self._state.reason = f"update to version {version}: target {adopted}"
                self._state.decided_at = time.time()
                self._persist_state()
                for r in kept:
                    r.version = version
                    self._save(r)
        except Exception:
            self._reload()
            raise
        for r in self.replicas.values():
            self._sync_probe(r)  # probe interval and threshold come from the latest version
        self.kick()
        self.decide()
        plan.new_version = version
        return plan

    def _stop_version(self, r: res.Replica, reason: str) -> None:
        """The stop rule (spec.md section 6): a version that fails before ever being ready."""
        version = r.version
        if version != self._row.latest_version or version in self._state.ever_ready_versions:
            return
        if any(v.version == version and v.status is st.ReplicaStatus.READY for v in self._views.values()):
            return  # SkyPilot's rule: any READY replica of the latest version
        if str(version) in self._state.stopped:
            return
        self._state.stopped[str(version)] = (
            f"scaling stopped: version {version} failed before ever being ready (replica {r.replica_id}: {reason})"
        )
        self._persist_state()
        log.warning("%s: %s", self.name, self._state.stopped[str(version)])

    def _persist_state(self) -> None:
        data = self._state.dump()
        try:
            self._db.put_autoscaler_state(self.name, data)
        except Exception:
            self._state = _ScalerState.load_from(self._state_stored)  # memory follows the store
            raise
        self._state_stored = data

    # ---- launches ------------------------------------------------------------------------

    def _launch_new(self, *, spot: bool) -> None:
        rid = self._db.allocate_replica_id(self.name)
        version = self._row.latest_version
        places = [place for _, place in convert.places_of(self.spec(version))]
        if spot and self._policy().spot_placer:
            used = {
                r.zone
                for r in self.replicas.values()
                if r.is_spot and r.zone and not st.is_terminal(st.ReplicaStatus(r.status))
            }
            zone = placer.select(placer.allowed(self._zones(), places), self._state.zones, used)
            if not zone:
                zone = placer.fixed_zone(self._zones(), places)  # zones unknown: the spec's zone
        else:
            # As SkyPilot: on-demand (and unplaced spot) replicas go where the spec allows and
            # the backend prefers; they neither avoid nor count as spot replicas' zones.
            zone = placer.fixed_zone(self._zones(), places)
        r = res.Replica(
            service=self.name,
            replica_id=rid,
            replica_name=f"{self.name}-{rid}-{self._row.uid}" if self._row.uid else f"{self.name}-{rid}",
            version=version,
            is_spot=spot,
            zone=zone,
            accelerator=convert.accelerator_of(self.spec(version)),
            create_time=pbtime.timestamp(time.time()),
            facts=res.ReplicaFacts(launch_phase=LP.LAUNCH_PHASE_SCHEDULED),
        )
        self._save(r)
        self._start_launch(rid)

    def _mark_zone(self, r: res.Replica, *, preempted: bool) -> None:
        """Spot placer bookkeeping: a zone that failed or preempted a spot replica is avoided."""
        if not (r.is_spot and r.zone and self._policy().spot_placer):
            return
        places = [place for _, place in convert.places_of(self.spec(self._row.latest_version))]
        marks = placer.mark(placer.allowed(self._zones(), places), self._state.zones, r.zone, preempted=preempted)
        if marks != self._state.zones:
            self._state.zones = marks
            self._persist_state()

    def _start_launch(self, rid: int) -> None:
        self._launches[rid] = asyncio.create_task(self._run_launch(rid), name=f"launch {self.name}/{rid}")

    async def _run_launch(self, rid: int) -> None:
        try:
            async with self._launch_slots:
                await self._follow_launch(rid)
        finally:
            if self._launches.get(rid) is asyncio.current_task():
                del self._launches[rid]

    async def _follow_launch(self, rid: int) -> None:
        delay = self._tuning.reconnect_initial_s
        while not self._gone:
            r = self.replicas.get(rid)
            if r is None or r.facts.launch_phase not in (
                LP.LAUNCH_PHASE_SCHEDULED,
                LP.LAUNCH_PHASE_RUNNING,
            ):
                return
            request = prov_pb.LaunchRequest(
                name=r.replica_name,
                service=self.name,
                replica_id=rid,
                version=r.version,
                spec=self.spec(r.version),
                use_spot=r.is_spot,
                zone=r.zone,
                owner=self._owner,
            )
            try:
                metadata = self._traces.launch_metadata(self.name, rid, r.version)
                async for response in self._prov.Launch(request, metadata=metadata):
                    delay = self._tuning.reconnect_initial_s
                    if self._on_launch_event(rid, response.event):
                        return
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _PERMANENT_CODES:
                    self._launch_failed(rid, f"provisioner refused the launch: {exc.details()}")
                    return
                log.info("%s/%d: launch stream broke (%s); re-attaching", self.name, rid, exc.code().name)
            except Exception:
                # A store error applying an event: re-attach and replay, never die silently.
                log.exception("%s/%d: following the launch failed; re-attaching", self.name, rid)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._tuning.reconnect_max_s)

    def _on_launch_event(self, rid: int, ev: prov_res.LaunchEvent) -> bool:
        """Apply one launch event; True when the launch is over for this reconciler."""
        r = self.replicas.get(rid)
        if r is None:
            return True
        f = r.facts
        if f.teardown_phase != TP.TEARDOWN_PHASE_UNSPECIFIED or f.launch_phase not in (
            LP.LAUNCH_PHASE_SCHEDULED,
            LP.LAUNCH_PHASE_RUNNING,
        ):
            return True  # a teardown owns the replica now
        r.provisioner_sequence = ev.sequence
        if ev.type == LE.LAUNCH_EVENT_TYPE_PROVISIONING:
            if f.launch_phase == LP.LAUNCH_PHASE_SCHEDULED:
                f.launch_phase = LP.LAUNCH_PHASE_RUNNING
                if ev.replica.zone:
                    r.zone = ev.replica.zone
                self._save(r)
        elif ev.type == LE.LAUNCH_EVENT_TYPE_ATTEMPT_FAILED:
            r.failure_reason = f"launch attempt {ev.attempt} failed: {ev.message}"
            self._save(r)
        elif ev.type == LE.LAUNCH_EVENT_TYPE_RUNNING:
            self._launched_in[rid] = self._watch_generation()
            self._capacity_backoff_s = 0.0
            f.launch_phase = LP.LAUNCH_PHASE_SUCCEEDED
            r.endpoint = ev.endpoint or ev.replica.endpoint
            r.zone = ev.replica.zone or r.zone
            if ev.replica.accelerator:  # the alternative the provisioner placed (any_of, ordered)
                r.accelerator = convert.accelerator_name(ev.replica.accelerator)
            r.launch_time.CopyFrom(ev.time)
            r.failure_reason = ""
            self._save(r)
            self._mark_zone(r, preempted=False)
            code = self._pending_exit.pop(rid, None)
            if code is not None:
                self.on_app_exit(rid, code)
            return True
        elif ev.type == LE.LAUNCH_EVENT_TYPE_FAILED:
            self._launch_failed(rid, ev.message, capacity=ev.capacity_unavailable)
            return True
        elif ev.type == LE.LAUNCH_EVENT_TYPE_CANCELLED:
            # Cancelled by someone else (the provisioner's CancelLaunch): over, not the app's fault.
            self._launch_failed(rid, ev.message or "the launch was cancelled at the provisioner", user_fault=False)
            return True
        return False

    def _launch_failed(self, rid: int, message: str, *, capacity: bool = False, user_fault: bool = True) -> None:
        r = self.replicas.get(rid)
        if r is None:
            return
        r.facts.launch_phase = LP.LAUNCH_PHASE_FAILED
        r.facts.failed_spot_availability = capacity
        r.failure_reason = f"launch failed: {message}"
        if capacity:
            self._mark_zone(r, preempted=True)
            self._capacity_backoff_s = min(max(self._capacity_backoff_s * 2, 1.0), 60.0)
            self._launch_not_before = time.monotonic() + self._capacity_backoff_s
        elif user_fault:
            # Setup is user code here, so a version whose launches keep failing would otherwise
            # be relaunched forever, exactly like an app that exits.
            self._stop_version(r, r.failure_reason)
        self.teardown(rid, drain=0.0, keep_logs=True)

    # ---- app and replica events ----------------------------------------------------------

    def on_app_exit(self, rid: int, code: int) -> None:
        """The provisioner saw the app exit."""
        r = self.replicas.get(rid)
        if r is None or r.facts.teardown_phase != TP.TEARDOWN_PHASE_UNSPECIFIED:
            return
        if r.facts.launch_phase != LP.LAUNCH_PHASE_SUCCEEDED:
            self._pending_exit[rid] = code  # the launch stream has not said RUNNING yet
            return
        if r.facts.user_app_failed:
            return
        r.facts.exit_code = code
        if code == 0:
            # Not a user app failure (spec.md section 3); probes will fail and decide.
            r.failure_reason = "app exited with code 0"
            self._save(r)
            return
        r.facts.user_app_failed = True
        r.failure_reason = f"app exited with code {code}"
        if not r.facts.HasField("first_ready_time"):
            self._stop_version(r, r.failure_reason)
        self.teardown(rid, drain=0.0, keep_logs=True)

    def on_replica_gone(self, rid: int, *, preempted: bool) -> None:
        """The replica vanished or was preempted without a teardown of ours."""
        r = self.replicas.get(rid)
        if r is None or r.facts.teardown_phase != TP.TEARDOWN_PHASE_UNSPECIFIED:
            return
        if r.facts.launch_phase != LP.LAUNCH_PHASE_SUCCEEDED:
            return  # the launch stream reports what happened to a launch
        if preempted or r.is_spot:
            r.facts.preempted = True
            r.failure_reason = "preempted"
            self._mark_zone(r, preempted=True)
            self.teardown(rid, drain=0.0, is_scale_down=True)
        else:
            # On-demand replicas that vanish go through the probe failure path (spec.md 5).
            r.failure_reason = "replica vanished"
            self._save(r)

    def on_provisioner_event(self, rid: int, ev: prov_res.ReplicaEvent) -> None:
        """Apply a WatchReplicas event (live or snapshot)."""
        p = ev.replica
        kind = ev.type
        if kind in (RE.REPLICA_EVENT_TYPE_SNAPSHOT, RE.REPLICA_EVENT_TYPE_TERMINATED):
            kind = {
                prov_res.APP_STATE_EXITED: RE.REPLICA_EVENT_TYPE_APP_EXITED,
                prov_res.APP_STATE_VANISHED: RE.REPLICA_EVENT_TYPE_VANISHED,
                prov_res.APP_STATE_PREEMPTED: RE.REPLICA_EVENT_TYPE_PREEMPTED,
            }.get(p.app_state, kind)
            if kind == RE.REPLICA_EVENT_TYPE_TERMINATED or (
                kind == RE.REPLICA_EVENT_TYPE_SNAPSHOT
                and p.state in (prov_res.REPLICA_STATE_TERMINATED, prov_res.REPLICA_STATE_FAILED)
            ):
                kind = RE.REPLICA_EVENT_TYPE_VANISHED
        if kind == RE.REPLICA_EVENT_TYPE_APP_EXITED:
            self.on_app_exit(rid, p.exit_code)
        elif kind == RE.REPLICA_EVENT_TYPE_VANISHED:
            self.on_replica_gone(rid, preempted=False)
        elif kind == RE.REPLICA_EVENT_TYPE_PREEMPTED:
            self.on_replica_gone(rid, preempted=True)

    def on_missing(self, names: set[str], generation: int) -> None:
        """After a provisioner snapshot: replicas it does not know are gone.

        A replica whose launch finished after this watch started may be missing from the
        snapshot only because the snapshot was older; it is left to live events and probes.
        """
        for rid, r in list(self.replicas.items()):
            if r.replica_name not in names and self._launched_in.get(rid, -1) < generation:
                self.on_replica_gone(rid, preempted=False)

    # ---- probing -------------------------------------------------------------------------

    def _probe_target(self, r: res.Replica) -> prober_pb.ProbeTarget:
        probe = self.spec(r.version).service.readiness_probe
        latest = self.spec(self._row.latest_version).service.readiness_probe
        return prober_pb.ProbeTarget(
            target_id=target_id(self.name, r.replica_id),
            url=r.endpoint,
            path=probe.path or "/",
            method=prober_pb.PROBE_METHOD_POST if probe.post_data_json else prober_pb.PROBE_METHOD_GET,
            post_data_json=probe.post_data_json,
            headers=dict(probe.headers),
            timeout=probe.timeout,
            interval=latest.probe_interval,
            fast_interval=pbtime.duration(self._tuning.probe_fast_interval_s),
            starting=not r.facts.HasField("first_ready_time"),
            traceparent=self._traces.traceparent(r),
        )

    def _sync_probe(self, r: res.Replica) -> None:
        rid = r.replica_id
        if st.should_probe(convert.facts_of(r)) and r.endpoint and not self._gone:
            target = self._probe_target(r)
            if self._probed.get(rid) != target:
                self._probed[rid] = target
                self._probes.upsert(target)
        elif self._probed.pop(rid, None) is not None:
            self._probes.remove(target_id(self.name, rid))

    def on_probe_result(self, rid: int, result: prober_pb.ProbeResult) -> None:
        """Apply a probe result (spec.md section 5)."""
        r = self.replicas.get(rid)
        if r is None or rid not in self._probed:  # _save keeps _probed == the replicas to probe
            return
        if result.outcome in (
            prober_pb.PROBE_OUTCOME_PROBE_UNAVAILABLE,
            prober_pb.PROBE_OUTCOME_INVALID_TARGET,
        ):
            return  # no information about the replica: never a failure
        f = r.facts
        if result.ready:
            self._on_probe_success(r, result)
            return
        reason = f"probe failed: {result.error or f'HTTP {result.http_code}'}"
        if f.HasField("first_ready_time"):
            f.ready_now = False
            if not f.HasField("streak_start_time"):
                f.streak_start_time.CopyFrom(result.probe_time)
            f.streak_last_time.CopyFrom(result.probe_time)
            r.failure_reason = reason
            window = pbtime.from_timestamp(f.streak_last_time) - pbtime.from_timestamp(f.streak_start_time)
            threshold = pbtime.seconds(
                self.spec(self._row.latest_version).service.readiness_probe.consecutive_failure_threshold
            )
            if window >= threshold:
                self.teardown(rid, drain=0.0, keep_logs=True)
            else:
                self._save(r)
            return
        if not f.HasField("first_failure_time"):
            f.first_failure_time.CopyFrom(result.probe_time)
            self._save(r)
            return
        delay = pbtime.seconds(self.spec(r.version).service.readiness_probe.initial_delay)
        waited = pbtime.from_timestamp(result.probe_time) - pbtime.from_timestamp(f.first_failure_time)
        if waited > delay:
            f.initial_delay_exceeded = True
            r.failure_reason = f"not ready within the initial delay of {delay:g} s ({reason})"
            self._stop_version(r, r.failure_reason)
            self.teardown(rid, drain=0.0, keep_logs=True)

    def _on_probe_success(self, r: res.Replica, result: prober_pb.ProbeResult) -> None:
        f = r.facts
        if f.ready_now and f.HasField("first_ready_time") and not f.HasField("streak_start_time"):
            return  # nothing changed: no write
        f.ready_now = True
        if not f.HasField("first_ready_time"):
            f.first_ready_time.CopyFrom(result.probe_time)
        f.ClearField("streak_start_time")
        f.ClearField("streak_last_time")
        r.failure_reason = ""
        if self._row.uptime_start is None:
            self._row = self._db.update_service(self.name, uptime_start=pbtime.from_timestamp(result.probe_time))
        self._save(r)

    def set_probing_stale(self, stale: bool) -> None:
        """Whether no prober is reachable; shown on the service, never acted on."""
        if stale != self._probing_stale:
            self._probing_stale = stale
            self._schedule_flush()

    # ---- teardowns -----------------------------------------------------------------------

    def teardown(
        self,
        rid: int,
        *,
        drain: float,
        keep_logs: bool = False,
        is_scale_down: bool = False,
        purge: bool = False,
    ) -> None:
        """Schedule a replica's teardown (cancelling its launch first, if any)."""
        r = self.replicas.get(rid)
        if r is None:
            return
        f = r.facts
        f.is_scale_down = f.is_scale_down or is_scale_down
        f.purged = f.purged or purge
        if rid in self._teardowns:
            self._save(r)
            return
        if f.launch_phase in (LP.LAUNCH_PHASE_SCHEDULED, LP.LAUNCH_PHASE_RUNNING):
            f.launch_phase = LP.LAUNCH_PHASE_INTERRUPTED
            task = self._launches.pop(rid, None)
            if task is not None:
                task.cancel()
        f.teardown_phase = TP.TEARDOWN_PHASE_SCHEDULED
        f.drain.CopyFrom(pbtime.duration(drain))
        self._save(r)
        self._start_teardown(rid, drain=drain, keep_logs=keep_logs)

    def _start_teardown(self, rid: int, *, drain: float, keep_logs: bool) -> None:
        if keep_logs:
            self._logs_kept.add(rid)
        else:
            self._logs_kept.discard(rid)
        self._teardowns[rid] = asyncio.create_task(
            self._run_teardown(rid, drain, keep_logs), name=f"teardown {self.name}/{rid}"
        )

    async def _run_teardown(self, rid: int, drain: float, keep_logs: bool) -> None:
        delay = self._tuning.reconnect_initial_s
        try:
            while True:
                r = self.replicas.get(rid)
                if r is None:
                    return
                request = prov_pb.TerminateRequest(
                    name=r.replica_name, drain=pbtime.duration(drain), keep_logs=keep_logs
                )
                try:
                    async for response in self._prov.Terminate(request):
                        delay = self._tuning.reconnect_initial_s
                        ev = response.event
                        if ev.type == TE.TERMINATE_EVENT_TYPE_TERMINATED:
                            self._finish_teardown(rid, ok=True, message=ev.message)
                            return
                        if ev.type == TE.TERMINATE_EVENT_TYPE_FAILED:
                            self._finish_teardown(rid, ok=False, message=ev.message)
                            return
                        if ev.type != TE.TERMINATE_EVENT_TYPE_QUEUED and (
                            r.facts.teardown_phase == TP.TEARDOWN_PHASE_SCHEDULED
                        ):
                            r.facts.teardown_phase = TP.TEARDOWN_PHASE_RUNNING
                            self._save(r)
                except grpc.aio.AioRpcError as exc:
                    log.info("%s/%d: teardown stream broke (%s); retrying", self.name, rid, exc.code().name)
                except Exception:
                    log.exception("%s/%d: following the teardown failed; retrying", self.name, rid)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._tuning.reconnect_max_s)
                drain = 0.0  # the replica already left the ready set; do not drain twice
        finally:
            if self._teardowns.get(rid) is asyncio.current_task():
                del self._teardowns[rid]
                if self._row.deleting:
                    self._continue_delete()

    def _finish_teardown(self, rid: int, *, ok: bool, message: str) -> None:
        r = self.replicas.get(rid)
        if r is None:
            return
        f = r.facts
        f.teardown_phase = TP.TEARDOWN_PHASE_SUCCEEDED if ok else TP.TEARDOWN_PHASE_FAILED
        if not ok:
            r.failure_reason = f"teardown failed: {message}"
            log.warning("%s/%d: teardown failed: %s", self.name, rid, message)
        if self._row.deleting:
            remove = ok or f.purged
        else:
            remove = st.removed_after_teardown(
                convert.facts_of(r), version=r.version, latest_version=self._row.latest_version
            )
        if remove:
            self._remove(rid)
        else:
            self._save(r)
        self.kick()

    async def _delete_logs(self, name: str) -> None:
        delay = self._tuning.reconnect_initial_s
        for _ in range(8):
            try:
                await self._prov.DeleteLogs(prov_pb.DeleteLogsRequest(name=name), timeout=10)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _PERMANENT_CODES:
                    log.info("logs of %s not deleted: %s", name, exc.code().name)
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._tuning.reconnect_max_s)
        log.warning("could not delete the logs of %s: the provisioner is unreachable", name)

    async def _end_drain(self, name: str) -> None:
        """Ask the provisioner again, without drain: it cuts the drain in progress short. The
        teardown's own task follows the same teardown to its end."""
        try:
            async for _ in self._prov.Terminate(prov_pb.TerminateRequest(name=name), timeout=120):
                pass
        except grpc.aio.AioRpcError as exc:
            log.info("could not end the drain of %s early: %s", name, exc.code().name)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- user actions --------------------------------------------------------------------

    def terminate_replica(self, rid: int, *, purge: bool) -> res.Replica:
        """Manual termination (spec.md section 4)."""
        r = self.replica(rid)
        status = convert.status_of(r)
        if status == st.ReplicaStatus.SHUTTING_DOWN or (rid in self._teardowns and status not in st.FAILED_STATUSES):
            raise errors.FailedPreconditionError(
                f"replica {rid} of service {self.name!r} is already shutting down",
                reason="REPLICA_SHUTTING_DOWN",
                subject=f"services/{self.name}/replicas/{rid}",
                service=self.name,
                replica_id=rid,
            )
        if status in st.FAILED_STATUSES:
            if not purge:
                raise errors.FailedPreconditionError(
                    f"replica {rid} of service {self.name!r} is {status.name}; terminating it could "
                    "leak resources. Use purge to remove the record",
                    reason="REPLICA_FAILED",
                    subject=f"services/{self.name}/replicas/{rid}",
                    service=self.name,
                    replica_id=rid,
                )
            self._purge(rid)
        else:
            self.teardown(rid, drain=self._tuning.drain_s, is_scale_down=True, purge=purge)
            self.kick()
        return self.replicas.get(rid, r)

    def _purge(self, rid: int) -> None:
        r = self.replicas[rid]
        if r.facts.teardown_phase == TP.TEARDOWN_PHASE_SUCCEEDED:
            self._remove(rid)
        else:
            # Cleanup failed or never ran: try once more; purge removes the record either way.
            if r.facts.teardown_phase == TP.TEARDOWN_PHASE_FAILED:
                r.facts.teardown_phase = TP.TEARDOWN_PHASE_UNSPECIFIED
            self.teardown(rid, drain=0.0, purge=True)

    def purge_failed(self) -> list[int]:
        """Purge every failed replica record."""
        ids = [rid for rid, r in sorted(self.replicas.items()) if convert.status_of(r) in st.FAILED_STATUSES]
        for rid in ids:
            self._purge(rid)
        return ids

    def delete(self, *, purge: bool) -> None:
        """Tear every replica down without drain, then forget the service (spec.md section 9)."""
        if self._row.deleting and not purge and self._row.status != res.SERVICE_STATUS_FAILED_CLEANUP:
            raise errors.FailedPreconditionError(
                f"service {self.name!r} is already shutting down",
                reason="SERVICE_SHUTTING_DOWN",
                subject=f"services/{self.name}",
                service=self.name,
            )
        self._row = self._db.update_service(
            self.name, deleting=True, status=res.SERVICE_STATUS_SHUTTING_DOWN, status_message=""
        )
        for rid, r in list(self.replicas.items()):
            phase = r.facts.teardown_phase
            if rid in self._teardowns:
                r.facts.purged = r.facts.purged or purge  # removed when it finishes, either way
                if r.facts.drain.ToNanoseconds() > 0:
                    # A drain in progress (scale-down, manual stop) ends now: down never drains.
                    self._spawn(self._end_drain(r.replica_name), f"end drain of {r.replica_name}")
            elif phase == TP.TEARDOWN_PHASE_SUCCEEDED or (purge and phase == TP.TEARDOWN_PHASE_FAILED):
                self._remove(rid)
            else:
                if phase == TP.TEARDOWN_PHASE_FAILED:
                    r.facts.teardown_phase = TP.TEARDOWN_PHASE_UNSPECIFIED  # try the cleanup once more
                self.teardown(rid, drain=0.0, purge=purge)
        self._continue_delete()

    def _continue_delete(self) -> None:
        if self._gone or self._stopping or self._teardowns:
            self._schedule_flush()
            return
        for rid, r in list(self.replicas.items()):
            if r.facts.teardown_phase != TP.TEARDOWN_PHASE_FAILED:
                self.teardown(rid, drain=0.0)
        if self._teardowns:
            return
        if self.replicas:
            left = ", ".join(str(i) for i in sorted(self.replicas))
            self._row = self._db.update_service(
                self.name,
                status=res.SERVICE_STATUS_FAILED_CLEANUP,
                status_message=f"teardown failed for replica(s) {left}; delete with purge to forget them",
            )
            self._schedule_flush()
            return
        self._gone = True
        self._cancel_decision()
        for rid in list(self._probed):
            self._probes.remove(target_id(self.name, rid))
        self._probed.clear()
        svc = self._without_unchanged_spec(self.service())
        svc.status = res.SERVICE_STATUS_SHUTTING_DOWN
        self._db.delete_service(self.name)
        self.hub.publish(svc, [], [], deleted=True)
        self._on_gone(self.name)

    # ---- load ----------------------------------------------------------------------------

    def set_load_balancer_url(self, url: str) -> None:
        """Show `url` (the balancer that reports this service's load) as the service's endpoint."""
        if url != self.load_balancer_url:
            self.load_balancer_url = url  # memory only: the balancer reports again within seconds
            self._schedule_flush()

    def report_load(self, report: load.Report, now: float) -> tuple[float, load.Applied]:
        """Record a report into the load window unless it was applied before, and decide at once;
        return the window's QPS and what the report added."""
        window_s = self._tuning.qps_window_s
        applied = load.apply(self._state.window(), self._state.ledger(), report, now, window_s=window_s)
        if not applied.already_applied:
            self._state.load = {str(k): v for k, v in applied.window.items()}
            self._state.reports = [[b, s] for b, s in applied.ledger.items()]
            self._persist_state()  # the window and the ledger in one write: a resend counts once
            self.decide()
        return self._qps(now), applied

    # ---- saving and publishing -----------------------------------------------------------

    def _save(self, r: res.Replica) -> None:
        """Write a replica's record, then make memory follow.

        Callers change `r` (often the record held in memory) before calling; if the write
        fails, `r` is put back as the store holds it and the error propagates, so memory never
        runs ahead of the store.
        """
        rid = r.replica_id
        previous = r.status
        r.status = convert.status_of(r)  # type: ignore[assignment]
        try:
            self._db.put_replica(r)
        except Exception:
            stored = self._stored.get(rid)
            if stored is not None:
                r.ParseFromString(stored)  # Parse clears first: back to the stored record
            raise
        self._stored[rid] = r.SerializeToString()
        if r.status != previous:
            self.kick()  # scaling and rollouts depend on statuses
        self._views[rid] = convert.view_of(r)
        self.replicas[rid] = r
        self._changed[rid] = r
        if r.status == res.REPLICA_STATUS_READY and r.version not in self._state.ever_ready_versions:
            # The stop rule's "ever ready": any READY replica of a version, whether it passed its
            # first probe under it or was kept READY through an in-place update.
            self._state.ever_ready_versions = [*self._state.ever_ready_versions[-15:], r.version]
            self._persist_state()
        self._sync_probe(r)
        self._schedule_flush()

    def _remove(self, rid: int) -> None:
        r = self.replicas.get(rid)
        if r is None:
            return
        self._db.delete_replica(self.name, rid)
        if rid in self._logs_kept:
            # A failed replica's logs were kept for the user; they go with its record.
            self._logs_kept.discard(rid)
            self._spawn(self._delete_logs(r.replica_name), f"delete logs of {r.replica_name}")
        self.replicas.pop(rid, None)
        self._stored.pop(rid, None)
        self._views.pop(rid, None)
        self._changed.pop(rid, None)
        self._launched_in.pop(rid, None)
        self._pending_exit.pop(rid, None)
        self._removed.append(rid)
        if self._probed.pop(rid, None) is not None:
            self._probes.remove(target_id(self.name, rid))
        for version in self._db.delete_unreferenced_versions(self.name):
            self._specs.pop(version, None)
        self._schedule_flush()

    def _without_unchanged_spec(self, svc: res.Service) -> res.Service:
        # The watch history holds ~1,000 messages per service: the spec (up to 1 MiB of YAML)
        # travels with the snapshot and with the change that brings a new version, not with
        # every replica status change.
        if svc.latest_version == self._published_version:
            svc.ClearField("spec")
        self._published_version = svc.latest_version
        return svc

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and not self._gone:
            self._flush_scheduled = True
            _soon(self._flush, self._last_flush, len(self.replicas))

    def _flush(self) -> None:
        """Publish what changed since the last flush as one watch message."""
        self._flush_scheduled = False
        self._last_flush = time.monotonic()
        if self._gone:
            return
        svc = self.service()
        changed = [self._changed[i] for i in sorted(self._changed)]
        removed, self._removed = self._removed, []
        self._changed = {}
        self.hub.publish(self._without_unchanged_spec(svc), changed, removed)
        self.hub.set_endpoints(list(svc.endpoints))
        if not self._row.deleting and (
            svc.status != self._row.status or svc.status_message != self._row.status_message
        ):
            try:
                self._row = self._db.update_service(self.name, status=svc.status, status_message=svc.status_message)
            except errors.UnavailableError:
                log.warning("%s: could not store the service status; the next change retries", self.name)

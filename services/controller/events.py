"""Events in, facts out: each handler turns what a provisioner, a prober or the user reported
into a `lifecycle` event, applies the domain's `step` to the replica's facts, and reacts to the
actions it returns (the stop rule, the launch pause, zone marks). Nothing here talks to a client
or the store: the pass stores the change and the drivers act on it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.prober.v1 import prober_service_pb2 as prober_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.common import pbtime
from services.controller import autoscaling, convert, facts, pools
from services.controller.domain import failures, lifecycle
from services.controller.domain import status as st

if TYPE_CHECKING:
    from services.controller.reconciler import ServiceReconciler

log = logging.getLogger(__name__)

LP = res.LaunchPhase
TP = res.TeardownPhase
LE = prov_res.LaunchEventType
TE = prov_res.TerminateEventType
RE = prov_res.ReplicaEventType


def step(rec: ServiceReconciler, rid: int, event: lifecycle.Event, *, changed: bool = False) -> None:
    """Apply one lifecycle event to a replica; `changed`: the caller changed the record too."""
    r = rec.replicas.get(rid)
    if r is None:
        return
    extra = rec.extra.setdefault(rid, facts.Extra())
    old = facts.life_of(r, extra)
    windows = facts.windows_of(rec.spec(r.version), rec.spec(rec.row.latest_version))
    new, actions = lifecycle.step(old, event, windows)
    changed = facts.write_life(r, old, new, extra) or changed
    for action in actions:
        _react(rec, r, action)
    if changed:
        rec.touch(r)


def _react(rec: ServiceReconciler, r: res.Replica, action: lifecycle.Action) -> None:

    rid = r.replica_id
    if isinstance(action, lifecycle.CancelLaunch):
        rec.launches.tasks.cancel(rid)
    elif isinstance(action, lifecycle.StartTeardown):
        log.info("%s/%d: teardown: %s", rec.name, rid, action.reason)
        rec.deps.hooks.call("on_teardown", rec.name, rid, action.reason)
    elif isinstance(action, lifecycle.MarkZone):
        autoscaling.mark_zone(rec, r, preempted=action.preempted)
    elif isinstance(action, lifecycle.LaunchSucceeded):
        rec.backoff = rec.backoff.succeeded()
        rec.launched_in[rid] = rec.deps.watch_generation()
    elif isinstance(action, lifecycle.Failed):
        _failed(rec, r, action.failure)


def _failed(rec: ServiceReconciler, r: res.Replica, failure: failures.Failure) -> None:
    """The service-level rules of a replica's failure: the stop rule and the launch pause."""
    rec.deps.hooks.call("on_failure", rec.name, r.replica_id, failure)
    version = r.version
    ever = failures.version_ever_ready(version, rec.state.ever_ready_versions, rec.views.values())
    stops = failures.stops_version(failure, version=version, latest_version=rec.row.latest_version, ever_ready=ever)
    if stops and str(version) not in rec.state.stopped:
        rec.state.stopped[str(version)] = failures.stop_message(version, r.replica_id, failure.message)
        log.warning("%s: %s", rec.name, rec.state.stopped[str(version)])
        rec.save_state()
    if failures.pauses_launches(failure):
        rec.backoff = rec.backoff.failed(time.monotonic(), failure.message)
        log.info("%s: launches paused %.0f s: %s", rec.name, rec.backoff.delay_s, failure.message)
        rec.show()


def ask_teardown(
    rec: ServiceReconciler,
    rid: int,
    *,
    drain_s: float,
    keep_logs: bool = False,
    scale_down: bool = False,
    purge: bool = False,
    reason: str = "asked",
) -> None:
    """Someone decided this replica goes (a scale-down, the user, a delete)."""
    event = lifecycle.TeardownAsked(
        drain_s=drain_s, keep_logs=keep_logs, scale_down=scale_down, purge=purge, reason=reason
    )
    step(rec, rid, event)


# ---- launches ---------------------------------------------------------------------------------


def follow_launch(rec: ServiceReconciler, rid: int) -> None:
    """Have the launch driver follow (or re-attach to) a replica's launch."""

    def request() -> prov_pb.LaunchRequest | None:
        r = rec.replicas.get(rid)
        if rec.gone or r is None or r.facts.launch_phase not in (LP.LAUNCH_PHASE_SCHEDULED, LP.LAUNCH_PHASE_RUNNING):
            return None
        if r.facts.teardown_phase != TP.TEARDOWN_PHASE_UNSPECIFIED:
            return None
        return prov_pb.LaunchRequest(
            name=r.replica_name,
            service=rec.name,
            replica_id=rid,
            version=r.version,
            spec=rec.spec(r.version),
            use_spot=r.is_spot,
            zone=r.zone,
            owner=rec.deps.owner,
        )

    def refused(message: str) -> None:
        step(rec, rid, lifecycle.LaunchFailed(message, refused=True))

    def metadata(req: prov_pb.LaunchRequest) -> tuple[tuple[str, str], ...]:
        return rec.deps.traces.launch_metadata(rec.name, rid, req.version)

    rec.launches.start(rid, request, lambda ev: on_launch_event(rec, rid, ev), refused, metadata)


def on_launch_event(rec: ServiceReconciler, rid: int, ev: prov_res.LaunchEvent) -> bool:
    """Apply one launch event; True when the launch is over for this service."""
    r = rec.replicas.get(rid)
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
        zoned = bool(ev.replica.zone) and f.launch_phase == LP.LAUNCH_PHASE_SCHEDULED
        if zoned:
            r.zone = ev.replica.zone
        step(rec, rid, lifecycle.LaunchProvisioning(), changed=zoned)
    elif ev.type == LE.LAUNCH_EVENT_TYPE_ATTEMPT_FAILED:
        step(rec, rid, lifecycle.LaunchAttemptFailed(ev.attempt, ev.message))
    elif ev.type == LE.LAUNCH_EVENT_TYPE_RUNNING:
        r.endpoint = ev.endpoint or ev.replica.endpoint
        r.zone = ev.replica.zone or r.zone
        if ev.replica.accelerator:  # the alternative the provisioner placed (any_of, ordered)
            r.accelerator = convert.accelerator_name(ev.replica.accelerator)
        r.launch_time.CopyFrom(ev.time)
        step(rec, rid, lifecycle.LaunchRunning(), changed=True)
        return True
    elif ev.type == LE.LAUNCH_EVENT_TYPE_SETUP_DONE and rec.pool is not None:
        r.zone = ev.replica.zone or r.zone
        r.launch_time.CopyFrom(ev.time)
        pools.setup_done(rec, rid, pbtime.from_timestamp(ev.time))
        return True
    elif ev.type == LE.LAUNCH_EVENT_TYPE_FAILED:
        event = lifecycle.LaunchFailed(ev.message, cause=failures.Cause(ev.cause), capacity=ev.capacity_unavailable)
        step(rec, rid, event)
        return True
    elif ev.type == LE.LAUNCH_EVENT_TYPE_CANCELLED:
        step(rec, rid, lifecycle.LaunchFailed(ev.message, cancelled=True))
        return True
    return False


# ---- teardowns --------------------------------------------------------------------------------


def start_teardown(rec: ServiceReconciler, r: res.Replica, *, drain_s: float) -> None:
    """Have the teardown driver tear a replica down (its facts say a teardown is in motion)."""
    rid = r.replica_id
    if rec.row.deleting:
        drain_s = 0.0  # a delete never drains (spec.md section 9)
    keep_logs = not (r.facts.is_scale_down or r.facts.purged or rec.row.deleting)
    if rec.pool is not None:
        # A worker's logs hold its jobs' output: kept until the pool goes (pools.forget_logs).
        keep_logs = not rec.row.deleting
        rec.logs_kept.discard(rid)
    elif keep_logs:
        rec.logs_kept.add(rid)
    else:
        rec.logs_kept.discard(rid)

    def on_event(ev: prov_res.TerminateEvent) -> bool:
        if ev.type == TE.TERMINATE_EVENT_TYPE_TERMINATED:
            teardown_finished(rec, rid, ok=True, message=ev.message)
            return True
        if ev.type == TE.TERMINATE_EVENT_TYPE_FAILED:
            teardown_finished(rec, rid, ok=False, message=ev.message)
            return True
        if ev.type != TE.TERMINATE_EVENT_TYPE_QUEUED:
            step(rec, rid, lifecycle.TeardownRunning())
        return False

    def on_end(_: int) -> None:
        if rec.row.deleting:
            rec.kick()

    rec.teardowns.start(rid, r.replica_name, drain_s=drain_s, keep_logs=keep_logs, on_event=on_event, on_end=on_end)
    if drain_s > 0 and rec.pool is None:  # a pool's worker is behind no balancer
        # A balancer reporting nothing in flight for it, with an endpoint set newer than this one,
        # ends the drain early (balancers.py).
        routed = any(e.replica_id == rid for e in rec.hub.endpoints)
        rec.balancers.draining(rid, after_version=rec.hub.endpoints_version if routed else None)


def teardown_finished(rec: ServiceReconciler, rid: int, *, ok: bool, message: str) -> None:
    """The provisioner says the teardown is over: the record goes or is kept (spec.md section 4)."""
    step(rec, rid, lifecycle.TeardownFinished(ok=ok, message=message))
    r = rec.replicas.get(rid)
    if r is None:
        return
    if not ok:
        log.warning("%s/%d: teardown failed: %s", rec.name, rid, message)

    facts_now = convert.facts_of(r)
    if st.record_removed(
        facts_now, version=r.version, latest_version=rec.row.latest_version, deleting=rec.row.deleting
    ):
        rec.remove(rid)
    rec.kick()


# ---- provisioner watch and probes -------------------------------------------------------------


def on_provisioner_event(rec: ServiceReconciler, rid: int, ev: prov_res.ReplicaEvent) -> None:
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
        step(rec, rid, lifecycle.AppExited(p.exit_code, failures.Cause(ev.cause)))
    elif kind == RE.REPLICA_EVENT_TYPE_VANISHED:
        step(rec, rid, lifecycle.Gone(preempted=False, message=ev.message))
    elif kind == RE.REPLICA_EVENT_TYPE_PREEMPTED:
        step(rec, rid, lifecycle.Gone(preempted=True))


def on_missing(rec: ServiceReconciler, names: set[str], generation: int) -> None:
    """After a provisioner snapshot: replicas it does not know are gone. A replica whose launch
    finished after this watch started may be missing only because the snapshot was older."""
    for rid, r in list(rec.replicas.items()):
        if r.replica_name not in names and rec.launched_in.get(rid, -1) < generation:
            step(rec, rid, lifecycle.Gone(preempted=False, message="the provisioner no longer knows it"))


def on_probe_result(rec: ServiceReconciler, rid: int, result: prober_pb.ProbeResult) -> None:
    """Apply a probe result (spec.md section 5); results that say nothing change nothing."""
    if rid not in rec.probes:
        return
    informative = result.outcome not in (
        prober_pb.PROBE_OUTCOME_PROBE_UNAVAILABLE,
        prober_pb.PROBE_OUTCOME_INVALID_TARGET,
    )
    when = pbtime.from_timestamp(result.probe_time)
    event = lifecycle.Probed(result.ready, when, result.error, result.http_code, informative)
    step(rec, rid, event)
    if informative and result.ready and rec.row.uptime_start is None:
        rec.row = dataclasses.replace(rec.row, uptime_start=when)
        rec.book.row(uptime_start=when)


def route_probe_results(services: dict[str, ServiceReconciler], results: list[prober_pb.ProbeResult]) -> None:
    """Apply each result to its service's replica (target ids are "service/replica id")."""
    for result in results:
        service, _, rid = result.target_id.rpartition("/")
        rec = services.get(service)
        if rec is not None and rid.isdigit():
            try:
                on_probe_result(rec, int(rid), result)
            except Exception:
                # Probes repeat: one failure never drops the rest of the batch.
                log.exception("could not apply a probe result of %s", result.target_id)

"""The autoscaler's timer and inputs for one service, and where a new replica goes: decisions
come from `domain.autoscaler` and `domain.placer`; this module feeds them and records results."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import pbtime
from services.controller import admission, convert, pools, retries
from services.controller.domain import autoscaler, load, placer
from services.controller.domain import status as st

if TYPE_CHECKING:
    from services.controller.reconciler import ServiceReconciler

log = logging.getLogger(__name__)


def qps(rec: ServiceReconciler, now: float) -> float:
    return autoscaler.qps(rec.state.window(), now, window_s=rec.tuning.qps_window_s)


def decide(rec: ServiceReconciler) -> None:
    """Make one autoscaler decision now and schedule the next (spec.md section 6)."""
    if rec.decision is not None:
        rec.decision.cancel()
        rec.decision = None
    if rec.gone or rec.stopping or rec.row.deleting or not rec.started:
        return
    now = time.time()
    policy = rec.policy()
    views = list(rec.views.values()) if policy.target_qps_per_accelerator else []
    wanted = autoscaler.candidate(policy, qps(rec, now), views)
    before = rec.state.hysteresis
    d = pools.decide(rec, before, now) or autoscaler.decide(
        policy,
        before,
        wanted,
        now,
        interval_s=rec.tuning.decision_interval_s,
        zero_interval_s=rec.tuning.zero_decision_interval_s,
    )
    if d.state != before:
        rec.state.target = d.state.target
        rec.state.upscale_since = d.state.upscale_since
        rec.state.downscale_since = d.state.downscale_since
        rec.state.reason = d.reason
        rec.state.decided_at = now
        if d.state.target != before.target:
            log.info("%s: %s", rec.name, d.reason)
        rec.save_state()
    rec.decision = asyncio.get_running_loop().call_later(max(d.next_in_s, 0.001), _decide_safely, rec)


def _decide_safely(rec: ServiceReconciler) -> None:
    rec.decision = None
    try:
        decide(rec)
    except Exception:
        log.exception("%s: autoscaler decision failed; retrying", rec.name)
        rec.decision = asyncio.get_running_loop().call_later(retries.PASS.delay(1), _decide_safely, rec)


def report_load(rec: ServiceReconciler, report: load.Report, now: float) -> tuple[float, load.Applied]:
    """Record a report into the load window unless it was applied before, and decide at once;
    return the window's QPS and what the report added. The window and the ledger are stored
    together (a resend counts once)."""
    window_s = rec.tuning.qps_window_s
    applied = load.apply(rec.state.window(), rec.state.ledger(), report, now, window_s=window_s)
    if not applied.already_applied:
        rec.state.load = {str(k): v for k, v in applied.window.items()}
        rec.state.reports = [[b, s] for b, s in applied.ledger.items()]
        rec.save_state()
        decide(rec)
    return qps(rec, now), applied


def launch_new(rec: ServiceReconciler, *, spot: bool) -> None:
    """A new PENDING record of the latest version (its launch starts once it is stored)."""
    rid = rec.next_id
    rec.next_id += 1
    version = rec.row.latest_version
    spec = rec.spec(version)
    places = [place for _, place in convert.places_of(spec)]
    zones = rec.deps.zones()
    if spot and rec.policy().spot_placer:
        used = {
            r.zone
            for r in rec.replicas.values()
            if r.is_spot and r.zone and not st.is_terminal(st.ReplicaStatus(r.status))
        }
        zone = placer.select(placer.allowed(zones, places), rec.state.zones, used)
        if not zone:
            zone = placer.fixed_zone(zones, places)  # zones unknown: the spec's zone
    else:
        # As SkyPilot: on-demand (and unplaced spot) replicas go where the spec allows and the
        # backend prefers; they neither avoid nor count as spot replicas' zones.
        zone = placer.fixed_zone(zones, places)
    uid = rec.row.uid
    r = res.Replica(
        service=rec.name,
        replica_id=rid,
        replica_name=f"{rec.name}-{rid}-{uid}" if uid else f"{rec.name}-{rid}",
        version=version,
        is_spot=spot,
        zone=zone,
        accelerator=convert.accelerator_of(spec),
        create_time=pbtime.timestamp(time.time()),
        facts=res.ReplicaFacts(launch_phase=res.LAUNCH_PHASE_SCHEDULED),
    )
    rec.touch(r)
    rec.deps.hooks.call("on_launch", rec.name, rid)


def mark_zone(rec: ServiceReconciler, r: res.Replica, *, preempted: bool) -> None:
    """Spot placer bookkeeping: a zone that failed or preempted a spot replica is avoided."""
    if not (r.is_spot and r.zone and rec.policy().spot_placer):
        return
    places = [place for _, place in convert.places_of(rec.spec(rec.row.latest_version))]
    marks = placer.mark(placer.allowed(rec.deps.zones(), places), rec.state.zones, r.zone, preempted=preempted)
    if marks != rec.state.zones:
        rec.state.zones = marks
        rec.save_state()


def report_request(
    rec: ServiceReconciler, request: api.ReportLoadRequest, report: load.Report
) -> api.ReportLoadResponse:
    """A checked ReportLoad call: the reporting balancer's URL is shown as the service's endpoint
    while that balancer reports (memory only: it reports again within seconds), and a drain every
    live balancer confirmed idle ends now."""
    for rid in rec.balancers.report(admission.balancer_of(request)):
        r = rec.replicas.get(rid)
        if r is not None and rid in rec.teardowns.tasks:
            log.info("%s/%d: no request in flight through any balancer; the drain ends now", rec.name, rid)
            rec.spawn(rec.teardowns.end_drain(r.replica_name), f"end drain of {r.replica_name}")
    rate, applied = report_load(rec, report, time.time())
    return api.ReportLoadResponse(qps=rate, already_applied=applied.already_applied, counted_requests=applied.counted)

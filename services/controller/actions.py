"""The user's actions on one service: update, delete, terminate and purge replicas.

Each waits until no batch of the service is being written, changes memory in one step (no
await in between), and stores the change with `write_now`: the call returns once it is stored,
and a store that refuses it leaves the service as it was (memory is read back).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors, spec
from services.controller import autoscaling, convert, events, pools
from services.controller.domain import autoscaler, scaling
from services.controller.domain import status as st

if TYPE_CHECKING:
    from services.controller.reconciler import ServiceReconciler

log = logging.getLogger(__name__)

TP = res.TeardownPhase


def _shutting_down(rec: ServiceReconciler) -> errors.FailedPreconditionError:
    return errors.FailedPreconditionError(
        f"service {rec.name!r} is shutting down",
        reason="SERVICE_SHUTTING_DOWN",
        subject=f"services/{rec.name}",
        service=rec.name,
    )


async def update(rec: ServiceReconciler, new: spec_pb2.ServiceSpec, *, mode: int, dry_run: bool) -> res.UpdatePlan:
    """Plan (and unless `dry_run`, apply) an update to `new` (spec.md section 7): replicas whose
    version differs from `new` only in the service section are kept and bumped in place."""
    async with rec.api_lock:  # another call's change is either stored or undone by now
        await rec.idle()
        if rec.row.deleting:
            raise _shutting_down(rec)
        live = [r for r in rec.replicas.values() if not st.is_terminal(convert.status_of(r))]
        keepable = {r.replica_id for r in live if spec.is_in_place_update(rec.spec(r.version), new)}
        # As SkyPilot: the new policy's target is adopted at once, from the load seen so far.
        policy = convert.policy_of(new)
        adopted = autoscaler_candidate(rec, policy)
        p = scaling.update_plan([convert.view_of(r) for r in live], keepable=keepable, target=policy.final(adopted))
        plan = res.UpdatePlan(
            new_version=rec.row.latest_version + 1,
            kept_replica_ids=p.kept,
            launch_count=p.launch,
            teardown_replica_ids=p.teardown,
            replaced_replica_ids=p.replaced,
            in_place=p.in_place,
        )
        if dry_run:
            return plan
        return await _apply_update(rec, new, plan, adopted, keepable, mode)


async def _apply_update(
    rec: ServiceReconciler, new: spec_pb2.ServiceSpec, plan: res.UpdatePlan, adopted: int, keepable: set[int], mode: int
) -> res.UpdatePlan:
    undo = rec.checkpoint()
    version = rec.row.latest_version + 1
    rec.specs[version] = new
    rec.book.version(version, new)
    mode = mode or res.UPDATE_MODE_ROLLING
    rec.row = dataclasses.replace(rec.row, latest_version=version, update_mode=mode, status_message="")
    rec.book.row(update_mode=mode, status_message="")
    rec.state.target = adopted
    rec.state.upscale_since = rec.state.downscale_since = None
    rec.state.reason = f"update to version {version}: target {adopted}"
    rec.state.decided_at = time.time()
    rec.save_state()
    for rid in keepable:
        r = rec.replicas.get(rid)
        if r is not None:
            r.version = version
            rec.touch(r)
    await rec.write_now(undo)
    rec.drive(rec.replicas)  # probe interval and threshold come from the latest version
    autoscaling.decide(rec)
    plan.new_version = version
    return plan


def autoscaler_candidate(rec: ServiceReconciler, policy: autoscaler.Policy) -> int:
    return autoscaler.candidate(policy, autoscaling.qps(rec, time.time()), list(rec.views.values()))


def _refuse(rec: ServiceReconciler, rid: int, decision: st.Termination, status: st.ReplicaStatus) -> None:
    subject = f"services/{rec.name}/replicas/{rid}"
    if decision is st.Termination.REFUSED_SHUTTING_DOWN:
        raise errors.FailedPreconditionError(
            f"replica {rid} of service {rec.name!r} is already shutting down",
            reason="REPLICA_SHUTTING_DOWN",
            subject=subject,
            service=rec.name,
            replica_id=rid,
        )
    raise errors.FailedPreconditionError(
        f"replica {rid} of service {rec.name!r} is {status.name}; terminating it could "
        "leak resources. Use purge to remove the record",
        reason="REPLICA_FAILED",
        subject=subject,
        service=rec.name,
        replica_id=rid,
    )


async def terminate_replica(rec: ServiceReconciler, rid: int, *, purge: bool) -> res.Replica:
    """Manual termination (spec.md section 4)."""
    rec.replica(rid)
    async with rec.api_lock:
        return await _terminate(rec, rid, purge=purge)


async def _terminate(rec: ServiceReconciler, rid: int, *, purge: bool) -> res.Replica:
    await rec.idle()
    r = rec.replica(rid)  # as stored: what the user saw
    status = convert.status_of(r)
    decision = st.termination(status, tearing_down=rid in rec.teardowns.tasks, purge=purge)
    if decision in (st.Termination.REFUSED_SHUTTING_DOWN, st.Termination.REFUSED_FAILED):
        _refuse(rec, rid, decision, status)
    undo = rec.checkpoint()
    if decision is st.Termination.PURGE:
        _purge(rec, rid)
    else:
        events.ask_teardown(
            rec, rid, drain_s=rec.tuning.drain_s, scale_down=True, purge=purge, reason="terminated by the user"
        )
    await rec.write_now(undo)
    return rec.shown.get(rid, rec.replicas.get(rid, r))


def _purge(rec: ServiceReconciler, rid: int) -> None:
    r = rec.replicas[rid]
    if r.facts.teardown_phase == TP.TEARDOWN_PHASE_SUCCEEDED:
        rec.remove(rid)
    else:
        # Cleanup failed or never ran: try once more; purge removes the record either way.
        events.ask_teardown(rec, rid, drain_s=0.0, purge=True, reason="purged")


async def purge_failed(rec: ServiceReconciler) -> list[int]:
    """Purge every failed replica record."""
    async with rec.api_lock:
        return await _purge_failed(rec)


async def _purge_failed(rec: ServiceReconciler) -> list[int]:
    await rec.idle()
    undo = rec.checkpoint()
    ids = [rid for rid, r in sorted(rec.replicas.items()) if convert.status_of(r) in st.FAILED_STATUSES]
    for rid in ids:
        _purge(rec, rid)
    await rec.write_now(undo)
    return ids


async def delete(rec: ServiceReconciler, *, purge: bool) -> None:
    """Tear every replica down without drain, then forget the service (spec.md section 9)."""
    async with rec.api_lock:
        await rec.idle()
        await _delete(rec, purge=purge)


async def _delete(rec: ServiceReconciler, *, purge: bool) -> None:
    row = rec.row
    if row.deleting and not purge and row.status != res.SERVICE_STATUS_FAILED_CLEANUP:
        raise errors.FailedPreconditionError(
            f"service {rec.name!r} is already shutting down",
            reason="SERVICE_SHUTTING_DOWN",
            subject=f"services/{rec.name}",
            service=rec.name,
        )
    await rec.idle()
    undo = rec.checkpoint()
    status = res.SERVICE_STATUS_SHUTTING_DOWN
    rec.row = dataclasses.replace(rec.row, deleting=True, status=status, status_message="")
    rec.book.row(deleting=True, status=status, status_message="")
    if rec.pool is not None:
        rec.pool.jobs.cancel_all()
    for rid, r in list(rec.replicas.items()):
        phase = r.facts.teardown_phase
        if rid in rec.teardowns.tasks or phase in (TP.TEARDOWN_PHASE_SCHEDULED, TP.TEARDOWN_PHASE_RUNNING):
            if purge and not r.facts.purged:
                events.ask_teardown(rec, rid, drain_s=0.0, purge=True, reason="purged")
            if r.facts.drain.ToNanoseconds() > 0 and rid in rec.teardowns.tasks:
                # A drain in progress (scale-down, manual stop) ends now: down never drains.
                rec.spawn(rec.teardowns.end_drain(r.replica_name), f"end drain of {r.replica_name}")
        elif phase == TP.TEARDOWN_PHASE_SUCCEEDED or (purge and phase == TP.TEARDOWN_PHASE_FAILED):
            rec.remove(rid)
        else:
            events.ask_teardown(rec, rid, drain_s=0.0, purge=purge, reason="service deleted")
    await rec.write_now(undo)
    rec.kick()  # with no replica, no teardown's end would: the service goes in this pass


def continue_delete(rec: ServiceReconciler) -> None:
    """A pass of a service being deleted: once no teardown is in motion, what is left either
    failed its cleanup (FAILED_CLEANUP) or is nothing (the service goes)."""
    if rec.teardowns.tasks or rec.gone:
        return
    for r in rec.replicas.values():
        if r.facts.teardown_phase in (TP.TEARDOWN_PHASE_SCHEDULED, TP.TEARDOWN_PHASE_RUNNING):
            return  # its driver starts once the batch is stored
    asked = False
    for rid, r in list(rec.replicas.items()):
        if r.facts.teardown_phase == TP.TEARDOWN_PHASE_UNSPECIFIED:
            events.ask_teardown(rec, rid, drain_s=0.0, reason="service deleted")
            asked = True
    if asked:
        return
    if rec.replicas:
        message = st.cleanup_message(rec.replicas)
        if rec.row.status != res.SERVICE_STATUS_FAILED_CLEANUP or rec.row.status_message != message:
            status = res.SERVICE_STATUS_FAILED_CLEANUP
            rec.row = dataclasses.replace(rec.row, status=status, status_message=message)
            rec.book.row(status=status, status_message=message)
        return
    rec.spawn(_finish_delete(rec), f"delete {rec.name}")


async def _finish_delete(rec: ServiceReconciler) -> None:
    if rec.gone or rec.finishing:
        return
    rec.finishing = True
    try:
        await rec.idle()
        if rec.pool is not None:  # every worker is gone, so every job has ended
            await pools.forget_logs(rec)
        await rec.deps.writer.submit(lambda db: db.delete_service(rec.name))
    except errors.UnavailableError:
        log.warning("%s: could not forget the deleted service yet; retrying", rec.name)
        rec.kick()
        return
    finally:
        rec.finishing = False
    rec.forget()

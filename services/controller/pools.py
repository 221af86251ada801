"""The pool side of a fleet: what makes a service record a pool at run time.

A pool is a fleet like a service, on the same controller core and store, with four differences,
all answered here so the core only asks:

- **Readiness.** A worker is READY when its launch ended with SETUP_DONE (setup exited 0); it
  is never probed (`ready_on_launch`, `probed`).
- **Size.** The job queue drives the target (`decide`, SkyPilot's queue-length rule through the
  up/downscale delays) and scale-down never removes a busy worker (`plan`).
- **Jobs.** `jobs` (a `jobs.PoolJobs`) queues and dispatches them; `on_replicas` tells it which
  workers are READY after every change, so a queued job starts the moment a worker is.
- **What is shown.** The kind, the job counts, and the job each worker runs (`show_service`,
  `show_replica`); no endpoint and no load balancer.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import grpc

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from services.common import errors, pbtime, spec
from services.controller import job_runs, jobs
from services.controller.domain import autoscaler, pool_scaling
from services.controller.domain import jobs as job_rules
from services.controller.domain import status as st

if TYPE_CHECKING:
    from services.controller.reconciler import ServiceReconciler

log = logging.getLogger(__name__)


def policy_of(parsed: spec_pb2.ServiceSpec) -> pool_scaling.PoolPolicy:
    """A pool spec's sizes and delays as plain values."""
    p = parsed.service.pool
    return pool_scaling.PoolPolicy(
        min_workers=p.min_workers,
        max_workers=max(p.max_workers, p.min_workers),
        queue_length_threshold=p.queue_length_threshold,
        upscale_delay_s=pbtime.seconds(p.upscale_delay),
        downscale_delay_s=pbtime.seconds(p.downscale_delay),
    )


def kind_of(parsed: spec_pb2.ServiceSpec) -> spec_pb2.FleetKind.ValueType:
    """POOL or SERVICE (specs stored before pools existed are services)."""
    return spec_pb2.FLEET_KIND_POOL if spec.is_pool(parsed) else spec_pb2.FLEET_KIND_SERVICE


class PoolSide:
    """One pool's jobs and sizing, called by the fleet's reconciler."""

    def __init__(
        self,
        name: str,
        uid: str,
        *,
        db: jobs.JobStore,
        provisioner: prov_grpc.ProvisionerServiceStub,
        on_change: Callable[[], None],
        max_recoveries: int = job_rules.MAX_RECOVERIES,
    ) -> None:
        self.name = name
        self.published_busy: dict[int, int] = {}
        self.jobs = jobs.PoolJobs(
            name, uid, db=db, provisioner=provisioner, on_change=on_change, max_recoveries=max_recoveries
        )

    # ---- readiness -----------------------------------------------------------------------

    @staticmethod
    def probed() -> bool:
        """Workers are never probed."""
        return False

    def on_replicas(self, replicas: Iterable[res.Replica]) -> None:
        """The workers after a change: READY ones take queued jobs at once."""
        self.jobs.set_workers(
            jobs.WorkerInfo(r.replica_id, r.replica_name, ready=r.status == res.REPLICA_STATUS_READY)
            for r in replicas
            if r.status not in (res.REPLICA_STATUS_UNSPECIFIED,) and not st.is_terminal(st.ReplicaStatus(r.status))
        )

    # ---- size ----------------------------------------------------------------------------

    def decide(
        self,
        parsed: spec_pb2.ServiceSpec,
        state: autoscaler.Hysteresis,
        now: float | None = None,
        *,
        interval_s: float = autoscaler.DECISION_INTERVAL_S,
        zero_interval_s: float = autoscaler.ZERO_DECISION_INTERVAL_S,
    ) -> autoscaler.Decision:
        """One sizing decision from the queue (see `pool_scaling.decide`)."""
        return pool_scaling.decide(
            policy_of(parsed),
            state,
            self.jobs.queued,
            time.time() if now is None else now,
            interval_s=interval_s,
            zero_interval_s=zero_interval_s,
        )

    def plan(
        self, views: list[st.ReplicaView], *, target: int, latest_version: int, stopped: bool
    ) -> pool_scaling.Plan:
        """Launches and teardowns toward `target`; busy workers are never torn down."""
        return pool_scaling.plan(
            views, set(self.jobs.busy()), target=target, latest_version=latest_version, stopped=stopped
        )

    # ---- what is shown -------------------------------------------------------------------

    def show_service(self, svc: res.Service) -> None:
        """Add the kind and the job counts; a pool has no endpoints and no load balancer."""
        svc.kind = spec_pb2.FLEET_KIND_POOL
        svc.queued_jobs = self.jobs.queued
        svc.running_jobs = self.jobs.running
        del svc.endpoints[:]
        svc.load_balancer_url = ""
        svc.autoscaler.kind = "queue_length"

    def show_replica(self, r: res.Replica) -> res.Replica:
        """The worker with the job it runs (0 when free)."""
        job = self.jobs.busy().get(r.replica_id, 0)
        if r.job_id == job:
            return r
        out = res.Replica()
        out.CopyFrom(r)
        out.job_id = job
        return out


# ---- the core's hooks: what a service loop asks its pool side ---------------------------------
# Each takes the loop (`rec`); `rec.pool` is None for a service, and each hook is then a no-op.


def attach(rec: ServiceReconciler) -> PoolSide | None:
    """The pool side of a new loop, when its spec is a pool (a service and a pool are never
    updates of each other, so the kind of version 1 is the kind for good)."""
    latest = rec.specs.get(rec.row.latest_version)
    if latest is None or not spec.is_pool(latest):
        return None
    return PoolSide(
        rec.name, rec.row.uid, db=rec.deps.reader, provisioner=rec.deps.provisioner, on_change=lambda: changed(rec)
    )


def check_update(rec: ServiceReconciler, parsed: spec_pb2.ServiceSpec) -> None:
    """Refuse an update that turns a service into a pool or a pool into a service.

    Raises:
        errors.ValidationError: naming `pool` (the new spec is a pool) or `service`.
    """
    if spec.is_pool(parsed) == (rec.pool is not None):
        return
    if rec.pool is None:
        field, why = "pool", f"{rec.name!r} is a service: a service cannot become a pool"
    else:
        field, why = "service", f"{rec.name!r} is a pool: a pool cannot become a service"
    raise errors.ValidationError(
        [errors.FieldViolation(field, why + "; delete it and create the new one")], subject="service spec"
    )


def changed(rec: ServiceReconciler) -> None:
    """The queue or a worker's job changed: decide the size again and publish."""
    from services.controller import autoscaling

    if rec.gone or rec.stopping or not rec.started:
        return
    autoscaling.decide(rec)
    rec.show()


def setup_done(rec: ServiceReconciler, rid: int, when: float) -> None:
    """A worker's setup exited 0: its launch is over and it is READY (no probe ever runs)."""
    from services.controller import events
    from services.controller.domain import lifecycle

    events.step(rec, rid, lifecycle.LaunchRunning(), changed=True)
    events.step(rec, rid, lifecycle.Probed(True, when, "", 0, True))
    if rec.row.uptime_start is None and rid in rec.replicas:  # the pool's uptime starts here
        rec.row = dataclasses.replace(rec.row, uptime_start=when)
        rec.book.row(uptime_start=when)


def decide(rec: ServiceReconciler, before: autoscaler.Hysteresis, now: float) -> autoscaler.Decision | None:
    """The pool's sizing decision, or None for a service."""
    if rec.pool is None:
        return None
    return rec.pool.decide(
        rec.spec(rec.row.latest_version),
        before,
        now,
        interval_s=rec.tuning.decision_interval_s,
        zero_interval_s=rec.tuning.zero_decision_interval_s,
    )


def plan(rec: ServiceReconciler, *, stopped: bool) -> pool_scaling.Plan | None:
    """The pool's plan of a pass, or None for a service."""
    if rec.pool is None:
        return None
    return rec.pool.plan(
        list(rec.views.values()),
        target=max(rec.state.target, 0),
        latest_version=rec.row.latest_version,
        stopped=stopped,
    )


def stored(rec: ServiceReconciler) -> None:
    """A batch is stored: the workers as stored now may take queued jobs."""
    if rec.pool is not None and not rec.row.deleting:
        rec.pool.on_replicas(rec.shown.values())


def shown(rec: ServiceReconciler, replicas: Iterable[res.Replica]) -> list[res.Replica]:
    """Records as the API shows them: a worker with the job it runs."""
    if rec.pool is None:
        return list(replicas)
    return [rec.pool.show_replica(r) for r in replicas]


def busy_changes(rec: ServiceReconciler, changed: list[res.Replica]) -> list[res.Replica]:
    """Workers whose job changed since the last publish, beside the records that changed."""
    if rec.pool is None:
        return changed
    busy = rec.pool.jobs.busy()
    last = rec.pool.published_busy
    rec.pool.published_busy = busy
    ids = {r.replica_id for r in changed}
    moved = {rid for rid in set(busy) | set(last) if busy.get(rid) != last.get(rid)} - ids
    extra = [rec.shown[rid] for rid in sorted(moved) if rid in rec.shown]
    return shown(rec, sorted([*changed, *extra], key=lambda r: r.replica_id))


async def forget_logs(rec: ServiceReconciler) -> None:
    """A deleted pool: stop following its jobs, and delete every worker's logs it ever had (its
    jobs' logs go with them; scaled-down workers kept theirs) and every job's."""
    if rec.pool is None:
        return
    await rec.pool.jobs.stop()
    uid = rec.row.uid
    for rid in range(1, rec.next_id):
        name = f"{rec.name}-{rid}-{uid}" if uid else f"{rec.name}-{rid}"
        try:
            await rec.deps.provisioner.DeleteLogs(prov_pb.DeleteLogsRequest(name=name), timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                log.info("could not delete the logs of worker %s: %s", name, exc.code().name)
    await job_runs.delete_logs(rec.pool.jobs)

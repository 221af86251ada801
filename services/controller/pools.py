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

import time
from collections.abc import Callable, Iterable

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from services.common import pbtime, spec
from services.controller import jobs
from services.controller.domain import autoscaler, pool_scaling
from services.controller.domain import jobs as job_rules
from services.controller.domain import status as st


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

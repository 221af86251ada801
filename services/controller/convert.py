"""Conversions between the stored protobuf records and the domain's plain types."""

from __future__ import annotations

from typing import Literal

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2
from services.common import pbtime
from services.common import spec as specs
from services.controller.domain import autoscaler, lifecycle, tally
from services.controller.domain import status as st


def facts_of(replica: resources_pb2.Replica) -> st.Facts:
    """The domain facts of a stored replica."""
    f = replica.facts
    return st.Facts(
        launch=st.LaunchPhase(f.launch_phase),
        teardown=st.TeardownPhase(f.teardown_phase),
        user_app_failed=f.user_app_failed,
        ready_now=f.ready_now,
        first_ready_time=pbtime.from_timestamp(f.first_ready_time) if f.HasField("first_ready_time") else None,
        initial_delay_exceeded=f.initial_delay_exceeded,
        is_scale_down=f.is_scale_down,
        preempted=f.preempted,
        purged=f.purged,
        failed_spot_availability=f.failed_spot_availability,
    )


_TimeField = Literal["first_ready_time", "first_failure_time", "streak_start_time", "streak_last_time"]


def _time(facts: resources_pb2.ReplicaFacts, field: _TimeField) -> float | None:
    return pbtime.from_timestamp(getattr(facts, field)) if facts.HasField(field) else None


def life_of(replica: resources_pb2.Replica, *, pending_exit: lifecycle.AppExited | None = None) -> lifecycle.Life:
    """The lifecycle facts of a stored replica; `pending_exit` is kept in memory only (the
    caller's)."""
    f = replica.facts
    return lifecycle.Life(
        launch=st.LaunchPhase(f.launch_phase),
        teardown=st.TeardownPhase(f.teardown_phase),
        user_app_failed=f.user_app_failed,
        ready_now=f.ready_now,
        first_ready_time=_time(f, "first_ready_time"),
        initial_delay_exceeded=f.initial_delay_exceeded,
        is_scale_down=f.is_scale_down,
        preempted=f.preempted,
        purged=f.purged,
        failed_spot_availability=f.failed_spot_availability,
        is_spot=replica.is_spot,
        first_failure_time=_time(f, "first_failure_time"),
        streak_start=_time(f, "streak_start_time"),
        streak_last=_time(f, "streak_last_time"),
        exit_code=f.exit_code,
        drain_s=pbtime.seconds(f.drain),
        failure_reason=replica.failure_reason,
        pending_exit=pending_exit,
    )


def put_life(replica: resources_pb2.Replica, life: lifecycle.Life) -> None:
    """Write lifecycle facts into a replica record (in place; the caller stores it)."""
    f = replica.facts
    f.launch_phase = int(life.launch)  # type: ignore[assignment]
    f.teardown_phase = int(life.teardown)  # type: ignore[assignment]
    f.user_app_failed = life.user_app_failed
    f.ready_now = life.ready_now
    f.initial_delay_exceeded = life.initial_delay_exceeded
    f.is_scale_down = life.is_scale_down
    f.preempted = life.preempted
    f.purged = life.purged
    f.failed_spot_availability = life.failed_spot_availability
    f.exit_code = life.exit_code
    times: tuple[tuple[_TimeField, float | None], ...] = (
        ("first_ready_time", life.first_ready_time),
        ("first_failure_time", life.first_failure_time),
        ("streak_start_time", life.streak_start),
        ("streak_last_time", life.streak_last),
    )
    for field, value in times:
        if value is None:
            f.ClearField(field)
        else:
            getattr(f, field).CopyFrom(pbtime.timestamp(value))
    f.drain.CopyFrom(pbtime.duration(life.drain_s))
    replica.failure_reason = life.failure_reason


def windows_of(replica_spec: spec_pb2.ServiceSpec, latest_spec: spec_pb2.ServiceSpec) -> lifecycle.Windows:
    """A replica's failure windows: the initial delay of its own version, the failure window of
    the latest (spec.md section 5)."""
    return lifecycle.Windows(
        initial_delay_s=pbtime.seconds(replica_spec.service.readiness_probe.initial_delay),
        failure_threshold_s=specs.failure_threshold_s(latest_spec),
    )


def status_of(replica: resources_pb2.Replica) -> st.ReplicaStatus:
    """The derived status of a stored replica."""
    return st.replica_status(facts_of(replica))


def view_of(replica: resources_pb2.Replica) -> st.ReplicaView:
    """What scaling rules need of a replica. Uses the status stored with the record, which every
    change refreshes, so large services do not re-derive it on each pass."""
    return st.ReplicaView(
        replica_id=replica.replica_id,
        version=replica.version,
        status=st.ReplicaStatus(replica.status),
        is_spot=replica.is_spot,
        accelerator=replica.accelerator,
    )


def tally_of(replicas: dict[int, resources_pb2.Replica]) -> tally.Views:
    """The views of these records, with their counts."""
    succeeded = resources_pb2.TEARDOWN_PHASE_SUCCEEDED
    return tally.Views((rid, view_of(r), r.facts.teardown_phase == succeeded) for rid, r in replicas.items())


def policy_of(spec: spec_pb2.ServiceSpec) -> autoscaler.Policy:
    """The autoscaler policy of a stored spec; a pool's sizes and delays for a pool (its target
    comes from its queue, see `pools.py`)."""
    if spec.kind == spec_pb2.FLEET_KIND_POOL:
        pool = spec.service.pool
        return autoscaler.Policy(
            min_replicas=pool.min_workers,
            max_replicas=max(pool.max_workers, pool.min_workers),
            upscale_delay_s=pbtime.seconds(pool.upscale_delay),
            downscale_delay_s=pbtime.seconds(pool.downscale_delay),
        )
    p = spec.service.replica_policy
    return autoscaler.Policy(
        min_replicas=p.min_replicas,
        max_replicas=max(p.max_replicas, p.min_replicas),
        target_qps=p.target_qps_per_replica,
        target_qps_per_accelerator=dict(p.target_qps_per_accelerator),
        upscale_delay_s=pbtime.seconds(p.upscale_delay),
        downscale_delay_s=pbtime.seconds(p.downscale_delay),
        num_overprovision=p.num_overprovision,
        use_spot=spec.resources.use_spot,
        base_ondemand=p.base_ondemand_fallback_replicas,
        dynamic_fallback=p.dynamic_ondemand_fallback,
        spot_placer=p.spot_placer == spec_pb2.SPOT_PLACER_DYNAMIC_FALLBACK,
    )


def places_of(spec: spec_pb2.ServiceSpec) -> list[tuple[str, tuple[str, str]]]:
    """(YAML path, (zone, region)) of each resources alternative: any_of/ordered entries, else the top.

    Entries already carry the top level's zone and region as defaults (spec parsing merges them).
    For Kubernetes the stored region is a context name, not a region, so it places nothing.
    """

    def place(r: spec_pb2.Resources) -> tuple[str, str]:
        return r.zone, "" if r.cloud == "kubernetes" else r.region

    r = spec.resources
    for kind in ("any_of", "ordered"):
        entries = getattr(r, kind)
        if entries:
            return [(f"resources.{kind}[{i}]", place(e)) for i, e in enumerate(entries)]
    return [("resources", place(r))]


def accelerator_of(spec: spec_pb2.ServiceSpec) -> str:
    """The accelerator name a replica of `spec` is expected to run on (the first choice of the
    first resources alternative, without count), or "". The provisioner's report of the one it
    placed replaces it (accelerator_name)."""
    r = spec.resources
    entries = r.any_of or r.ordered
    return accelerator_name(entries[0].accelerators if entries else r.accelerators)


def accelerator_name(text: str) -> str:
    """`A100` of `A100:2` (or of `A100:2,H100:1`, the first choice); "" for ""."""
    return text.split(",", 1)[0].split(":", 1)[0].strip()

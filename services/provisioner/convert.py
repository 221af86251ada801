"""Conversions between provisioner protos and the plain domain types."""

from __future__ import annotations

from google.protobuf import timestamp_pb2

from replicaplane.common.v1 import spec_pb2
from replicaplane.provisioner.v1 import provisioner_service_pb2 as service_pb2
from replicaplane.provisioner.v1 import resources_pb2
from services.common import pbtime
from services.provisioner import capability, model

_RECORDED_RESOURCES = (
    "cloud",
    "region",
    "zone",
    "cpus",
    "memory",
    "accelerators",
    "instance_type",
    "image_id",
)


def timestamp(seconds: float) -> timestamp_pb2.Timestamp | None:
    """A Timestamp for wall-clock `seconds`; None when unset (0)."""
    if not seconds:
        return None
    return pbtime.timestamp(seconds)


duration = pbtime.duration
seconds = pbtime.seconds


def _recorded(res: spec_pb2.Resources) -> dict[str, str]:
    """The hardware and placement fields of one set of resources, as text."""
    recorded = {f: str(getattr(res, f)) for f in _RECORDED_RESOURCES if getattr(res, f)}
    if res.disk_size:
        recorded["disk_size"] = str(res.disk_size)
    return recorded


def replica_spec(spec: spec_pb2.ServiceSpec) -> model.ReplicaSpec:
    """The parts of a ServiceSpec the provisioner runs, with every resources alternative."""
    res = spec.resources
    ports = tuple(res.ports)
    serving = spec.service.port or (ports[0] if ports else 0)
    if spec.kind == spec_pb2.FLEET_KIND_POOL:
        ports, serving = (), 0  # a worker serves nothing
    recorded = _recorded(res)
    kind = "any_of" if res.any_of else "ordered" if res.ordered else ""
    # Entries were merged with the top level when the spec was parsed: each is whole.
    entries = tuple(_recorded(e) for e in getattr(res, kind)) if kind else ()
    if kind:
        recorded[kind] = str(len(entries))
    return model.ReplicaSpec(
        setup=spec.setup,
        run=spec.run,
        envs=dict(spec.envs),
        secrets=dict(spec.secrets),
        workdir=spec.workdir,
        file_mounts=dict(spec.file_mounts),
        ports=ports,
        serving_port=serving,
        use_spot=res.use_spot,
        num_nodes=spec.num_nodes or 1,
        resources=recorded,
        alternatives=entries,
        alternatives_kind=kind,
        worker=spec.kind == spec_pb2.FLEET_KIND_POOL,
    )


def needs(spec: spec_pb2.ServiceSpec) -> capability.Needs:
    """What a spec asks of the backend, with the YAML path of each accelerator request."""
    res = spec.resources
    places: list[tuple[str, str]] = []
    entries = [("any_of", i, r) for i, r in enumerate(res.any_of)] + [
        ("ordered", i, r) for i, r in enumerate(res.ordered)
    ]
    # An entry without accelerators of its own inherits the top-level ones; one that asks for
    # none at all can always run.
    if entries and not res.accelerators and any(not r.accelerators for _, _, r in entries):
        entries = []
    # An entry without accelerators of its own inherits the top-level ones.
    if res.accelerators and (not entries or any(not r.accelerators for _, _, r in entries)):
        places.append(("resources.accelerators", res.accelerators))
    places += [(f"resources.{kind}[{i}].accelerators", r.accelerators) for kind, i, r in entries if r.accelerators]
    return capability.Needs(
        accelerators=tuple(places),
        alternatives=bool(entries),
        workdir=spec.workdir,
        file_mounts=tuple(sorted(spec.file_mounts.items())),
    )


def launch_request(req: service_pb2.LaunchRequest) -> model.LaunchRequest:
    """The domain launch request. `use_spot` of the request wins over the spec's."""
    return model.LaunchRequest(
        name=req.name,
        service=req.service,
        replica_id=req.replica_id,
        version=req.version,
        spec=replica_spec(req.spec),
        use_spot=req.use_spot,
        zone=req.zone,
        owner=req.owner,
    )


def replica(r: model.Replica) -> resources_pb2.ProvisionedReplica:
    """The proto of a replica."""
    return resources_pb2.ProvisionedReplica(
        name=r.name,
        service=r.service,
        replica_id=r.replica_id,
        version=r.version,
        state=resources_pb2.ReplicaState.Value(f"REPLICA_STATE_{r.state.value}"),
        app_state=resources_pb2.AppState.Value(f"APP_STATE_{r.app_state.value}"),
        endpoint=r.endpoint,
        zone=r.zone,
        is_spot=r.is_spot,
        exit_code=r.exit_code,
        attempt=r.attempt,
        failure_reason=r.failure_reason,
        backend=r.backend,
        create_time=timestamp(r.create_time),
        start_time=timestamp(r.start_time),
        price_per_hour=r.price_per_hour,
        owner=r.owner,
        accelerator=r.accelerator,
        resources_path=r.resources_path,
        worker=r.worker,
        job_id=r.job_id,
    )


def failure_cause(cause: model.FailureCause) -> resources_pb2.FailureCause.ValueType:
    """The proto enum of a failure cause."""
    return resources_pb2.FailureCause.Value(f"FAILURE_CAUSE_{cause.value}")


def launch_event(e: model.LaunchEvent) -> service_pb2.LaunchResponse:
    """The response carrying a launch event."""
    return service_pb2.LaunchResponse(
        event=resources_pb2.LaunchEvent(
            sequence=e.sequence,
            time=timestamp(e.time),
            type=resources_pb2.LaunchEventType.Value(f"LAUNCH_EVENT_TYPE_{e.type.value}"),
            attempt=e.attempt,
            message=e.message,
            retry_delay=duration(e.retry_delay_s) if e.retry_delay_s else None,
            endpoint=e.endpoint,
            replica=replica(e.replica),
            permanent=e.permanent,
            capacity_unavailable=e.capacity_unavailable,
            cause=failure_cause(e.cause),
        )
    )


def terminate_event(e: model.TerminateEvent) -> service_pb2.TerminateResponse:
    """The response carrying a teardown event."""
    return service_pb2.TerminateResponse(
        event=resources_pb2.TerminateEvent(
            sequence=e.sequence,
            time=timestamp(e.time),
            type=resources_pb2.TerminateEventType.Value(f"TERMINATE_EVENT_TYPE_{e.type.value}"),
            message=e.message,
            delay=duration(e.delay_s) if e.delay_s else None,
            attempt=e.attempt,
        )
    )


def replica_event(e: model.ReplicaEvent) -> service_pb2.WatchReplicasResponse:
    """The response carrying a watch event."""
    return service_pb2.WatchReplicasResponse(
        event=resources_pb2.ReplicaEvent(
            sequence=e.sequence,
            time=timestamp(e.time),
            type=resources_pb2.ReplicaEventType.Value(f"REPLICA_EVENT_TYPE_{e.type.value}"),
            replica=replica(e.replica) if e.replica else None,
            message=e.message,
            cause=failure_cause(e.cause),
        )
    )


def zone(z: model.Zone, now: float) -> resources_pb2.Zone:
    """The proto of a zone at time `now`."""
    refusing = z.refusing(now)
    return resources_pb2.Zone(
        name=z.name,
        price_per_hour=z.price_per_hour,
        refusing_launches=refusing,
        refuse_until_time=timestamp(z.refuse_until) if refusing else None,
    )


def log_kind(kind: int) -> model.LogKind:
    """The log a StreamLogs request names; unspecified means the app output."""
    if kind == resources_pb2.LOG_KIND_LAUNCH:
        return model.LogKind.LAUNCH
    return model.LogKind.JOB if kind == resources_pb2.LOG_KIND_JOB else model.LogKind.APP


def job_request(req: service_pb2.RunJobRequest) -> model.JobRequest:
    """The domain job request."""
    return model.JobRequest(job_id=req.job_id, replica=req.replica, run=req.run, envs=dict(req.envs))


def job(j: model.Job) -> resources_pb2.ProvisionedJob:
    """The proto of a job."""
    return resources_pb2.ProvisionedJob(
        job_id=j.job_id,
        replica=j.replica,
        service=j.service,
        state=resources_pb2.JobState.Value(f"JOB_STATE_{j.state.value}"),
        exit_code=j.exit_code,
        failure_reason=j.failure_reason,
        cause=failure_cause(j.cause),
        create_time=timestamp(j.create_time),
        start_time=timestamp(j.start_time),
        end_time=timestamp(j.end_time),
    )


def job_event(e: model.JobEvent) -> service_pb2.RunJobResponse:
    """The response carrying a job event."""
    return service_pb2.RunJobResponse(
        event=resources_pb2.JobEvent(
            sequence=e.sequence,
            time=timestamp(e.time),
            type=resources_pb2.JobEventType.Value(f"JOB_EVENT_TYPE_{e.type.value}"),
            job=job(e.job),
            message=e.message,
            exit_code=e.exit_code,
            cause=failure_cause(e.cause),
        )
    )

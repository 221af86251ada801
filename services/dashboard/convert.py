"""Controller messages to the fleet's plain values."""

from __future__ import annotations

from typing import Any

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import watchlines
from services.dashboard import fleet


def _ms(message: Any, field: str) -> int | None:
    return int(getattr(message, field).ToMilliseconds()) if message.HasField(field) else None


def replica_info(replica: res.Replica) -> fleet.ReplicaInfo:
    """One replica."""
    return fleet.ReplicaInfo(
        replica_id=replica.replica_id,
        status=watchlines.enum_label(res.ReplicaStatus, replica.status, "REPLICA_STATUS_"),
        version=replica.version,
        endpoint=replica.endpoint,
        failure_reason=replica.failure_reason,
        zone=replica.zone,
        is_spot=replica.is_spot,
        create_ms=_ms(replica, "create_time"),
        launch_ms=_ms(replica, "launch_time"),
        first_ready_ms=_ms(replica.facts, "first_ready_time"),
        streak_start_ms=_ms(replica.facts, "streak_start_time"),
    )


def service_info(service: res.Service) -> fleet.ServiceInfo:
    """One service (its spec is left out: the page shows where it stands, not what it runs)."""
    scaler = service.autoscaler
    return fleet.ServiceInfo(
        name=service.name,
        uid=service.uid,
        status=watchlines.enum_label(res.ServiceStatus, service.status, "SERVICE_STATUS_"),
        message=service.status_message,
        ready=service.ready_replicas,
        total=service.total_replicas,
        target=service.target_replicas,
        active_versions=list(service.active_versions),
        latest_version=service.latest_version,
        load_balancer_url=service.load_balancer_url,
        endpoints=[e.url for e in sorted(service.endpoints, key=lambda e: e.replica_id)],
        probing_stale=service.probing_stale,
        autoscaler={
            "kind": scaler.kind,
            "target": scaler.target_replicas,
            "min": scaler.min_replicas,
            "max": scaler.max_replicas,
            "qps": round(scaler.qps, 3),
            "reason": scaler.last_decision_reason,
        },
        create_ms=_ms(service, "create_time"),
        uptime_start_ms=_ms(service, "uptime_start_time"),
    )


def change(message: api.WatchServiceResponse) -> fleet.Change:
    """One WatchService message."""
    return fleet.Change(
        service=service_info(message.service),
        replicas=[replica_info(r) for r in message.replicas],
        removed=list(message.removed_replica_ids),
        snapshot=message.snapshot,
        deleted=message.deleted,
    )

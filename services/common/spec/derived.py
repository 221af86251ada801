"""Answers read off a parsed spec: service or pool, the probe's method and body, the failure
window, and which autoscaling applies."""

from __future__ import annotations

from replicaplane.common.v1 import spec_pb2
from services.common import pbtime


def is_pool(spec: spec_pb2.ServiceSpec) -> bool:
    """Returns True when the spec is a pool (workers running jobs), False for a service."""
    return spec.kind == spec_pb2.FLEET_KIND_POOL


def failure_threshold_s(spec: spec_pb2.ServiceSpec) -> float:
    """Returns how long a once-READY replica may be unavailable before it is replaced, in seconds.

    A pool's `failure_threshold_seconds` (default 10 s); a service's readiness probe
    `consecutive_failure_threshold_timeout` (default 180 s).
    """
    if is_pool(spec):
        return pbtime.seconds(spec.service.pool.failure_threshold)
    return pbtime.seconds(spec.service.readiness_probe.consecutive_failure_threshold)


def probe_method_and_body(spec: spec_pb2.ServiceSpec) -> tuple[str, str]:
    """Returns the readiness probe's HTTP method and JSON body.

    Args:
        spec: A parsed spec.

    Returns:
        ("POST", json_text) when the spec has `post_data`, else ("GET", "").
    """
    body = spec.service.readiness_probe.post_data_json
    return ("POST", body) if body else ("GET", "")


def uses_ondemand_fallback(spec: spec_pb2.ServiceSpec) -> bool:
    """Returns True when spot replicas get on-demand fallback (base > 0 or dynamic)."""
    policy = spec.service.replica_policy
    return policy.dynamic_ondemand_fallback or policy.base_ondemand_fallback_replicas > 0


def is_autoscaling(spec: spec_pb2.ServiceSpec) -> bool:
    """Returns True when the replica (or worker) count can move between its min and max."""
    if is_pool(spec):
        return spec.service.pool.max_workers > spec.service.pool.min_workers
    policy = spec.service.replica_policy
    return policy.max_replicas > policy.min_replicas


def autoscaler_kind(spec: spec_pb2.ServiceSpec) -> str:
    """Returns which autoscaler a spec selects, in SkyPilot's order (reference 8.1).

    Args:
        spec: A parsed spec.

    Returns:
        "queue_length" (a pool: sized by its job queue, fixed-size pools too), "fallback"
        (spot with on-demand fallback), "instance_aware" (per-accelerator QPS targets) or
        "request_rate" (also used for fixed-size services).
    """
    if is_pool(spec):
        return "queue_length"
    if uses_ondemand_fallback(spec):
        return "fallback"
    if spec.service.replica_policy.target_qps_per_accelerator:
        return "instance_aware"
    return "request_rate"

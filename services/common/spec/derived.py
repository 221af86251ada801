"""Answers read off a parsed spec: the probe's method and body, and which autoscaling applies."""

from __future__ import annotations

from replicaplane.common.v1 import spec_pb2


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
    """Returns True when the replica count can move between min and max replicas."""
    policy = spec.service.replica_policy
    return policy.max_replicas > policy.min_replicas


def autoscaler_kind(spec: spec_pb2.ServiceSpec) -> str:
    """Returns which autoscaler a spec selects, in SkyPilot's order (reference 8.1).

    Args:
        spec: A parsed spec.

    Returns:
        "fallback" (spot with on-demand fallback), "instance_aware" (per-accelerator QPS
        targets) or "request_rate" (also used for fixed-size services).
    """
    if uses_ondemand_fallback(spec):
        return "fallback"
    if spec.service.replica_policy.target_qps_per_accelerator:
        return "instance_aware"
    return "request_rate"

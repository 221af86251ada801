"""The `service` section: replica count or policy, load balancing, serving port, spot fallback.

The readiness probe has its own module (`probe`); the serving port is checked against the
resources in `resources.serving_port`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replicaplane.common.v1 import spec_pb2
from services.common import pbtime
from services.common.spec import checks, probe, resources, rollout, schema

_POLICY = "service.replica_policy"


def parse(c: checks.Checker, service: dict[Any, Any], out: spec_pb2.ServiceSection, *, on_demand: bool) -> int | None:
    """Fills `out` from the service section.

    Args:
        c: The violation collector.
        service: The loaded section.
        out: The message to fill.
        on_demand: True if some readable resources alternative is not spot; fallback and spot
            placement are then refused.

    Returns:
        The `service.ports` value if given and valid.
    """
    c.keys(service, "service", schema.SERVICE_KEYS, schema.UNSUPPORTED_SERVICE)
    probe.parse(c, service.get("readiness_probe"), out.readiness_probe)

    lb = c.mapping(service.get("load_balancer"), "service.load_balancer")
    if lb is not None:
        c.keys(lb, "service.load_balancer", schema.LB_KEYS, {})
        out.load_balancer.stream_timeout.CopyFrom(
            c.seconds(
                lb, "stream_timeout_seconds", "service.load_balancer", schema.DEFAULT_LB_STREAM_TIMEOUT_S, positive=True
            )
        )

    rollout.parse(c, service.get("rollout"), out.rollout)

    policy_name = service.get("load_balancing_policy")
    out.load_balancing_policy = schema.DEFAULT_LOAD_BALANCING_POLICY
    policy_ok = True
    if policy_name is not None:
        chosen = c.choice(policy_name, "service.load_balancing_policy", schema.LOAD_BALANCING_POLICIES)
        policy_ok = chosen is not None
        if chosen is not None:
            out.load_balancing_policy = spec_pb2.LoadBalancingPolicy.ValueType(chosen)

    target_is_dict, target_ok = _parse_replicas(c, service, out)

    # A per-accelerator target goes with instance-aware least load, and only with it.
    instance_aware = spec_pb2.LOAD_BALANCING_POLICY_INSTANCE_AWARE_LEAST_LOAD
    if policy_ok and target_ok:
        if target_is_dict and out.load_balancing_policy != instance_aware:
            c.add(
                "service.load_balancing_policy",
                "must be instance_aware_least_load when target_qps_per_replica is a per-accelerator mapping",
            )
        if out.load_balancing_policy == instance_aware and not target_is_dict:
            c.add(
                f"{_POLICY}.target_qps_per_replica",
                "instance_aware_least_load needs a per-accelerator mapping, for example {A100: 5, 'H100:1': 10}",
            )

    # Fallback replicas and spot placement only make sense on spot capacity.
    if on_demand:
        policy = out.replica_policy
        spot_only = {
            "base_ondemand_fallback_replicas": policy.base_ondemand_fallback_replicas > 0,
            "dynamic_ondemand_fallback": policy.dynamic_ondemand_fallback,
            "spot_placer": policy.spot_placer != spec_pb2.SPOT_PLACER_UNSPECIFIED,
        }
        for key, used in spot_only.items():
            if used:
                c.add(f"{_POLICY}.{key}", "requires use_spot: true in resources (every any_of/ordered entry included)")

    raw_port = service.get("ports")
    if raw_port is None:
        return None
    return resources.port_value(c, raw_port, "service.ports")


def _parse_replicas(c: checks.Checker, service: dict[Any, Any], out: spec_pb2.ServiceSection) -> tuple[bool, bool]:
    """Fills the replica policy; returns (target is a per-accelerator dict, target parsed ok)."""
    policy = out.replica_policy
    policy.min_replicas = schema.DEFAULT_MIN_REPLICAS
    policy.max_replicas = schema.DEFAULT_MIN_REPLICAS
    policy.upscale_delay.CopyFrom(pbtime.duration(schema.DEFAULT_UPSCALE_DELAY_S))
    policy.downscale_delay.CopyFrom(pbtime.duration(schema.DEFAULT_DOWNSCALE_DELAY_S))

    raw_replicas = service.get("replicas")
    raw_policy = service.get("replica_policy")
    if raw_replicas is not None and raw_policy is not None:
        c.add("service.replicas", "replicas and replica_policy are mutually exclusive; use one of them")
    if raw_replicas is not None:
        count = c.replica_count(raw_replicas, "service.replicas")
        out.fixed_replicas_shorthand = True
        if count is not None:
            policy.min_replicas = policy.max_replicas = count
    if raw_policy is None:
        return False, True
    section = c.mapping(raw_policy, _POLICY)
    if section is None:
        return False, False
    c.keys(section, _POLICY, schema.POLICY_KEYS, {})

    def read_int(key: str) -> int | None:
        return None if section.get(key) is None else c.replica_count(section[key], f"{_POLICY}.{key}")

    min_replicas = read_int("min_replicas")
    if section.get("min_replicas") is None:
        c.add(f"{_POLICY}.min_replicas", "required inside replica_policy")
    max_replicas = read_int("max_replicas")
    has_max = section.get("max_replicas") is not None
    for key in ("num_overprovision", "base_ondemand_fallback_replicas"):
        value = read_int(key)
        if value is not None:
            setattr(policy, key, value)
    if section.get("dynamic_ondemand_fallback") is not None:
        flag = c.boolean(section["dynamic_ondemand_fallback"], f"{_POLICY}.dynamic_ondemand_fallback")
        policy.dynamic_ondemand_fallback = bool(flag)
    if section.get("spot_placer") is not None:
        placer = c.choice(section["spot_placer"], f"{_POLICY}.spot_placer", schema.SPOT_PLACERS)
        if placer is not None:
            policy.spot_placer = spec_pb2.SpotPlacer.ValueType(placer)
    policy.upscale_delay.CopyFrom(c.seconds(section, "upscale_delay_seconds", _POLICY, schema.DEFAULT_UPSCALE_DELAY_S))
    policy.downscale_delay.CopyFrom(
        c.seconds(section, "downscale_delay_seconds", _POLICY, schema.DEFAULT_DOWNSCALE_DELAY_S)
    )

    raw_target = section.get("target_qps_per_replica")
    target_is_dict, target_ok = isinstance(raw_target, Mapping), True
    if raw_target is not None:
        target_ok = _target_qps(c, raw_target, f"{_POLICY}.target_qps_per_replica", policy)

    # Only a policy the replicas shorthand did not already fill is applied.
    if raw_replicas is None and min_replicas is not None:
        policy.min_replicas = min_replicas
        policy.max_replicas = max_replicas if max_replicas is not None else min_replicas
    if min_replicas is not None and max_replicas is not None and max_replicas < min_replicas:
        c.add(f"{_POLICY}.max_replicas", f"must be >= min_replicas ({min_replicas}), got {max_replicas}")
    if raw_target is not None and not has_max:
        c.add(f"{_POLICY}.max_replicas", "required when target_qps_per_replica is set")
    if raw_target is None and min_replicas is not None and max_replicas is not None and max_replicas > min_replicas:
        c.add(
            f"{_POLICY}.target_qps_per_replica",
            "required when max_replicas exceeds min_replicas (it turns on autoscaling)",
        )
    return target_is_dict, target_ok


def _target_qps(c: checks.Checker, raw: Any, path: str, policy: spec_pb2.ReplicaPolicy) -> bool:
    """Reads a QPS target: one number, or a mapping of accelerator to number; False if bad."""
    if not isinstance(raw, Mapping):
        number = c.number(raw, path, positive=True)
        if number is None:
            return False
        policy.target_qps_per_replica = number
        return True
    if not raw:
        c.add(path, "a per-accelerator mapping must not be empty")
        return False
    ok = True
    for key, value in raw.items():
        if not isinstance(key, str) or not schema.ACCELERATOR_RE.fullmatch(key.strip()):
            c.add(path, "keys must be accelerator names such as 'A100' or 'H100:1'")
            ok = False
            continue
        number = c.number(value, f"{path}.{checks.short(key)}", positive=True)
        if number is None:
            ok = False
        else:
            policy.target_qps_per_accelerator[key.strip()] = number
    return ok

"""The `pool:` section: a fleet of workers that run jobs instead of serving HTTP.

A pool is written as a top-level `pool:` (SkyPilot's `sky jobs pool` form) or inside the service
section as `service: {pool: ...}` (the form SkyPilot wraps it into). Its workers have no port, no
endpoint, no readiness probe and no load balancer, so every serving setting is refused, each with
the reason and the field to fix. Sizes and delays follow SkyPilot's rules (reference 2.1-2.3):

- `workers: N` is a fixed size; `min_workers` + `max_workers` a range scaled on the job queue.
  `workers` with `max_workers` starts at `workers` (SkyPilot reads it as the minimum), and
  `max_workers` alone starts at 1.
- `queue_length_threshold` (default 1) and the up/downscale delays only drive autoscaling, so
  they need `max_workers`.
- `failure_threshold_seconds` (a Replicaplane name; SkyPilot has a fixed 10 s for pools) is how
  long a READY worker may be unavailable before it is replaced.
"""

from __future__ import annotations

from typing import Any

from replicaplane.common.v1 import spec_pb2
from services.common import pbtime
from services.common.spec import checks, resources, schema

_SIZE = "a pool is sized with workers, or min_workers and max_workers"
_NO_TRAFFIC = "a pool's workers run jobs and serve no traffic"
_NOT_PROBED = "a worker is ready when its setup exits 0; it is never probed"
_NO_FALLBACK = "spot fallback and placement are not supported for a pool"

# Serving and replica-policy keys, refused in a pool (in `pool:` itself, and beside it in the
# `service: {pool: ...}` form), each with why.
REFUSED = {
    "replicas": _SIZE,
    "replica_policy": _SIZE + "; replica_policy (QPS targets, overprovision, spot fallback) does not apply",
    "min_replicas": "use min_workers",
    "max_replicas": "use max_workers",
    "target_qps_per_replica": "a pool scales on its job queue (queue_length_threshold), not on QPS",
    "num_overprovision": "overprovisioning is not supported for a pool",
    "base_ondemand_fallback_replicas": _NO_FALLBACK,
    "dynamic_ondemand_fallback": _NO_FALLBACK,
    "spot_placer": _NO_FALLBACK,
    "load_balancing_policy": _NO_TRAFFIC + ": no load balancer is started",
    "load_balancer": _NO_TRAFFIC + ": no load balancer is started",
    "ports": _NO_TRAFFIC + ": workers open no port",
    "readiness_probe": _NOT_PROBED,
    "post_data": _NOT_PROBED,
    "headers": _NOT_PROBED,
    "tls": _NO_TRAFFIC,
    "rollout": "a pool has no traffic to shift: an update replaces its workers (rolling)",
}
# Keys beside `pool` in the `service: {pool: ...}` form.
REFUSED_BESIDE = {**REFUSED, "workers": "give the size inside the pool section: pool: {workers: N}"}


def parse(c: checks.Checker, raw: Any, path: str, out: spec_pb2.PoolPolicy) -> None:
    """Fills `out` from the loaded pool section (`path` is `pool` or `service.pool`).

    Args:
        c: The violation collector.
        raw: The loaded section (None reads as empty).
        path: Where the section is, for violations.
        out: The message to fill, defaults included.
    """
    out.upscale_delay.CopyFrom(pbtime.duration(schema.DEFAULT_UPSCALE_DELAY_S))
    out.downscale_delay.CopyFrom(pbtime.duration(schema.DEFAULT_DOWNSCALE_DELAY_S))
    out.failure_threshold.CopyFrom(pbtime.duration(schema.DEFAULT_POOL_FAILURE_THRESHOLD_S))
    section = c.mapping(raw, path)
    if section is None:
        return
    c.keys(section, path, schema.POOL_KEYS, REFUSED)

    def given(key: str) -> bool:
        return section.get(key) is not None

    def count(key: str) -> int | None:
        return c.replica_count(section[key], f"{path}.{key}") if given(key) else None

    workers, low, high = count("workers"), count("min_workers"), count("max_workers")
    if not any(given(k) for k in ("workers", "min_workers", "max_workers")):
        c.add(path, "one of workers, or min_workers and max_workers, is required")
    if given("workers") and given("min_workers"):
        c.add(f"{path}.workers", "workers and min_workers are mutually exclusive: workers is a fixed size")
    if given("min_workers") and not given("max_workers"):
        c.add(f"{path}.max_workers", "required with min_workers")
    minimum = low if low is not None else workers if workers is not None else schema.DEFAULT_MIN_REPLICAS
    if high is not None and high < minimum:
        which = "min_workers" if low is not None else "workers" if workers is not None else "the default min_workers"
        c.add(f"{path}.max_workers", f"must be >= {which} ({minimum}), got {high}")
    out.min_workers = minimum
    out.max_workers = high if high is not None else minimum
    out.fixed_workers_shorthand = given("workers") and not given("max_workers")

    autoscaled = given("max_workers")
    for key in ("queue_length_threshold", "upscale_delay_seconds", "downscale_delay_seconds"):
        if given(key) and not autoscaled:
            c.add(f"{path}.{key}", "only applies to an autoscaling pool: set max_workers")
    if autoscaled:
        out.queue_length_threshold = schema.DEFAULT_QUEUE_LENGTH_THRESHOLD
        if given("queue_length_threshold"):
            threshold = c.integer(section["queue_length_threshold"], f"{path}.queue_length_threshold", minimum=1)
            if threshold is not None:
                out.queue_length_threshold = threshold
        out.upscale_delay.CopyFrom(c.seconds(section, "upscale_delay_seconds", path, schema.DEFAULT_UPSCALE_DELAY_S))
        out.downscale_delay.CopyFrom(
            c.seconds(section, "downscale_delay_seconds", path, schema.DEFAULT_DOWNSCALE_DELAY_S)
        )
    out.failure_threshold.CopyFrom(
        c.seconds(section, "failure_threshold_seconds", path, schema.DEFAULT_POOL_FAILURE_THRESHOLD_S)
    )


def check_resources(c: checks.Checker, section: Any, alternatives: list[resources.Alternative]) -> None:
    """Refuses what a pool's resources may not ask for: ports, and ordered alternatives.

    Args:
        c: The violation collector.
        section: The loaded `resources` section (anything; only a mapping is looked into).
        alternatives: What `resources.parse` returned.
    """
    if not isinstance(section, dict):
        return
    if section.get("ordered") is not None:
        c.add("resources.ordered", "ordered resources are not supported for a pool (as SkyPilot); use any_of")
    why = "a pool's workers open no port: jobs talk to nothing through the pool"
    if section.get("ports") is not None:
        c.add("resources.ports", why)
    for alt in alternatives:
        if alt.path != "resources" and "ports" in alt.given:
            c.add(f"{alt.path}.ports", why)

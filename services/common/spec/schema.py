"""What a spec may say: the accepted keys per section, the SkyPilot keys refused (with why),
defaults, input limits and the accepted names of enum values. docs/spec.md is the prose.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from replicaplane.common.v1 import spec_pb2

# Defaults, as SkyPilot's (reference section 2.2).
DEFAULT_READINESS_PATH = "/"
DEFAULT_INITIAL_DELAY_S = 1200.0
DEFAULT_PROBE_TIMEOUT_S = 15.0
DEFAULT_PROBE_INTERVAL_S = 10.0
DEFAULT_CONSECUTIVE_FAILURE_THRESHOLD_S = 180.0
DEFAULT_MIN_REPLICAS = 1
DEFAULT_UPSCALE_DELAY_S = 300.0
DEFAULT_DOWNSCALE_DELAY_S = 1200.0
DEFAULT_LB_STREAM_TIMEOUT_S = 120.0
DEFAULT_LOAD_BALANCING_POLICY = spec_pb2.LOAD_BALANCING_POLICY_LEAST_LOAD
# Pools (reference 2.2 and 11): a queued job per worker grows the pool, and a READY worker that
# stops being available is replaced after 10 s.
DEFAULT_QUEUE_LENGTH_THRESHOLD = 1
DEFAULT_POOL_FAILURE_THRESHOLD_S = 10.0

# Rollout defaults: a rollout that is not READY in 10 minutes fails, a failed one goes back, and a
# new version fails with 5 points more errors than the stable one over 30 s and 20 requests.
DEFAULT_PROGRESS_DEADLINE_S = 600.0
DEFAULT_CANARY_STEPS = ((10, 60.0), (50, 60.0))
DEFAULT_STEP_PAUSE_S = 60.0
DEFAULT_MAX_ERROR_RATE_INCREASE_PCT = 5.0
DEFAULT_ANALYSIS_WINDOW_S = 30.0
DEFAULT_ANALYSIS_MIN_REQUESTS = 20
MAX_ANALYSIS_WINDOW_S = 3600.0

# Input limits: a spec is a small document; these stop accidental or hostile giants.
MAX_YAML_BYTES = 1 << 20
MAX_EXPANDED_NODES = 100_000
MAX_NAME_LEN = 63
MAX_REPLICAS_PER_SERVICE = 1000
# A readiness probe body nests a few levels; deeper ones only exhaust the JSON codec's stack.
MAX_POST_DATA_DEPTH = 64
INT32_MAX = 2**31 - 1
# The largest value a google.protobuf.Duration can hold.
MAX_DURATION_S = 315_576_000_000

SERVICE_NAME_RE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# An accelerator with an optional count: "A100", "H100:8", "tpu-v4:0.5".
ACCELERATOR_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.\-]*)(?::(\d+(?:\.\d*)?|\.\d+))?")

LOAD_BALANCING_POLICIES = {
    "round_robin": spec_pb2.LOAD_BALANCING_POLICY_ROUND_ROBIN,
    "least_load": spec_pb2.LOAD_BALANCING_POLICY_LEAST_LOAD,
    "instance_aware_least_load": spec_pb2.LOAD_BALANCING_POLICY_INSTANCE_AWARE_LEAST_LOAD,
}
SPOT_PLACERS = {"dynamic_fallback": spec_pb2.SPOT_PLACER_DYNAMIC_FALLBACK}
ROLLOUT_STRATEGIES = {
    "rolling": spec_pb2.ROLLOUT_STRATEGY_ROLLING,
    "blue_green": spec_pb2.ROLLOUT_STRATEGY_BLUE_GREEN,
    "canary": spec_pb2.ROLLOUT_STRATEGY_CANARY,
}

# Keys per section. A key in an `UNSUPPORTED_*` table is a SkyPilot key Replicaplane rejects
# with the reason given; any other key outside the accepted set is "unknown".
TOP_KEYS = frozenset(
    {"name", "workdir", "setup", "run", "envs", "secrets", "file_mounts", "resources", "service", "pool", "num_nodes"}
)
SERVICE_KEYS = frozenset(
    {"readiness_probe", "replica_policy", "replicas", "load_balancing_policy", "ports", "load_balancer", "rollout"}
)
PROBE_KEYS = frozenset(
    {
        "path",
        "initial_delay_seconds",
        "timeout_seconds",
        "endpoint_probe_interval_seconds",
        "consecutive_failure_threshold_timeout",
        "post_data",
        "headers",
    }
)
POLICY_KEYS = frozenset(
    {
        "min_replicas",
        "max_replicas",
        "target_qps_per_replica",
        "upscale_delay_seconds",
        "downscale_delay_seconds",
        "num_overprovision",
        "base_ondemand_fallback_replicas",
        "dynamic_ondemand_fallback",
        "spot_placer",
    }
)
POOL_KEYS = frozenset(
    {
        "workers",
        "min_workers",
        "max_workers",
        "queue_length_threshold",
        "upscale_delay_seconds",
        "downscale_delay_seconds",
        "failure_threshold_seconds",
    }
)
LB_KEYS = frozenset({"stream_timeout_seconds"})
ROLLOUT_KEYS = frozenset({"strategy", "steps", "progress_deadline_seconds", "auto_rollback", "analysis"})
ROLLOUT_STEP_KEYS = frozenset({"weight", "pause_seconds"})
ROLLOUT_ANALYSIS_KEYS = frozenset(
    {"max_error_rate_increase_pct", "window_seconds", "min_requests", "max_latency_p99_ratio"}
)
RESOURCE_KEYS = frozenset(
    {
        "ports",
        "use_spot",
        "cpus",
        "memory",
        "accelerators",
        "cloud",
        "region",
        "zone",
        "infra",
        "instance_type",
        "disk_size",
        "image_id",
        "labels",
        "any_of",
        "ordered",
    }
)
# The keys an any_of/ordered entry may set: everything but the lists themselves.
RESOURCE_ENTRY_KEYS = RESOURCE_KEYS - {"any_of", "ordered"}

_JOB_RECOVERY = "job_recovery is not allowed for services: preempted replicas are replaced by the autoscaler"
_VOLUMES = "volumes are not supported; use file_mounts"
UNSUPPORTED_TOP = {
    "event_callback": "event callbacks are not supported",
    "inputs": "optimizer hints (inputs) are not supported",
    "outputs": "optimizer hints (outputs) are not supported",
    "volumes": _VOLUMES,
    "config": "per-task SkyPilot config overrides are not supported",
    "job_recovery": _JOB_RECOVERY,
    "rollout": "rollout: belongs in the service: section (service.rollout)",
}
UNSUPPORTED_SERVICE = {
    "workers": "workers sizes a pool (pool: {workers: N}, which runs jobs); a service uses replicas",
    "tls": "TLS termination is not supported; terminate TLS at your load balancer or ingress",
}
UNSUPPORTED_RESOURCES = {
    "job_recovery": _JOB_RECOVERY,
    "spot_recovery": _JOB_RECOVERY,
    "disk_tier": "disk_tier is not supported",
    "network_tier": "network_tier is not supported",
    "accelerator_args": "accelerator_args is not supported",
    "autostop": "autostop does not apply to service replicas",
    "priority": "priority is not supported",
    "volumes": _VOLUMES,
}
UNSUPPORTED_RESOURCE_ENTRY = {
    **UNSUPPORTED_RESOURCES,
    "any_of": "entries cannot nest any_of",
    "ordered": "entries cannot nest ordered",
}

# Exported for callers that want to branch on the accepted keys (docs, CLI completion).
ACCEPTED_KEYS: Mapping[str, frozenset[str]] = {
    "": TOP_KEYS,
    "service": SERVICE_KEYS,
    "service.readiness_probe": PROBE_KEYS,
    "service.replica_policy": POLICY_KEYS,
    "service.load_balancer": LB_KEYS,
    "service.rollout": ROLLOUT_KEYS,
    "service.rollout.steps[]": ROLLOUT_STEP_KEYS,
    "service.rollout.analysis": ROLLOUT_ANALYSIS_KEYS,
    "pool": POOL_KEYS,
    "resources": RESOURCE_KEYS,
}

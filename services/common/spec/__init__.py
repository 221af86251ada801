"""Parse and validate SkyPilot-style service (or pool) task YAML into a `replicaplane.common.v1.ServiceSpec`.

`parse()` turns YAML text into the stored message or raises `errors.ValidationError` with every
problem found, each naming its field as a dotted path (`service.replica_policy.max_replicas`,
`resources.any_of[1].ports`). Header and secret values never appear in a description.
`is_in_place_update()` says whether replicas of one spec can be kept under another (spec.md 7.2).
The accepted keys, defaults and decisions are written down in docs/spec.md.

The parts, by concern:

- `schema`: accepted keys, refused SkyPilot keys, defaults and limits.
- `loading`: safe YAML loading (size, alias bombs, duplicate keys, unstorable strings).
- `parsing`: `parse()`, the task-level fields and service names.
- `service`, `pool`, `probe`, `resources`, `rollout`: one section each.
- `checks`: the violation collector the section readers share.
- `redact`: masking header and secret values for display.
- `compare`: the in-place update rule; `derived`: answers read off a parsed spec.

Callers use this module's names (`spec.parse`, `spec.redacted`, ...), not the parts.
"""

from services.common.pbtime import duration, seconds
from services.common.spec.compare import is_in_place_update, launch_config
from services.common.spec.derived import (
    autoscaler_kind,
    failure_threshold_s,
    is_autoscaling,
    is_pool,
    probe_method_and_body,
    uses_ondemand_fallback,
)
from services.common.spec.parsing import effective_name, parse, validate_service_name
from services.common.spec.redact import REDACTED, mask_secrets, redacted, secret_values, shown_yaml
from services.common.spec.schema import (
    ACCEPTED_KEYS,
    DEFAULT_CONSECUTIVE_FAILURE_THRESHOLD_S,
    DEFAULT_DOWNSCALE_DELAY_S,
    DEFAULT_INITIAL_DELAY_S,
    DEFAULT_LB_STREAM_TIMEOUT_S,
    DEFAULT_LOAD_BALANCING_POLICY,
    DEFAULT_MIN_REPLICAS,
    DEFAULT_POOL_FAILURE_THRESHOLD_S,
    DEFAULT_PROBE_INTERVAL_S,
    DEFAULT_PROBE_TIMEOUT_S,
    DEFAULT_QUEUE_LENGTH_THRESHOLD,
    DEFAULT_READINESS_PATH,
    DEFAULT_UPSCALE_DELAY_S,
    LOAD_BALANCING_POLICIES,
    MAX_EXPANDED_NODES,
    MAX_NAME_LEN,
    MAX_POST_DATA_DEPTH,
    MAX_REPLICAS_PER_SERVICE,
    MAX_YAML_BYTES,
    SERVICE_NAME_RE,
    SPOT_PLACERS,
)

__all__ = [
    "ACCEPTED_KEYS",
    "DEFAULT_CONSECUTIVE_FAILURE_THRESHOLD_S",
    "DEFAULT_DOWNSCALE_DELAY_S",
    "DEFAULT_INITIAL_DELAY_S",
    "DEFAULT_LB_STREAM_TIMEOUT_S",
    "DEFAULT_LOAD_BALANCING_POLICY",
    "DEFAULT_MIN_REPLICAS",
    "DEFAULT_POOL_FAILURE_THRESHOLD_S",
    "DEFAULT_PROBE_INTERVAL_S",
    "DEFAULT_PROBE_TIMEOUT_S",
    "DEFAULT_QUEUE_LENGTH_THRESHOLD",
    "DEFAULT_READINESS_PATH",
    "DEFAULT_UPSCALE_DELAY_S",
    "LOAD_BALANCING_POLICIES",
    "MAX_EXPANDED_NODES",
    "MAX_NAME_LEN",
    "MAX_POST_DATA_DEPTH",
    "MAX_REPLICAS_PER_SERVICE",
    "MAX_YAML_BYTES",
    "REDACTED",
    "SERVICE_NAME_RE",
    "SPOT_PLACERS",
    "autoscaler_kind",
    "duration",
    "effective_name",
    "failure_threshold_s",
    "is_autoscaling",
    "is_in_place_update",
    "is_pool",
    "launch_config",
    "mask_secrets",
    "parse",
    "probe_method_and_body",
    "redacted",
    "seconds",
    "secret_values",
    "shown_yaml",
    "uses_ondemand_fallback",
    "validate_service_name",
]

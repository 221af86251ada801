"""Parse and validate SkyPilot-style service task YAML into a `replicaplane.common.v1.ServiceSpec`.

`parse()` turns YAML text into the stored message or raises `errors.ValidationError` with every
problem found, each naming its field as a dotted path (`service.replica_policy.max_replicas`,
`resources.any_of[1].ports`). Header and secret values never appear in a description.
`is_in_place_update()` says whether replicas of one spec can be kept under another (spec.md 7.2).
The accepted keys, defaults and decisions are written down in docs/spec.md.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import yaml
from google.protobuf import duration_pb2

from replicaplane.common.v1 import spec_pb2
from services.common import errors, pbtime

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

# Input limits: a spec is a small document; these stop accidental or hostile giants.
MAX_YAML_BYTES = 1 << 20
MAX_EXPANDED_NODES = 100_000
MAX_NAME_LEN = 63
MAX_REPLICAS_PER_SERVICE = 1000
# A readiness probe body nests a few levels; deeper ones only exhaust the JSON codec's stack.
MAX_POST_DATA_DEPTH = 64
_INT32_MAX = 2**31 - 1
# The largest value a google.protobuf.Duration can hold.
_MAX_DURATION_S = 315_576_000_000

SERVICE_NAME_RE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_REF_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_ACCELERATOR_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.\-]*)(?::(\d+(?:\.\d*)?|\.\d+))?")
_CPUS_RE = re.compile(r"\d+(\.\d+)?\+?")
_MEMORY_RE = re.compile(r"\d+(\.\d+)?([KkMmGgTt][Bb]?)?[+x]?")
_PORT_RANGE_RE = re.compile(r"(\d+)\s*-\s*(\d+)")

LOAD_BALANCING_POLICIES = {
    "round_robin": spec_pb2.LOAD_BALANCING_POLICY_ROUND_ROBIN,
    "least_load": spec_pb2.LOAD_BALANCING_POLICY_LEAST_LOAD,
    "instance_aware_least_load": spec_pb2.LOAD_BALANCING_POLICY_INSTANCE_AWARE_LEAST_LOAD,
}
SPOT_PLACERS = {"dynamic_fallback": spec_pb2.SPOT_PLACER_DYNAMIC_FALLBACK}

# Keys per section. A key in an `_UNSUPPORTED_*` table is a SkyPilot key Replicaplane rejects
# with the reason given; any other key outside the accepted set is "unknown".
_TOP_KEYS = frozenset(
    {"name", "workdir", "setup", "run", "envs", "secrets", "file_mounts", "resources", "service", "num_nodes"}
)
_UNSUPPORTED_TOP = {
    "pool": "pools are not supported: Replicaplane runs services; use a service: section",
    "event_callback": "event callbacks are not supported",
    "inputs": "optimizer hints (inputs) are not supported",
    "outputs": "optimizer hints (outputs) are not supported",
    "volumes": "volumes are not supported; use file_mounts",
    "config": "per-task SkyPilot config overrides are not supported",
    "job_recovery": "job_recovery is not allowed for services: preempted replicas are replaced by the autoscaler",
}
_SERVICE_KEYS = frozenset(
    {"readiness_probe", "replica_policy", "replicas", "load_balancing_policy", "ports", "load_balancer"}
)
_UNSUPPORTED_SERVICE = {
    "pool": "pools are not supported",
    "workers": "pools are not supported; use replicas",
    "tls": "TLS termination is not supported; terminate TLS at your load balancer or ingress",
}
_PROBE_KEYS = frozenset(
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
_POLICY_KEYS = frozenset(
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
_LB_KEYS = frozenset({"stream_timeout_seconds"})
_RESOURCE_KEYS = frozenset(
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
_JOB_RECOVERY = "job_recovery is not allowed for services: preempted replicas are replaced by the autoscaler"
_UNSUPPORTED_RESOURCES = {
    "job_recovery": _JOB_RECOVERY,
    "spot_recovery": _JOB_RECOVERY,
    "disk_tier": "disk_tier is not supported",
    "network_tier": "network_tier is not supported",
    "accelerator_args": "accelerator_args is not supported",
    "autostop": "autostop does not apply to service replicas",
    "priority": "priority is not supported",
    "volumes": "volumes are not supported; use file_mounts",
}
_CLOUD_ALIASES = {"k8s": "kubernetes"}
# Marker in a resources mapping's "given" set: its ports were present but invalid.
_BAD_PORTS = "!ports"


# ---------------------------------------------------------------------------------------------
# Public helpers.


# Kept here too because spec users think in spec terms; one implementation in pbtime.
seconds = pbtime.seconds
duration = pbtime.duration


def validate_service_name(name: str, *, field: str = "service_name") -> list[errors.FieldViolation]:
    """Checks a service name: `[a-z]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.

    Args:
        name: The candidate name.
        field: The field path to name in a violation.

    Returns:
        An empty list if the name is valid, else one violation.
    """
    if not isinstance(name, str) or not name:
        return [errors.FieldViolation(field, "a service name is required")]
    if len(name) > MAX_NAME_LEN:
        return [errors.FieldViolation(field, f"must be at most {MAX_NAME_LEN} characters, got {len(name)}")]
    if not SERVICE_NAME_RE.fullmatch(name):
        return [
            errors.FieldViolation(
                field,
                "must start with a lowercase letter and contain only lowercase letters, digits and "
                "'-', not ending with '-'",
            )
        ]
    return []


def effective_name(spec: spec_pb2.ServiceSpec, name: str = "") -> str:
    """Returns the service name: `name` if given, else the YAML's `name:`.

    Args:
        spec: A parsed spec.
        name: The name given with the request, if any.

    Returns:
        The name; empty if neither was given.
    """
    return name or spec.name


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


def launch_config(spec: spec_pb2.ServiceSpec) -> spec_pb2.ServiceSpec:
    """Returns the part of a spec that decides how a replica is launched, normalized.

    The `service` section, the YAML text and the task name are cleared, and `resources.any_of`
    is sorted, so two specs launch alike exactly when their launch configs are equal.

    Args:
        spec: A parsed spec.

    Returns:
        A new message; `spec` is not changed.
    """
    out = spec_pb2.ServiceSpec()
    out.CopyFrom(spec)
    out.ClearField("service")
    out.ClearField("yaml")
    out.ClearField("name")
    entries = sorted(out.resources.any_of, key=lambda r: r.SerializeToString(deterministic=True))
    copies = [spec_pb2.Resources() for _ in entries]
    for copy, entry in zip(copies, entries, strict=True):
        copy.CopyFrom(entry)
    out.resources.ClearField("any_of")
    out.resources.any_of.extend(copies)
    return out


def is_in_place_update(old: spec_pb2.ServiceSpec, new: spec_pb2.ServiceSpec) -> bool:
    """Says whether replicas of `old` can be kept, version bumped, under `new` (spec.md 7.2).

    True when the specs differ only in the `service:` section, neither has a workdir or a
    non-empty file_mounts, and `resources.any_of` is equal ignoring order. A change of the
    serving port (`service.ports`) is not in place: the replica was launched serving the old one.

    Args:
        old: The spec a replica runs.
        new: The spec of the new version.

    Returns:
        True if the replica can be kept.
    """
    if old.workdir or new.workdir or old.file_mounts or new.file_mounts:
        return False
    if old.service.port != new.service.port:
        return False
    return launch_config(old) == launch_config(new)


def redacted(spec: spec_pb2.ServiceSpec) -> spec_pb2.ServiceSpec:
    """Returns a copy safe to show: header and secret values replaced by `<redacted>`.

    Every occurrence of a header or secret value in any string of the spec is masked too, since
    secrets are substituted into `service`, `file_mounts` and `workdir`. `yaml` is not the text
    the user sent but the document re-emitted from its loaded values with the same masking
    (see `shown_yaml`): YAML can spell one value in many ways, so searching the raw text for
    it cannot be made safe.

    Args:
        spec: A parsed spec.

    Returns:
        A new message.
    """
    out = spec_pb2.ServiceSpec()
    out.CopyFrom(spec)
    values = secret_values(spec)
    # Keys are listed first: assigning to a protobuf map while iterating it skips entries.
    for key in list(out.secrets):
        out.secrets[key] = REDACTED
    headers = out.service.readiness_probe.headers
    for key in list(headers):
        headers[key] = REDACTED
    if values:
        _mask_strings(out, lambda text: mask_secrets(text, values))
    out.yaml = shown_yaml(spec.yaml, values)
    return out


REDACTED = "<redacted>"


def secret_values(spec: spec_pb2.ServiceSpec) -> list[str]:
    """The header and secret values of a spec, longest first (so a value holding another is masked whole)."""
    values = set(spec.secrets.values()) | set(spec.service.readiness_probe.headers.values())
    return sorted((v for v in values if v), key=len, reverse=True)


def mask_secrets(text: str, values: list[str]) -> str:
    """Replaces every occurrence of each value (from `secret_values`) in text."""
    for value in values:
        if value in text:
            text = text.replace(value, REDACTED)
    return text


def shown_yaml(yaml_text: str, values: list[str]) -> str:
    """Re-emits a spec's YAML for display, with header and secret values replaced.

    The text is loaded, every value under `secrets:` and `service.readiness_probe.headers:` is
    replaced, every key and value holding one of `values` (from `secret_values`) is masked, and
    the result is dumped again. Masking works on the loaded values, which have one spelling
    whatever the quoting, escapes, line folding or anchors of the text; the raw text is never
    returned. Comments and formatting are not kept.

    Args:
        yaml_text: The YAML a spec was parsed from.
        values: The values to mask anywhere.

    Returns:
        The YAML to show; empty if the text does not load (it did when it was accepted).
    """
    if not yaml_text:
        return ""
    try:
        config = yaml.load(yaml_text, Loader=_Loader)
    except (yaml.YAMLError, ValueError, OverflowError, TypeError, RecursionError):
        return ""
    if not isinstance(config, dict):
        return ""
    # Replaced in place first, where the document says they are secret; aliases of these
    # mappings elsewhere are replaced with them.
    secrets = config.get("secrets")
    service = config.get("service")
    probe = service.get("readiness_probe") if isinstance(service, Mapping) else None
    headers = probe.get("headers") if isinstance(probe, Mapping) else None
    for section in (secrets, headers):
        if isinstance(section, dict):
            for key in list(section):
                section[key] = REDACTED
    try:
        return yaml.dump(
            _hide(config, values),
            Dumper=_ShownDumper,
            sort_keys=False,
            allow_unicode=True,
            default_flow_style=False,
            width=100,
        )
    except (yaml.YAMLError, RecursionError, ValueError, TypeError):
        return ""


# The values are masked before they are dumped, so the faster C emitter is as safe.
_SafeDumper: type[yaml.SafeDumper] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _ShownDumper(_SafeDumper):  # type: ignore[valid-type,misc]
    """A safe dumper that writes multi-line strings (run scripts) as literal blocks."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    # PyYAML falls back to a quoted style where a block cannot hold the text exactly.
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_ShownDumper.add_representer(str, _represent_str)


def _hide(node: Any, values: list[str]) -> Any:
    """A copy of loaded YAML with every key and value holding one of `values` masked."""
    if isinstance(node, str):
        return mask_secrets(node, values)
    if isinstance(node, Mapping):
        return {_hide(key, values): _hide(value, values) for key, value in node.items()}
    if isinstance(node, list | tuple | set | frozenset):
        return [_hide(item, values) for item in node]
    if node is None or not values:
        return node
    # A number, boolean, date or bytes: SkyPilot stringifies env and secret values, so a
    # secret `PIN: 1234` is "1234"; its text is checked the same way.
    text = node.decode("utf-8", "replace") if isinstance(node, bytes) else str(node)
    return REDACTED if mask_secrets(text, values) != text else node


def _mask_strings(message: Any, fill: Callable[[str], str]) -> None:
    """Applies fill to every string field, map key and value of a message, recursively."""
    for field, value in list(message.ListFields()):
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            entries = list(value.items())
            for key, _ in entries:
                del value[key]
            for key, item in entries:
                new_key = fill(key) if isinstance(key, str) else key
                if value_field.message_type is not None:
                    _mask_strings(item, fill)
                    value[new_key].CopyFrom(item)
                else:
                    value[new_key] = fill(item) if isinstance(item, str) else item
        elif field.message_type is not None:
            items = value if field.is_repeated else [value]
            for item in items:
                _mask_strings(item, fill)
        elif field.type == field.TYPE_STRING:
            if field.is_repeated:
                value[:] = [fill(item) for item in value]
            else:
                setattr(message, field.name, fill(value))


def parse(
    yaml_text: str, *, name: str = "", require_name: bool = False, replica_cap: int = MAX_REPLICAS_PER_SERVICE
) -> spec_pb2.ServiceSpec:
    """Parses and validates a SkyPilot-style service task YAML.

    Args:
        yaml_text: The task YAML.
        name: The service name given with the request. If empty, the YAML's `name:` is the
            service name and is checked as one.
        require_name: If True, a spec with neither `name` nor a YAML `name:` is a violation on
            `service_name` (create); if False no name is needed (update, dry runs).
        replica_cap: The most replicas a service may ask for (replicas, min/max_replicas,
            overprovision and fallback counts each).

    Returns:
        The ServiceSpec, with defaults filled in and `yaml` set to `yaml_text`.

    Raises:
        errors.ValidationError: With every violation found. Malformed YAML, or a document
            that is not a mapping, is a single violation on field `yaml`.
    """
    config = _load(yaml_text)
    c = _Checker(replica_cap)
    out = spec_pb2.ServiceSpec(yaml=yaml_text, num_nodes=1)
    c.keys(config, "", _TOP_KEYS, _UNSUPPORTED_TOP)

    yaml_name = config.get("name")
    if yaml_name is not None:
        text = c.string(yaml_name, "name")
        if text is not None:
            out.name = text
    if name:
        c.extend(validate_service_name(name, field="service_name"))
    elif out.name:
        c.extend(validate_service_name(out.name, field="name"))
    elif require_name:
        c.add("service_name", "a service name is required: pass one or set name: in the YAML")

    envs = _env_map(c, config.get("envs"), "envs", secret=False)
    secrets = _env_map(c, config.get("secrets"), "secrets", secret=True)
    out.envs.update(envs)
    out.secrets.update(secrets)
    # SkyPilot fills ${VAR} references to envs and secrets into these three sections.
    substitutions = {**envs, **secrets}
    for key in ("service", "file_mounts", "workdir"):
        if config.get(key) is not None:
            config[key] = _substitute(config[key], substitutions)

    for key in ("setup", "run"):
        text = _commands(c, config.get(key), key)
        if text is not None:
            setattr(out, key, text)
    if config.get("workdir") is not None:
        if isinstance(config["workdir"], Mapping):
            c.add("workdir", "a git workdir (mapping) is not supported; give a local directory path")
        else:
            text = c.string(config["workdir"], "workdir")
            if text is not None:
                out.workdir = text
    out.file_mounts.update(_file_mounts(c, config.get("file_mounts")))
    if config.get("num_nodes") is not None:
        nodes = c.integer(config["num_nodes"], "num_nodes", minimum=1)
        if nodes is not None and nodes != 1:
            c.add("num_nodes", f"only 1 node per replica is supported, got {nodes}")

    alternatives = _parse_resources(c, config.get("resources"), out.resources)
    raw_service = config.get("service")
    service_port: int | None = None
    if raw_service is None:
        c.add("service", "a service section is required")
    else:
        service = c.mapping(raw_service, "service")
        if service is not None:
            service_port = _parse_service(c, service, out.service, alternatives)
    port = _serving_port(c, alternatives, service_port)
    if port is not None:
        out.service.port = port

    # Secrets are substituted into fields a description may quote (an enum, a path).
    hidden = secret_values(out)
    errors.require(
        [
            errors.FieldViolation(mask_secrets(v.field, hidden), mask_secrets(v.description, hidden))
            for v in c.violations
        ],
        subject="service spec",
    )
    return out


class _Alternative:
    """One launchable set of resources with where each field came from, for error paths."""

    def __init__(self, resources: spec_pb2.Resources, path: str, given: set[str], *, bad_ports: bool) -> None:
        self.resources = resources
        self.path = path
        self.given = given
        # True when the ports this alternative uses were invalid (and already reported).
        self.bad_ports = bad_ports

    def field(self, key: str) -> str:
        """Path of `key`: on the entry when the entry set it, else on the top level."""
        return f"{self.path}.{key}" if key in self.given else f"resources.{key}"


class _Checker:
    """Collects violations; the typed readers return None after recording a bad value."""

    def __init__(self, replica_cap: int = MAX_REPLICAS_PER_SERVICE) -> None:
        self.violations: list[errors.FieldViolation] = []
        self.replica_cap = replica_cap

    def add(self, field: str, description: str) -> None:
        violation = errors.FieldViolation(field or "yaml", description)
        if violation not in self.violations:
            self.violations.append(violation)

    def extend(self, violations: list[errors.FieldViolation]) -> None:
        for v in violations:
            self.add(v.field, v.description)

    def keys(
        self, mapping: Mapping[Any, Any], path: str, allowed: frozenset[str], unsupported: Mapping[str, str]
    ) -> None:
        for key in mapping:
            if isinstance(key, str) and key in allowed:
                continue
            label = _short(str(key))
            if isinstance(key, str) and key in unsupported:
                self.add(_join(path, label), unsupported[key])
            else:
                where = f"in {path}" if path else "at the top level"
                self.add(_join(path, label), f"unknown key {label!r} {where}")

    def mapping(self, value: Any, path: str) -> dict[Any, Any] | None:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.add(path, f"must be a mapping, got {_kind(value)}")
            return None
        return dict(value)

    def string(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str):
            self.add(path, f"must be a string, got {_kind(value)}")
            return None
        return value

    def boolean(self, value: Any, path: str) -> bool | None:
        if not isinstance(value, bool):
            self.add(path, f"must be a boolean (true or false), got {_kind(value)}")
            return None
        return value

    def integer(self, value: Any, path: str, *, minimum: int = 0, maximum: int = _INT32_MAX) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int):
            self.add(path, f"must be an integer, got {_kind(value)}")
            return None
        if value < minimum:
            self.add(path, f"must be >= {minimum}, got {_short(value)}")
            return None
        if value > maximum:
            self.add(path, f"must be at most {maximum}, got {_short(value)}")
            return None
        return value

    def replica_count(self, value: Any, path: str) -> int | None:
        if isinstance(value, int) and not isinstance(value, bool) and value > self.replica_cap:
            self.add(path, f"must be at most {self.replica_cap} (the controller's per-service replica limit)")
            return None
        return self.integer(value, path)

    def number(self, value: Any, path: str, *, positive: bool = False, limit: float = math.inf) -> float | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.add(path, f"must be a number, got {_kind(value)}")
            return None
        try:
            number = float(value)
        except OverflowError:
            self.add(path, "is too large")
            return None
        if not math.isfinite(number):
            self.add(path, "must be a finite number")
            return None
        if positive and number <= 0:
            self.add(path, f"must be > 0, got {_short(value)}")
            return None
        if number < 0:
            self.add(path, f"must be >= 0, got {_short(value)}")
            return None
        if number > limit:
            self.add(path, f"must be at most {limit:g}, got {_short(value)}")
            return None
        return number

    def seconds(
        self, mapping: Mapping[str, Any], key: str, path: str, default: float, *, positive: bool = False
    ) -> duration_pb2.Duration:
        value = mapping.get(key)
        if value is None:
            return duration(default)
        number = self.number(value, _join(path, key), positive=positive, limit=_MAX_DURATION_S)
        return duration(default if number is None else number)


def _parse_service(
    c: _Checker, service: dict[Any, Any], out: spec_pb2.ServiceSection, alternatives: list[_Alternative]
) -> int | None:
    """Fills `out` from the service section; returns the `service.ports` value if valid."""
    c.keys(service, "service", _SERVICE_KEYS, _UNSUPPORTED_SERVICE)
    _parse_probe(c, service.get("readiness_probe"), out.readiness_probe)

    lb = c.mapping(service.get("load_balancer"), "service.load_balancer")
    if lb is not None:
        c.keys(lb, "service.load_balancer", _LB_KEYS, {})
        out.load_balancer.stream_timeout.CopyFrom(
            c.seconds(lb, "stream_timeout_seconds", "service.load_balancer", DEFAULT_LB_STREAM_TIMEOUT_S, positive=True)
        )

    policy_name = service.get("load_balancing_policy")
    out.load_balancing_policy = DEFAULT_LOAD_BALANCING_POLICY
    policy_ok = True
    if policy_name is not None:
        chosen = _enum(c, policy_name, "service.load_balancing_policy", LOAD_BALANCING_POLICIES)
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
                "service.replica_policy.target_qps_per_replica",
                "instance_aware_least_load needs a per-accelerator mapping, for example {A100: 5, 'H100:1': 10}",
            )

    # Fallback replicas and spot placement only make sense on spot capacity.
    # With no readable resources there is nothing to check against (already reported).
    all_spot = all(a.resources.use_spot for a in alternatives)
    policy = out.replica_policy
    needs_spot = "requires use_spot: true in resources (every any_of/ordered entry included)"
    if alternatives and not all_spot:
        if policy.base_ondemand_fallback_replicas > 0:
            c.add("service.replica_policy.base_ondemand_fallback_replicas", needs_spot)
        if policy.dynamic_ondemand_fallback:
            c.add("service.replica_policy.dynamic_ondemand_fallback", needs_spot)
        if policy.spot_placer != spec_pb2.SPOT_PLACER_UNSPECIFIED:
            c.add("service.replica_policy.spot_placer", needs_spot)

    raw_port = service.get("ports")
    if raw_port is None:
        return None
    return _port_value(c, raw_port, "service.ports", allow_string=True)


def _parse_probe(c: _Checker, raw: Any, out: spec_pb2.ReadinessProbe) -> None:
    path = "service.readiness_probe"
    probe: dict[Any, Any] | None = {}
    if isinstance(raw, str):
        probe = {"path": raw}
    elif raw is not None:
        probe = c.mapping(raw, path)
    if probe is None:
        probe = {}
    else:
        c.keys(probe, path, _PROBE_KEYS, {})

    out.path = DEFAULT_READINESS_PATH
    if probe.get("path") is not None:
        text = c.string(probe["path"], f"{path}.path")
        if text is not None:
            if not text.startswith("/"):
                c.add(f"{path}.path", "must start with '/'")
            elif any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in text):
                c.add(f"{path}.path", "must not contain whitespace or control characters")
            else:
                out.path = text
    out.initial_delay.CopyFrom(c.seconds(probe, "initial_delay_seconds", path, DEFAULT_INITIAL_DELAY_S))
    out.timeout.CopyFrom(c.seconds(probe, "timeout_seconds", path, DEFAULT_PROBE_TIMEOUT_S, positive=True))
    out.probe_interval.CopyFrom(
        c.seconds(probe, "endpoint_probe_interval_seconds", path, DEFAULT_PROBE_INTERVAL_S, positive=True)
    )
    out.consecutive_failure_threshold.CopyFrom(
        c.seconds(probe, "consecutive_failure_threshold_timeout", path, DEFAULT_CONSECUTIVE_FAILURE_THRESHOLD_S)
    )
    out.post_data_json = _post_data(c, probe.get("post_data"), f"{path}.post_data")
    out.headers.update(_headers(c, probe.get("headers"), f"{path}.headers"))


def _post_data(c: _Checker, raw: Any, path: str) -> str:
    """Returns the probe body as JSON text; empty means GET (as SkyPilot, JSON `null` too)."""
    if raw is None:
        return ""
    value = raw
    too_deep = f"must not nest lists and mappings more than {MAX_POST_DATA_DEPTH} levels deep"
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except ValueError:
            # The decoder's message quotes the text; the body may hold a token, so say less.
            c.add(path, "a string post_data must be valid JSON")
            return ""
        except RecursionError:
            c.add(path, too_deep)
            return ""
    elif not isinstance(raw, Mapping):
        c.add(path, f"must be a mapping or a JSON string, got {_kind(raw)}")
        return ""
    if value is None:
        return ""
    if _nesting(value) > MAX_POST_DATA_DEPTH:
        c.add(path, too_deep)
        return ""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        c.add(path, "must hold only JSON values (strings, numbers, booleans, null, lists, mappings)")
        return ""


def _nesting(value: Any) -> int:
    """How deeply lists and mappings nest in a loaded value (a scalar is 0); no recursion."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        node, level = pending.pop()
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_POST_DATA_DEPTH:
            break
        pending.extend((child, level + 1) for child in children)
    return deepest


def _headers(c: _Checker, raw: Any, path: str) -> dict[str, str]:
    """Returns probe headers. Values are secret: no description ever includes one."""
    headers = c.mapping(raw, path)
    if not headers:
        return {}
    out: dict[str, str] = {}
    for key, value in headers.items():
        if not isinstance(key, str) or not _HEADER_NAME_RE.fullmatch(key):
            c.add(path, "header names must be non-empty HTTP tokens (letters, digits, '-', ...)")
            continue
        field = f"{path}.{_short(key)}"
        if not isinstance(value, str):
            c.add(field, f"header value must be a string, got {_kind(value)}")
        elif any(ch in value for ch in "\r\n\0"):
            c.add(field, "header value must not contain line breaks or NUL")
        else:
            out[key] = value
    return out


def _parse_replicas(c: _Checker, service: dict[Any, Any], out: spec_pb2.ServiceSection) -> tuple[bool, bool]:
    """Fills the replica policy; returns (target is a per-accelerator dict, target parsed ok)."""
    policy = out.replica_policy
    policy.min_replicas = DEFAULT_MIN_REPLICAS
    policy.max_replicas = DEFAULT_MIN_REPLICAS
    policy.upscale_delay.CopyFrom(duration(DEFAULT_UPSCALE_DELAY_S))
    policy.downscale_delay.CopyFrom(duration(DEFAULT_DOWNSCALE_DELAY_S))

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
    section = c.mapping(raw_policy, "service.replica_policy")
    if section is None:
        return False, False
    path = "service.replica_policy"
    c.keys(section, path, _POLICY_KEYS, {})

    def read_int(key: str) -> int | None:
        return None if section.get(key) is None else c.replica_count(section[key], f"{path}.{key}")

    min_replicas = read_int("min_replicas")
    if section.get("min_replicas") is None:
        c.add(f"{path}.min_replicas", "required inside replica_policy")
    max_replicas = read_int("max_replicas")
    has_max = section.get("max_replicas") is not None
    for key in ("num_overprovision", "base_ondemand_fallback_replicas"):
        value = read_int(key)
        if value is not None:
            setattr(policy, key, value)
    if section.get("dynamic_ondemand_fallback") is not None:
        flag = c.boolean(section["dynamic_ondemand_fallback"], f"{path}.dynamic_ondemand_fallback")
        policy.dynamic_ondemand_fallback = bool(flag)
    if section.get("spot_placer") is not None:
        placer = _enum(c, section["spot_placer"], f"{path}.spot_placer", SPOT_PLACERS)
        if placer is not None:
            policy.spot_placer = spec_pb2.SpotPlacer.ValueType(placer)
    policy.upscale_delay.CopyFrom(c.seconds(section, "upscale_delay_seconds", path, DEFAULT_UPSCALE_DELAY_S))
    policy.downscale_delay.CopyFrom(c.seconds(section, "downscale_delay_seconds", path, DEFAULT_DOWNSCALE_DELAY_S))

    raw_target = section.get("target_qps_per_replica")
    target_is_dict, target_ok = isinstance(raw_target, Mapping), True
    if raw_target is not None:
        target_ok = _target_qps(c, raw_target, f"{path}.target_qps_per_replica", policy)

    # Only a policy the replicas shorthand did not already fill is applied.
    if raw_replicas is None and min_replicas is not None:
        policy.min_replicas = min_replicas
        policy.max_replicas = max_replicas if max_replicas is not None else min_replicas
    if min_replicas is not None and max_replicas is not None and max_replicas < min_replicas:
        c.add(f"{path}.max_replicas", f"must be >= min_replicas ({min_replicas}), got {max_replicas}")
    if raw_target is not None and not has_max:
        c.add(f"{path}.max_replicas", "required when target_qps_per_replica is set")
    if raw_target is None and min_replicas is not None and max_replicas is not None and max_replicas > min_replicas:
        c.add(
            f"{path}.target_qps_per_replica",
            "required when max_replicas exceeds min_replicas (it turns on autoscaling)",
        )
    return target_is_dict, target_ok


def _target_qps(c: _Checker, raw: Any, path: str, policy: spec_pb2.ReplicaPolicy) -> bool:
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
        if not isinstance(key, str) or not _ACCELERATOR_RE.fullmatch(key.strip()):
            c.add(path, "keys must be accelerator names such as 'A100' or 'H100:1'")
            ok = False
            continue
        number = c.number(value, f"{path}.{_short(key)}", positive=True)
        if number is None:
            ok = False
        else:
            policy.target_qps_per_accelerator[key.strip()] = number
    return ok


def _parse_resources(c: _Checker, raw: Any, out: spec_pb2.Resources) -> list[_Alternative]:
    """Fills `out`; returns the launchable alternatives (any_of/ordered entries, else the top)."""
    section = c.mapping(raw, "resources")
    if section is None:
        return []
    given = _resource_fields(c, section, "resources", out, nested=False)
    alternatives: list[_Alternative] = []
    lists = [k for k in ("any_of", "ordered") if section.get(k) is not None]
    if len(lists) == 2:
        c.add("resources.ordered", "any_of and ordered are mutually exclusive")
    for kind in lists:
        entries = section[kind]
        if not isinstance(entries, list) or not entries:
            got = "an empty list" if entries == [] else _kind(entries)
            c.add(f"resources.{kind}", f"must be a non-empty list of resource mappings, got {got}")
            continue
        for i, raw_entry in enumerate(entries):
            path = f"resources.{kind}[{i}]"
            entry = c.mapping(raw_entry, path)
            if entry is None:
                continue
            parsed = spec_pb2.Resources()
            entry_given = _resource_fields(c, entry, path, parsed, nested=True)
            # Each entry is a whole alternative: top-level keys are defaults it overrides.
            merged = _merge_resources(out, parsed, entry_given)
            getattr(out, kind).append(merged)
            bad = _BAD_PORTS in entry_given or ("ports" not in entry_given and _BAD_PORTS in given)
            alternatives.append(_Alternative(merged, path, entry_given, bad_ports=bad))
    if not lists:
        alternatives.append(_Alternative(out, "resources", given, bad_ports=_BAD_PORTS in given))
    elif alternatives and all(a.resources.use_spot == alternatives[0].resources.use_spot for a in alternatives):
        out.use_spot = alternatives[0].resources.use_spot
    spot = {a.resources.use_spot for a in alternatives}
    if len(spot) > 1:
        c.add(
            "resources.use_spot",
            "resources must be all spot or all on-demand; to mix, use base_ondemand_fallback_replicas "
            "or dynamic_ondemand_fallback with use_spot: true",
        )
    return alternatives


def _resource_fields(
    c: _Checker, section: dict[Any, Any], path: str, out: spec_pb2.Resources, *, nested: bool
) -> set[str]:
    """Reads one resources mapping (without any_of/ordered); returns the proto fields it set."""
    allowed = _RESOURCE_KEYS - {"any_of", "ordered"} if nested else _RESOURCE_KEYS
    unsupported = dict(_UNSUPPORTED_RESOURCES)
    if nested:
        unsupported.update(any_of="entries cannot nest any_of", ordered="entries cannot nest ordered")
    c.keys(section, path, allowed, unsupported)
    given: set[str] = set()

    def present(key: str) -> bool:
        return section.get(key) is not None

    if present("ports"):
        ports = _ports(c, section["ports"], f"{path}.ports")
        if ports is not None:
            out.ports.extend(ports)
            given.add("ports")
        else:
            given.add(_BAD_PORTS)
    if present("use_spot"):
        flag = c.boolean(section["use_spot"], f"{path}.use_spot")
        if flag is not None:
            out.use_spot = flag
            given.add("use_spot")
    for key, pattern in (("cpus", _CPUS_RE), ("memory", _MEMORY_RE)):
        if present(key):
            text = _quantity(c, section[key], f"{path}.{key}", pattern)
            if text is not None:
                setattr(out, key, text)
                given.add(key)
    if present("accelerators"):
        text = _accelerators(c, section["accelerators"], f"{path}.accelerators")
        if text is not None:
            out.accelerators = text
            given.add("accelerators")
    for key in ("cloud", "region", "zone", "instance_type"):
        if present(key):
            text = c.string(section[key], f"{path}.{key}")
            if text is not None:
                text = text.strip()
                if key == "cloud":
                    text = _CLOUD_ALIASES.get(text.lower(), text.lower())
                setattr(out, key, text)
                given.add(key)
    if present("infra"):
        if any(present(k) for k in ("cloud", "region", "zone")):
            c.add(f"{path}.infra", "infra and cloud/region/zone are mutually exclusive")
        else:
            parts = _infra(c, section["infra"], f"{path}.infra")
            if parts is not None:
                out.cloud, out.region, out.zone = parts
                given.update({"cloud", "region", "zone"})
    if present("disk_size"):
        size = c.integer(section["disk_size"], f"{path}.disk_size")
        if size is not None:
            out.disk_size = size
            given.add("disk_size")
    if present("image_id"):
        if isinstance(section["image_id"], Mapping):
            c.add(f"{path}.image_id", "a per-region image_id mapping is not supported; give one image id")
        else:
            text = c.string(section["image_id"], f"{path}.image_id")
            if text is not None:
                out.image_id = text
                given.add("image_id")
    if present("labels"):
        labels = c.mapping(section["labels"], f"{path}.labels")
        if labels is not None:
            for key, value in labels.items():
                if not isinstance(key, str) or not key:
                    c.add(f"{path}.labels", "label names must be non-empty strings")
                elif c.string(value, f"{path}.labels.{_short(key)}") is not None:
                    out.labels[key] = value
            given.add("labels")
    return given


def _merge_resources(top: spec_pb2.Resources, entry: spec_pb2.Resources, given: set[str]) -> spec_pb2.Resources:
    merged = spec_pb2.Resources()
    merged.CopyFrom(top)
    merged.ClearField("any_of")
    merged.ClearField("ordered")
    for key in given:
        if key == "ports":
            merged.ClearField("ports")
            merged.ports.extend(entry.ports)
        elif key == "labels":
            merged.ClearField("labels")
            merged.labels.update(entry.labels)
        else:
            setattr(merged, key, getattr(entry, key))
    return merged


def _serving_port(c: _Checker, alternatives: list[_Alternative], service_port: int | None) -> int | None:
    """Resolves the one port replicas serve on, checking it against every alternative."""
    if not alternatives:
        return service_port
    if any(a.bad_ports for a in alternatives):
        return None
    if service_port is not None:
        ok = True
        for alt in alternatives:
            if service_port not in alt.resources.ports:
                c.add("service.ports", f"port {service_port} must be one of {alt.field('ports')}")
                ok = False
        return service_port if ok else None
    found: set[int] = set()
    complete = True
    for alt in alternatives:
        ports = list(alt.resources.ports)
        if len(ports) != 1:
            complete = False
            got = "none" if not ports else f"{len(ports)} ports"
            c.add(
                alt.field("ports"),
                f"a service needs exactly one port here, or service.ports naming one of them (got {got})",
            )
        else:
            found.add(ports[0])
    if len(found) > 1:
        c.add(
            "resources.ports",
            f"alternatives serve on different ports {sorted(found)}; use one port or set service.ports",
        )
        return None
    return found.pop() if complete and found else None


def _port_value(c: _Checker, raw: Any, path: str, *, allow_string: bool) -> int | None:
    if isinstance(raw, str) and allow_string and raw.strip().isdigit():
        raw = int(raw.strip())
    if isinstance(raw, bool) or not isinstance(raw, int):
        c.add(path, f"must be a port number, got {_kind(raw)}")
        return None
    if not 1 <= raw <= 65535:
        c.add(path, f"port must be in 1..65535, got {raw}")
        return None
    return raw


def _ports(c: _Checker, raw: Any, path: str) -> list[int] | None:
    """Parses resources.ports: an int, "8080", "8080-8081", or a list of those; sorted, unique."""
    items = raw if isinstance(raw, list) else [raw]
    ports: set[int] = set()
    ok = True
    for i, item in enumerate(items):
        where = f"{path}[{i}]" if isinstance(raw, list) else path
        if isinstance(item, str) and (match := _PORT_RANGE_RE.fullmatch(item.strip())):
            low, high = int(match.group(1)), int(match.group(2))
            if not (1 <= low <= 65535 and 1 <= high <= 65535):
                c.add(where, f"ports must be in 1..65535, got range {low}-{high}")
                ok = False
            elif low > high:
                c.add(where, f"range start must not exceed its end, got {low}-{high}")
                ok = False
            else:
                ports.update(range(low, high + 1))
            continue
        if isinstance(item, str) and not item.strip().isdigit():
            c.add(where, "must be a port number or a range such as '8080-8081'")
            ok = False
            continue
        port = _port_value(c, item, where, allow_string=True)
        if port is None:
            ok = False
        else:
            ports.add(port)
    if isinstance(raw, list) and not raw:
        return []
    return sorted(ports) if ok else None


def _quantity(c: _Checker, raw: Any, path: str, pattern: re.Pattern[str]) -> str | None:
    """Normalizes cpus/memory: a number, or text such as '2', '2+', '0.5', '16+' ('8x' for memory)."""
    if isinstance(raw, bool):
        c.add(path, "must be a number or a string such as '2+'")
        return None
    if isinstance(raw, int | float):
        if not math.isfinite(raw) or raw < 0:
            c.add(path, "must be a finite number >= 0")
            return None
        return _fmt_number(float(raw))
    if isinstance(raw, str) and pattern.fullmatch(raw.strip()):
        return raw.strip()
    c.add(path, "must be a number or a string such as '2', '2+' or '0.5'")
    return None


def _accelerators(c: _Checker, raw: Any, path: str) -> str | None:
    """Normalizes accelerators to "NAME:COUNT[,NAME:COUNT...]" from a string, list or mapping."""
    items: list[tuple[str, float]] = []
    bad = "must name accelerators such as 'A100', 'A100:2', a list of them, or a mapping {A100: 1}"
    if isinstance(raw, Mapping):
        for key, value in raw.items():
            match = _ACCELERATOR_RE.fullmatch(key.strip()) if isinstance(key, str) else None
            # {A100: 1} maps names to counts; the set form {A100:1, H100:1} (no space after the
            # colon) is read by YAML as keys "A100:1" with no value.
            if match is None or (match.group(2) and value is not None):
                c.add(path, bad)
                return None
            if match.group(2):
                count = float(match.group(2))
                if count <= 0:
                    c.add(path, "accelerator counts must be > 0")
                    return None
            else:
                number = 1.0 if value is None else c.number(value, f"{path}.{_short(key)}", positive=True)
                if number is None:
                    return None
                count = number
            items.append((match.group(1), count))
    else:
        texts = raw if isinstance(raw, list) else [raw]
        if isinstance(raw, str):
            texts = raw.split(",")
        for text in texts:
            match = _ACCELERATOR_RE.fullmatch(text.strip()) if isinstance(text, str) else None
            if match is None:
                c.add(path, bad)
                return None
            count = float(match.group(2)) if match.group(2) else 1.0
            if count <= 0:
                c.add(path, "accelerator counts must be > 0")
                return None
            items.append((match.group(1), count))
    if not items:
        c.add(path, bad)
        return None
    return ",".join(f"{name}:{_fmt_number(count)}" for name, count in items)


def _infra(c: _Checker, raw: Any, path: str) -> tuple[str, str, str] | None:
    """Splits `infra: cloud[/region[/zone]]`; for Kubernetes the rest is the context name."""
    text = c.string(raw, path)
    if text is None:
        return None
    parts = [p.strip() for p in text.strip().split("/")]
    if not parts[0]:
        c.add(path, "must look like 'aws', 'aws/us-east-1' or 'aws/us-east-1/us-east-1a'")
        return None
    cloud = _CLOUD_ALIASES.get(parts[0].lower(), parts[0].lower())
    if cloud == "kubernetes":
        return cloud, "/".join(parts[1:]), ""
    if len(parts) > 3 or any(not p for p in parts):
        c.add(path, "must look like 'aws', 'aws/us-east-1' or 'aws/us-east-1/us-east-1a'")
        return None
    parts += ["", ""]
    # '*' is SkyPilot's "any" for a part.
    cloud = "" if cloud == "*" else cloud
    return cloud, "" if parts[1] == "*" else parts[1], "" if parts[2] == "*" else parts[2]


def _env_map(c: _Checker, raw: Any, path: str, *, secret: bool) -> dict[str, str]:
    """Reads envs or secrets: names are env-var names; values are stringified (never echoed)."""
    section = c.mapping(raw, path)
    if not section:
        return {}
    out: dict[str, str] = {}
    for key, value in section.items():
        name = str(key)
        if not _ENV_NAME_RE.fullmatch(name):
            c.add(f"{path}.{_short(name)}", "must be a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
            continue
        field = f"{path}.{name}"
        if value is None:
            c.add(field, 'needs a value; use an empty string ("") for an empty one')
        elif isinstance(value, str | int | float | bool):
            # As SkyPilot: str() of the YAML value, so `true` becomes "True".
            out[name] = str(value)
        else:
            kind = "a secret" if secret else "an environment variable"
            c.add(field, f"{kind} value must be a string, number or boolean, got {_kind(value)}")
    return out


def _commands(c: _Checker, raw: Any, path: str) -> str | None:
    """Reads run/setup: a string, or a list of lines joined with newlines."""
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        if all(isinstance(line, str) for line in raw):
            return "\n".join(raw)
        c.add(path, "must be a string or a list of strings; an item is not a string")
        return None
    c.add(path, f"must be a string or a list of strings, got {_kind(raw)}")
    return None


def _file_mounts(c: _Checker, raw: Any) -> dict[str, str]:
    """Reads file_mounts: remote path -> local path or URI; a storage mapping is kept as JSON."""
    section = c.mapping(raw, "file_mounts")
    if not section:
        return {}
    out: dict[str, str] = {}
    for key, value in section.items():
        if not isinstance(key, str) or not key.strip():
            c.add("file_mounts", "destination paths must be non-empty strings")
            continue
        field = f"file_mounts.{_short(key)}"
        if ".." in key.replace("\\", "/").split("/"):
            c.add(field, "the destination must stay inside the replica's working directory (no '..')")
            continue
        if isinstance(value, str) and value.strip():
            out[key] = value
        elif isinstance(value, Mapping):
            try:
                out[key] = json.dumps(value, sort_keys=True, allow_nan=False)
            except (TypeError, ValueError):
                c.add(field, "a storage mapping must hold only JSON values")
        else:
            c.add(field, f"must be a source path, URI or storage mapping, got {_kind(value)}")
    return out


def _enum(c: _Checker, raw: Any, path: str, choices: Mapping[str, int]) -> int | None:
    if isinstance(raw, str) and raw.strip().lower() in choices:
        return choices[raw.strip().lower()]
    shown = repr(_short(raw)) if isinstance(raw, str) else _kind(raw)
    c.add(path, f"must be one of {', '.join(choices)} (case-insensitive), got {shown}")
    return None


def _substitute(value: Any, names: Mapping[str, str]) -> Any:
    """Replaces $VAR and ${VAR} in every string (keys too); unknown names stay as written."""
    if not names:
        return value

    def fill(text: str) -> str:
        return _ENV_REF_RE.sub(lambda m: names.get(m.group(1) or m.group(2), m.group(0)), text)

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return fill(node)
        if isinstance(node, list):
            return [walk(item) for item in node]
        if isinstance(node, Mapping):
            return {(fill(k) if isinstance(k, str) else k): walk(v) for k, v in node.items()}
        return node

    return walk(value)


# ---------------------------------------------------------------------------------------------
# YAML loading.


class _Loader(yaml.SafeLoader):
    """A safe loader that rejects duplicate keys: a second `run:` is a mistake, not an override."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            # Merge keys (<<) may repeat and override on purpose; only plain scalar keys count.
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {_short(key_node.value)!r}", key_node.start_mark
                )
            seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


def _load(yaml_text: str) -> dict[Any, Any]:
    """Loads the document; any failure is one violation on `yaml`, never quoting the text."""

    def fail(description: str) -> errors.ValidationError:
        return errors.ValidationError([errors.FieldViolation("yaml", description)], subject="service spec")

    if not isinstance(yaml_text, str):
        raise fail("the spec must be YAML text")
    if len(yaml_text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise fail(f"the spec is larger than {MAX_YAML_BYTES} bytes")
    try:
        # _Loader is a SafeLoader: no arbitrary Python objects.
        config = yaml.load(yaml_text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        # str(exc) quotes the offending line, which may hold a secret: report position only.
        where = ""
        if exc.problem_mark is not None:
            where = f" at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}"
        problem = exc.problem or exc.context or "syntax error"
        raise fail(f"malformed YAML: {problem}{where}") from None
    except yaml.YAMLError:
        raise fail("malformed YAML") from None
    except (ValueError, OverflowError, TypeError):
        # An impossible date (2001-13-45) or an integer over Python's digit limit: the message
        # would quote the value.
        raise fail("malformed YAML: a value cannot be read (an impossible date or a number too long)") from None
    except RecursionError:
        raise fail("malformed YAML: nested too deeply") from None
    if not isinstance(config, dict):
        got = "an empty document" if config is None else _kind(config)
        raise fail(f"the document must be a mapping of task keys (name, service, resources, run, ...), got {got}")
    if _expanded_size(config) > MAX_EXPANDED_NODES:
        raise fail(f"the document expands to more than {MAX_EXPANDED_NODES} values (alias bomb or recursion)")
    unreadable = [errors.FieldViolation(path, problem) for path, problem in _unstorable_strings(config, "")]
    if unreadable:
        raise errors.ValidationError(unreadable[:20], subject="service spec")
    return config


def _unstorable_strings(node: Any, path: str) -> Iterator[tuple[str, str]]:
    """Yields (path, problem) for keys and values no process argument or UTF-8 store can hold."""

    def problem(text: str) -> str | None:
        if "\x00" in text:
            return "must not contain a NUL character"
        if any("\ud800" <= ch <= "\udfff" for ch in text):
            return "must not contain a lone surrogate (invalid unicode)"
        return None

    if isinstance(node, str):
        bad = problem(node)
        if bad:
            yield path or "yaml", bad
    elif isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str) and (bad := problem(key)):
                yield path or "yaml", f"a key {bad}"
                continue
            yield from _unstorable_strings(value, _join(path, _short(key)) if isinstance(key, str) else path)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _unstorable_strings(item, f"{path}[{i}]")


def _expanded_size(root: Any) -> int:
    """Counts values as if aliases were copied; a cycle counts as too many."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any) -> int:
        if not isinstance(node, list | dict):
            return 1
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            return MAX_EXPANDED_NODES + 1
        active.add(key)
        children = list(node.keys()) + list(node.values()) if isinstance(node, dict) else node
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_EXPANDED_NODES:
                break
        active.discard(key)
        sizes[key] = total
        return total

    try:
        return size(root)
    except RecursionError:
        return MAX_EXPANDED_NODES + 1


# ---------------------------------------------------------------------------------------------
# Small utilities.


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _short(text: Any, limit: int = 64) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(value: Any) -> str:
    """Names a value's YAML type without showing the value (it may be a secret)."""
    kinds: dict[type, str] = {bool: "a boolean", int: "an integer", float: "a decimal number", str: "a string"}
    if value is None:
        return "null"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    for cls, name in kinds.items():
        if isinstance(value, cls):
            return name
    return f"a {type(value).__name__}"


def _fmt_number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


# Exported for callers that want to branch on the accepted keys (docs, CLI completion).
ACCEPTED_KEYS: Mapping[str, frozenset[str]] = {
    "": _TOP_KEYS,
    "service": _SERVICE_KEYS,
    "service.readiness_probe": _PROBE_KEYS,
    "service.replica_policy": _POLICY_KEYS,
    "service.load_balancer": _LB_KEYS,
    "resources": _RESOURCE_KEYS,
}

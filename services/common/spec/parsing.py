"""`parse()`: a task YAML to a `ServiceSpec`, with the task-level fields and service names.

The top level (name, envs, secrets, run/setup, workdir, file_mounts, num_nodes) is read here;
`service`, `pool`, `resources` and `readiness_probe` have their own modules. A spec is a service,
or a pool when it has `pool:` (top level, or inside `service:`). Every problem becomes a
violation naming its field; header and secret values never appear in one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from replicaplane.common.v1 import spec_pb2
from services.common import errors
from services.common.spec import checks, loading, pool, redact, resources, schema, service

_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_REF_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def parse(
    yaml_text: str, *, name: str = "", require_name: bool = False, replica_cap: int = schema.MAX_REPLICAS_PER_SERVICE
) -> spec_pb2.ServiceSpec:
    """Parses and validates a SkyPilot-style service (or pool) task YAML.

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
    config = loading.load(yaml_text)
    c = checks.Checker(replica_cap)
    out = spec_pb2.ServiceSpec(yaml=yaml_text, num_nodes=1)
    c.keys(config, "", schema.TOP_KEYS, schema.UNSUPPORTED_TOP)

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
    for key in ("service", "pool", "file_mounts", "workdir"):
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

    alternatives = resources.parse(c, config.get("resources"), out.resources)
    raw_service = config.get("service")
    top_pool = "pool" in config
    if top_pool or (isinstance(raw_service, Mapping) and "pool" in raw_service):
        out.kind = spec_pb2.FLEET_KIND_POOL
        if top_pool:
            raw_pool, pool_path = config["pool"], "pool"
            if raw_service is not None:
                c.add("pool", "pool and service are mutually exclusive: a pool runs jobs, a service serves requests")
        else:
            assert isinstance(raw_service, Mapping)
            c.keys(raw_service, "service", frozenset({"pool"}), pool.REFUSED_BESIDE)
            raw_pool, pool_path = raw_service["pool"], "service.pool"
        pool.parse(c, raw_pool, pool_path, out.service.pool)
        pool.check_resources(c, config.get("resources"), alternatives)
        # As SkyPilot, a pool's `run` is not run: workers run setup, and each job its own command.
        out.ClearField("run")
    elif raw_service is None:
        c.add("service", "a service (or pool) section is required")
    else:
        out.kind = spec_pb2.FLEET_KIND_SERVICE
        service_port: int | None = None
        section = c.mapping(raw_service, "service")
        if section is not None:
            # With no readable resources there is nothing to check spot settings against.
            on_demand = any(not a.resources.use_spot for a in alternatives)
            service_port = service.parse(c, section, out.service, on_demand=on_demand)
        port = resources.serving_port(c, alternatives, service_port)
        if port is not None:
            out.service.port = port

    # Secrets are substituted into fields a description may quote (an enum, a path).
    hidden = redact.secret_values(out)
    errors.require(
        [
            errors.FieldViolation(redact.mask_secrets(v.field, hidden), redact.mask_secrets(v.description, hidden))
            for v in c.violations
        ],
        subject="service spec",
    )
    return out


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
    if len(name) > schema.MAX_NAME_LEN:
        return [errors.FieldViolation(field, f"must be at most {schema.MAX_NAME_LEN} characters, got {len(name)}")]
    if not schema.SERVICE_NAME_RE.fullmatch(name):
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


def _env_map(c: checks.Checker, raw: Any, path: str, *, secret: bool) -> dict[str, str]:
    """Reads envs or secrets: names are env-var names; values are stringified (never echoed)."""
    section = c.mapping(raw, path)
    if not section:
        return {}
    out: dict[str, str] = {}
    for key, value in section.items():
        name = str(key)
        if not _ENV_NAME_RE.fullmatch(name):
            c.add(f"{path}.{checks.short(name)}", "must be a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
            continue
        field = f"{path}.{name}"
        if value is None:
            c.add(field, 'needs a value; use an empty string ("") for an empty one')
        elif isinstance(value, str | int | float | bool):
            # As SkyPilot: str() of the YAML value, so `true` becomes "True".
            out[name] = str(value)
        else:
            kind = "a secret" if secret else "an environment variable"
            c.add(field, f"{kind} value must be a string, number or boolean, got {checks.kind(value)}")
    return out


def _commands(c: checks.Checker, raw: Any, path: str) -> str | None:
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
    c.add(path, f"must be a string or a list of strings, got {checks.kind(raw)}")
    return None


def _file_mounts(c: checks.Checker, raw: Any) -> dict[str, str]:
    """Reads file_mounts: remote path -> local path or URI; a storage mapping is kept as JSON."""
    section = c.mapping(raw, "file_mounts")
    if not section:
        return {}
    out: dict[str, str] = {}
    for key, value in section.items():
        if not isinstance(key, str) or not key.strip():
            c.add("file_mounts", "destination paths must be non-empty strings")
            continue
        field = f"file_mounts.{checks.short(key)}"
        if ".." in key.replace("\\", "/").split("/"):
            c.add(field, "the destination must stay inside the replica's working directory (no '..')")
            continue
        if isinstance(value, str) and value.strip():
            out[key] = value
        elif isinstance(value, Mapping):
            text = checks.json_text(value, sort_keys=True)
            if text is None:
                c.add(field, "a storage mapping must hold only JSON values")
            else:
                out[key] = text
        else:
            c.add(field, f"must be a source path, URI or storage mapping, got {checks.kind(value)}")
    return out


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

"""Settings loading: dataclass defaults < YAML file < environment.

Each service declares a frozen dataclass of settings. `load()` fills it from the file named by
REPLICAPLANE_CONFIG (its section for the service) and then from environment variables named
REPLICAPLANE_<SECTION>_<FIELD>, for example REPLICAPLANE_CONTROLLER_LISTEN_ADDR.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import yaml

from services.common import errors

T = TypeVar("T")

CONFIG_FILE_ENV = "REPLICAPLANE_CONFIG"

# Shared address defaults, so every component and client agrees on them.
CONTROLLER_ADDR = "127.0.0.1:50051"
PROVISIONER_ADDR = "127.0.0.1:50052"
PROBER_ADDR = "127.0.0.1:50053"
LOADBALANCER_ADDR = "127.0.0.1:50054"
LOADBALANCER_HTTP_ADDR = "127.0.0.1:30001"
# Each service's Prometheus `/metrics` endpoint: the gRPC port's last digit after 945.
CONTROLLER_METRICS_ADDR = "127.0.0.1:9451"
PROVISIONER_METRICS_ADDR = "127.0.0.1:9452"
PROBER_METRICS_ADDR = "127.0.0.1:9453"
LOADBALANCER_METRICS_ADDR = "127.0.0.1:9454"
DASHBOARD_METRICS_ADDR = "127.0.0.1:9459"
DASHBOARD_ADDR = "127.0.0.1:50059"
DASHBOARD_HTTP_ADDR = "127.0.0.1:30080"


def env_name(section: str, field: str) -> str:
    """The environment variable that overrides `field` of `section`."""
    return f"REPLICAPLANE_{section}_{field}".upper()


def _convert(raw: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if raw is None or raw == "":
            return None
        return _convert(raw, args[0], path)
    if origin is tuple:
        (item,) = typing.get_args(hint)[:1]
        items = raw.split(",") if isinstance(raw, str) else list(raw)
        return tuple(_convert(i.strip() if isinstance(i, str) else i, item, path) for i in items if i != "")
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{path}: expected a boolean, got {raw!r}")
    if hint in (int, float, str):
        try:
            return hint(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{path}: expected {hint.__name__}, got {raw!r}") from None
    return raw


def read_file(path: str) -> dict[str, Any]:
    """The settings file named by REPLICAPLANE_CONFIG: a mapping of sections.

    Raises:
        errors.ValidationError: it cannot be read, is not YAML, or is not a mapping; the violation
            names REPLICAPLANE_CONFIG and the file.
    """

    def bad(why: str) -> errors.ValidationError:
        return errors.ValidationError([errors.FieldViolation(CONFIG_FILE_ENV, f"{path}: {why}")], subject="settings")

    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except OSError as exc:
        raise bad(exc.strerror or str(exc)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise bad(f"not valid YAML{where}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise bad("must be a mapping of sections (controller:, provisioner:, ...)")
    return doc


def load(cls: type[T], section: str, *, environ: Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Build settings of type `cls` from defaults, the config file, the environment and overrides.

    Args:
        cls: a frozen dataclass type.
        section: the config-file section and environment prefix, for example "controller".
        environ: environment to read; defaults to os.environ.
        **overrides: values that win over everything (tests use these).

    Raises:
        errors.ValidationError: a value has the wrong type or an unknown key is in the file.
    """
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    violations: list[errors.FieldViolation] = []

    path = env.get(CONFIG_FILE_ENV)
    if path:
        doc = read_file(path)
        part = doc.get(section) or {}
        if not isinstance(part, dict):
            raise errors.ValidationError(
                [errors.FieldViolation(section, f"{CONFIG_FILE_ENV} ({path}): must be a mapping of settings")],
                subject=f"{section} settings",
            )
        for key, raw in part.items():
            if key not in names:
                violations.append(errors.FieldViolation(f"{section}.{key}", "unknown setting"))
                continue
            values[key] = (raw, f"{path}:{section}.{key}")
    for name in names:
        var = env_name(section, name)
        if var in env:
            values[name] = (env[var], var)
    converted: dict[str, Any] = {}
    for name, (raw, where) in values.items():
        try:
            converted[name] = _convert(raw, hints[name], where)
        except ValueError as exc:
            violations.append(errors.FieldViolation(f"{section}.{name}", str(exc)))
    errors.require(violations, subject=f"{section} settings")
    converted.update(overrides)
    return cls(**converted)

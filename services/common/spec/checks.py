"""The violation collector every section reader shares, and the text helpers for its messages.

`Checker` gathers every problem in a document instead of stopping at the first; its typed
readers return None after recording a bad value. Messages name a value's type, never the value
itself (it may be a secret).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from google.protobuf import duration_pb2

from services.common import errors, pbtime
from services.common.spec import schema


class Checker:
    """Collects violations; the typed readers return None after recording a bad value."""

    def __init__(self, replica_cap: int = schema.MAX_REPLICAS_PER_SERVICE) -> None:
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
        """Reports each key outside `allowed`: with its reason if refused on purpose, else unknown."""
        for key in mapping:
            if isinstance(key, str) and key in allowed:
                continue
            label = short(str(key))
            if isinstance(key, str) and key in unsupported:
                self.add(join(path, label), unsupported[key])
            else:
                where = f"in {path}" if path else "at the top level"
                self.add(join(path, label), f"unknown key {label!r} {where}")

    def mapping(self, value: Any, path: str) -> dict[Any, Any] | None:
        """A mapping (null reads as empty), or None if the value is something else."""
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.add(path, f"must be a mapping, got {kind(value)}")
            return None
        return dict(value)

    def string(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str):
            self.add(path, f"must be a string, got {kind(value)}")
            return None
        return value

    def boolean(self, value: Any, path: str) -> bool | None:
        if not isinstance(value, bool):
            self.add(path, f"must be a boolean (true or false), got {kind(value)}")
            return None
        return value

    def integer(self, value: Any, path: str, *, minimum: int = 0, maximum: int = schema.INT32_MAX) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int):
            self.add(path, f"must be an integer, got {kind(value)}")
            return None
        if value < minimum:
            self.add(path, f"must be >= {minimum}, got {short(value)}")
            return None
        if value > maximum:
            self.add(path, f"must be at most {maximum}, got {short(value)}")
            return None
        return value

    def replica_count(self, value: Any, path: str) -> int | None:
        if isinstance(value, int) and not isinstance(value, bool) and value > self.replica_cap:
            self.add(path, f"must be at most {self.replica_cap} (the controller's per-service replica limit)")
            return None
        return self.integer(value, path)

    def number(self, value: Any, path: str, *, positive: bool = False, limit: float = math.inf) -> float | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.add(path, f"must be a number, got {kind(value)}")
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
            self.add(path, f"must be > 0, got {short(value)}")
            return None
        if number < 0:
            self.add(path, f"must be >= 0, got {short(value)}")
            return None
        if number > limit:
            self.add(path, f"must be at most {limit:g}, got {short(value)}")
            return None
        return number

    def seconds(
        self, mapping: Mapping[str, Any], key: str, path: str, default: float, *, positive: bool = False
    ) -> duration_pb2.Duration:
        """`mapping[key]` as a Duration; the default when absent or bad (bad is reported)."""
        value = mapping.get(key)
        if value is None:
            return pbtime.duration(default)
        number = self.number(value, join(path, key), positive=positive, limit=schema.MAX_DURATION_S)
        return pbtime.duration(default if number is None else number)

    def choice(self, raw: Any, path: str, choices: Mapping[str, int]) -> int | None:
        """An enum value by its case-insensitive name."""
        if isinstance(raw, str) and raw.strip().lower() in choices:
            return choices[raw.strip().lower()]
        shown = repr(short(raw)) if isinstance(raw, str) else kind(raw)
        self.add(path, f"must be one of {', '.join(choices)} (case-insensitive), got {shown}")
        return None


def json_text(value: Any, *, sort_keys: bool = False) -> str | None:
    """Loaded YAML as JSON text; None if it holds what JSON cannot (a date, NaN, a set)."""
    try:
        return json.dumps(value, sort_keys=sort_keys, allow_nan=False)
    except (TypeError, ValueError):
        return None


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def short(text: Any, limit: int = 64) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def kind(value: Any) -> str:
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


def fmt_number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)

"""The `service.readiness_probe` section: path, timings, POST body and (secret) headers."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from replicaplane.common.v1 import spec_pb2
from services.common.spec import checks, schema

PATH = "service.readiness_probe"
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def parse(c: checks.Checker, raw: Any, out: spec_pb2.ReadinessProbe) -> None:
    """Fills `out` from a probe given as a path string or a mapping; defaults where absent."""
    probe: dict[Any, Any] | None = {}
    if isinstance(raw, str):
        probe = {"path": raw}
    elif raw is not None:
        probe = c.mapping(raw, PATH)
    if probe is None:
        probe = {}
    else:
        c.keys(probe, PATH, schema.PROBE_KEYS, {})

    out.path = schema.DEFAULT_READINESS_PATH
    if probe.get("path") is not None:
        text = c.string(probe["path"], f"{PATH}.path")
        if text is not None:
            if not text.startswith("/"):
                c.add(f"{PATH}.path", "must start with '/'")
            elif any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in text):
                c.add(f"{PATH}.path", "must not contain whitespace or control characters")
            else:
                out.path = text
    out.initial_delay.CopyFrom(c.seconds(probe, "initial_delay_seconds", PATH, schema.DEFAULT_INITIAL_DELAY_S))
    out.timeout.CopyFrom(c.seconds(probe, "timeout_seconds", PATH, schema.DEFAULT_PROBE_TIMEOUT_S, positive=True))
    out.probe_interval.CopyFrom(
        c.seconds(probe, "endpoint_probe_interval_seconds", PATH, schema.DEFAULT_PROBE_INTERVAL_S, positive=True)
    )
    out.consecutive_failure_threshold.CopyFrom(
        c.seconds(probe, "consecutive_failure_threshold_timeout", PATH, schema.DEFAULT_CONSECUTIVE_FAILURE_THRESHOLD_S)
    )
    out.post_data_json = _post_data(c, probe.get("post_data"), f"{PATH}.post_data")
    out.headers.update(_headers(c, probe.get("headers"), f"{PATH}.headers"))


def _post_data(c: checks.Checker, raw: Any, path: str) -> str:
    """Returns the probe body as JSON text; empty means GET (as SkyPilot, JSON `null` too)."""
    if raw is None:
        return ""
    value = raw
    too_deep = f"must not nest lists and mappings more than {schema.MAX_POST_DATA_DEPTH} levels deep"
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
        c.add(path, f"must be a mapping or a JSON string, got {checks.kind(raw)}")
        return ""
    if value is None:
        return ""
    if _nesting(value) > schema.MAX_POST_DATA_DEPTH:
        c.add(path, too_deep)
        return ""
    text = checks.json_text(value)
    if text is None:
        c.add(path, "must hold only JSON values (strings, numbers, booleans, null, lists, mappings)")
        return ""
    return text


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
        if deepest > schema.MAX_POST_DATA_DEPTH:
            break
        pending.extend((child, level + 1) for child in children)
    return deepest


def _headers(c: checks.Checker, raw: Any, path: str) -> dict[str, str]:
    """Returns probe headers. Values are secret: no description ever includes one."""
    headers = c.mapping(raw, path)
    if not headers:
        return {}
    out: dict[str, str] = {}
    for key, value in headers.items():
        if not isinstance(key, str) or not _HEADER_NAME_RE.fullmatch(key):
            c.add(path, "header names must be non-empty HTTP tokens (letters, digits, '-', ...)")
            continue
        field = f"{path}.{checks.short(key)}"
        if not isinstance(value, str):
            c.add(field, f"header value must be a string, got {checks.kind(value)}")
        elif any(ch in value for ch in "\r\n\0"):
            c.add(field, "header value must not contain line breaks or NUL")
        else:
            out[key] = value
    return out

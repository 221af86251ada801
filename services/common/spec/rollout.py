"""The `service.rollout` section: how an update moves replicas and traffic to the new version.

It sits inside `service:` with the other serving settings (SkyPilot refuses unknown keys at the top
level and in `service:` alike, so neither place keeps such a YAML runnable on SkyPilot; changing
only this section is an in-place update, as for the rest of `service:`). A top-level `rollout:`
is refused with a pointer here. Every default is filled in, so the stored section is complete.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replicaplane.common.v1 import spec_pb2
from services.common import pbtime
from services.common.spec import checks, schema

_PATH = "service.rollout"


def parse(c: checks.Checker, raw: Any, out: spec_pb2.RolloutPolicy) -> None:
    """Fills `out` from the loaded `service.rollout` value (None when absent), defaults included."""
    out.strategy = spec_pb2.ROLLOUT_STRATEGY_ROLLING
    out.progress_deadline.CopyFrom(pbtime.duration(schema.DEFAULT_PROGRESS_DEADLINE_S))
    out.auto_rollback = True
    section = c.mapping(raw, _PATH)
    _analysis(c, None if section is None else section.get("analysis"), out.analysis)
    if section is None:
        return
    c.keys(section, _PATH, schema.ROLLOUT_KEYS, {})
    if section.get("strategy") is not None:
        chosen = c.choice(section["strategy"], f"{_PATH}.strategy", schema.ROLLOUT_STRATEGIES)
        if chosen is not None:
            out.strategy = spec_pb2.RolloutStrategy.ValueType(chosen)
    out.progress_deadline.CopyFrom(
        c.seconds(section, "progress_deadline_seconds", _PATH, schema.DEFAULT_PROGRESS_DEADLINE_S, positive=True)
    )
    if section.get("auto_rollback") is not None:
        flag = c.boolean(section["auto_rollback"], f"{_PATH}.auto_rollback")
        out.auto_rollback = True if flag is None else flag
    _steps(c, section.get("steps"), out)


def _steps(c: checks.Checker, raw: Any, out: spec_pb2.RolloutPolicy) -> None:
    path = f"{_PATH}.steps"
    canary = out.strategy == spec_pb2.ROLLOUT_STRATEGY_CANARY
    if raw is None:
        if canary:
            for default_weight, default_pause in schema.DEFAULT_CANARY_STEPS:
                out.steps.add(weight=default_weight, pause=pbtime.duration(default_pause))
        return
    if not isinstance(raw, list):
        c.add(path, f"must be a list, got {checks.kind(raw)}")
        return
    if not canary:
        c.add(path, "steps apply to strategy: canary only")
        return
    if not raw:
        c.add(path, "a canary needs at least one step")
        return
    previous = 0
    for i, item in enumerate(raw):
        where = f"{path}[{i}]"
        step = c.mapping(item, where)
        if step is None:
            continue
        c.keys(step, where, schema.ROLLOUT_STEP_KEYS, {})
        weight: int | None = None
        if step.get("weight") is None:
            c.add(f"{where}.weight", "required")
        else:
            weight = c.integer(step["weight"], f"{where}.weight", minimum=1, maximum=100)
        if weight is not None and weight <= previous:
            c.add(
                f"{where}.weight",
                f"must be above the previous step's {previous} (weights strictly increase), got {weight}",
            )
            weight = None
        pause = c.seconds(step, "pause_seconds", where, schema.DEFAULT_STEP_PAUSE_S)
        if weight is not None:
            previous = weight
            out.steps.add(weight=weight, pause=pause)


def _analysis(c: checks.Checker, raw: Any, out: spec_pb2.RolloutAnalysis) -> None:
    path = f"{_PATH}.analysis"
    out.max_error_rate_increase_pct = schema.DEFAULT_MAX_ERROR_RATE_INCREASE_PCT
    out.window.CopyFrom(pbtime.duration(schema.DEFAULT_ANALYSIS_WINDOW_S))
    out.min_requests = schema.DEFAULT_ANALYSIS_MIN_REQUESTS
    section = c.mapping(raw, path)
    if not section:
        return
    c.keys(section, path, schema.ROLLOUT_ANALYSIS_KEYS, {})
    value = _number(c, section, "max_error_rate_increase_pct", path, limit=100.0)
    if value is not None:
        out.max_error_rate_increase_pct = value
    if section.get("window_seconds") is not None:
        window = c.number(
            section["window_seconds"], f"{path}.window_seconds", positive=True, limit=schema.MAX_ANALYSIS_WINDOW_S
        )
        if window is not None:
            out.window.CopyFrom(pbtime.duration(window))
    if section.get("min_requests") is not None:
        count = c.integer(section["min_requests"], f"{path}.min_requests", minimum=1, maximum=1_000_000)
        if count is not None:
            out.min_requests = count
    ratio = _number(c, section, "max_latency_p99_ratio", path, positive=True, limit=1000.0)
    if ratio is not None:
        if ratio <= 1:
            c.add(
                f"{path}.max_latency_p99_ratio",
                f"must be > 1 (the new version's p99 over the stable one's), got {checks.fmt_number(ratio)}",
            )
        else:
            out.max_latency_p99_ratio = ratio


def _number(
    c: checks.Checker, section: Mapping[Any, Any], key: str, path: str, *, positive: bool = False, limit: float
) -> float | None:
    if section.get(key) is None:
        return None
    return c.number(section[key], f"{path}.{key}", positive=positive, limit=limit)

"""The `service.rollout` section of a spec: strategy, canary steps, deadline, rollback, analysis."""

from __future__ import annotations

import textwrap

import pytest

from replicaplane.common.v1 import spec_pb2
from services.common import errors, spec

TAIL = "resources:\n  ports: 8080\nrun: python3 app.py\n"


def doc(rollout: str) -> str:
    """A spec whose service section has `rollout` (YAML lines, indented under service:)."""
    body = textwrap.indent(textwrap.dedent(rollout).strip("\n"), "  ")
    return f"service:\n  replicas: 2\n{body}\n{TAIL}"


def violations(text: str) -> list[tuple[str, str]]:
    with pytest.raises(errors.ValidationError) as err:
        spec.parse(text)
    return [(v.field, v.description) for v in err.value.violations]


def test_without_a_rollout_section_every_default_is_filled_in() -> None:
    r = spec.parse(f"service:\n  replicas: 2\n{TAIL}").service.rollout
    assert r.strategy == spec_pb2.ROLLOUT_STRATEGY_ROLLING
    assert list(r.steps) == []
    assert spec.seconds(r.progress_deadline) == 600
    assert r.auto_rollback is True
    a = r.analysis
    assert (a.max_error_rate_increase_pct, spec.seconds(a.window), a.min_requests) == (5, 30, 20)
    assert not a.HasField("max_latency_p99_ratio")


def test_a_full_canary_section_is_stored() -> None:
    r = spec.parse(
        doc("""
        rollout:
          strategy: Canary
          steps:
            - {weight: 10, pause_seconds: 120}
            - {weight: 50}
            - {weight: 100, pause_seconds: 0}
          progress_deadline_seconds: 900
          auto_rollback: false
          analysis:
            max_error_rate_increase_pct: 2.5
            window_seconds: 60
            min_requests: 50
            max_latency_p99_ratio: 1.5
        """)
    ).service.rollout
    assert r.strategy == spec_pb2.ROLLOUT_STRATEGY_CANARY
    assert [(s.weight, spec.seconds(s.pause)) for s in r.steps] == [(10, 120), (50, 60), (100, 0)]
    assert spec.seconds(r.progress_deadline) == 900
    assert r.auto_rollback is False
    a = r.analysis
    assert (a.max_error_rate_increase_pct, spec.seconds(a.window), a.min_requests) == (2.5, 60, 50)
    assert a.max_latency_p99_ratio == 1.5


def test_a_canary_without_steps_gets_the_default_steps() -> None:
    r = spec.parse(doc("rollout: {strategy: canary}")).service.rollout
    assert [(s.weight, spec.seconds(s.pause)) for s in r.steps] == [(10, 60), (50, 60)]


@pytest.mark.parametrize("strategy", ["rolling", "blue_green", "BLUE_GREEN"])
def test_other_strategies(strategy: str) -> None:
    r = spec.parse(doc(f"rollout: {{strategy: {strategy}}}")).service.rollout
    assert spec_pb2.RolloutStrategy.Name(r.strategy) == f"ROLLOUT_STRATEGY_{strategy.upper()}"
    assert list(r.steps) == []


@pytest.mark.parametrize(
    ("rollout", "expected"),
    [
        ("rollout: canary", [("service.rollout", "must be a mapping, got a string")]),
        (
            "rollout: {strategy: linear}",
            [
                (
                    "service.rollout.strategy",
                    "must be one of rolling, blue_green, canary (case-insensitive), got 'linear'",
                )
            ],
        ),
        ("rollout: {speed: 3}", [("service.rollout.speed", "unknown key 'speed' in service.rollout")]),
        (
            "rollout: {strategy: rolling, steps: [{weight: 10}]}",
            [("service.rollout.steps", "steps apply to strategy: canary only")],
        ),
        ("rollout: {strategy: canary, steps: []}", [("service.rollout.steps", "a canary needs at least one step")]),
        (
            "rollout: {strategy: canary, steps: {weight: 10}}",
            [("service.rollout.steps", "must be a list, got a mapping")],
        ),
        (
            "rollout: {strategy: canary, steps: [10]}",
            [("service.rollout.steps[0]", "must be a mapping, got an integer")],
        ),
        ("rollout: {strategy: canary, steps: [{pause_seconds: 5}]}", [("service.rollout.steps[0].weight", "required")]),
        (
            "rollout: {strategy: canary, steps: [{weight: 0}, {weight: 101}]}",
            [
                ("service.rollout.steps[0].weight", "must be >= 1, got 0"),
                ("service.rollout.steps[1].weight", "must be at most 100, got 101"),
            ],
        ),
        (
            "rollout: {strategy: canary, steps: [{weight: 10}, {weight: 50}, {weight: 50}, {weight: 20}]}",
            [
                (
                    "service.rollout.steps[2].weight",
                    "must be above the previous step's 50 (weights strictly increase), got 50",
                ),
                (
                    "service.rollout.steps[3].weight",
                    "must be above the previous step's 50 (weights strictly increase), got 20",
                ),
            ],
        ),
        (
            "rollout: {strategy: canary, steps: [{weight: 10.5, pause_seconds: -1, hold: 1}]}",
            [
                ("service.rollout.steps[0].hold", "unknown key 'hold' in service.rollout.steps[0]"),
                ("service.rollout.steps[0].weight", "must be an integer, got a decimal number"),
                ("service.rollout.steps[0].pause_seconds", "must be >= 0, got -1"),
            ],
        ),
        (
            "rollout: {progress_deadline_seconds: 0, auto_rollback: 'yes'}",
            [
                ("service.rollout.progress_deadline_seconds", "must be > 0, got 0"),
                ("service.rollout.auto_rollback", "must be a boolean (true or false), got a string"),
            ],
        ),
        (
            "rollout: {analysis: {max_error_rate_increase_pct: 101, window_seconds: 0, min_requests: 0, "
            "max_latency_p99_ratio: 1, extra: 1}}",
            [
                ("service.rollout.analysis.extra", "unknown key 'extra' in service.rollout.analysis"),
                ("service.rollout.analysis.max_error_rate_increase_pct", "must be at most 100, got 101"),
                ("service.rollout.analysis.window_seconds", "must be > 0, got 0"),
                ("service.rollout.analysis.min_requests", "must be >= 1, got 0"),
                (
                    "service.rollout.analysis.max_latency_p99_ratio",
                    "must be > 1 (the new version's p99 over the stable one's), got 1",
                ),
            ],
        ),
        (
            "rollout: {analysis: {window_seconds: 7200}}",
            [("service.rollout.analysis.window_seconds", "must be at most 3600, got 7200")],
        ),
        ("rollout: {analysis: []}", [("service.rollout.analysis", "must be a mapping, got a list")]),
    ],
)
def test_each_mistake_names_its_field(rollout: str, expected: list[tuple[str, str]]) -> None:
    assert violations(doc(rollout)) == expected


def test_a_top_level_rollout_points_to_the_service_section() -> None:
    text = f"rollout: {{strategy: canary}}\nservice:\n  replicas: 1\n{TAIL}"
    assert violations(text) == [("rollout", "rollout: belongs in the service: section (service.rollout)")]


def test_a_rollout_change_alone_is_an_in_place_update() -> None:
    old = spec.parse(doc("rollout: {strategy: rolling}"))
    new = spec.parse(doc("rollout: {strategy: canary, steps: [{weight: 20}]}"))
    assert spec.is_in_place_update(old, new)


def test_an_empty_rollout_section_means_the_defaults() -> None:
    assert spec.parse(doc("rollout:")).service.rollout == spec.parse(doc("rollout: {}")).service.rollout
    assert (
        spec.parse(doc("rollout: {}")).service.rollout == spec.parse(f"service:\n  replicas: 2\n{TAIL}").service.rollout
    )

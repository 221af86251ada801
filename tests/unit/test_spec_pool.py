"""Unit tests for pool specs (`pool:` or `service: {pool: ...}`): fields, defaults, SkyPilot's
rules (each violation naming its field), in-place updates and the derived answers."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import duration_pb2

from replicaplane.common.v1 import spec_pb2
from services.common import errors, spec


def _get(message: Any, dotted: str) -> Any:
    value = message
    for part in dotted.split("."):
        value = getattr(value, part)
    return spec.seconds(value) if isinstance(value, duration_pb2.Duration) else value


def _fields(text: str) -> set[str]:
    with pytest.raises(errors.ValidationError) as info:
        spec.parse(text)
    return {v.field for v in info.value.violations}


P = "service.pool"
SETUP = "setup: pip install -r requirements.txt\n"

GOOD = {
    "fixed_size_workers": (
        "pool: {workers: 3}\n" + SETUP,
        {
            "kind": spec_pb2.FLEET_KIND_POOL,
            f"{P}.min_workers": 3,
            f"{P}.max_workers": 3,
            f"{P}.fixed_workers_shorthand": True,
            f"{P}.queue_length_threshold": 0,
            f"{P}.failure_threshold": 10.0,
            "setup": "pip install -r requirements.txt",
        },
    ),
    "zero_workers": ("pool: {workers: 0}\n", {f"{P}.min_workers": 0, f"{P}.max_workers": 0}),
    "autoscaling_defaults": (
        "pool: {min_workers: 0, max_workers: 3}\n",
        {
            f"{P}.min_workers": 0,
            f"{P}.max_workers": 3,
            f"{P}.fixed_workers_shorthand": False,
            f"{P}.queue_length_threshold": 1,
            f"{P}.upscale_delay": 300.0,
            f"{P}.downscale_delay": 1200.0,
            f"{P}.failure_threshold": 10.0,
        },
    ),
    "autoscaling_settings": (
        "pool:\n  min_workers: 1\n  max_workers: 8\n  queue_length_threshold: 4\n"
        "  upscale_delay_seconds: 5\n  downscale_delay_seconds: 60\n  failure_threshold_seconds: 30\n",
        {
            f"{P}.queue_length_threshold": 4,
            f"{P}.upscale_delay": 5.0,
            f"{P}.downscale_delay": 60.0,
            f"{P}.failure_threshold": 30.0,
        },
    ),
    "max_workers_alone_starts_at_one": (
        "pool: {max_workers: 4}\n",
        {f"{P}.min_workers": 1, f"{P}.max_workers": 4, f"{P}.queue_length_threshold": 1},
    ),
    "workers_with_max_workers_is_the_minimum": (
        "pool: {workers: 2, max_workers: 5}\n",
        {f"{P}.min_workers": 2, f"{P}.max_workers": 5, f"{P}.fixed_workers_shorthand": False},
    ),
    "failure_threshold_for_a_fixed_pool": (
        "pool: {workers: 1, failure_threshold_seconds: 0}\n",
        {f"{P}.failure_threshold": 0.0},
    ),
    "wrapped_in_service": (
        "service:\n  pool: {workers: 2}\n",
        {"kind": spec_pb2.FLEET_KIND_POOL, f"{P}.min_workers": 2, f"{P}.max_workers": 2},
    ),
    "run_is_ignored_as_skypilot_does": ("pool: {workers: 1}\nrun: echo never\n", {"run": ""}),
    "spot_and_any_of_resources": (
        "pool: {workers: 1}\nresources: {use_spot: true, any_of: [{cpus: 2}, {cpus: 4}]}\n",
        {"resources.use_spot": True},
    ),
    "envs_and_secrets_reach_workers": (
        "pool: {workers: 1}\nenvs: {A: 1}\nsecrets: {T: x}\n",
        {"envs": {"A": "1"}, "secrets": {"T": "x"}},
    ),
    "no_serving_settings": (
        "pool: {workers: 1}\n",
        {
            "service.port": 0,
            "service.load_balancing_policy": spec_pb2.LOAD_BALANCING_POLICY_UNSPECIFIED,
            "service.replica_policy.max_replicas": 0,
            "service.readiness_probe.path": "",
        },
    ),
}


@pytest.mark.parametrize("text, expected", list(GOOD.values()), ids=list(GOOD))
def test_good_pool_fields(text: str, expected: dict[str, Any]) -> None:
    parsed = spec.parse(text)
    for field, value in expected.items():
        got = _get(parsed, field)
        got = dict(got) if field in ("envs", "secrets") else got
        assert got == value, field


def test_a_service_is_of_kind_service() -> None:
    parsed = spec.parse("service: {replicas: 1}\nresources: {ports: 8080}\n")
    assert parsed.kind == spec_pb2.FLEET_KIND_SERVICE and not parsed.service.HasField("pool")


BAD = {
    "service_and_pool_together": ("pool: {workers: 1}\nservice: {replicas: 1}\n", {"pool"}),
    "no_size": ("pool: {}\n", {"pool"}),
    "null_pool": ("pool:\n", {"pool"}),
    "not_a_mapping": ("pool: 3\n", {"pool"}),
    "unknown_key": ("pool: {workers: 1, worker: 2}\n", {"pool.worker"}),
    "min_workers_without_max": ("pool: {min_workers: 1}\n", {"pool.max_workers"}),
    "min_above_max": ("pool: {min_workers: 3, max_workers: 2}\n", {"pool.max_workers"}),
    "workers_above_max": ("pool: {workers: 3, max_workers: 2}\n", {"pool.max_workers"}),
    "max_below_the_default_min": ("pool: {max_workers: 0}\n", {"pool.max_workers"}),
    "workers_and_min_workers": ("pool: {workers: 1, min_workers: 0, max_workers: 2}\n", {"pool.workers"}),
    "negative_workers": ("pool: {workers: -1}\n", {"pool.workers"}),
    "fractional_workers": ("pool: {workers: 1.5}\n", {"pool.workers"}),
    "workers_over_the_cap": ("pool: {min_workers: 0, max_workers: 100000}\n", {"pool.max_workers"}),
    "queue_threshold_without_max": ("pool: {workers: 2, queue_length_threshold: 2}\n", {"pool.queue_length_threshold"}),
    "queue_threshold_zero": ("pool: {max_workers: 2, queue_length_threshold: 0}\n", {"pool.queue_length_threshold"}),
    "upscale_delay_without_max": ("pool: {workers: 2, upscale_delay_seconds: 1}\n", {"pool.upscale_delay_seconds"}),
    "downscale_delay_without_max": (
        "pool: {workers: 2, downscale_delay_seconds: 1}\n",
        {"pool.downscale_delay_seconds"},
    ),
    "negative_delay": ("pool: {max_workers: 2, upscale_delay_seconds: -1}\n", {"pool.upscale_delay_seconds"}),
    "negative_failure_threshold": (
        "pool: {workers: 1, failure_threshold_seconds: -5}\n",
        {"pool.failure_threshold_seconds"},
    ),
    "replicas_in_pool": ("pool: {workers: 1, replicas: 2}\n", {"pool.replicas"}),
    "replica_policy_in_pool": ("pool: {workers: 1, replica_policy: {min_replicas: 1}}\n", {"pool.replica_policy"}),
    "min_replicas_in_pool": ("pool: {workers: 1, min_replicas: 1}\n", {"pool.min_replicas"}),
    "ports_in_pool": ("pool: {workers: 1, ports: 8080}\n", {"pool.ports"}),
    "readiness_probe_in_pool": ("pool: {workers: 1, readiness_probe: /health}\n", {"pool.readiness_probe"}),
    "post_data_in_pool": ("pool: {workers: 1, post_data: {a: 1}}\n", {"pool.post_data"}),
    "headers_in_pool": ("pool: {workers: 1, headers: {X: y}}\n", {"pool.headers"}),
    "load_balancing_policy_in_pool": (
        "pool: {workers: 1, load_balancing_policy: round_robin}\n",
        {"pool.load_balancing_policy"},
    ),
    "qps_target_in_pool": ("pool: {max_workers: 2, target_qps_per_replica: 3}\n", {"pool.target_qps_per_replica"}),
    "overprovision_in_pool": ("pool: {workers: 1, num_overprovision: 1}\n", {"pool.num_overprovision"}),
    "base_fallback_in_pool": (
        "pool: {workers: 1, base_ondemand_fallback_replicas: 1}\n",
        {"pool.base_ondemand_fallback_replicas"},
    ),
    "dynamic_fallback_in_pool": (
        "pool: {workers: 1, dynamic_ondemand_fallback: true}\n",
        {"pool.dynamic_ondemand_fallback"},
    ),
    "spot_placer_in_pool": ("pool: {workers: 1, spot_placer: dynamic_fallback}\n", {"pool.spot_placer"}),
    "resources_ports": ("pool: {workers: 1}\nresources: {ports: 8080}\n", {"resources.ports"}),
    "any_of_entry_ports": (
        "pool: {workers: 1}\nresources: {any_of: [{cpus: 2}, {cpus: 4, ports: 8080}]}\n",
        {"resources.any_of[1].ports"},
    ),
    "ordered_resources": ("pool: {workers: 1}\nresources: {ordered: [{cpus: 2}, {cpus: 4}]}\n", {"resources.ordered"}),
    "wrapped_no_size": ("service:\n  pool: {}\n", {"service.pool"}),
    "wrapped_min_without_max": ("service:\n  pool: {min_workers: 1}\n", {"service.pool.max_workers"}),
    "wrapped_replicas_beside": ("service:\n  pool: {workers: 1}\n  replicas: 2\n", {"service.replicas"}),
    "wrapped_replica_policy_beside": (
        "service:\n  pool: {workers: 1}\n"
        "  replica_policy: {min_replicas: 1, max_replicas: 2, target_qps_per_replica: 1}\n",
        {"service.replica_policy"},
    ),
    "wrapped_ports_beside": ("service:\n  pool: {workers: 1}\n  ports: 8080\n", {"service.ports"}),
    "wrapped_probe_beside": ("service:\n  pool: {workers: 1}\n  readiness_probe: /\n", {"service.readiness_probe"}),
    "wrapped_lb_policy_beside": (
        "service:\n  pool: {workers: 1}\n  load_balancing_policy: least_load\n",
        {"service.load_balancing_policy"},
    ),
    "wrapped_load_balancer_beside": (
        "service:\n  pool: {workers: 1}\n  load_balancer: {stream_timeout_seconds: 3}\n",
        {"service.load_balancer"},
    ),
    "wrapped_rollout_beside": ("service:\n  pool: {workers: 1}\n  rollout: {strategy: canary}\n", {"service.rollout"}),
    "wrapped_workers_beside": ("service:\n  pool: {}\n  workers: 2\n", {"service.pool", "service.workers"}),
    "workers_in_a_service": ("service: {workers: 2}\nresources: {ports: 8080}\n", {"service.workers"}),
    "every_problem_at_once": (
        "pool: {min_workers: 1, ports: 80}\nresources: {ports: 80, ordered: [{cpus: 1}]}\n",
        {"pool.max_workers", "pool.ports", "resources.ports", "resources.ordered"},
    ),
}


@pytest.mark.parametrize("text, fields", list(BAD.values()), ids=list(BAD))
def test_bad_pool_violations_name_their_fields(text: str, fields: set[str]) -> None:
    assert _fields(text) == fields


def test_pool_violations_say_how_to_fix() -> None:
    with pytest.raises(errors.ValidationError) as info:
        spec.parse("pool: {min_workers: 1, target_qps_per_replica: 2}\nservice: {}\n")
    described = {v.field: v.description for v in info.value.violations}
    assert described["pool"] == "pool and service are mutually exclusive: a pool runs jobs, a service serves requests"
    assert described["pool.max_workers"] == "required with min_workers"
    assert "job queue" in described["pool.target_qps_per_replica"]


# ---------------------------------------------------------------------------------------------
# In-place updates: changes to `pool:` alone keep the workers (the seed 003 rule).

BASE = "pool: {min_workers: 0, max_workers: 3}\nresources: {cpus: 2}\nsetup: pip install x\nenvs: {A: '1'}\n"

IN_PLACE = {
    "identical": (BASE, True),
    "sizes": (BASE.replace("{min_workers: 0, max_workers: 3}", "{min_workers: 1, max_workers: 5}"), True),
    "fixed_size": (BASE.replace("{min_workers: 0, max_workers: 3}", "{workers: 2}"), True),
    "threshold_and_delays": (
        BASE.replace(
            "max_workers: 3}",
            "max_workers: 3, queue_length_threshold: 5, upscale_delay_seconds: 1, downscale_delay_seconds: 2}",
        ),
        True,
    ),
    "failure_threshold": (BASE.replace("max_workers: 3}", "max_workers: 3, failure_threshold_seconds: 60}"), True),
    "wrapped_form": (BASE.replace("pool: {min_workers: 0, max_workers: 3}", "service: {pool: {workers: 1}}"), True),
    "ignored_run": (BASE + "run: echo ignored\n", True),
    "setup": (BASE.replace("pip install x", "pip install y"), False),
    "envs": (BASE.replace("'1'", "'2'"), False),
    "resources": (BASE.replace("cpus: 2", "cpus: 4"), False),
    "workdir": (BASE + "workdir: /srv\n", False),
    "to_a_service": (
        BASE.replace("pool: {min_workers: 0, max_workers: 3}", "service: {replicas: 1}")
        .replace("{cpus: 2}", "{cpus: 2, ports: 8080}")
        .replace("setup:", "run: python3 -m http.server 8080\nsetup:"),
        False,
    ),
}


@pytest.mark.parametrize("new, expected", list(IN_PLACE.values()), ids=list(IN_PLACE))
def test_pool_in_place_updates(new: str, expected: bool) -> None:
    old = spec.parse(BASE)
    assert spec.is_in_place_update(old, spec.parse(new)) is expected
    assert spec.is_in_place_update(spec.parse(new), old) is expected


def test_a_service_stored_before_kinds_existed_is_in_place_with_its_reparse() -> None:
    text = "service: {replicas: 2}\nresources: {ports: 8080}\nrun: python3 app.py\n"
    stored = spec.parse(text)
    stored.ClearField("kind")  # as written before pools
    assert spec.is_in_place_update(stored, spec.parse(text.replace("replicas: 2", "replicas: 3")))


def test_a_service_and_a_pool_with_the_same_commands_are_not_in_place() -> None:
    service = spec.parse("service: {replicas: 1}\nresources: {cpus: 1, ports: 8080}\nsetup: s\n")
    pool = spec.parse("pool: {workers: 1}\nresources: {cpus: 1}\nsetup: s\n")
    assert not spec.is_in_place_update(service, pool)


# ---------------------------------------------------------------------------------------------
# Derived answers.


def test_derived_answers_for_pools_and_services() -> None:
    fixed = spec.parse("pool: {workers: 2}\n")
    scaled = spec.parse("pool: {min_workers: 0, max_workers: 2, failure_threshold_seconds: 4}\n")
    service = spec.parse("service: {replicas: 1}\nresources: {ports: 8080}\n")
    assert spec.is_pool(fixed) and spec.is_pool(scaled) and not spec.is_pool(service)
    assert spec.autoscaler_kind(fixed) == spec.autoscaler_kind(scaled) == "queue_length"
    assert not spec.is_autoscaling(fixed) and spec.is_autoscaling(scaled)
    assert spec.failure_threshold_s(fixed) == spec.DEFAULT_POOL_FAILURE_THRESHOLD_S == 10.0
    assert spec.failure_threshold_s(scaled) == 4.0
    assert spec.failure_threshold_s(service) == 180.0


def test_pool_yaml_examples_are_valid() -> None:
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    found = sorted((root / "examples" / "pool").glob("*.yaml"))
    assert found, "examples/pool/ holds at least one pool"
    for path in found:
        assert spec.is_pool(spec.parse(path.read_text()))

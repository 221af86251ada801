"""Unit tests for services.common.spec: parsing, defaults, validation and in-place updates."""

from __future__ import annotations

import json
import pathlib
import textwrap
from typing import Any

import pytest
import yaml
from google.protobuf import duration_pb2
from google.protobuf.internal import containers

from replicaplane.common.v1 import spec_pb2
from services.common import errors, spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
PORT = "resources:\n  ports: 8080\n"


def _yaml(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def _get(message: Any, dotted: str) -> Any:
    """Reads a dotted field path; Durations as float seconds, containers as list/dict."""
    value = message
    for part in dotted.split("."):
        value = getattr(value, part)
    if isinstance(value, duration_pb2.Duration):
        return spec.seconds(value)
    if isinstance(value, containers.ScalarMap | containers.MessageMap):
        return dict(value)
    if isinstance(value, containers.RepeatedScalarFieldContainer):
        return list(value)
    return value


def _violations(text: str, **kwargs: Any) -> list[errors.FieldViolation]:
    with pytest.raises(errors.ValidationError) as info:
        spec.parse(text, **kwargs)
    return info.value.violations


def _fields(text: str, **kwargs: Any) -> set[str]:
    return {v.field for v in _violations(text, **kwargs)}


# ---------------------------------------------------------------------------------------------
# Good specs: each case is (YAML, expected fields). Unlisted fields are checked by the defaults
# test below.

LB = spec_pb2.LoadBalancingPolicy
GOOD = {
    "probe_as_path_string": (
        "service:\n  readiness_probe: /health\n" + PORT,
        {"service.readiness_probe.path": "/health", "service.readiness_probe.post_data_json": ""},
    ),
    "probe_as_mapping": (
        _yaml("""
            service:
              readiness_probe:
                path: /ready
                initial_delay_seconds: 30
                timeout_seconds: 2.5
                endpoint_probe_interval_seconds: 1
                consecutive_failure_threshold_timeout: 60
            """)
        + PORT,
        {
            "service.readiness_probe.path": "/ready",
            "service.readiness_probe.initial_delay": 30.0,
            "service.readiness_probe.timeout": 2.5,
            "service.readiness_probe.probe_interval": 1.0,
            "service.readiness_probe.consecutive_failure_threshold": 60.0,
        },
    ),
    "probe_mapping_without_path_defaults_to_root": (
        "service:\n  readiness_probe: {initial_delay_seconds: 0}\n" + PORT,
        {"service.readiness_probe.path": "/", "service.readiness_probe.initial_delay": 0.0},
    ),
    "replicas_shorthand": (
        "service:\n  replicas: 3\n" + PORT,
        {
            "service.replica_policy.min_replicas": 3,
            "service.replica_policy.max_replicas": 3,
            "service.fixed_replicas_shorthand": True,
        },
    ),
    "replicas_zero": (
        "service:\n  replicas: 0\n" + PORT,
        {"service.replica_policy.min_replicas": 0, "service.replica_policy.max_replicas": 0},
    ),
    "replica_policy_fixed_max_defaults_to_min": (
        "service:\n  replica_policy: {min_replicas: 2}\n" + PORT,
        {
            "service.replica_policy.min_replicas": 2,
            "service.replica_policy.max_replicas": 2,
            "service.fixed_replicas_shorthand": False,
        },
    ),
    "autoscaling_with_target_qps": (
        _yaml("""
            service:
              replica_policy:
                min_replicas: 1
                max_replicas: 5
                target_qps_per_replica: 2.5
                upscale_delay_seconds: 30
                downscale_delay_seconds: 90
                num_overprovision: 1
            """)
        + PORT,
        {
            "service.replica_policy.max_replicas": 5,
            "service.replica_policy.target_qps_per_replica": 2.5,
            "service.replica_policy.upscale_delay": 30.0,
            "service.replica_policy.downscale_delay": 90.0,
            "service.replica_policy.num_overprovision": 1,
        },
    ),
    "target_qps_with_equal_min_max": (
        "service:\n  replica_policy: {min_replicas: 2, max_replicas: 2, target_qps_per_replica: 1}\n" + PORT,
        {"service.replica_policy.target_qps_per_replica": 1.0},
    ),
    "spot_with_fallbacks_and_placer": (
        _yaml("""
            service:
              replica_policy:
                min_replicas: 2
                max_replicas: 4
                target_qps_per_replica: 1
                base_ondemand_fallback_replicas: 1
                dynamic_ondemand_fallback: true
                spot_placer: Dynamic_Fallback
            resources:
              ports: 8080
              use_spot: true
            """),
        {
            "resources.use_spot": True,
            "service.replica_policy.base_ondemand_fallback_replicas": 1,
            "service.replica_policy.dynamic_ondemand_fallback": True,
            "service.replica_policy.spot_placer": spec_pb2.SPOT_PLACER_DYNAMIC_FALLBACK,
        },
    ),
    "fallback_zero_and_false_need_no_spot": (
        _yaml("""
            service:
              replica_policy: {min_replicas: 1, base_ondemand_fallback_replicas: 0, dynamic_ondemand_fallback: false}
            """)
        + PORT,
        {"service.replica_policy.base_ondemand_fallback_replicas": 0, "resources.use_spot": False},
    ),
    "instance_aware_dict_target": (
        _yaml("""
            service:
              replica_policy:
                min_replicas: 1
                max_replicas: 3
                target_qps_per_replica: {A100: 5, "H100:1": 10}
              load_balancing_policy: INSTANCE_AWARE_LEAST_LOAD
            """)
        + PORT,
        {
            "service.replica_policy.target_qps_per_accelerator": {"A100": 5.0, "H100:1": 10.0},
            "service.replica_policy.target_qps_per_replica": 0.0,
            "service.load_balancing_policy": LB.LOAD_BALANCING_POLICY_INSTANCE_AWARE_LEAST_LOAD,
        },
    ),
    "load_balancing_round_robin_case_insensitive": (
        "service:\n  load_balancing_policy: Round_Robin\n" + PORT,
        {"service.load_balancing_policy": LB.LOAD_BALANCING_POLICY_ROUND_ROBIN},
    ),
    "post_data_mapping": (
        "service:\n  readiness_probe: {path: /v1, post_data: {model: x, n: 1}}\n" + PORT,
        {"service.readiness_probe.post_data_json": json.dumps({"model": "x", "n": 1})},
    ),
    "post_data_json_string": (
        "service:\n  readiness_probe: {path: /v1, post_data: '{\"a\": [1, 2]}'}\n" + PORT,
        {"service.readiness_probe.post_data_json": '{"a": [1, 2]}'},
    ),
    "post_data_json_scalar_string": (
        "service:\n  readiness_probe: {path: /v1, post_data: '\"hello\"'}\n" + PORT,
        {"service.readiness_probe.post_data_json": '"hello"'},
    ),
    "post_data_json_null_means_get": (
        "service:\n  readiness_probe: {path: /v1, post_data: 'null'}\n" + PORT,
        {"service.readiness_probe.post_data_json": ""},
    ),
    "headers": (
        "service:\n  readiness_probe: {path: /, headers: {Authorization: Bearer abc, X-Id: '7'}}\n" + PORT,
        {"service.readiness_probe.headers": {"Authorization": "Bearer abc", "X-Id": "7"}},
    ),
    "ports_int": ("service: {}\nresources: {ports: 9000}\n", {"resources.ports": [9000], "service.port": 9000}),
    "ports_string": ("service: {}\nresources: {ports: '9000'}\n", {"resources.ports": [9000], "service.port": 9000}),
    "ports_single_item_list": (
        "service: {}\nresources: {ports: [9001]}\n",
        {"resources.ports": [9001], "service.port": 9001},
    ),
    "ports_range_with_service_port": (
        "service: {ports: 8081}\nresources: {ports: 8080-8082}\n",
        {"resources.ports": [8080, 8081, 8082], "service.port": 8081},
    ),
    "ports_list_mixed_with_service_port": (
        "service: {ports: 9002}\nresources: {ports: [9002, '9000-9001', '9005']}\n",
        {"resources.ports": [9000, 9001, 9002, 9005], "service.port": 9002},
    ),
    "ports_range_of_one": ("service: {}\nresources: {ports: '7000-7000'}\n", {"service.port": 7000}),
    "any_of_entries_merge_top_level": (
        _yaml("""
            service: {}
            resources:
              ports: 8080
              cpus: 4+
              use_spot: true
              any_of:
                - {infra: aws/us-east-1, accelerators: A100}
                - {cloud: GCP, cpus: 8}
            """),
        {"resources.use_spot": True, "resources.cpus": "4+", "service.port": 8080},
    ),
    "ordered_entries": (
        "service: {}\nresources:\n  ports: 8080\n  ordered: [{instance_type: m5.large}, {instance_type: m5.xlarge}]\n",
        {"service.port": 8080},
    ),
    "resources_hardware_fields": (
        _yaml("""
            service: {}
            resources:
              ports: 8080
              cpus: 2
              memory: 16+
              accelerators: {A100: 2, V100: 0.5}
              infra: k8s/my-context
              instance_type: n2-standard-8
              disk_size: 256
              image_id: docker:python:3.11
              labels: {team: ml}
            """),
        {
            "resources.cpus": "2",
            "resources.memory": "16+",
            "resources.accelerators": "A100:2,V100:0.5",
            "resources.cloud": "kubernetes",
            "resources.region": "my-context",
            "resources.instance_type": "n2-standard-8",
            "resources.disk_size": 256,
            "resources.image_id": "docker:python:3.11",
            "resources.labels": {"team": "ml"},
        },
    ),
    "accelerators_string_and_list_normalize": (
        "service: {}\nresources: {ports: 80, accelerators: 'A100', any_of: [{accelerators: [L4, 'T4:2']}]}\n",
        {"resources.accelerators": "A100:1"},
    ),
    "accelerators_set_form": (
        "service: {}\nresources: {ports: 80, accelerators: {H100:1, H200:1}}\n",
        {"resources.accelerators": "H100:1,H200:1"},
    ),
    "infra_cloud_region_zone": (
        "service: {}\nresources: {ports: 80, infra: AWS/us-east-1/us-east-1a}\n",
        {"resources.cloud": "aws", "resources.region": "us-east-1", "resources.zone": "us-east-1a"},
    ),
    "task_sections": (
        _yaml("""
            name: my-svc
            service: {}
            resources: {ports: 8080}
            envs: {A: 1, B: true, C: x, D: 1.5}
            secrets: {TOKEN: s3cr3t}
            setup: [pip install a, pip install b]
            run: python3 app.py
            workdir: /srv/app
            file_mounts: {/data: s3://bucket/data, /models: {source: gs://m, mode: MOUNT}}
            num_nodes: 1
            """),
        {
            "name": "my-svc",
            "envs": {"A": "1", "B": "True", "C": "x", "D": "1.5"},
            "secrets": {"TOKEN": "s3cr3t"},
            "setup": "pip install a\npip install b",
            "run": "python3 app.py",
            "workdir": "/srv/app",
            "file_mounts": {"/data": "s3://bucket/data", "/models": '{"mode": "MOUNT", "source": "gs://m"}'},
            "num_nodes": 1,
        },
    ),
    "env_references_fill_service_section": (
        _yaml("""
            service:
              readiness_probe:
                path: /v1/$ROUTE
                post_data: {model: "${MODEL}"}
                headers: {Authorization: "Bearer ${TOKEN}", X-Unknown: "$NOT_SET"}
            resources: {ports: 8080}
            envs: {MODEL: llama, ROUTE: models}
            secrets: {TOKEN: t0k}
            run: echo $MODEL
            """),
        {
            "service.readiness_probe.path": "/v1/models",
            "service.readiness_probe.post_data_json": '{"model": "llama"}',
            "service.readiness_probe.headers": {"Authorization": "Bearer t0k", "X-Unknown": "$NOT_SET"},
            "run": "echo $MODEL",
        },
    ),
    "null_sections_are_empty": (
        "name:\nservice:\n  readiness_probe:\n  replica_policy:\n    min_replicas: 1\nresources:\n  ports: 80\n"
        "envs:\nfile_mounts:\nsetup:\n",
        {"name": "", "envs": {}, "file_mounts": {}, "setup": "", "service.readiness_probe.path": "/"},
    ),
}


@pytest.mark.parametrize("text, expected", list(GOOD.values()), ids=list(GOOD))
def test_good_spec_fields(text: str, expected: dict[str, Any]) -> None:
    parsed = spec.parse(text)
    assert parsed.yaml == text
    for path, want in expected.items():
        assert _get(parsed, path) == want, path


def test_defaults_for_minimal_spec() -> None:
    parsed = spec.parse("service: {}\nresources: {ports: 8080}\n")
    probe = parsed.service.readiness_probe
    policy = parsed.service.replica_policy
    assert probe.path == "/"
    assert spec.seconds(probe.initial_delay) == 1200
    assert spec.seconds(probe.timeout) == 15
    assert spec.seconds(probe.probe_interval) == 10
    assert spec.seconds(probe.consecutive_failure_threshold) == 180
    assert probe.post_data_json == "" and not probe.headers
    assert (policy.min_replicas, policy.max_replicas) == (1, 1)
    assert policy.target_qps_per_replica == 0 and not policy.target_qps_per_accelerator
    assert spec.seconds(policy.upscale_delay) == 300
    assert spec.seconds(policy.downscale_delay) == 1200
    assert policy.num_overprovision == 0 and policy.base_ondemand_fallback_replicas == 0
    assert not policy.dynamic_ondemand_fallback
    assert policy.spot_placer == spec_pb2.SPOT_PLACER_UNSPECIFIED
    assert parsed.service.load_balancing_policy == spec_pb2.LOAD_BALANCING_POLICY_LEAST_LOAD
    assert spec.seconds(parsed.service.load_balancer.stream_timeout) == 120
    assert parsed.service.port == 8080
    assert parsed.num_nodes == 1
    assert not parsed.service.fixed_replicas_shorthand


def test_any_of_entries_are_whole_alternatives() -> None:
    parsed = spec.parse(GOOD["any_of_entries_merge_top_level"][0])
    first, second = parsed.resources.any_of
    assert (first.cloud, first.region, first.accelerators, first.cpus) == ("aws", "us-east-1", "A100:1", "4+")
    assert (second.cloud, second.cpus, second.accelerators) == ("gcp", "8", "")
    assert list(first.ports) == list(second.ports) == [8080]
    assert first.use_spot and second.use_spot
    assert not first.any_of and not second.any_of


def test_entry_level_spot_sets_top_level_use_spot() -> None:
    parsed = spec.parse(
        "service: {}\nresources:\n  ports: 80\n  any_of: [{use_spot: true, cloud: aws}, {use_spot: true}]\n"
    )
    assert parsed.resources.use_spot


def test_entry_ports_override_top_level() -> None:
    parsed = spec.parse("service: {}\nresources:\n  ports: [80, 81]\n  any_of: [{ports: 90}, {ports: '90'}]\n")
    assert parsed.service.port == 90
    assert [list(e.ports) for e in parsed.resources.any_of] == [[90], [90]]


def test_name_argument_wins_over_yaml_name() -> None:
    parsed = spec.parse("name: Not A Service Name\nservice: {}\n" + PORT, name="svc-1")
    assert parsed.name == "Not A Service Name"
    assert spec.effective_name(parsed, "svc-1") == "svc-1"
    assert spec.effective_name(parsed) == "Not A Service Name"


@pytest.mark.parametrize("path", sorted((ROOT / "examples").rglob("*.yaml")), ids=lambda p: p.name)
def test_example_specs_are_valid(path: pathlib.Path) -> None:
    parsed = spec.parse(path.read_text())
    assert parsed.service.port > 0 or spec.is_pool(parsed)  # a pool's workers serve no port


def test_example_specs_exercise_the_features() -> None:
    examples = ROOT / "examples" / "specs"
    auto = spec.parse((examples / "autoscale.yaml").read_text())
    assert spec.probe_method_and_body(auto) == ("POST", '{"model": "tiny"}')
    assert auto.service.readiness_probe.headers["Authorization"] == "Bearer change-me"
    assert spec.autoscaler_kind(auto) == "request_rate" and spec.is_autoscaling(auto)
    spot = spec.parse((examples / "spot.yaml").read_text())
    assert spec.autoscaler_kind(spot) == "fallback" and spec.uses_ondemand_fallback(spot)
    aware = spec.parse((examples / "instance-aware.yaml").read_text())
    assert spec.autoscaler_kind(aware) == "instance_aware"
    assert [e.accelerators for e in aware.resources.any_of] == ["A100:1", "H100:1"]
    fixed = spec.parse((examples / "fixed.yaml").read_text())
    assert spec.probe_method_and_body(fixed) == ("GET", "") and not spec.is_autoscaling(fixed)


# ---------------------------------------------------------------------------------------------
# Bad specs: each case is (YAML, the exact set of violated field paths).

BAD = {
    "unknown_top_level_key": ("servce: {}\nservice: {}\n" + PORT, {"servce"}),
    "unknown_service_key": ("service: {replica: 2}\n" + PORT, {"service.replica"}),
    "unknown_probe_key": (
        "service:\n  readiness_probe: {path: /, delay: 3}\n" + PORT,
        {"service.readiness_probe.delay"},
    ),
    "unknown_policy_key": (
        "service:\n  replica_policy: {min_replicas: 1, qps_upper_threshold: 3}\n" + PORT,
        {"service.replica_policy.qps_upper_threshold"},
    ),
    "unknown_resources_key": ("service: {}\nresources: {ports: 80, gpus: 1}\n", {"resources.gpus"}),
    "unknown_any_of_entry_key": (
        "service: {}\nresources: {ports: 80, any_of: [{cloud: aws}, {clod: gcp}]}\n",
        {"resources.any_of[1].clod"},
    ),
    "unknown_load_balancer_key": ("service: {load_balancer: {timeout: 1}}\n" + PORT, {"service.load_balancer.timeout"}),
    "top_level_pool_beside_a_service": ("pool: {workers: 1}\nservice: {}\n" + PORT, {"pool", "resources.ports"}),
    "service_workers": ("service: {workers: 2}\n" + PORT, {"service.workers"}),
    "service_tls": ("service: {tls: {keyfile: k, certfile: c}}\n" + PORT, {"service.tls"}),
    "job_recovery": ("service: {}\nresources: {ports: 80, job_recovery: FAILOVER}\n", {"resources.job_recovery"}),
    "job_recovery_in_any_of": (
        "service: {}\nresources: {ports: 80, any_of: [{job_recovery: {strategy: EAGER_NEXT_REGION}}]}\n",
        {"resources.any_of[0].job_recovery"},
    ),
    "missing_service": (PORT, {"service"}),
    "service_not_a_mapping": ("service: yes\n" + PORT, {"service"}),
    "replicas_and_replica_policy": (
        "service:\n  replicas: 2\n  replica_policy: {min_replicas: 1}\n" + PORT,
        {"service.replicas"},
    ),
    "min_replicas_required": (
        "service:\n  replica_policy: {max_replicas: 2}\n" + PORT,
        {"service.replica_policy.min_replicas"},
    ),
    "negative_min_replicas": (
        "service:\n  replica_policy: {min_replicas: -1}\n" + PORT,
        {"service.replica_policy.min_replicas"},
    ),
    "negative_replicas": ("service:\n  replicas: -2\n" + PORT, {"service.replicas"}),
    "float_replicas": ("service:\n  replicas: 1.5\n" + PORT, {"service.replicas"}),
    "string_replicas": ("service:\n  replicas: '2'\n" + PORT, {"service.replicas"}),
    "bool_replicas": ("service:\n  replicas: true\n" + PORT, {"service.replicas"}),
    "max_below_min": (
        "service:\n  replica_policy: {min_replicas: 3, max_replicas: 2, target_qps_per_replica: 1}\n" + PORT,
        {"service.replica_policy.max_replicas"},
    ),
    "target_qps_without_max": (
        "service:\n  replica_policy: {min_replicas: 1, target_qps_per_replica: 3}\n" + PORT,
        {"service.replica_policy.max_replicas"},
    ),
    "autoscaling_without_target_qps": (
        "service:\n  replica_policy: {min_replicas: 1, max_replicas: 3}\n" + PORT,
        {"service.replica_policy.target_qps_per_replica"},
    ),
    "target_qps_zero": (
        "service:\n  replica_policy: {min_replicas: 1, max_replicas: 2, target_qps_per_replica: 0}\n" + PORT,
        {"service.replica_policy.target_qps_per_replica"},
    ),
    "target_qps_string": (
        "service:\n  replica_policy: {min_replicas: 1, max_replicas: 2, target_qps_per_replica: fast}\n" + PORT,
        {"service.replica_policy.target_qps_per_replica"},
    ),
    "dict_target_without_instance_aware": (
        "service:\n  replica_policy: {min_replicas: 1, max_replicas: 2, target_qps_per_replica: {A100: 1}}\n" + PORT,
        {"service.load_balancing_policy"},
    ),
    "instance_aware_without_dict_target": (
        _yaml("""
            service:
              replica_policy: {min_replicas: 1, max_replicas: 2, target_qps_per_replica: 1}
              load_balancing_policy: instance_aware_least_load
            """)
        + PORT,
        {"service.replica_policy.target_qps_per_replica"},
    ),
    "instance_aware_with_fixed_replicas": (
        "service:\n  replicas: 2\n  load_balancing_policy: instance_aware_least_load\n" + PORT,
        {"service.replica_policy.target_qps_per_replica"},
    ),
    "empty_dict_target": (
        _yaml("""
            service:
              replica_policy: {min_replicas: 1, max_replicas: 2, target_qps_per_replica: {}}
              load_balancing_policy: instance_aware_least_load
            """)
        + PORT,
        {"service.replica_policy.target_qps_per_replica"},
    ),
    "unknown_load_balancing_policy": (
        "service: {load_balancing_policy: random}\n" + PORT,
        {"service.load_balancing_policy"},
    ),
    "unknown_spot_placer": (
        "service:\n  replica_policy: {min_replicas: 1, spot_placer: cheapest}\n"
        "resources: {ports: 80, use_spot: true}\n",
        {"service.replica_policy.spot_placer"},
    ),
    "base_fallback_without_spot": (
        "service:\n  replica_policy: {min_replicas: 1, base_ondemand_fallback_replicas: 1}\n" + PORT,
        {"service.replica_policy.base_ondemand_fallback_replicas"},
    ),
    "dynamic_fallback_without_spot": (
        "service:\n  replica_policy: {min_replicas: 1, dynamic_ondemand_fallback: true}\n" + PORT,
        {"service.replica_policy.dynamic_ondemand_fallback"},
    ),
    "spot_placer_without_spot": (
        "service:\n  replica_policy: {min_replicas: 1, spot_placer: dynamic_fallback}\n" + PORT,
        {"service.replica_policy.spot_placer"},
    ),
    "dynamic_fallback_not_boolean": (
        "service:\n  replica_policy: {min_replicas: 1, dynamic_ondemand_fallback: 'yes'}\n"
        "resources: {ports: 80, use_spot: true}\n",
        {"service.replica_policy.dynamic_ondemand_fallback"},
    ),
    "bad_ports_in_any_of_entry": (
        "service: {}\nresources: {any_of: [{ports: abc}, {ports: 80}]}\n",
        {"resources.any_of[0].ports"},
    ),
    "bad_port_range_in_ordered_entry": (
        "service: {}\nresources: {ports: 80, ordered: [{ports: '90-70'}]}\n",
        {"resources.ordered[0].ports"},
    ),
    "mixed_spot_any_of": (
        "service: {}\nresources: {ports: 80, any_of: [{use_spot: true}, {use_spot: false}]}\n",
        {"resources.use_spot"},
    ),
    "mixed_spot_any_of_with_fallback": (
        _yaml("""
            service:
              replica_policy: {min_replicas: 1, dynamic_ondemand_fallback: true}
            resources: {ports: 80, use_spot: true, any_of: [{cloud: aws}, {use_spot: false}]}
            """),
        {"resources.use_spot", "service.replica_policy.dynamic_ondemand_fallback"},
    ),
    "use_spot_not_boolean": ("service: {}\nresources: {ports: 80, use_spot: 'true'}\n", {"resources.use_spot"}),
    "no_ports": ("service: {}\n", {"resources.ports"}),
    "two_ports_without_service_ports": ("service: {}\nresources: {ports: [80, 81]}\n", {"resources.ports"}),
    "range_without_service_ports": ("service: {}\nresources: {ports: 80-81}\n", {"resources.ports"}),
    "service_port_not_opened": ("service: {ports: 90}\nresources: {ports: 80-81}\n", {"service.ports"}),
    "service_port_out_of_range": ("service: {ports: 70000}\nresources: {ports: 80}\n", {"service.ports"}),
    "port_zero": ("service: {}\nresources: {ports: 0}\n", {"resources.ports"}),
    "port_too_big": ("service: {}\nresources: {ports: '65536'}\n", {"resources.ports"}),
    "port_range_reversed": ("service: {ports: 81}\nresources: {ports: [80, '90-85']}\n", {"resources.ports[1]"}),
    "port_garbage": ("service: {}\nresources: {ports: http}\n", {"resources.ports"}),
    "any_of_entries_disagree_on_port": (
        "service: {}\nresources: {any_of: [{ports: 80}, {ports: 81}]}\n",
        {"resources.ports"},
    ),
    "any_of_entry_without_port": (
        "service: {}\nresources: {any_of: [{ports: 80}, {cloud: aws}]}\n",
        {"resources.ports"},
    ),
    "any_of_and_ordered": (
        "service: {}\nresources: {ports: 80, any_of: [{cloud: aws}], ordered: [{cloud: gcp}]}\n",
        {"resources.ordered"},
    ),
    "any_of_empty": ("service: {}\nresources: {ports: 80, any_of: []}\n", {"resources.any_of"}),
    "any_of_nested": (
        "service: {}\nresources: {ports: 80, any_of: [{any_of: [{cloud: aws}]}]}\n",
        {"resources.any_of[0].any_of"},
    ),
    "path_without_slash": ("service:\n  readiness_probe: health\n" + PORT, {"service.readiness_probe.path"}),
    "path_with_space": ("service:\n  readiness_probe: /he alth\n" + PORT, {"service.readiness_probe.path"}),
    "probe_not_mapping": ("service:\n  readiness_probe: [/a]\n" + PORT, {"service.readiness_probe"}),
    "post_data_invalid_json": (
        "service:\n  readiness_probe: {path: /, post_data: '{model: x'}\n" + PORT,
        {"service.readiness_probe.post_data"},
    ),
    "post_data_list": (
        "service:\n  readiness_probe: {path: /, post_data: [1]}\n" + PORT,
        {"service.readiness_probe.post_data"},
    ),
    "headers_not_strings": (
        "service:\n  readiness_probe: {path: /, headers: {X-A: 1, X-B: ok}}\n" + PORT,
        {"service.readiness_probe.headers.X-A"},
    ),
    "headers_bad_name": (
        "service:\n  readiness_probe: {path: /, headers: {'Bad Name': v}}\n" + PORT,
        {"service.readiness_probe.headers"},
    ),
    "negative_delay": (
        "service:\n  readiness_probe: {path: /, initial_delay_seconds: -1}\n" + PORT,
        {"service.readiness_probe.initial_delay_seconds"},
    ),
    "zero_timeout": (
        "service:\n  readiness_probe: {path: /, timeout_seconds: 0}\n" + PORT,
        {"service.readiness_probe.timeout_seconds"},
    ),
    "infinite_interval": (
        "service:\n  readiness_probe: {path: /, endpoint_probe_interval_seconds: .inf}\n" + PORT,
        {"service.readiness_probe.endpoint_probe_interval_seconds"},
    ),
    "delay_as_string": (
        "service:\n  replica_policy: {min_replicas: 1, upscale_delay_seconds: 5m}\n" + PORT,
        {"service.replica_policy.upscale_delay_seconds"},
    ),
    "num_nodes_two": ("num_nodes: 2\nservice: {}\n" + PORT, {"num_nodes"}),
    "envs_bad_name_and_null": ("envs: {1A: x, B: null}\nservice: {}\n" + PORT, {"envs.1A", "envs.B"}),
    "envs_not_mapping": ("envs: [A=1]\nservice: {}\n" + PORT, {"envs"}),
    "run_not_string": ("run: {cmd: x}\nservice: {}\n" + PORT, {"run"}),
    "setup_list_with_number": ("setup: [a, 1]\nservice: {}\n" + PORT, {"setup"}),
    "workdir_git_mapping": ("workdir: {url: https://x/y.git}\nservice: {}\n" + PORT, {"workdir"}),
    "file_mount_bad_value": ("file_mounts: {/d: 3}\nservice: {}\n" + PORT, {"file_mounts./d"}),
    "accelerators_set_form_with_a_count_too": (
        "service: {}\nresources: {ports: 80, accelerators: {'H100:1': 2}}\n",
        {"resources.accelerators"},
    ),
    "file_mount_destination_outside_workdir": (
        "file_mounts: {../../etc/cron.d/x: /tmp, /data/../../y: /tmp}\nservice: {}\n" + PORT,
        {"file_mounts.../../etc/cron.d/x", "file_mounts./data/../../y"},
    ),
    "accelerators_bad": ("service: {}\nresources: {ports: 80, accelerators: 'A100:x'}\n", {"resources.accelerators"}),
    "cpus_bad": ("service: {}\nresources: {ports: 80, cpus: lots}\n", {"resources.cpus"}),
    "infra_with_cloud": ("service: {}\nresources: {ports: 80, infra: aws, cloud: aws}\n", {"resources.infra"}),
    "image_id_per_region": (
        "service: {}\nresources: {ports: 80, image_id: {us-east-1: ami-1}}\n",
        {"resources.image_id"},
    ),
    "labels_not_strings": ("service: {}\nresources: {ports: 80, labels: {tier: 1}}\n", {"resources.labels.tier"}),
    "yaml_name_invalid": ("name: My_Service\nservice: {}\n" + PORT, {"name"}),
    "yaml_name_not_string": ("name: 42\nservice: {}\n" + PORT, {"name"}),
    "malformed_yaml": ("service: {\n", {"yaml"}),
    "duplicate_key": ("service: {}\nrun: a\nrun: b\n" + PORT, {"yaml"}),
    "document_is_list": ("- service: {}\n", {"yaml"}),
    "document_is_scalar": ("just text\n", {"yaml"}),
    "empty_document": ("", {"yaml"}),
    "python_tag": ("service: !!python/object:os.system {}\n", {"yaml"}),
}


@pytest.mark.parametrize("text, fields", list(BAD.values()), ids=list(BAD))
def test_bad_spec_violations(text: str, fields: set[str]) -> None:
    assert _fields(text) == fields


@pytest.mark.parametrize(
    "name, field",
    [("Bad_Name", "service_name"), ("-x", "service_name"), ("x-", "service_name"), ("a" * 64, "service_name")],
)
def test_bad_name_argument(name: str, field: str) -> None:
    assert _fields("service: {}\n" + PORT, name=name) == {field}


def test_require_name() -> None:
    assert _fields("service: {}\n" + PORT, require_name=True) == {"service_name"}
    assert _fields("service: {}\n", require_name=True) == {"service_name", "resources.ports"}
    assert spec.parse("name: ok\nservice: {}\n" + PORT, require_name=True).name == "ok"
    assert spec.parse("service: {}\n" + PORT, name="ok", require_name=True).name == ""


def test_three_distinct_errors_are_reported_together() -> None:
    text = _yaml("""
        service:
          readiness_probe: health
          replica_policy: {min_replicas: 1, max_replicas: 4}
        resources: {ports: [80, 81]}
        """)
    violations = _violations(text)
    assert {v.field for v in violations} == {
        "service.readiness_probe.path",
        "service.replica_policy.target_qps_per_replica",
        "resources.ports",
    }
    assert len(violations) == 3
    assert all(v.description for v in violations)


def test_validation_error_is_invalid_argument_with_every_violation() -> None:
    with pytest.raises(errors.ValidationError) as info:
        spec.parse("service: {bogus: 1}\nresources: {ports: 0}\n")
    assert info.value.reason == "INVALID_ARGUMENT"
    assert "service.bogus" in str(info.value) and "resources.ports" in str(info.value)


SECRET = "sk-live-0123456789abcdef"


@pytest.mark.parametrize(
    "text",
    [
        # A bad header next to a good secret one; a bad secret value type.
        "service:\n  readiness_probe:\n    path: /\n    headers: {Authorization: 'Bearer "
        + SECRET
        + "', X-Bad: [1]}\nsecrets: {K: {v: 1}}\n"
        + PORT,
        # The header value is malformed YAML: the parser error must not quote the line.
        'service:\n  readiness_probe:\n    headers: {Authorization: "Bearer ' + SECRET + "\n" + PORT,
        "service:\n  readiness_probe:\n    headers: {Authorization: Bearer " + SECRET + "\t: x}\n" + PORT,
        # A header value with a line break; a secret used in post_data that is not JSON.
        'service:\n  readiness_probe:\n    path: /\n    headers: {X-Token: "' + SECRET + '\\nx"}\n' + PORT,
        'service:\n  readiness_probe: {path: /, post_data: \'{"k": ' + SECRET + "'}\n" + PORT,
        # A secret that is an invalid header name, and one in an unknown spot placer.
        "service:\n  readiness_probe: {path: /, headers: {'" + SECRET + " x': v}}\n" + PORT,
    ],
)
def test_secrets_are_never_echoed(text: str) -> None:
    with pytest.raises(errors.ValidationError) as info:
        spec.parse(text)
    assert SECRET not in str(info.value)
    for v in info.value.violations:
        assert SECRET not in v.description and SECRET not in v.field


def test_redacted_hides_header_and_secret_values() -> None:
    text = _yaml("""
        service:
          readiness_probe: {path: /, headers: {Authorization: Bearer abc123}}
        resources: {ports: 80}
        secrets: {TOKEN: zz-secret}
        envs: {PLAIN: visible}
        """)
    shown = spec.redacted(spec.parse(text))
    assert dict(shown.service.readiness_probe.headers) == {"Authorization": "<redacted>"}
    assert dict(shown.secrets) == {"TOKEN": "<redacted>"}
    assert "abc123" not in shown.yaml and "zz-secret" not in shown.yaml
    assert dict(shown.envs) == {"PLAIN": "visible"}


def test_redacted_masks_every_header_and_secret_of_a_large_spec() -> None:
    # Assigning to a protobuf map while iterating it skipped entries: some values leaked.
    headers = "\n".join(f"      H{i}: header-value-{i}" for i in range(40))
    secrets = "\n".join(f"  S{i}: secret-value-{i}" for i in range(40))
    text = f"service:\n  readiness_probe:\n    path: /\n    headers:\n{headers}\n{PORT}secrets:\n{secrets}\n"
    shown = str(spec.redacted(spec.parse(text, name="svc")))
    assert "header-value-" not in shown and "secret-value-" not in shown


def test_redacted_masks_secrets_substituted_into_any_field() -> None:
    text = _yaml("""
        service:
          readiness_probe:
            path: /health?key=${TOKEN}
            post_data: {key: $TOKEN}
        resources: {ports: 80}
        workdir: /srv/${TOKEN}
        file_mounts:
          /data/${TOKEN}: s3://bucket/${TOKEN}
        secrets: {TOKEN: zz-secret-42}
        """)
    parsed = spec.parse(text, name="svc")
    assert "zz-secret-42" in parsed.service.readiness_probe.path  # substituted, as SkyPilot does
    shown = spec.redacted(parsed)
    assert "zz-secret-42" not in str(shown)
    assert shown.service.readiness_probe.path == "/health?key=<redacted>"
    assert shown.workdir == "/srv/<redacted>"
    assert dict(shown.file_mounts) == {"/data/<redacted>": "s3://bucket/<redacted>"}


@pytest.mark.parametrize("as_string", [True, False], ids=["json string", "yaml mapping"])
def test_post_data_may_nest_up_to_the_limit(as_string: bool) -> None:
    def probe(depth: int) -> str:
        body = '{"a": ' * (depth - 1) + "[1]" + "}" * (depth - 1)
        shown = json.dumps(body) if as_string else body
        return f"service:\n  readiness_probe: {{path: /, post_data: {shown}}}\n" + PORT

    limit = spec.MAX_POST_DATA_DEPTH
    parsed = spec.parse(probe(limit), name="svc")
    assert json.loads(parsed.service.readiness_probe.post_data_json)["a"]
    violations = _violations(probe(limit + 1), name="svc")
    assert [v.field for v in violations] == ["service.readiness_probe.post_data"]
    assert f"more than {limit} levels" in violations[0].description


def test_shown_yaml_is_re_emitted_without_comments_or_secret_spellings() -> None:
    text = _yaml("""
        # deploy with token zz-secret-42 (a comment is never shown)
        service:
          readiness_probe: {path: /, headers: {X-Key: &key "zz\\u002dsecret-42"}}
          replicas: 1
        resources: {ports: 80}
        secrets: {TOKEN: *key, PIN: 4711}
        envs: {COPY: 'zz-secret-42''s', PIN_AGAIN: 4711, KEEP: 12}
        run: |
          echo start
          python3 -m http.server 80
        """)
    shown = spec.redacted(spec.parse(text, name="svc")).yaml
    assert "zz" not in shown and "4711" not in shown and "#" not in shown
    doc = yaml.safe_load(shown)
    assert doc["secrets"] == {"TOKEN": "<redacted>", "PIN": "<redacted>"}
    assert doc["service"]["readiness_probe"]["headers"] == {"X-Key": "<redacted>"}
    assert doc["envs"] == {"COPY": "<redacted>'s", "PIN_AGAIN": "<redacted>", "KEEP": 12}
    assert doc["run"] == "echo start\npython3 -m http.server 80\n"
    assert "run: |\n" in shown  # scripts stay readable


def test_shown_yaml_of_text_that_does_not_load_is_empty() -> None:
    assert spec.shown_yaml("run: [unclosed", ["x"]) == ""
    assert spec.shown_yaml("- a list\n", []) == ""
    assert spec.shown_yaml("", []) == ""


def test_a_secret_substituted_into_a_bad_field_is_not_quoted_in_the_error() -> None:
    text = _yaml("""
        service:
          readiness_probe: /
          load_balancing_policy: ${TOKEN}
        resources: {ports: 80}
        secrets: {TOKEN: zz-secret-42}
        """)
    violations = _violations(text, name="svc")
    assert [v.field for v in violations] == ["service.load_balancing_policy"]
    assert "zz-secret-42" not in violations[0].description


def test_alias_bomb_is_rejected() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 8):
        prev = f"*a{i - 1}"
        lines.append(f"a{i}: &a{i} [{', '.join([prev] * 10)}]")
    text = "\n".join(lines) + "\nservice: {}\n" + PORT
    assert _fields(text) == {"yaml"}


def test_recursive_alias_is_rejected() -> None:
    assert _fields("loop: &a [*a]\nservice: {}\n" + PORT) == {"yaml"}


def test_merge_keys_may_override() -> None:
    text = _yaml("""
        service:
          replica_policy:
            <<: &base {min_replicas: 1, max_replicas: 3, target_qps_per_replica: 1}
            max_replicas: 2
        resources: {ports: 80}
        """)
    assert spec.parse(text).service.replica_policy.max_replicas == 2


def test_secrets_win_over_envs_in_substitution() -> None:
    text = "service: {readiness_probe: {path: /, headers: {X-T: $T}}}\n" + PORT + "envs: {T: env}\nsecrets: {T: sec}\n"
    assert spec.parse(text).service.readiness_probe.headers["X-T"] == "sec"


def test_oversized_yaml_is_rejected() -> None:
    text = "service: {}\n" + PORT + "run: |\n" + ("  echo hi\n" * 120_000)
    assert _fields(text) == {"yaml"}


# ---------------------------------------------------------------------------------------------
# Names.


@pytest.mark.parametrize("name", ["a", "svc", "my-svc-2", "a" * 63, "x1"])
def test_valid_service_names(name: str) -> None:
    assert spec.validate_service_name(name) == []


@pytest.mark.parametrize("name", ["", "A", "1abc", "a_b", "a.b", "abc-", "-abc", "a" * 64, "ünï"])
def test_invalid_service_names(name: str) -> None:
    (violation,) = spec.validate_service_name(name, field="name")
    assert violation.field == "name"


# ---------------------------------------------------------------------------------------------
# Helpers.


def test_seconds_and_duration_round_trip() -> None:
    assert spec.seconds(spec.duration(2.5)) == 2.5
    assert spec.seconds(spec.duration(0.1)) == pytest.approx(0.1)
    assert spec.duration(1200).seconds == 1200


def test_probe_method_and_body() -> None:
    get = spec.parse("service: {readiness_probe: /h}\n" + PORT)
    post = spec.parse("service: {readiness_probe: {path: /h, post_data: {q: 1}}}\n" + PORT)
    assert spec.probe_method_and_body(get) == ("GET", "")
    assert spec.probe_method_and_body(post) == ("POST", '{"q": 1}')


def test_accepted_keys_are_documented() -> None:
    docs = (ROOT / "docs" / "spec.md").read_text()
    for section, keys in spec.ACCEPTED_KEYS.items():
        for key in keys:
            assert f"`{key}`" in docs, f"{section or 'top level'}: {key} is not in docs/spec.md"


# ---------------------------------------------------------------------------------------------
# In-place updates (spec.md 7.2).

BASE = _yaml("""
    service:
      readiness_probe: /health
      replica_policy: {min_replicas: 2}
    resources:
      ports: 8080
      cpus: 2+
      any_of: [{cloud: aws}, {cloud: gcp}]
    envs: {A: "1"}
    setup: pip install x
    run: python3 app.py
    """)


def _changed(old: str, new: str) -> str:
    assert old in BASE, old
    return BASE.replace(old, new)


IN_PLACE = {
    "identical": (BASE, True),
    "min_replicas_up": (_changed("{min_replicas: 2}", "{min_replicas: 3}"), True),
    "autoscaling_policy": (
        _changed("{min_replicas: 2}", "{min_replicas: 1, max_replicas: 4, target_qps_per_replica: 2}"),
        True,
    ),
    "probe_change": (_changed("readiness_probe: /health", "readiness_probe: {path: /ready, timeout_seconds: 3}"), True),
    "load_balancing_change": (
        _changed("replica_policy:", "load_balancing_policy: round_robin\n  replica_policy:"),
        True,
    ),
    "any_of_reordered": (_changed("[{cloud: aws}, {cloud: gcp}]", "[{cloud: gcp}, {cloud: aws}]"), True),
    "reformatted_yaml": (
        _changed('envs: {A: "1"}', "envs:\n  A: 1   # same value, different spelling"),
        True,
    ),
    "task_name_added": ("name: renamed\n" + BASE, True),
    "run_change": (_changed("python3 app.py", "python3 app.py --v2"), False),
    "setup_change": (_changed("pip install x", "pip install y"), False),
    "envs_change": (_changed('{A: "1"}', '{A: "2"}'), False),
    "secrets_added": (BASE + "secrets: {T: x}\n", False),
    "resources_change": (_changed("cpus: 2+", "cpus: 4+"), False),
    "any_of_entry_change": (_changed("{cloud: gcp}", "{cloud: azure}"), False),
    "any_of_to_ordered": (_changed("any_of:", "ordered:"), False),
    "ports_change": (_changed("ports: 8080", "ports: 9090"), False),
    "workdir_added": (BASE + "workdir: /srv\n", False),
    "file_mounts_added": (BASE + "file_mounts: {/d: /tmp/d}\n", False),
    "empty_file_mounts_is_fine": (BASE + "file_mounts: {}\n", True),
}


@pytest.mark.parametrize("new, expected", list(IN_PLACE.values()), ids=list(IN_PLACE))
def test_is_in_place_update(new: str, expected: bool) -> None:
    old = spec.parse(BASE)
    assert spec.is_in_place_update(old, spec.parse(new)) is expected
    assert spec.is_in_place_update(spec.parse(new), old) is expected


def test_equivalent_spellings_are_in_place() -> None:
    old = spec.parse("service: {}\nresources: {ports: 80, accelerators: A100, cpus: 2}\nenvs: {N: 1}\n")
    new = spec.parse("service: {}\nresources: {ports: '80', accelerators: {A100: 1}, cpus: '2'}\nenvs: {N: '1'}\n")
    assert spec.is_in_place_update(old, new)


def test_ordered_reordered_is_not_in_place() -> None:
    old = spec.parse("service: {}\nresources: {ports: 80, ordered: [{cloud: aws}, {cloud: gcp}]}\n")
    new = spec.parse("service: {}\nresources: {ports: 80, ordered: [{cloud: gcp}, {cloud: aws}]}\n")
    assert not spec.is_in_place_update(old, new)


def test_workdir_in_both_specs_is_never_in_place() -> None:
    text = BASE + "workdir: /srv\n"
    assert not spec.is_in_place_update(spec.parse(text), spec.parse(text))


def test_serving_port_change_is_not_in_place() -> None:
    old = spec.parse("service: {ports: 80}\nresources: {ports: [80, 81]}\n")
    new = spec.parse("service: {ports: 81}\nresources: {ports: [80, 81]}\n")
    assert not spec.is_in_place_update(old, new)


def test_launch_config_does_not_change_its_input() -> None:
    parsed = spec.parse(_changed("[{cloud: aws}, {cloud: gcp}]", "[{cloud: gcp}, {cloud: aws}]"))
    before = parsed.SerializeToString(deterministic=True)
    config = spec.launch_config(parsed)
    assert parsed.SerializeToString(deterministic=True) == before
    assert config == spec.launch_config(spec.parse(BASE))
    assert not config.HasField("service") and config.yaml == "" and config.name == ""

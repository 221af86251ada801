"""Every metric family the services register follows Prometheus' naming conventions: a unit in the
name, `_total` on counters (and only there), bounded labels, help text, no name used twice."""

from __future__ import annotations

import collections
import re

import pytest

from tests.helpers import metric_names

FAMILIES = metric_names.families()
OURS = [(c, f) for c, f in FAMILIES if f.name.startswith(("replicaplane_", "grpc_server_"))]
# Labels whose values are unbounded or carry request data: never labels here.
FORBIDDEN_LABELS = {"url", "path", "endpoint", "target", "target_id", "query", "method_path", "replica_name", "error"}
# Histograms and gauges measure something with a unit, or count things (named for the things).
UNITS = ("_seconds", "_bytes", "_ratio")


def _id(item: tuple[str, object]) -> str:
    return f"{item[0]}:{item[1].name}"  # type: ignore[attr-defined]


def test_every_component_registers_its_own_metrics() -> None:
    prefixes = {
        c: {f.name.split("_")[1] for _, f in OURS if _ == c and f.name.startswith("replicaplane_")} for c, _ in OURS
    }
    assert prefixes["prober"] >= {"prober", "build"}
    assert prefixes["provisioner"] >= {"provisioner", "build"}
    assert prefixes["loadbalancer"] >= {"loadbalancer", "build"}
    assert prefixes["dashboard"] >= {"dashboard", "build"}
    assert prefixes["controller"] >= {"controller", "build"}
    # Everything but process and Python metrics is named for this project or for gRPC.
    others = {f.name for _, f in FAMILIES} - {f.name for _, f in OURS}
    assert all(name.startswith(("process_", "python_")) for name in others), others


@pytest.mark.parametrize(("component", "family"), OURS, ids=[_id(x) for x in OURS])
def test_names_and_labels_follow_the_conventions(component: str, family) -> None:
    name = family.name
    assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
    assert family.documentation.strip(), f"{name} has no help text"
    if family.type == "counter":
        # prometheus_client keeps a counter's family name without `_total` and adds it to samples.
        assert not name.endswith("_total"), name
    else:
        assert not name.endswith("_total"), f"{name}: only counters end in _total"
    if family.type == "histogram":
        assert name.endswith(UNITS), f"{name}: a histogram's name ends in its unit"
    assert not re.search(r"_(ms|milliseconds|secs|minutes|kb|mb)(_|$)", name), f"{name}: use base units"
    labels = {label for sample in family.samples for label in sample.labels} - {"le"}
    assert not labels & FORBIDDEN_LABELS, f"{name} has unbounded labels {labels & FORBIDDEN_LABELS}"


def test_declared_labels_are_bounded() -> None:
    # Families whose children are made on use (no samples yet) are checked by their declared labels.
    declared = {name: labels for name, labels in metric_names.label_names().items() if labels}
    assert "replicaplane_loadbalancer_requests_total" in declared
    assert declared["replicaplane_loadbalancer_requests_total"] == {"service", "version", "code"}
    for name, labels in declared.items():
        assert not labels & FORBIDDEN_LABELS, f"{name} has unbounded labels {labels & FORBIDDEN_LABELS}"


def test_no_family_name_is_used_twice_in_one_process() -> None:
    # A counter `x` exposes `x_total`; a gauge named `x` beside it would make two families `x`.
    seen = collections.Counter((component, family.name) for component, family in FAMILIES)
    assert [key for key, count in seen.items() if count > 1] == []


def test_the_controller_registers_every_metric_the_dashboard_and_alerts_use_with_its_type() -> None:
    registered = {
        f.name if f.type != "counter" else f"{f.name}_total": f.type for c, f in FAMILIES if c == "controller"
    }
    for name, kind in metric_names.CONTROLLER_METRICS.items():
        assert registered.get(name) == kind, name
        assert re.fullmatch(r"replicaplane_controller_[a-z_]+", name)
        assert name.endswith("_total") == (kind == "counter"), name


def test_promql_names_are_found_in_expressions() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, job) (rate(grpc_server_handling_seconds_bucket{grpc_type="unary"}'
        '[$__rate_interval]))) / 1e3 and on (service) (x offset 15m) > bool 2 or vector(0) unless up{job=~"a|b"}'
    )
    assert metric_names.promql_metrics(expr) == {"grpc_server_handling_seconds_bucket", "x", "up"}

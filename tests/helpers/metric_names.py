"""Every metric family the code registers, and the metric names a PromQL expression uses: for the
checks of metric names, the Grafana dashboard and the alert rules."""

from __future__ import annotations

import re

import prometheus_client
from prometheus_client import Metric

from services.common import grpc_metrics
from services.common import metrics as metrics_mod
from services.controller import metrics as controller_metrics
from services.dashboard import metrics as dashboard_metrics
from services.loadbalancer import connections, policies
from services.loadbalancer import metrics as lb_metrics
from services.prober import metrics as prober_metrics
from services.provisioner import metrics as provisioner_metrics

# The controller's own metrics, by name and type (the dashboard and alerts use them); test_metric_names
# checks that the controller registers each with this type.
CONTROLLER_METRICS = {
    "replicaplane_controller_replicas": "gauge",
    "replicaplane_controller_launch_to_ready_seconds": "histogram",
    "replicaplane_controller_autoscaler_target_replicas": "gauge",
    "replicaplane_controller_autoscaler_current_replicas": "gauge",
    "replicaplane_controller_autoscaler_qps": "gauge",
    "replicaplane_controller_launches_total": "counter",
    "replicaplane_controller_teardowns_total": "counter",
    "replicaplane_controller_pass_duration_seconds": "histogram",
    "replicaplane_controller_queue_depth": "gauge",
    "replicaplane_controller_watch_subscribers": "gauge",
    "replicaplane_controller_store_write_seconds": "histogram",
    "replicaplane_controller_store_write_errors_total": "counter",
    "replicaplane_controller_probing_stale": "gauge",
}

# Series Prometheus makes itself for every target.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def registries() -> dict[str, prometheus_client.CollectorRegistry]:
    """One registry per component, holding everything that component registers."""
    out = {}
    for component in ("controller", "provisioner", "prober", "loadbalancer", "dashboard"):
        metrics = metrics_mod.Metrics(component)
        grpc_metrics.GrpcServerMetrics(metrics.registry)
        out[component] = metrics.registry
    controller_metrics.ControllerMetrics(out["controller"]).watch(
        controller_metrics.Fleet(services=list, watchers=lambda: 0)
    )
    prober_metrics.ProberMetrics(out["prober"]).watch(streams=lambda: 0, targets=lambda: 0)
    provisioner_metrics.ProvisionerMetrics(out["provisioner"], "local").watch(dict)
    lb = lb_metrics.BalancerMetrics(out["loadbalancer"], "web")
    tracker = connections.Tracker(connections.Limits(header_timeout_s=1, idle_timeout_s=1, max_connections=1))
    lb.watch(in_flight=policies.InFlight, ready=lambda: 0, held=lambda: 0, tracker=lambda: tracker)
    dashboard_metrics.DashboardMetrics(out["dashboard"]).watch(pages=lambda: 0, bridges=dict, streams=lambda: 0)
    return out


def families() -> list[tuple[str, Metric]]:
    """(component, family) for every family of every component."""
    return [(component, family) for component, registry in registries().items() for family in registry.collect()]


def label_names() -> dict[str, set[str]]:
    """Family name -> its label names, for every prometheus_client metric (children or not)."""
    out: dict[str, set[str]] = {}
    for registry in registries().values():
        for collector, names in registry._collector_to_names.items():  # no public way to list them
            labels = set(getattr(collector, "_labelnames", ()))
            for name in names:
                out.setdefault(name, set()).update(labels)
    return out


def sample_names(name: str, kind: str) -> set[str]:
    """The names a family's samples carry in the text format."""
    base = name.removesuffix("_total")
    if kind == "counter":
        return {f"{base}_total"}
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    if kind == "summary":
        return {name, f"{name}_count", f"{name}_sum"}
    return {name}


def known_series() -> set[str]:
    """Every series name the code exposes, the controller's promised ones, and Prometheus' own."""
    names = set(PROMETHEUS_SERIES)
    for _, family in families():
        names |= sample_names(family.name, family.type)
    for name, kind in CONTROLLER_METRICS.items():
        names |= sample_names(name, kind)
    return names


_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool"}


def promql_metrics(expr: str) -> set[str]:
    """Metric names an expression selects (functions, keywords, labels and variables left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\w+", " ", text)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        word = match.group(0)
        if word in _KEYWORDS or text[match.end() :].lstrip().startswith("("):
            continue  # a keyword, or a function or aggregation applied to what follows
        names.add(word)
    return names

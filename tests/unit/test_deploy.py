"""deploy/: the Grafana dashboard, the Prometheus scrape configs and alert rules, and how compose
mounts them.

Grafana cannot run here (no package, no registry), so the dashboard is checked for what makes a
dashboard work when imported or provisioned: valid JSON with a uid and schema version, panels
that fit the 24-column grid without overlapping, each with a data source and queries, and every
metric a query names is one the services export (or the controller's promised ones). A metric
renamed in the code without the dashboard fails here, as it would show "No data" in Grafana.
promtool (Debian's `prometheus` package; `make deploy-check`) checks the Prometheus side for
real; the tests that need it are skipped where it is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml

from services.common import config
from services.stack import statefiles
from tests.helpers import metric_names

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(REPO, "deploy")
DASHBOARD = os.path.join(DEPLOY, "grafana", "replicaplane.json")
RULES = os.path.join(DEPLOY, "prometheus", "rules", "replicaplane.yml")
PANEL_TYPES = {"timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "text"}


def load_yaml(*parts: str) -> dict:
    with open(os.path.join(DEPLOY, *parts), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


@pytest.fixture(scope="module")
def dashboard() -> dict:
    with open(DASHBOARD, encoding="utf-8") as fh:
        return json.load(fh)


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_dashboard_has_identity_time_and_a_datasource_variable(dashboard: dict) -> None:
    assert dashboard["uid"] == "replicaplane" and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["time"]["from"].startswith("now-")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    # A data source variable: the JSON imports into any Grafana, whatever its data source's uid.
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["service"]["includeAll"] and variables["service"]["allValue"] == ".*"


def test_every_panel_has_a_datasource_and_queries(dashboard: dict) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels(dashboard):
        where = panel["title"]
        assert panel["type"] in PANEL_TYPES, where
        assert panel["title"] and panel.get("description"), where
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["targets"], where
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), where
        for target in panel["targets"]:
            assert target["expr"].strip(), where
            assert target.get("datasource", panel["datasource"]) == panel["datasource"], where


def test_panels_fit_the_grid_without_overlapping(dashboard: dict) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_dashboard_shows_what_operators_look_for(dashboard: dict) -> None:
    exprs = " ".join(t["expr"] for p in panels(dashboard) for t in p["targets"])
    for needed in (
        "replicaplane_controller_replicas",  # fleet status
        "replicaplane_controller_launch_to_ready_seconds_bucket",  # launch to READY
        "replicaplane_loadbalancer_requests_total",  # error rates and per-version traffic
        "grpc_server_handled_total",  # control-plane errors
        "replicaplane_controller_autoscaler_target_replicas",  # autoscaler target vs actual
        "replicaplane_controller_autoscaler_current_replicas",
    ):
        assert needed in exprs, needed
    assert any("by (service, version)" in t["expr"] for p in panels(dashboard) for t in p["targets"])


def test_every_metric_in_the_dashboard_and_rules_exists() -> None:
    known = metric_names.known_series()
    with open(DASHBOARD, encoding="utf-8") as fh:
        exprs = [(p["title"], t["expr"]) for p in panels(json.load(fh)) for t in p["targets"]]
    exprs += [
        (r["alert"], r["expr"])
        for g in load_yaml("prometheus", "rules", "replicaplane.yml")["groups"]
        for r in g["rules"]
    ]
    assert len(exprs) > 40
    for where, expr in exprs:
        used = metric_names.promql_metrics(expr)
        assert used, (where, expr)
        assert used <= known, f"{where}: unknown metrics {sorted(used - known)}"


def test_rules_cover_the_alerts_operators_need_and_each_has_a_unit_test() -> None:
    rules = [r for g in load_yaml("prometheus", "rules", "replicaplane.yml")["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert {
        "ReplicaplaneReplicasFailing",
        "ReplicaplaneVersionStopped",
        "ReplicaplaneProberFleetStale",
        "ReplicaplaneStoreWriteErrors",
    } <= names
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    tests = load_yaml("prometheus", "tests", "replicaplane.test.yml")
    tested = {case["alertname"] for t in tests["tests"] for case in t["alert_rule_test"] if case.get("exp_alerts")}
    assert tested == names, "every alert has a unit test in which it fires"


def test_compose_scrape_config_reaches_every_service_on_its_metrics_port() -> None:
    cfg = load_yaml("prometheus", "prometheus.yml")
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    static = {
        name: jobs[name]["static_configs"][0]["targets"]
        for name in ("controller", "provisioner", "loadbalancer", "dashboard")
    }
    assert static == {
        "controller": [f"controller:{config.CONTROLLER_METRICS_ADDR.rpartition(':')[2]}"],
        "provisioner": [f"provisioner:{config.PROVISIONER_METRICS_ADDR.rpartition(':')[2]}"],
        "loadbalancer": [f"loadbalancer:{config.LOADBALANCER_METRICS_ADDR.rpartition(':')[2]}"],
        "dashboard": [f"dashboard:{config.DASHBOARD_METRICS_ADDR.rpartition(':')[2]}"],
    }
    (dns,) = jobs["prober"]["dns_sd_configs"]
    assert dns["names"] == ["prober"] and str(dns["port"]) == config.PROBER_METRICS_ADDR.rpartition(":")[2]
    assert cfg["rule_files"] == ["rules/*.yml"]


def test_local_scrape_config_reads_the_targets_file_the_stack_writes() -> None:
    cfg = load_yaml("prometheus", "prometheus-local.yml")
    (job,) = cfg["scrape_configs"]
    (sd,) = job["file_sd_configs"]
    (path,) = sd["files"]
    written = statefiles.StateFiles(os.path.join(REPO, ".state")).targets_path  # make up's state dir
    assert os.path.normpath(os.path.join(DEPLOY, "prometheus", path)) == written


def test_grafana_provisioning_matches_the_compose_mounts() -> None:
    (source,) = load_yaml("grafana", "provisioning", "datasources", "prometheus.yml")["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090" and source["isDefault"]
    (provider,) = load_yaml("grafana", "provisioning", "dashboards", "replicaplane.yml")["providers"]
    with open(os.path.join(REPO, "docker-compose.yml"), encoding="utf-8") as fh:
        compose = yaml.safe_load(fh)
    grafana, prometheus = compose["services"]["grafana"], compose["services"]["prometheus"]
    assert grafana["profiles"] == prometheus["profiles"] == ["observability"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in grafana["volumes"] if m.startswith("./")}
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    assert mounts[f"{provider['options']['path']}/replicaplane.json"] == "./deploy/grafana/replicaplane.json"
    assert "./deploy/prometheus:/etc/prometheus:ro" in prometheus["volumes"]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; make deploy-check installs it in CI)")
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, check=False, cwd=REPO)


@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus-local.yml"])
def test_promtool_accepts_the_scrape_configs(name: str) -> None:
    result = _promtool("check", "config", os.path.join(DEPLOY, "prometheus", name))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_rules_and_their_unit_tests_pass() -> None:
    checked = _promtool("check", "rules", RULES)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool("test", "rules", os.path.join(DEPLOY, "prometheus", "tests", "replicaplane.test.yml"))
    assert tested.returncode == 0, tested.stdout + tested.stderr

"""A real Prometheus (Debian's `prometheus` binary) against a live local stack, with the scrape
config and alert rules of deploy/prometheus: it finds every process through the stack's targets
file, scrapes them all, loads and evaluates every rule without error, and runs every query of
the Grafana dashboard without error. Skipped where the binary is missing (`make deploy-check`
installs it in CI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
import yaml

from tests.helpers import ports

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMETHEUS_DIR = os.path.join(REPO, "deploy", "prometheus")
DASHBOARD = os.path.join(REPO, "deploy", "grafana", "replicaplane.json")
EXAMPLE = os.path.join(REPO, "examples", "hello", "service.yaml")


def _stack(*args: str) -> subprocess.CompletedProcess[str]:
    # The public ports on port 0; the rest are Unix sockets, and every metrics port follows.
    env = {
        **os.environ,
        "REPLICAPLANE_CONTROLLER_LISTEN_ADDR": "127.0.0.1:0",
        "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": "127.0.0.1:0",
        "REPLICAPLANE_DASHBOARD_HTTP_ADDR": "127.0.0.1:0",
    }
    return subprocess.run(
        [sys.executable, "-m", "services.stack", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )


def _api(base: str, path: str, **params: str) -> dict:
    url = f"{base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as resp:
        data = json.loads(resp.read())
    assert data["status"] == "success", data
    return dict(data["data"])


@pytest.fixture
def prometheus(tmp_path) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (Debian package `prometheus`)")
    state = tmp_path / "state"
    up = _stack("up", "--detach", "--probers", "2", "--state-dir", str(state), "--example", EXAMPLE)
    assert up.returncode == 0, up.stdout + up.stderr
    proc = None
    try:
        # The local config as shipped, pointed at this stack's state dir, scraping every second.
        with open(os.path.join(PROMETHEUS_DIR, "prometheus-local.yml"), encoding="utf-8") as fh:
            cfg = yaml.safe_load(fh)
        cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = "1s"
        cfg["rule_files"] = [os.path.join(PROMETHEUS_DIR, f) for f in cfg["rule_files"]]
        cfg["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(state / "prometheus" / "targets.json")]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        # Prometheus cannot report a port it picked: it gets its usual port on this test
        # process's own loopback address, which no other process listens on.
        listen = f"{ports.private_host()}:9090"
        log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - the child writes it
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address={listen}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        yield f"http://{listen}"
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        down = _stack("down", "--state-dir", str(state))
        assert down.returncode == 0, down.stdout + down.stderr


def _until(what: str, check, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except OSError as exc:  # not listening yet
            last = exc
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout:.0f} s; last: {last}")


def test_prometheus_scrapes_the_stack_and_runs_every_rule_and_dashboard_query(prometheus: str) -> None:
    def all_up() -> list[tuple[str, str]] | None:
        targets = _api(prometheus, "targets")["activeTargets"]
        found = sorted((t["labels"]["job"], t["labels"]["process"]) for t in targets)
        return found if len(found) == 6 and all(t["health"] == "up" for t in targets) else None

    assert _until("every process scraped", all_up) == [
        ("controller", "controller"),
        ("dashboard", "dashboard"),
        ("loadbalancer", "loadbalancer"),
        ("prober", "prober-1"),
        ("prober", "prober-2"),
        ("provisioner", "provisioner"),
    ]

    def evaluated() -> list[dict] | None:
        rules = [r for g in _api(prometheus, "rules")["groups"] for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None

    rules = _until("every rule evaluated", evaluated)
    assert len(rules) == 8
    assert [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok"] == []
    # A healthy stack fires nothing.
    assert [r["name"] for r in rules if r["state"] == "firing"] == []

    with open(DASHBOARD, encoding="utf-8") as fh:
        dashboard = json.load(fh)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    results = {}
    for expr in exprs:
        query = expr.replace("$__rate_interval", "1m").replace("$service", ".*")
        results[expr] = _api(prometheus, "query", query=query)["result"]  # a bad query is a 400 here
    assert results["sum by (instance) (replicaplane_prober_assigned_replicas)"] != []
    build = _api(prometheus, "query", query="count by (job) (replicaplane_build_info)")["result"]
    assert {r["metric"]["job"]: r["value"][1] for r in build} == {
        "controller": "1",
        "dashboard": "1",
        "loadbalancer": "1",
        "prober": "2",
        "provisioner": "1",
    }

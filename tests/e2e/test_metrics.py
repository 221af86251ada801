"""Metrics and traces on a live local stack: `python -m services.stack up --detach` prints each
service's metrics URL, every one of them answers in the Prometheus text format, and the metrics
move when the example service is created, probed and used through its load balancer; with
OTEL_TRACES_EXPORTER=otlp the create is one trace across the controller, provisioner and prober
processes, received over OTLP."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import aiohttp
import pytest

from tests.e2e import test_stack
from tests.helpers import metrics, otlp

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "hello", "service.yaml")
PROCESSES = ["controller", "dashboard", "loadbalancer", "prober-1", "provisioner"]


def _stack(*args: str, timeout: float, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        **(extra or {}),
        # Port 0 for the public ports, the rest on Unix sockets, and every metrics port follows:
        # no clash with anything.
        "REPLICAPLANE_CONTROLLER_LISTEN_ADDR": "127.0.0.1:0",
        "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": "127.0.0.1:0",
        "REPLICAPLANE_DASHBOARD_HTTP_ADDR": "127.0.0.1:0",
    }
    return subprocess.run(
        [sys.executable, "-m", "services.stack", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def collector() -> Iterator[otlp.Serving]:
    yield from otlp.serving()


@pytest.fixture
def stack(tmp_path, collector: otlp.Serving) -> Iterator[tuple[str, dict]]:
    state_dir = tmp_path / "state"
    up = _stack(
        "up", "--detach", "--state-dir", str(state_dir), "--example", EXAMPLE, timeout=240, extra=collector.env()
    )
    try:
        assert up.returncode == 0, f"{up.stdout}{up.stderr}\n{(state_dir / 'stack.log').read_text(errors='replace')}"
        yield up.stdout, json.loads((state_dir / "stack.json").read_text())
    finally:
        down = _stack("down", "--state-dir", str(state_dir), timeout=200)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not (state_dir / "prometheus" / "targets.json").exists()


def _get(url: str) -> int:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:  # 503 until the balancer has the ready endpoints
            if exc.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


async def test_every_process_prints_and_serves_metrics_that_move(stack, tmp_path, collector) -> None:
    out, state = stack
    printed = dict(re.findall(r"(\S+) metrics: (http://127\.0\.0\.1:\d+/metrics)", out))
    assert sorted(printed) == PROCESSES, out
    assert printed == state["metrics"]
    urls = printed
    for name, url in urls.items():
        scrape = await metrics.ascrape(url)
        (build,) = scrape.samples("replicaplane_build_info")
        assert build.labels["component"] == name.split("-")[0]
        assert scrape.has("process_cpu_seconds_total")

    # The stack created hello through the controller's API and follows it with a watch.
    controller = await metrics.ascrape(urls["controller"])
    create = {"grpc_service": "replicaplane.controller.v1.ControllerService", "grpc_method": "CreateService"}
    assert controller.value("grpc_server_handled_total", **create, grpc_code="OK") == 1

    # The controller's own: two replicas launched and READY, the launch to READY of each, the
    # watch streams following hello (the stack's and the balancer's), the store's writes.
    controller = await metrics.until(
        urls["controller"],
        lambda s: s.value("replicaplane_controller_replicas", service="hello", version="1", status="READY") == 2,
        what="two READY replicas in the controller's metrics",
    )
    assert controller.value("replicaplane_controller_launches_total", service="hello", outcome="succeeded") == 2
    assert controller.value("replicaplane_controller_launch_to_ready_seconds_count") == 2
    assert controller.value("replicaplane_controller_autoscaler_target_replicas", service="hello") == 2
    assert controller.value("replicaplane_controller_autoscaler_current_replicas", service="hello") == 2
    assert controller.value("replicaplane_controller_watch_subscribers") >= 1
    assert controller.value("replicaplane_controller_store_write_seconds_count") > 0
    assert controller.value("replicaplane_controller_store_write_errors_total") == 0
    assert controller.value("replicaplane_controller_probing_stale") == 0
    assert controller.value("replicaplane_controller_pass_duration_seconds_count") > 0
    assert controller.has("replicaplane_controller_queue_depth")

    # The provisioner launched both replicas; the prober probes them.
    provisioner = await metrics.until(
        urls["provisioner"],
        lambda s: s.value("replicaplane_provisioner_replicas", state="running") == 2,
        what="two running replicas",
    )
    assert provisioner.value("replicaplane_provisioner_launch_duration_seconds_count", outcome="succeeded") == 2
    launch = {"grpc_service": "replicaplane.provisioner.v1.ProvisionerService", "grpc_method": "Launch"}
    assert provisioner.value("grpc_server_started_total", **launch) == 2
    prober = await metrics.until(
        urls["prober-1"],
        lambda s: (
            s.value("replicaplane_prober_assigned_replicas") == 2
            and s.value("replicaplane_prober_probes_total", outcome="ready") >= 2
        ),
        what="two probed replicas",
    )
    probe = {"grpc_service": "replicaplane.prober.v1.ProberService", "grpc_method": "Probe"}
    assert prober.value("grpc_server_in_flight_rpcs", **probe) >= 1
    before = prober.value("replicaplane_prober_probes_total")
    await metrics.until(urls["prober-1"], lambda s: s.value("replicaplane_prober_probes_total") > before)

    # Requests through the balancer are counted by version and code.
    token = (tmp_path / "state" / "api-token").read_text().strip()
    balancer_url = test_stack.service_url(state, [("authorization", f"Bearer {token}")])
    for _ in range(3):
        assert _get(balancer_url + "/") == 200
    ok = {"service": "hello", "version": "1", "code": "200"}
    # Counted once the handler returns, a moment after the client has its answer.
    balancer = await metrics.until(
        urls["loadbalancer"], lambda s: s.value("replicaplane_loadbalancer_requests_total", **ok) == 3
    )
    assert balancer.value("replicaplane_loadbalancer_request_duration_seconds_count", service="hello") >= 3
    await metrics.until(urls["loadbalancer"], lambda s: s.value("replicaplane_loadbalancer_ready_replicas") == 2)

    # A page open on the web dashboard is counted, with the controller stream it follows hello on.
    dashboard_url = next(p["url"] for p in state["processes"] if p["name"] == "dashboard")
    token = (tmp_path / "state" / "api-token").read_text().strip()  # the stack's: the page's token
    events = f"{dashboard_url}/api/events"
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as session, session.get(events, headers=headers) as resp:
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"event: snapshot")
        dashboard = await metrics.until(
            urls["dashboard"],
            lambda s: (
                s.value("replicaplane_dashboard_pages") == 1
                and s.value("replicaplane_dashboard_controller_streams") == 1
            ),
            what="one page following hello",
        )
    assert dashboard.value("replicaplane_dashboard_events_sent_total", kind="snapshot") == 1
    assert dashboard.value("replicaplane_dashboard_page_connections_total", outcome="accepted") == 1
    assert dashboard.value("replicaplane_dashboard_bridges", state="live") == 1

    # Prometheus finds them all through the stack's file_sd targets file.
    targets = json.loads((tmp_path / "state" / "prometheus" / "targets.json").read_text())
    assert {g["labels"]["process"]: g["targets"] for g in targets} == {
        name: [url.removeprefix("http://").removesuffix("/metrics")] for name, url in urls.items()
    }
    assert {g["labels"]["job"] for g in targets} == {"controller", "dashboard", "loadbalancer", "prober", "provisioner"}

    # The create is one trace over three processes, received over OTLP.
    spans = collector.receiver.until(
        lambda spans: (
            sum(1 for s in spans if s.name == "replica.ready") == 2
            and sum(1 for s in spans if s.name == "Launch") == 2
            and any(s.name == "probe" for s in spans)
        ),
        timeout=60,
    )
    (create,) = [s for s in spans if s.name == "CreateService"]
    assert create.process == "replicaplane-controller" and create.parent_id == ""
    assert create.attributes["replicaplane.service"] == "hello"
    traced = [s for s in spans if s.trace_id == create.trace_id]
    assert {(s.process, s.name) for s in traced} == {
        ("replicaplane-controller", "CreateService"),
        ("replicaplane-controller", "replica.start"),
        ("replicaplane-controller", "replica.ready"),
        ("replicaplane-provisioner", "Launch"),
        ("replicaplane-prober", "probe"),
    }
    starts = {s.span_id: s for s in traced if s.name == "replica.start"}
    assert sorted(s.attributes["replicaplane.replica_id"] for s in starts.values()) == [1, 2]
    assert all(s.parent_id == create.span_id for s in starts.values())
    assert all(s.parent_id in starts for s in traced if s.name in ("Launch", "probe", "replica.ready"))
    assert all("LAUNCH_EVENT_TYPE_RUNNING" in s.events for s in traced if s.name == "Launch")

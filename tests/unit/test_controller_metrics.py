"""The controller's metrics from what its hubs publish: replica facts moving become launch,
teardown and launch-to-READY counts; the fleet gauges read at scrape time, parsed back with
prometheus_client's own parser."""

from __future__ import annotations

import time
from typing import Any

import prometheus_client
import pytest
from prometheus_client import parser

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import pbtime
from services.controller import metrics

LP, TP = res.LaunchPhase, res.TeardownPhase
SINCE = 1_000.0


def replica(
    rid: int = 1,
    *,
    launch: int = LP.LAUNCH_PHASE_SCHEDULED,
    teardown: int = TP.TEARDOWN_PHASE_UNSPECIFIED,
    created: float = SINCE + 1,
    ready_at: float | None = None,
    capacity: bool = False,
    status: int = res.REPLICA_STATUS_PENDING,
    version: int = 1,
) -> res.Replica:
    r = res.Replica(service="web", replica_id=rid, version=version, status=status)  # type: ignore[arg-type]
    r.create_time.CopyFrom(pbtime.timestamp(created))
    r.facts.launch_phase = launch  # type: ignore[assignment]
    r.facts.teardown_phase = teardown  # type: ignore[assignment]
    r.facts.failed_spot_availability = capacity
    if ready_at is not None:
        r.facts.first_ready_time.CopyFrom(pbtime.timestamp(ready_at))
    return r


def kinds(events: list[metrics.Event]) -> list[tuple[str, str, str]]:
    return [(e.kind, e.outcome, e.cause) for e in events]


# Each row: the facts a replica is published with, one change after another, and what each says happened.
ROWS = {
    "a launch that succeeds and becomes ready": [
        (dict(), []),
        (dict(launch=LP.LAUNCH_PHASE_RUNNING), []),
        (dict(launch=LP.LAUNCH_PHASE_SUCCEEDED), [("launch", "succeeded", "none")]),
        (dict(launch=LP.LAUNCH_PHASE_SUCCEEDED, ready_at=SINCE + 4), [("ready", "", "none")]),
        (dict(launch=LP.LAUNCH_PHASE_SUCCEEDED, ready_at=SINCE + 4), []),  # a later change of a ready replica
    ],
    "changes coalesced into one message still count each step": [
        (
            dict(launch=LP.LAUNCH_PHASE_SUCCEEDED, ready_at=SINCE + 2),
            [("launch", "succeeded", "none"), ("ready", "", "none")],
        ),
    ],
    "a launch refused for capacity is the infrastructure's fault": [
        (dict(), []),
        (
            dict(launch=LP.LAUNCH_PHASE_FAILED, teardown=TP.TEARDOWN_PHASE_SCHEDULED, capacity=True),
            [("launch", "failed", "infrastructure")],
        ),
        (
            dict(launch=LP.LAUNCH_PHASE_FAILED, teardown=TP.TEARDOWN_PHASE_SUCCEEDED, capacity=True),
            [("teardown", "succeeded", "none")],
        ),
    ],
    "any other launch failure is the user's (a setup that exits 1)": [
        (dict(launch=LP.LAUNCH_PHASE_RUNNING), []),
        (dict(launch=LP.LAUNCH_PHASE_FAILED, teardown=TP.TEARDOWN_PHASE_RUNNING), [("launch", "failed", "user")]),
        (dict(launch=LP.LAUNCH_PHASE_FAILED, teardown=TP.TEARDOWN_PHASE_FAILED), [("teardown", "failed", "none")]),
    ],
    "a replica known from before this process counts only what moves now": [
        (dict(launch=LP.LAUNCH_PHASE_SUCCEEDED, created=SINCE - 50, ready_at=SINCE - 40), []),
        (
            dict(
                launch=LP.LAUNCH_PHASE_SUCCEEDED,
                created=SINCE - 50,
                ready_at=SINCE - 40,
                teardown=TP.TEARDOWN_PHASE_SCHEDULED,
            ),
            [],
        ),
        (
            dict(
                launch=LP.LAUNCH_PHASE_SUCCEEDED,
                created=SINCE - 50,
                ready_at=SINCE - 40,
                teardown=TP.TEARDOWN_PHASE_FAILED,
            ),
            [("teardown", "failed", "none")],
        ),
    ],
    "a launch in flight before a restart counts when it ends": [
        (dict(launch=LP.LAUNCH_PHASE_RUNNING, created=SINCE - 5), []),
        (dict(launch=LP.LAUNCH_PHASE_SUCCEEDED, created=SINCE - 5), [("launch", "succeeded", "none")]),
    ],
}


@pytest.mark.parametrize("steps", ROWS.values(), ids=ROWS.keys())
def test_published_facts_become_events(steps) -> None:
    t = metrics.Transitions(since=SINCE)
    for facts, expected in steps:
        assert kinds(t.changes([replica(**facts)], [])) == expected, facts


def test_the_cause_the_core_reports_wins_over_the_guess() -> None:
    t = metrics.Transitions(since=SINCE)
    t.changes([replica(1, launch=LP.LAUNCH_PHASE_RUNNING), replica(2, launch=LP.LAUNCH_PHASE_RUNNING)], [])
    t.failed(1, "infrastructure")  # an API server's 503: not the user's setup
    t.failed(2, "unspecified")  # not a cause: the guess stands
    events = t.changes(
        [replica(1, launch=LP.LAUNCH_PHASE_FAILED), replica(2, launch=LP.LAUNCH_PHASE_FAILED, capacity=True)], []
    )
    assert kinds(events) == [("launch", "failed", "infrastructure"), ("launch", "failed", "infrastructure")]
    t.changes([replica(3, launch=LP.LAUNCH_PHASE_RUNNING)], [])
    t.failed(3, "user")
    assert kinds(t.changes([replica(3, launch=LP.LAUNCH_PHASE_FAILED)], [])) == [("launch", "failed", "user")]


def test_launch_to_ready_is_from_the_record_to_the_first_ready() -> None:
    t = metrics.Transitions(since=SINCE)
    (_, ready) = t.changes([replica(launch=LP.LAUNCH_PHASE_SUCCEEDED, created=SINCE + 1, ready_at=SINCE + 3.5)], [])
    assert ready.kind == "ready" and ready.seconds == pytest.approx(2.5)


def test_removals_end_teardowns_and_launches_refused_without_a_teardown() -> None:
    t = metrics.Transitions(since=SINCE)
    t.changes(
        [
            replica(1, launch=LP.LAUNCH_PHASE_SUCCEEDED, teardown=TP.TEARDOWN_PHASE_RUNNING),
            replica(2, launch=LP.LAUNCH_PHASE_RUNNING),
            replica(3, launch=LP.LAUNCH_PHASE_SUCCEEDED),  # preempted: gone, no teardown of ours
            replica(4, launch=LP.LAUNCH_PHASE_FAILED, teardown=TP.TEARDOWN_PHASE_FAILED),  # purged
        ],
        [],
    )
    assert kinds(t.changes([], [1, 2, 3, 4, 99])) == [
        ("teardown", "succeeded", "none"),
        ("launch", "failed", "infrastructure"),
    ]
    assert t.changes([], [1]) == []  # forgotten once gone


def published(*replicas: res.Replica, removed=(), deleted=False, name="web") -> api.WatchServiceResponse:
    return api.WatchServiceResponse(
        service=res.Service(name=name), replicas=replicas, removed_replica_ids=list(removed), deleted=deleted
    )


def scrape(registry: prometheus_client.CollectorRegistry) -> dict[str, parser.Metric]:
    text = prometheus_client.generate_latest(registry).decode()
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def value(families: dict[str, parser.Metric], name: str, **labels: str) -> float:
    return sum(
        s.value
        for f in families.values()
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_counts_by_service_and_their_removal_with_the_service() -> None:
    registry = prometheus_client.CollectorRegistry()
    m = metrics.ControllerMetrics(registry)
    now = time.time()
    m.published(published(replica(1, created=now)))
    m.published(published(replica(1, created=now, launch=LP.LAUNCH_PHASE_SUCCEEDED, ready_at=now + 1)))
    m.published(published(replica(7, created=now), name="api"))
    m.published(published(replica(7, created=now, launch=LP.LAUNCH_PHASE_FAILED, capacity=True), name="api"))
    m.store_write(0.002, True)
    m.store_write(5.0, False)
    families = scrape(registry)
    assert value(families, "replicaplane_controller_launches_total", service="web", outcome="succeeded") == 1
    assert value(families, "replicaplane_controller_launches_total", service="api", cause="infrastructure") == 1
    assert value(families, "replicaplane_controller_launch_to_ready_seconds_count") == 1
    assert value(families, "replicaplane_controller_launch_to_ready_seconds_bucket", le="1.0") == 1
    assert value(families, "replicaplane_controller_store_write_seconds_count") == 2
    assert value(families, "replicaplane_controller_store_write_errors_total") == 1

    m.published(published(deleted=True, name="api"))
    families = scrape(registry)
    assert value(families, "replicaplane_controller_launches_total", service="api") == 0
    assert value(families, "replicaplane_controller_launches_total", service="web") == 1


def test_fleet_gauges_read_at_scrape_time() -> None:
    registry = prometheus_client.CollectorRegistry()
    svc = res.Service(name="web", total_replicas=3)
    svc.autoscaler.target_replicas = 4
    svc.autoscaler.qps = 2.5
    reps = [
        replica(1, status=res.REPLICA_STATUS_READY),
        replica(2, status=res.REPLICA_STATUS_READY, version=2),
        replica(3, status=res.REPLICA_STATUS_READY, version=2),
        replica(4, status=res.REPLICA_STATUS_FAILED_PROBING),
    ]
    state: dict[str, Any] = {"watchers": 2, "stale": False}
    m = metrics.ControllerMetrics(registry)
    m.watch(
        metrics.Fleet(
            services=lambda: [(svc, reps)],
            watchers=lambda: state["watchers"],
            queue_depth=lambda: 1,
            probing_stale=lambda: state["stale"],
        )
    )
    families = scrape(registry)
    replicas = {
        (s.labels["version"], s.labels["status"]): s.value for s in families["replicaplane_controller_replicas"].samples
    }
    assert replicas == {("1", "READY"): 1, ("2", "READY"): 2, ("1", "FAILED_PROBING"): 1}
    assert value(families, "replicaplane_controller_autoscaler_target_replicas", service="web") == 4
    assert value(families, "replicaplane_controller_autoscaler_current_replicas", service="web") == 3
    assert value(families, "replicaplane_controller_autoscaler_qps", service="web") == 2.5
    assert value(families, "replicaplane_controller_watch_subscribers") == 2
    assert value(families, "replicaplane_controller_queue_depth") == 1
    assert value(families, "replicaplane_controller_probing_stale") == 0
    state.update(watchers=0, stale=True)
    families = scrape(registry)
    assert value(families, "replicaplane_controller_watch_subscribers") == 0
    assert value(families, "replicaplane_controller_probing_stale") == 1

"""The replica status table of spec.md section 2, row by row, and the rules built on it."""

from __future__ import annotations

import pytest

from services.controller.domain import status as st
from services.controller.domain.status import Facts
from services.controller.domain.status import LaunchPhase as L
from services.controller.domain.status import ReplicaStatus as S
from services.controller.domain.status import TeardownPhase as D

ROWS = [
    # (row, facts, expected)
    (1, Facts(launch=L.SCHEDULED), S.PENDING),
    (1, Facts(launch=L.SCHEDULED, teardown=D.FAILED, user_app_failed=True), S.PENDING),
    (2, Facts(launch=L.RUNNING, teardown=D.FAILED), S.FAILED_CLEANUP),
    (3, Facts(launch=L.RUNNING, teardown=D.SUCCEEDED), S.UNKNOWN),
    (4, Facts(launch=L.RUNNING), S.PROVISIONING),
    (4, Facts(launch=L.RUNNING, teardown=D.SCHEDULED), S.PROVISIONING),
    (5, Facts(launch=L.INTERRUPTED, teardown=D.RUNNING), S.SHUTTING_DOWN),
    (5, Facts(launch=L.INTERRUPTED, teardown=D.SCHEDULED), S.SHUTTING_DOWN),
    (5, Facts(launch=L.INTERRUPTED, teardown=D.FAILED), S.FAILED_CLEANUP),  # fix: purgeable
    (6, Facts(launch=L.SUCCEEDED, teardown=D.SUCCEEDED, preempted=True), S.PREEMPTED),
    (6, Facts(launch=L.SUCCEEDED, teardown=D.FAILED, preempted=True), S.PREEMPTED),
    (7, Facts(launch=L.SUCCEEDED, teardown=D.SCHEDULED), S.SHUTTING_DOWN),
    (7, Facts(launch=L.FAILED, teardown=D.RUNNING, user_app_failed=True), S.SHUTTING_DOWN),
    (8, Facts(launch=L.SUCCEEDED, teardown=D.FAILED, user_app_failed=True), S.FAILED_CLEANUP),
    (9, Facts(launch=L.SUCCEEDED, teardown=D.SUCCEEDED, user_app_failed=True), S.FAILED),
    (10, Facts(launch=L.FAILED, teardown=D.SUCCEEDED), S.FAILED_PROVISION),
    (11, Facts(launch=L.SUCCEEDED, teardown=D.SUCCEEDED), S.SHUTTING_DOWN),
    (12, Facts(launch=L.SUCCEEDED, teardown=D.SUCCEEDED, initial_delay_exceeded=True), S.FAILED_INITIAL_DELAY),
    (13, Facts(launch=L.SUCCEEDED, teardown=D.SUCCEEDED, first_ready_time=5.0), S.FAILED_PROBING),
    (
        14,
        Facts(launch=L.SUCCEEDED, teardown=D.SUCCEEDED, first_ready_time=5.0, ready_now=True),
        S.UNKNOWN,
    ),
    (15, Facts(launch=L.FAILED), S.FAILED_CLEANUP),
    (15, Facts(launch=L.SUCCEEDED, user_app_failed=True, ready_now=True), S.FAILED_CLEANUP),
    (16, Facts(launch=L.SUCCEEDED, ready_now=True, first_ready_time=1.0), S.READY),
    (17, Facts(launch=L.SUCCEEDED, first_ready_time=1.0), S.NOT_READY),
    (18, Facts(launch=L.SUCCEEDED), S.STARTING),
]


@pytest.mark.parametrize(("row", "facts", "expected"), ROWS, ids=[f"row{r[0]}-{r[2].name}" for r in ROWS])
def test_status_table(row: int, facts: Facts, expected: S) -> None:
    assert st.replica_status(facts) is expected


def test_every_row_is_covered() -> None:
    assert {r[0] for r in ROWS} == set(range(1, 19))


def test_terminal_and_failed_sets() -> None:
    assert st.FAILED_STATUSES < st.TERMINAL_STATUSES
    assert {S.SHUTTING_DOWN, S.PREEMPTED} == st.TERMINAL_STATUSES - st.FAILED_STATUSES
    assert set(st.SCALE_DOWN_ORDER) == set(S) - st.TERMINAL_STATUSES - {S.UNSPECIFIED}


def test_should_probe_only_launched_live_replicas() -> None:
    assert st.should_probe(Facts(launch=L.SUCCEEDED))
    assert not st.should_probe(Facts(launch=L.RUNNING))
    assert not st.should_probe(Facts(launch=L.SUCCEEDED, teardown=D.SCHEDULED))
    assert not st.should_probe(Facts(launch=L.SUCCEEDED, user_app_failed=True))
    assert not st.should_probe(Facts(launch=L.SUCCEEDED, preempted=True))


@pytest.mark.parametrize(
    ("facts", "version", "latest", "removed"),
    [
        (Facts(launch=L.SUCCEEDED, teardown=D.SUCCEEDED, is_scale_down=True), 1, 1, True),
        (Facts(launch=L.SUCCEEDED, teardown=D.SUCCEEDED, preempted=True, is_scale_down=True), 1, 1, True),
        (Facts(launch=L.SUCCEEDED, teardown=D.SUCCEEDED, user_app_failed=True), 1, 1, False),
        (Facts(launch=L.SUCCEEDED, teardown=D.SUCCEEDED, user_app_failed=True), 1, 2, True),
        (Facts(launch=L.SUCCEEDED, teardown=D.SUCCEEDED, purged=True), 1, 1, True),
        (Facts(launch=L.FAILED, teardown=D.SUCCEEDED, failed_spot_availability=True), 1, 1, True),
        (Facts(launch=L.FAILED, teardown=D.SUCCEEDED), 1, 1, False),
        # Fix: a failed scale-down teardown is kept as FAILED_CLEANUP, not dropped.
        (Facts(launch=L.SUCCEEDED, teardown=D.FAILED, is_scale_down=True), 1, 1, False),
        (Facts(launch=L.SUCCEEDED, teardown=D.FAILED, is_scale_down=True, purged=True), 1, 1, True),
    ],
)
def test_removed_or_kept_after_teardown(facts: Facts, version: int, latest: int, removed: bool) -> None:
    assert st.removed_after_teardown(facts, version=version, latest_version=latest) is removed


def test_scale_down_victim_order() -> None:
    rv = st.ReplicaView
    replicas = [
        rv(1, 1, S.READY),
        rv(2, 2, S.READY),
        rv(3, 2, S.STARTING),
        rv(4, 2, S.PENDING),
        rv(5, 2, S.PENDING),
        rv(6, 1, S.NOT_READY),
        rv(7, 2, S.FAILED),
        rv(8, 1, S.READY),
    ]
    order = [r.replica_id for r in st.scale_down_victims(replicas, 10)]
    assert order == [5, 4, 3, 6, 8, 1, 2]
    assert [r.replica_id for r in st.scale_down_victims(replicas, 2)] == [5, 4]
    assert st.scale_down_victims(replicas, 0) == []


def test_service_status_and_counts() -> None:
    assert st.service_status([]) is st.ServiceStatus.NO_REPLICA
    assert st.service_status([S.FAILED]) is st.ServiceStatus.NO_REPLICA
    assert st.service_status([S.PENDING, S.FAILED]) is st.ServiceStatus.REPLICA_INIT
    assert st.service_status([S.READY, S.STARTING]) is st.ServiceStatus.READY
    assert st.service_status([], launching=True) is st.ServiceStatus.REPLICA_INIT  # a new service
    assert st.service_status([S.FAILED], launching=True) is st.ServiceStatus.REPLICA_INIT
    # A replica shutting down (a scale-down draining) is on its way out, not counted (issue 20 item 8).
    assert st.ready_and_total([S.READY, S.STARTING, S.FAILED, S.SHUTTING_DOWN]) == (1, 2)
    assert st.ready_and_total([S.FAILED]) == (0, 0)

"""Failure causes, the stop rule and the launch pause, as tables."""

from __future__ import annotations

import pytest

from services.controller.domain import failures
from services.controller.domain.failures import Backoff, Cause, Failure, Kind
from services.controller.domain.status import ReplicaStatus as S
from services.controller.domain.status import ReplicaView as R

U, INF, N = Cause.USER, Cause.INFRASTRUCTURE, Cause.UNSPECIFIED


@pytest.mark.parametrize(
    ("kind", "reported", "cause"),
    [
        # user-caused by default: setup or run exit, never ready, an app crash, a refused spec
        (Kind.SETUP_EXITED, N, U),
        (Kind.APP_EXITED, N, U),
        (Kind.NEVER_READY, N, U),
        (Kind.LAUNCH_REFUSED, N, U),
        (Kind.LAUNCH_FAILED, N, U),  # an old provisioner's unclassified failure: the user's
        # what the provisioner reports wins where the kind allows it
        (Kind.LAUNCH_FAILED, INF, INF),  # an API server 503, a quota, a timeout
        (Kind.LAUNCH_FAILED, U, U),
        (Kind.APP_EXITED, INF, INF),  # a pool worker's holder ended from outside
        (Kind.NEVER_READY, INF, INF),  # its machine vanished meanwhile
        # never the user's, whatever is reported
        (Kind.CAPACITY, U, INF),
        (Kind.CAPACITY, N, INF),
        (Kind.PREEMPTED, U, INF),
        (Kind.LAUNCH_CANCELLED, U, INF),
        (Kind.PROVISIONER_UNREACHABLE, N, INF),
        (Kind.VANISHED, N, INF),
    ],
)
def test_cause_of(kind: Kind, reported: Cause, cause: Cause) -> None:
    assert failures.cause_of(kind, reported) is cause


def test_every_kind_has_a_default_cause() -> None:
    for kind in Kind:
        assert failures.cause_of(kind) in (U, INF)


@pytest.mark.parametrize(("cause", "counts"), [(U, True), (N, True), (INF, False)])
def test_counts_toward_stop(cause: Cause, counts: bool) -> None:
    assert failures.counts_toward_stop(cause) is counts


@pytest.mark.parametrize(
    ("failure", "version", "latest", "ever_ready", "stops"),
    [
        # a broken setup or app of the latest version, never ready: stopped
        (Failure(Kind.SETUP_EXITED, U), 2, 2, False, True),
        (Failure(Kind.APP_EXITED, U), 2, 2, False, True),
        (Failure(Kind.NEVER_READY, U), 2, 2, False, True),
        (Failure(Kind.LAUNCH_FAILED, N), 2, 2, False, True),
        # issue 19: a transient 503, a quota, capacity: retried, never stopped
        (Failure(Kind.LAUNCH_FAILED, INF), 2, 2, False, False),
        (Failure(Kind.CAPACITY, INF), 2, 2, False, False),
        (Failure(Kind.PREEMPTED, INF), 2, 2, False, False),
        # the version was READY once (any replica): not stopped
        (Failure(Kind.APP_EXITED, U), 2, 2, True, False),
        # the replica itself was ready before it crashed: not "before ever being ready"
        (Failure(Kind.APP_EXITED, U, ever_ready=True), 2, 2, False, False),
        (Failure(Kind.PROBE_WINDOW, U, ever_ready=True), 2, 2, False, False),
        # an outdated version's failure: the latest decides
        (Failure(Kind.APP_EXITED, U), 1, 2, False, False),
    ],
)
def test_stops_version(failure: Failure, version: int, latest: int, ever_ready: bool, stops: bool) -> None:
    assert failures.stops_version(failure, version=version, latest_version=latest, ever_ready=ever_ready) is stops


@pytest.mark.parametrize(
    ("remembered", "replicas", "ever"),
    [
        ([], [], False),
        ([2], [], True),
        ([1], [R(1, 1, S.READY)], False),
        ([], [R(1, 2, S.READY)], True),  # kept READY through an in-place update
        ([], [R(1, 2, S.NOT_READY), R(2, 2, S.STARTING)], False),
    ],
)
def test_version_ever_ready(remembered: list[int], replicas: list[R], ever: bool) -> None:
    assert failures.version_ever_ready(2, remembered, replicas) is ever


def test_stop_message() -> None:
    assert failures.stop_message(2, 3, "app exited with code 1") == (
        "scaling stopped: version 2 failed before ever being ready (replica 3: app exited with code 1)"
    )


@pytest.mark.parametrize(
    ("failure", "pauses"),
    [
        (Failure(Kind.CAPACITY, INF), True),
        (Failure(Kind.LAUNCH_FAILED, INF), True),
        (Failure(Kind.PROVISIONER_UNREACHABLE, INF), True),
        (Failure(Kind.LAUNCH_FAILED, U), False),  # the stop rule handles it
        (Failure(Kind.LAUNCH_CANCELLED, INF), False),  # someone else's decision
        (Failure(Kind.PREEMPTED, INF), False),  # the spot placer moves on
        (Failure(Kind.APP_EXITED, U), False),
    ],
)
def test_pauses_launches(failure: Failure, pauses: bool) -> None:
    assert failures.pauses_launches(failure) is pauses


def test_backoff_doubles_from_one_second_to_sixty() -> None:
    b, delays = Backoff(), []
    for _ in range(9):
        b = b.failed(100.0, "quota")
        delays.append(b.delay_s)
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert b.not_before == 160.0 and b.reason == "quota"


def test_backoff_success_resets_the_delay_not_the_running_pause() -> None:
    b = Backoff().failed(0.0).failed(0.0).failed(10.0)  # 4 s from 10
    ok = b.succeeded()
    assert ok.delay_s == 0 and ok.not_before == 14.0
    assert ok.failed(20.0).delay_s == 1.0


@pytest.mark.parametrize(
    ("now", "pause", "message"),
    [
        (10.0, 4.0, "launches paused for 4 s after an infrastructure failure: launch failed: HTTP 503"),
        (13.5, 0.5, "launches paused for 1 s after an infrastructure failure: launch failed: HTTP 503"),
        (14.0, 0.0, ""),
        (99.0, 0.0, ""),
    ],
)
def test_launch_pause_and_its_message(now: float, pause: float, message: str) -> None:
    b = Backoff(delay_s=4.0, not_before=14.0, reason="launch failed: HTTP 503")
    assert failures.launch_pause(b, now) == pause
    assert failures.pause_message(b, now) == message


@pytest.mark.parametrize(
    ("failure", "version", "ever_ready", "stop", "paused_until"),
    [
        (
            Failure(Kind.APP_EXITED, U, "app exited with code 1"),
            2,
            False,
            "scaling stopped: version 2 failed before ever being ready (replica 7: app exited with code 1)",
            0.0,
        ),
        (Failure(Kind.LAUNCH_FAILED, INF, "launch failed: HTTP 503"), 2, False, "", 101.0),
        (Failure(Kind.CAPACITY, INF, "launch failed: no capacity"), 1, True, "", 101.0),
        (Failure(Kind.APP_EXITED, U, "app exited with code 1"), 2, True, "", 0.0),
        (Failure(Kind.PREEMPTED, INF, "preempted"), 2, False, "", 0.0),
    ],
)
def test_react(failure: Failure, version: int, ever_ready: bool, stop: str, paused_until: float) -> None:
    got = failures.react(
        failure, replica_id=7, version=version, latest_version=2, ever_ready=ever_ready, backoff=Backoff(), now=100.0
    )
    assert got.stop == stop
    assert got.backoff.not_before == paused_until
    assert got.backoff.reason == (failure.message if paused_until else "")


@pytest.mark.parametrize(
    ("remembered", "version", "after"),
    [
        ([], 1, [1]),
        ([1, 2], 2, [1, 2]),
        (list(range(1, 17)), 17, list(range(2, 18))),  # the last 16
    ],
)
def test_remember_ready(remembered: list[int], version: int, after: list[int]) -> None:
    assert failures.remember_ready(remembered, version) == after

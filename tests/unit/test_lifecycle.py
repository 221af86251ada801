"""A replica's lifecycle: each event's effect on its facts, status and actions, as a table."""

from __future__ import annotations

import dataclasses

import hypothesis
import pytest
from hypothesis import strategies as hst

from services.controller.domain import lifecycle as lc
from services.controller.domain.failures import Cause, Failure, Kind
from services.controller.domain.lifecycle import Life
from services.controller.domain.status import LaunchPhase as LP
from services.controller.domain.status import ReplicaStatus as S
from services.controller.domain.status import TeardownPhase as TP

W = lc.Windows(initial_delay_s=10.0, failure_threshold_s=30.0)

SCHEDULED = Life()
PROVISIONING = Life(launch=LP.RUNNING)
STARTING = Life(launch=LP.SUCCEEDED)
READY = Life(launch=LP.SUCCEEDED, ready_now=True, first_ready_time=100.0)
NOT_READY = dataclasses.replace(READY, ready_now=False, streak_start=200.0, streak_last=210.0, failure_reason="x")
SPOT_READY = dataclasses.replace(READY, is_spot=True)
DRAINING = dataclasses.replace(READY, teardown=TP.SCHEDULED, is_scale_down=True, drain_s=120.0)
KEPT = Life(launch=LP.SUCCEEDED, teardown=TP.SUCCEEDED, user_app_failed=True, exit_code=1)


def failed(kind: Kind, cause: Cause, message: str, *, ever_ready: bool = False) -> lc.Failed:
    return lc.Failed(Failure(kind, cause, message, ever_ready))


def torn(reason: str, *, keep_logs: bool = True, drain: float = 0.0) -> lc.StartTeardown:
    return lc.StartTeardown(drain, keep_logs, reason)


# (name, life before, event, status after, changes expected in the facts, actions)
TABLE = [
    # ---- launches
    ("provisioning", SCHEDULED, lc.LaunchProvisioning(), S.PROVISIONING, {"launch": LP.RUNNING}, ()),
    ("provisioning twice", PROVISIONING, lc.LaunchProvisioning(), S.PROVISIONING, {}, ()),
    (
        "attempt failed",
        PROVISIONING,
        lc.LaunchAttemptFailed(1, "quota"),
        S.PROVISIONING,
        {"failure_reason": "launch attempt 1 failed: quota"},
        (),
    ),
    (
        "running",
        PROVISIONING,
        lc.LaunchRunning(),
        S.STARTING,
        {"launch": LP.SUCCEEDED},
        (lc.LaunchSucceeded(), lc.MarkZone(preempted=False)),
    ),
    (
        "broken setup: user failure, stops the version",
        PROVISIONING,
        lc.LaunchFailed("setup exited with code 2", Cause.USER),
        S.SHUTTING_DOWN,
        {"launch": LP.FAILED, "teardown": TP.SCHEDULED, "failure_reason": "launch failed: setup exited with code 2"},
        (
            failed(Kind.LAUNCH_FAILED, Cause.USER, "launch failed: setup exited with code 2"),
            torn("launch failed: setup exited with code 2"),
        ),
    ),
    (
        "transient 503: infrastructure failure",
        PROVISIONING,
        lc.LaunchFailed("HTTP 503", Cause.INFRASTRUCTURE),
        S.SHUTTING_DOWN,
        {"launch": LP.FAILED, "teardown": TP.SCHEDULED, "failure_reason": "launch failed: HTTP 503"},
        (
            failed(Kind.LAUNCH_FAILED, Cause.INFRASTRUCTURE, "launch failed: HTTP 503"),
            torn("launch failed: HTTP 503"),
        ),
    ),
    (
        "no capacity: the zone is marked, whatever the cause says",
        SCHEDULED,
        lc.LaunchFailed("no spot capacity", Cause.USER, capacity=True),
        S.SHUTTING_DOWN,
        {
            "launch": LP.FAILED,
            "teardown": TP.SCHEDULED,
            "failed_spot_availability": True,
            "failure_reason": "launch failed: no spot capacity",
        },
        (
            lc.MarkZone(preempted=True),
            failed(Kind.CAPACITY, Cause.INFRASTRUCTURE, "launch failed: no spot capacity"),
            torn("launch failed: no spot capacity"),
        ),
    ),
    (
        "refused by the provisioner",
        SCHEDULED,
        lc.LaunchFailed("bad zone", refused=True),
        S.SHUTTING_DOWN,
        {
            "launch": LP.FAILED,
            "teardown": TP.SCHEDULED,
            "failure_reason": "launch failed: provisioner refused the launch: bad zone",
        },
        (
            failed(Kind.LAUNCH_REFUSED, Cause.USER, "launch failed: provisioner refused the launch: bad zone"),
            torn("launch failed: provisioner refused the launch: bad zone"),
        ),
    ),
    (
        "cancelled at the provisioner",
        PROVISIONING,
        lc.LaunchFailed("", cancelled=True),
        S.SHUTTING_DOWN,
        {
            "launch": LP.FAILED,
            "teardown": TP.SCHEDULED,
            "failure_reason": "launch failed: the launch was cancelled at the provisioner",
        },
        (
            failed(
                Kind.LAUNCH_CANCELLED,
                Cause.INFRASTRUCTURE,
                "launch failed: the launch was cancelled at the provisioner",
            ),
            torn("launch failed: the launch was cancelled at the provisioner"),
        ),
    ),
    (
        "launch news after a teardown began",
        dataclasses.replace(PROVISIONING, launch=LP.INTERRUPTED, teardown=TP.SCHEDULED),
        lc.LaunchRunning(),
        S.SHUTTING_DOWN,
        {},
        (),
    ),
    ("launch news after it succeeded", STARTING, lc.LaunchFailed("late"), S.STARTING, {}, ()),
    # ---- app exits
    (
        "app crash before ever ready",
        STARTING,
        lc.AppExited(1, Cause.USER),
        S.SHUTTING_DOWN,
        {"user_app_failed": True, "exit_code": 1, "teardown": TP.SCHEDULED, "failure_reason": "app exited with code 1"},
        (failed(Kind.APP_EXITED, Cause.USER, "app exited with code 1"), torn("app exited with code 1")),
    ),
    (
        "app crash once ready",
        READY,
        lc.AppExited(137),
        S.SHUTTING_DOWN,
        {
            "user_app_failed": True,
            "exit_code": 137,
            "teardown": TP.SCHEDULED,
            "failure_reason": "app exited with code 137",
        },
        (
            failed(Kind.APP_EXITED, Cause.USER, "app exited with code 137", ever_ready=True),
            torn("app exited with code 137"),
        ),
    ),
    (
        "app exit 0: the probes decide",
        READY,
        lc.AppExited(0),
        S.READY,
        {"failure_reason": "app exited with code 0"},
        (),
    ),
    (
        "app exit before RUNNING is kept for later",
        PROVISIONING,
        lc.AppExited(3),
        S.PROVISIONING,
        {"pending_exit": lc.AppExited(3)},
        (),
    ),
    (
        "RUNNING then applies the exit seen before",
        dataclasses.replace(PROVISIONING, pending_exit=lc.AppExited(3, Cause.USER)),
        lc.LaunchRunning(),
        S.SHUTTING_DOWN,
        {
            "launch": LP.SUCCEEDED,
            "pending_exit": None,
            "user_app_failed": True,
            "exit_code": 3,
            "teardown": TP.SCHEDULED,
            "failure_reason": "app exited with code 3",
        },
        (
            lc.LaunchSucceeded(),
            lc.MarkZone(preempted=False),
            failed(Kind.APP_EXITED, Cause.USER, "app exited with code 3"),
            torn("app exited with code 3"),
        ),
    ),
    ("app exit while tearing down", DRAINING, lc.AppExited(1), S.SHUTTING_DOWN, {}, ()),
    ("second app exit", dataclasses.replace(STARTING, user_app_failed=True), lc.AppExited(2), S.FAILED_CLEANUP, {}, ()),
    # ---- vanished and preempted
    (
        "spot replica vanished: preempted",
        SPOT_READY,
        lc.Gone(),
        S.PREEMPTED,
        {"preempted": True, "is_scale_down": True, "teardown": TP.SCHEDULED, "failure_reason": "preempted"},
        (
            lc.MarkZone(preempted=True),
            failed(Kind.PREEMPTED, Cause.INFRASTRUCTURE, "preempted", ever_ready=True),
            torn("preempted", keep_logs=False),
        ),
    ),
    (
        "preempted on-demand",
        STARTING,
        lc.Gone(preempted=True),
        S.PREEMPTED,
        {"preempted": True, "is_scale_down": True, "teardown": TP.SCHEDULED, "failure_reason": "preempted"},
        (
            lc.MarkZone(preempted=True),
            failed(Kind.PREEMPTED, Cause.INFRASTRUCTURE, "preempted"),
            torn("preempted", keep_logs=False),
        ),
    ),
    (
        "on-demand vanished: fails at once, not after a probe window",
        READY,
        lc.Gone(message="its process group ended"),
        S.SHUTTING_DOWN,
        {"ready_now": False, "teardown": TP.SCHEDULED, "failure_reason": "replica vanished: its process group ended"},
        (
            failed(Kind.VANISHED, Cause.INFRASTRUCTURE, "replica vanished: its process group ended", ever_ready=True),
            torn("replica vanished: its process group ended"),
        ),
    ),
    (
        "on-demand vanished before it was ever ready: fails at once, not the user's fault",
        dataclasses.replace(STARTING, first_failure_time=50.0),
        lc.Gone(),
        S.SHUTTING_DOWN,
        {"initial_delay_exceeded": True, "teardown": TP.SCHEDULED, "failure_reason": "replica vanished"},
        (failed(Kind.VANISHED, Cause.INFRASTRUCTURE, "replica vanished"), torn("replica vanished")),
    ),
    ("vanished while tearing down: the teardown owns it", DRAINING, lc.Gone(), S.SHUTTING_DOWN, {}, ()),
    ("vanished while launching: the launch stream reports", PROVISIONING, lc.Gone(), S.PROVISIONING, {}, ()),
    # ---- probes of a replica never ready
    (
        "first probe fails: the delay starts",
        STARTING,
        lc.Probed(False, 50.0),
        S.STARTING,
        {"first_failure_time": 50.0},
        (),
    ),
    (
        "within the initial delay",
        dataclasses.replace(STARTING, first_failure_time=50.0),
        lc.Probed(False, 60.0),
        S.STARTING,
        {},
        (),
    ),
    (
        "past the initial delay (strictly)",
        dataclasses.replace(STARTING, first_failure_time=50.0),
        lc.Probed(False, 60.5, http_code=503),
        S.SHUTTING_DOWN,
        {
            "initial_delay_exceeded": True,
            "teardown": TP.SCHEDULED,
            "failure_reason": "not ready within the initial delay of 10 s (probe failed: HTTP 503)",
        },
        (
            failed(Kind.NEVER_READY, Cause.USER, "not ready within the initial delay of 10 s (probe failed: HTTP 503)"),
            torn("not ready within the initial delay of 10 s (probe failed: HTTP 503)"),
        ),
    ),
    (
        "first success",
        dataclasses.replace(STARTING, first_failure_time=50.0),
        lc.Probed(True, 55.0),
        S.READY,
        {"ready_now": True, "first_ready_time": 55.0},
        (),
    ),
    # ---- probes of a replica ready once
    ("success again: nothing to write", READY, lc.Probed(True, 300.0), S.READY, {}, ()),
    (
        "failure starts a streak",
        READY,
        lc.Probed(False, 200.0, error="timeout"),
        S.NOT_READY,
        {"ready_now": False, "streak_start": 200.0, "streak_last": 200.0, "failure_reason": "probe failed: timeout"},
        (),
    ),
    (
        "streak shorter than the window",
        NOT_READY,
        lc.Probed(False, 229.0, http_code=500),
        S.NOT_READY,
        {"streak_last": 229.0, "failure_reason": "probe failed: HTTP 500"},
        (),
    ),
    (
        "streak spans the window: failed probing",
        NOT_READY,
        lc.Probed(False, 230.0, http_code=500),
        S.SHUTTING_DOWN,
        {"streak_last": 230.0, "teardown": TP.SCHEDULED, "failure_reason": "probe failed: HTTP 500"},
        (
            failed(Kind.PROBE_WINDOW, Cause.USER, "probe failed: HTTP 500", ever_ready=True),
            torn("probe failed: HTTP 500"),
        ),
    ),
    (
        "recovered: the streak clears",
        NOT_READY,
        lc.Probed(True, 231.0),
        S.READY,
        {"ready_now": True, "streak_start": None, "streak_last": None, "failure_reason": ""},
        (),
    ),
    ("prober unreachable: no information", NOT_READY, lc.Probed(False, 999.0, informative=False), S.NOT_READY, {}, ()),
    ("probe of a replica not probed", DRAINING, lc.Probed(False, 999.0), S.SHUTTING_DOWN, {}, ()),
    # ---- teardowns
    (
        "scale-down drains",
        READY,
        lc.TeardownAsked(drain_s=120.0, scale_down=True, reason="scale down"),
        S.SHUTTING_DOWN,
        {"teardown": TP.SCHEDULED, "is_scale_down": True, "drain_s": 120.0},
        (torn("scale down", keep_logs=False, drain=120.0),),
    ),
    (
        "teardown of a launch in flight cancels it",
        PROVISIONING,
        lc.TeardownAsked(scale_down=True, reason="scale down"),
        S.SHUTTING_DOWN,
        {"launch": LP.INTERRUPTED, "teardown": TP.SCHEDULED, "is_scale_down": True},
        (lc.CancelLaunch(), torn("scale down", keep_logs=False)),
    ),
    (
        "purge during a teardown only marks it",
        DRAINING,
        lc.TeardownAsked(purge=True),
        S.SHUTTING_DOWN,
        {"purged": True},
        (),
    ),
    (
        "purge of a failed cleanup tries once more",
        dataclasses.replace(KEPT, teardown=TP.FAILED),
        lc.TeardownAsked(purge=True, reason="purge"),
        S.SHUTTING_DOWN,
        {"teardown": TP.SCHEDULED, "purged": True},
        (torn("purge", keep_logs=False),),
    ),
    ("teardown runs", DRAINING, lc.TeardownRunning(), S.SHUTTING_DOWN, {"teardown": TP.RUNNING}, ()),
    (
        "teardown finished",
        dataclasses.replace(READY, teardown=TP.RUNNING, user_app_failed=True),
        lc.TeardownFinished(ok=True),
        S.FAILED,
        {"teardown": TP.SUCCEEDED},
        (),
    ),
    (
        "teardown failed",
        DRAINING,
        lc.TeardownFinished(ok=False, message="API server gone"),
        S.FAILED_CLEANUP,
        {"teardown": TP.FAILED, "failure_reason": "teardown failed: API server gone"},
        (),
    ),
]


@pytest.mark.parametrize(("name", "life", "event", "status", "changes", "actions"), TABLE, ids=[t[0] for t in TABLE])
def test_step(
    name: str, life: Life, event: lc.Event, status: S, changes: dict[str, object], actions: tuple[lc.Action, ...]
) -> None:
    new, got = lc.step(life, event, W)
    assert got == actions
    assert new == dataclasses.replace(life, **changes)  # type: ignore[arg-type]
    assert new.status is status


def test_failure_windows_reach_the_statuses_of_the_spec() -> None:
    """Walk a replica through a whole life: never-ready failure -> FAILED_INITIAL_DELAY."""
    life = STARTING
    for t in (0.0, 5.0, 10.0, 10.5):
        life, actions = lc.step(life, lc.Probed(False, t), W)
    assert [type(a) for a in actions] == [lc.Failed, lc.StartTeardown]
    life, _ = lc.step(life, lc.TeardownFinished(ok=True), W)
    assert life.status is S.FAILED_INITIAL_DELAY


def test_a_vanished_replica_ends_in_the_status_its_window_would_have_given() -> None:
    """Once ready: FAILED_PROBING; never ready: FAILED_INITIAL_DELAY; the record is kept."""
    for life, status in ((READY, S.FAILED_PROBING), (STARTING, S.FAILED_INITIAL_DELAY)):
        life, _ = lc.step(life, lc.Gone(message="gone"), W)
        life, _ = lc.step(life, lc.TeardownFinished(ok=True), W)
        assert life.status is status
        assert not life.is_scale_down and not life.preempted


def test_a_ready_replica_fails_probing_at_the_window() -> None:
    life = READY
    times = [200.0 + 10 * i for i in range(4)]  # 200 .. 230: the window of 30 s spans at 230
    for t in times:
        life, actions = lc.step(life, lc.Probed(False, t), W)
        assert bool(actions) is (t == 230.0)
    life, _ = lc.step(life, lc.TeardownFinished(ok=True), W)
    assert life.status is S.FAILED_PROBING


@pytest.mark.parametrize(
    ("life", "motion"),
    [
        (SCHEDULED, lc.Motion.FOLLOW_LAUNCH),
        (PROVISIONING, lc.Motion.FOLLOW_LAUNCH),
        (STARTING, lc.Motion.PROBE),
        (READY, lc.Motion.PROBE),
        (DRAINING, lc.Motion.TEARDOWN),
        (dataclasses.replace(DRAINING, teardown=TP.RUNNING), lc.Motion.TEARDOWN),
        (KEPT, lc.Motion.NOTHING),
        (dataclasses.replace(KEPT, teardown=TP.FAILED), lc.Motion.NOTHING),
        (dataclasses.replace(STARTING, user_app_failed=True), lc.Motion.FAILED_TEARDOWN),
        (Life(launch=LP.FAILED), lc.Motion.FAILED_TEARDOWN),
        (dataclasses.replace(READY, preempted=True), lc.Motion.NOTHING),
    ],
)
def test_wanted_motion(life: Life, motion: lc.Motion) -> None:
    assert lc.wanted_motion(life) is motion


@pytest.mark.parametrize(
    ("life", "keeps", "left"),
    [
        (dataclasses.replace(STARTING, teardown=TP.SCHEDULED, user_app_failed=True), True, True),
        (DRAINING, False, False),  # a scale-down
        (dataclasses.replace(KEPT, purged=True), False, True),
        (READY, True, False),  # no teardown yet: nothing left behind
    ],
)
def test_logs(life: Life, keeps: bool, left: bool) -> None:
    assert lc.keeps_logs(life) is keeps
    assert lc.logs_left(life) is left


# ---- properties over any sequence of events ---------------------------------------------------

_causes = hst.sampled_from(list(Cause))
_events = hst.one_of(
    hst.just(lc.LaunchProvisioning()),
    hst.builds(lc.LaunchAttemptFailed, hst.integers(1, 3), hst.sampled_from(["quota", "503"])),
    hst.just(lc.LaunchRunning()),
    hst.builds(lc.LaunchFailed, hst.just("x"), _causes, hst.booleans(), hst.booleans(), hst.booleans()),
    hst.builds(lc.AppExited, hst.integers(0, 2), _causes),
    hst.builds(lc.Gone, hst.booleans()),
    hst.builds(lc.Probed, hst.booleans(), hst.floats(0, 100), hst.just(""), hst.sampled_from([0, 503]), hst.booleans()),
    hst.builds(lc.TeardownAsked, hst.sampled_from([0.0, 5.0]), hst.booleans(), hst.booleans(), hst.booleans()),
    hst.just(lc.TeardownRunning()),
    hst.builds(lc.TeardownFinished, hst.booleans(), hst.just("gone")),
)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(spot=hst.booleans(), events=hst.lists(_events, max_size=12))
def test_any_sequence_keeps_the_invariants(spot: bool, events: list[lc.Event]) -> None:
    """Whatever arrives in whatever order: a repeated event changes nothing and starts nothing
    (so a replayed or duplicated event is harmless); a teardown starts once and never un-starts;
    facts that record the past (ever ready, app failed, first failure) are never forgotten; a
    replica being torn down has no launch in flight."""
    life = Life(is_spot=spot)
    for event in sorted(events, key=lambda e: e.time if isinstance(e, lc.Probed) else 0.0):
        new, actions = lc.step(life, event, W)
        again, more = lc.step(new, event, W)
        assert (again, more) == (new, ()), f"{event} applied twice"
        starts = [a for a in actions if isinstance(a, lc.StartTeardown)]
        assert len(starts) <= 1
        if starts:
            assert not life.tearing_down and new.teardown is TP.SCHEDULED
        if life.teardown is not TP.NONE:
            assert new.teardown is not TP.NONE
        if life.first_ready_time is not None:
            assert new.first_ready_time == life.first_ready_time
        if life.first_failure_time is not None:
            assert new.first_failure_time == life.first_failure_time
        assert new.user_app_failed >= life.user_app_failed
        if new.tearing_down:
            assert not new.launching
        cancelled = any(isinstance(a, lc.CancelLaunch) for a in actions)
        assert cancelled is (life.launching and new.launch is LP.INTERRUPTED)
        life = new

"""One replica's lifecycle: what each event does to its facts, and what must happen next.

`step(life, event, windows) -> (new_life, actions)` is the only place a replica's facts change
and the only place a replica is torn down for a reason of its own (a failed launch, an app
exit, a probe window, an initial delay, a preemption, a user's request): "why was replica 7 torn
down" is answered by the `StartTeardown.reason` it returned. Scale-down victims come from
`scaling.plan`; the stop rule and the launch pause from `failures` (applied to `Failed`).

`wanted_motion(life)` is the level-triggered half: what a replica in these facts should have in
motion (a launch followed, a teardown, probing), so a restart or a resync puts it back.

The events and actions are plain values in `replica_events` (re-exported here).

Pure: no asyncio, grpc or store. Times are wall-clock seconds (probe times, as the prober
stamps them).
"""

from __future__ import annotations

import dataclasses
import enum

from services.controller.domain import status as st
from services.controller.domain.failures import Failure, Kind
from services.controller.domain.replica_events import (
    Action,
    AppExited,
    CancelLaunch,
    Event,
    Failed,
    Gone,
    LaunchAttemptFailed,
    LaunchFailed,
    LaunchProvisioning,
    LaunchRunning,
    LaunchSucceeded,
    MarkZone,
    Probed,
    StartTeardown,
    TeardownAsked,
    TeardownFinished,
    TeardownRunning,
)

__all__ = [
    "Action",
    "AppExited",
    "CancelLaunch",
    "Event",
    "Failed",
    "Gone",
    "LaunchAttemptFailed",
    "LaunchFailed",
    "LaunchProvisioning",
    "LaunchRunning",
    "LaunchSucceeded",
    "Life",
    "MarkZone",
    "Motion",
    "Probed",
    "StartTeardown",
    "TeardownAsked",
    "TeardownFinished",
    "TeardownRunning",
    "Windows",
    "keeps_logs",
    "logs_left",
    "step",
    "wanted_motion",
]

LP = st.LaunchPhase
TP = st.TeardownPhase


@dataclasses.dataclass(frozen=True)
class Life:
    """A replica's lifecycle facts (the stored ReplicaFacts, plus what the rules need).

    Attributes:
        is_spot: the replica runs on spot capacity (a vanished spot replica was preempted).
        first_failure_time: first failed probe ever; the initial delay counts from here.
        streak_start, streak_last: the current failure streak of a once-ready replica.
        exit_code: the app's exit code, once it exited.
        drain_s: the drain of the teardown asked.
        failure_reason: the replica's one-line failure reason ("" when well).
        pending_exit: an app exit seen before the launch said RUNNING (memory only).
    """

    launch: st.LaunchPhase = LP.SCHEDULED
    teardown: st.TeardownPhase = TP.NONE
    user_app_failed: bool = False
    ready_now: bool = False
    first_ready_time: float | None = None
    initial_delay_exceeded: bool = False
    is_scale_down: bool = False
    preempted: bool = False
    purged: bool = False
    failed_spot_availability: bool = False
    is_spot: bool = False
    first_failure_time: float | None = None
    streak_start: float | None = None
    streak_last: float | None = None
    exit_code: int = 0
    drain_s: float = 0.0
    failure_reason: str = ""
    pending_exit: AppExited | None = None

    def facts(self) -> st.Facts:
        """The facts the replica's status is derived from."""
        return st.Facts(
            launch=self.launch,
            teardown=self.teardown,
            user_app_failed=self.user_app_failed,
            ready_now=self.ready_now,
            first_ready_time=self.first_ready_time,
            initial_delay_exceeded=self.initial_delay_exceeded,
            is_scale_down=self.is_scale_down,
            preempted=self.preempted,
            purged=self.purged,
            failed_spot_availability=self.failed_spot_availability,
        )

    @property
    def status(self) -> st.ReplicaStatus:
        return st.replica_status(self.facts())

    @property
    def launching(self) -> bool:
        return self.launch in (LP.SCHEDULED, LP.RUNNING)

    @property
    def tearing_down(self) -> bool:
        return self.teardown in (TP.SCHEDULED, TP.RUNNING)


@dataclasses.dataclass(frozen=True)
class Windows:
    """The failure windows (spec.md section 5).

    Attributes:
        initial_delay_s: a never-ready replica fails once (probe time - first failed probe)
            exceeds this; from the replica's own version.
        failure_threshold_s: a once-ready replica fails once its failure streak spans this;
            from the latest version.
    """

    initial_delay_s: float = 1200.0
    failure_threshold_s: float = 180.0


# ---- the step ------------------------------------------------------------------------------


def _teardown(
    life: Life, *, drain_s: float, keep_logs: bool, reason: str, scale_down: bool = False, purge: bool = False
) -> tuple[Life, tuple[Action, ...]]:
    """Schedule a teardown (cancelling the launch first, if any). One already in motion only
    takes the new flags: a purge or scale-down mark is never lost, a drain never restarted."""
    life = dataclasses.replace(life, is_scale_down=life.is_scale_down or scale_down, purged=life.purged or purge)
    if life.tearing_down:
        return life, ()
    actions: list[Action] = []
    if life.launching:
        life = dataclasses.replace(life, launch=LP.INTERRUPTED)
        actions.append(CancelLaunch())
    life = dataclasses.replace(life, teardown=TP.SCHEDULED, drain_s=drain_s)
    actions.append(StartTeardown(drain_s, keep_logs, reason))
    return life, tuple(actions)


def _fail(life: Life, failure: Failure, **changes: object) -> tuple[Life, tuple[Action, ...]]:
    """A failure of the replica itself: torn down at once, logs kept, reported upward."""
    life = dataclasses.replace(life, **changes)  # type: ignore[arg-type]
    life, actions = _teardown(life, drain_s=0.0, keep_logs=True, reason=life.failure_reason)
    return life, (Failed(failure), *actions)


def _launch_event(life: Life, event: Event) -> tuple[Life, tuple[Action, ...]]:
    if isinstance(event, LaunchProvisioning):
        if life.launch is LP.SCHEDULED:
            return dataclasses.replace(life, launch=LP.RUNNING), ()
        return life, ()
    if isinstance(event, LaunchAttemptFailed):
        return dataclasses.replace(life, failure_reason=f"launch attempt {event.attempt} failed: {event.message}"), ()
    if isinstance(event, LaunchRunning):
        pending = life.pending_exit
        life = dataclasses.replace(life, launch=LP.SUCCEEDED, failure_reason="", pending_exit=None)
        actions: tuple[Action, ...] = (LaunchSucceeded(), MarkZone(preempted=False))
        if pending is not None:  # the app exited before the launch said RUNNING
            life, more = _app_exited(life, pending)
            actions += more
        return life, actions
    assert isinstance(event, LaunchFailed)
    if event.cancelled:
        kind = Kind.LAUNCH_CANCELLED
        message = event.message or "the launch was cancelled at the provisioner"
    elif event.capacity:
        kind, message = Kind.CAPACITY, event.message
    elif event.refused:
        kind, message = Kind.LAUNCH_REFUSED, f"provisioner refused the launch: {event.message}"
    else:
        kind, message = Kind.LAUNCH_FAILED, event.message
    reason = f"launch failed: {message}"
    failure = Failure.of(kind, reason, reported=event.cause)
    life, actions = _fail(
        life, failure, launch=LP.FAILED, failed_spot_availability=event.capacity, failure_reason=reason
    )
    if event.capacity:
        actions = (MarkZone(preempted=True), *actions)
    return life, actions


def _app_exited(life: Life, event: AppExited) -> tuple[Life, tuple[Action, ...]]:
    if life.teardown is not TP.NONE:
        return life, ()
    if life.launch is not LP.SUCCEEDED:
        return dataclasses.replace(life, pending_exit=event), ()  # RUNNING not seen yet
    if life.user_app_failed:
        return life, ()
    if event.code == 0:
        # Not a user app failure (spec.md section 3); the probes will fail and decide.
        return dataclasses.replace(life, exit_code=0, failure_reason="app exited with code 0"), ()
    reason = f"app exited with code {event.code}"
    failure = Failure.of(Kind.APP_EXITED, reason, reported=event.cause, ever_ready=life.first_ready_time is not None)
    return _fail(life, failure, exit_code=event.code, user_app_failed=True, failure_reason=reason)


def _gone(life: Life, event: Gone) -> tuple[Life, tuple[Action, ...]]:
    if life.teardown is not TP.NONE or life.launch is not LP.SUCCEEDED:
        return life, ()  # a launch's own stream reports what happened to it
    if event.preempted or life.is_spot:
        life = dataclasses.replace(life, preempted=True, failure_reason="preempted")
        life, actions = _teardown(life, drain_s=0.0, keep_logs=False, reason="preempted", scale_down=True)
        failure = Failure.of(Kind.PREEMPTED, "preempted", ever_ready=life.first_ready_time is not None)
        return life, (MarkZone(preempted=True), Failed(failure), *actions)
    # The backend saw it go (its processes, its Pod): final, unlike a failed probe, so an
    # on-demand replica or worker fails now instead of waiting out a probe window. The status is
    # the one that window would have ended in; the cause is never the user's.
    reason = f"replica vanished: {event.message}" if event.message else "replica vanished"
    ever_ready = life.first_ready_time is not None
    failure = Failure.of(Kind.VANISHED, reason, ever_ready=ever_ready)
    return _fail(life, failure, ready_now=False, initial_delay_exceeded=not ever_ready, failure_reason=reason)


def _probed(life: Life, event: Probed, windows: Windows) -> tuple[Life, tuple[Action, ...]]:
    if not event.informative or not st.should_probe(life.facts()):
        return life, ()
    if event.ready:
        if life.ready_now and life.first_ready_time is not None and life.streak_start is None:
            return life, ()  # nothing changed: no write
        first = life.first_ready_time if life.first_ready_time is not None else event.time
        return dataclasses.replace(
            life, ready_now=True, first_ready_time=first, streak_start=None, streak_last=None, failure_reason=""
        ), ()
    reason = f"probe failed: {event.error or f'HTTP {event.http_code}'}"
    if life.first_ready_time is not None:
        start = life.streak_start if life.streak_start is not None else event.time
        life = dataclasses.replace(
            life, ready_now=False, streak_start=start, streak_last=event.time, failure_reason=reason
        )
        if event.time - start >= windows.failure_threshold_s:
            failure = Failure.of(Kind.PROBE_WINDOW, reason, ever_ready=True)
            return _fail(life, failure)
        return life, ()
    if life.first_failure_time is None:
        return dataclasses.replace(life, first_failure_time=event.time), ()
    if event.time - life.first_failure_time > windows.initial_delay_s:  # strict, as SkyPilot
        reason = f"not ready within the initial delay of {windows.initial_delay_s:g} s ({reason})"
        failure = Failure.of(Kind.NEVER_READY, reason)
        return _fail(life, failure, initial_delay_exceeded=True, failure_reason=reason)
    return life, ()


def step(life: Life, event: Event, windows: Windows = Windows()) -> tuple[Life, tuple[Action, ...]]:
    """Apply one event to a replica's facts.

    Returns the new facts (equal to `life` when nothing changed: nothing to write) and what must
    happen now, in order. A replica being torn down ignores launch, app and probe news: the
    teardown owns it.
    """
    if isinstance(event, (LaunchProvisioning, LaunchAttemptFailed, LaunchRunning, LaunchFailed)):
        if life.teardown is not TP.NONE or not life.launching:
            return life, ()
        return _launch_event(life, event)
    if isinstance(event, AppExited):
        return _app_exited(life, event)
    if isinstance(event, Gone):
        return _gone(life, event)
    if isinstance(event, Probed):
        return _probed(life, event, windows)
    if isinstance(event, TeardownAsked):
        return _teardown(
            life,
            drain_s=event.drain_s,
            keep_logs=event.keep_logs,
            reason=event.reason,
            scale_down=event.scale_down,
            purge=event.purge,
        )
    if isinstance(event, TeardownRunning):
        if life.teardown is TP.SCHEDULED:
            return dataclasses.replace(life, teardown=TP.RUNNING), ()
        return life, ()
    assert isinstance(event, TeardownFinished)
    if life.teardown is TP.NONE:
        return life, ()
    if event.ok:
        return dataclasses.replace(life, teardown=TP.SUCCEEDED), ()
    return dataclasses.replace(life, teardown=TP.FAILED, failure_reason=f"teardown failed: {event.message}"), ()


# ---- what should be in motion ----------------------------------------------------------------


class Motion(enum.Enum):
    """What a replica in given facts should have going (`wanted_motion`)."""

    NOTHING = "a kept record: nothing runs"
    FOLLOW_LAUNCH = "its launch is followed (re-attached by name)"
    TEARDOWN = "its teardown runs (resumed without drain)"
    FAILED_TEARDOWN = "it failed and its teardown was lost: tear it down, logs kept"
    PROBE = "it is probed"


def wanted_motion(life: Life) -> Motion:
    """What a replica should have in motion, from its facts alone: used at start and by the
    periodic resync, so a lost event or a dead task delays a step but never loses it."""
    if life.tearing_down:
        return Motion.TEARDOWN
    if life.teardown is not TP.NONE:
        return Motion.NOTHING
    if life.launching:
        return Motion.FOLLOW_LAUNCH
    if life.launch is LP.FAILED or life.user_app_failed:
        return Motion.FAILED_TEARDOWN
    if st.should_probe(life.facts()):
        return Motion.PROBE
    return Motion.NOTHING


def keeps_logs(life: Life) -> bool:
    """Whether the replica's teardown keeps its logs: a failure's do (the user reads why), a
    scale-down's, a preemption's or a purge's do not."""
    return not (life.is_scale_down or life.purged)


def logs_left(life: Life) -> bool:
    """Whether logs were left behind by the teardown (they go when the record goes)."""
    return life.teardown is not TP.NONE and not life.is_scale_down

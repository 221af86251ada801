"""The canary rollout state machine: steps with weights and pauses, analysis, the progress
deadline, automatic rollback, promote and abort. Plain data in, plain data out.

A rollout moves the traffic from the stable version to the new (canary) version in steps. Step
k (1..n) gives the canary `steps[k].weight` percent of the requests and needs
`ceil(target * weight / 100)` canary replicas READY (at least 1); its pause counts from the moment
they are. After the last step comes the final step: 100 %, the canary at the full target; once
that is READY the rollout has succeeded and the stable version's replicas go.

The rollout fails when:

- the canary version hits the stop rule (it failed before ever being ready);
- the replicas a step needs are not READY within `progress_deadline_s` of the step starting
  (pauses do not count: a deadline is about progress, as Argo Rollouts and Kubernetes read it);
- the analysis fails (a verdict of not enough data never blocks a step: a quiet service still
  rolls out, judged on whatever traffic it has).

A failed rollout is rolled back (all the traffic to the stable version at once; the driver then
restores the stable spec as a new version), unless `auto_rollback` is off: then it holds where it
failed until a person promotes, aborts or updates. `abort` always rolls back. `promote` moves to
the next step (or with `full` to the final step) at once, and turns analysis off for the rest of
the rollout: the person promoting has judged.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Sequence

from services.controller.domain import analysis, scaling
from services.controller.domain import status as st


class Phase(enum.IntEnum):
    """Values match replicaplane.controller.v1.RolloutState."""

    PROGRESSING = 1
    SUCCEEDED = 2
    ROLLED_BACK = 3
    FAILED = 4


class Action(enum.Enum):
    """What the driver must do beyond publishing weights and scaling."""

    NONE = "none"
    ROLLBACK = "rollback"  # restore the stable version's spec (a new version)
    COMPLETE = "complete"  # the canary is the stable version now


@dataclasses.dataclass(frozen=True)
class Step:
    """One canary step: percent of the requests, and how long to hold it."""

    weight: int
    pause_s: float


@dataclasses.dataclass(frozen=True)
class Config:
    """The spec's `service.rollout` section, as plain values."""

    steps: tuple[Step, ...] = (Step(10, 60.0), Step(50, 60.0))
    progress_deadline_s: float = 600.0
    auto_rollback: bool = True
    thresholds: analysis.Thresholds = dataclasses.field(default_factory=analysis.Thresholds)


@dataclasses.dataclass(frozen=True)
class State:
    """Where a rollout is; persisted (as JSON) so a restarted controller resumes the same step."""

    stable_version: int
    canary_version: int
    phase: Phase = Phase.PROGRESSING
    step: int = 1
    """1..len(steps); len(steps) + 1 is the final step (all the traffic)."""
    started_at: float = 0.0
    progress_at: float = 0.0
    """When the current step started: its replicas must be READY within the deadline from here."""
    step_ready_at: float | None = None
    """When the current step's replicas were READY (its pause counts from here); None before."""
    ended_at: float | None = None
    message: str = ""
    analysis: str = ""
    analysis_off: bool = False
    """Set by a promote: the rest of the rollout is not analysed."""

    def dump(self) -> bytes:
        """The state as JSON bytes."""
        d = dataclasses.asdict(self)
        d["phase"] = int(self.phase)
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def load(cls, data: bytes) -> State:
        """A state from `dump`'s bytes; unknown keys are ignored (a newer controller wrote them)."""
        d = json.loads(data)
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["phase"] = Phase(d.get("phase", Phase.PROGRESSING))
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class Observed:
    """What the driver sees now."""

    now: float
    target: int
    """Replicas the service wants (the autoscaler's target)."""
    canary_ready: int
    """READY replicas of the canary version."""
    canary_stopped: str = ""
    """The stop rule's message when it fired for the canary version, else empty."""
    verdict: analysis.Verdict | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    """The rollout's answer for now."""

    state: State
    weights: dict[int, int]
    """Per-mille weights by version to publish with the endpoints; empty: no split."""
    canary_replicas: int
    """Replicas of the canary version wanted."""
    keep_stable: bool
    """Keep every replica of the stable version (False once the canary took over)."""
    action: Action = Action.NONE
    wake_at: float | None = None
    """When to decide again at the latest (a pause or deadline ends); None: on the next change."""
    events: tuple[tuple[str, str], ...] = ()
    """(reason, message) of what happened in this decision."""

    def after(self, events: Sequence[tuple[str, str]]) -> Decision:
        """This decision with `events` before its own."""
        return dataclasses.replace(self, events=(*events, *self.events))


def start(stable_version: int, canary_version: int, now: float) -> State:
    """A new rollout at step 1."""
    return State(stable_version, canary_version, started_at=now, progress_at=now)


def weight_of(state: State, config: Config) -> int:
    """The canary's percent of the requests in the state's step."""
    if state.step > len(config.steps):
        return 100
    return config.steps[state.step - 1].weight


def replicas_for(weight: int, target: int) -> int:
    """Canary replicas a weight needs: its share of the target, rounded up, at least 1."""
    target = max(target, 1)
    return min(target, max(1, math.ceil(target * weight / 100)))


def _weights(state: State, weight: int) -> dict[int, int]:
    return {state.stable_version: 1000 - 10 * weight, state.canary_version: 10 * weight}


def _step_name(state: State, config: Config) -> str:
    n = len(config.steps)
    return "final step" if state.step > n else f"step {state.step}/{n}"


def decide(state: State, config: Config, seen: Observed) -> Decision:
    """The rollout's next state, weights, canary replicas and action."""
    if state.phase is Phase.SUCCEEDED:
        return Decision(state, {}, seen.target, keep_stable=False)
    if state.phase is Phase.ROLLED_BACK:
        return Decision(state, {state.stable_version: 1000}, 0, keep_stable=True)
    weight = weight_of(state, config)
    need = replicas_for(weight, seen.target)
    if state.phase is Phase.FAILED:  # auto_rollback off: hold where it failed
        return Decision(state, _weights(state, weight), need, keep_stable=True)
    failure = _failure(state, config, seen, need)
    if failure:
        return fail(state, config, failure, seen.now, target=seen.target)
    events: list[tuple[str, str]] = []
    verdict = seen.verdict
    if verdict is not None and not state.analysis_off:
        state = dataclasses.replace(state, analysis=verdict.reason)
    ready_at = state.step_ready_at
    if ready_at is None and seen.canary_ready >= need:
        ready_at = seen.now
        state = dataclasses.replace(state, step_ready_at=ready_at)
        if state.step <= len(config.steps):
            events.append(
                (
                    "RolloutStep",
                    f"{_step_name(state, config)}: {weight} % of the requests to version {state.canary_version}",
                )
            )
    if ready_at is None:
        state = dataclasses.replace(
            state,
            message=f"{_step_name(state, config)} ({weight} %): waiting for {seen.canary_ready}/{need} "
            f"replicas of version {state.canary_version} to be READY",
        )
        deadline = state.progress_at + config.progress_deadline_s
        return Decision(state, _weights(state, weight), need, True, wake_at=deadline, events=tuple(events))
    if state.step > len(config.steps):  # the final step's replicas are READY: done
        done = dataclasses.replace(
            state,
            phase=Phase.SUCCEEDED,
            ended_at=seen.now,
            message=f"succeeded: version {state.canary_version} has all the traffic",
        )
        events.append(("RolloutSucceeded", f"version {state.canary_version} has all the traffic"))
        return Decision(done, {}, seen.target, False, Action.COMPLETE, events=tuple(events))
    pause = config.steps[state.step - 1].pause_s
    if seen.now >= ready_at + pause:
        return decide(_advance(state, seen.now), config, seen).after(events)
    state = dataclasses.replace(
        state,
        message=f"{_step_name(state, config)} ({weight} %): pausing until {ready_at + pause - seen.now:.0f} s from now",
    )
    return Decision(state, _weights(state, weight), need, True, wake_at=ready_at + pause, events=tuple(events))


def _failure(state: State, config: Config, seen: Observed, need: int) -> str:
    if seen.canary_stopped:
        return seen.canary_stopped
    if state.step_ready_at is None and seen.canary_ready < need:
        waited = seen.now - state.progress_at
        if waited >= config.progress_deadline_s:
            return (
                f"progress deadline: {seen.canary_ready}/{need} replicas of version {state.canary_version} READY "
                f"after {config.progress_deadline_s:g} s ({_step_name(state, config)})"
            )
    verdict = seen.verdict
    if verdict is not None and verdict.outcome is analysis.Outcome.FAIL and not state.analysis_off:
        return f"analysis failed: {verdict.reason}"
    return ""


def _advance(state: State, now: float, *, full: bool = False, n: int | None = None) -> State:
    step = (n + 1) if (full and n is not None) else state.step + 1
    return dataclasses.replace(state, step=step, progress_at=now, step_ready_at=None)


def fail(
    state: State, config: Config, reason: str, now: float, *, target: int, rollback: bool | None = None
) -> Decision:
    """End a rollout as failed: rolled back (the default with auto_rollback), or held."""
    back = config.auto_rollback if rollback is None else rollback
    if back:
        ended = dataclasses.replace(
            state, phase=Phase.ROLLED_BACK, ended_at=now, message=f"rolled back: {reason}", step_ready_at=None
        )
        event = ("RolloutRolledBack", f"version {state.canary_version} rolled back: {reason}")
        return Decision(ended, {state.stable_version: 1000}, 0, True, Action.ROLLBACK, events=(event,))
    held = dataclasses.replace(
        state,
        phase=Phase.FAILED,
        ended_at=now,
        message=f"failed: {reason} (auto_rollback is off: promote, abort or update)",
    )
    weight = weight_of(state, config)
    event = ("RolloutFailed", f"version {state.canary_version} failed: {reason}")
    return Decision(held, _weights(held, weight), replicas_for(weight, target), True, events=(event,))


def promote(state: State, config: Config, now: float, *, full: bool) -> State:
    """The next step now (or with `full` the final step), pauses and analysis skipped from here.

    Raises:
        ValueError: the rollout is not progressing or failed.
    """
    if state.phase not in (Phase.PROGRESSING, Phase.FAILED):
        raise ValueError(f"the rollout of version {state.canary_version} has ended")
    n = len(config.steps)
    nxt = _advance(state, now, full=full, n=n) if state.step <= n else state
    return dataclasses.replace(nxt, phase=Phase.PROGRESSING, ended_at=None, analysis_off=True)


def abort(state: State, config: Config, now: float, *, target: int) -> Decision:
    """Roll back now, whatever `auto_rollback` says.

    Raises:
        ValueError: the rollout is not progressing or failed.
    """
    if state.phase not in (Phase.PROGRESSING, Phase.FAILED):
        raise ValueError(f"the rollout of version {state.canary_version} has ended")
    return fail(state, config, "aborted by a user", now, target=target, rollback=True)


def scale(
    replicas: Sequence[st.ReplicaView], decision: Decision, *, canary_version: int, stopped: bool
) -> scaling.ScalePlan:
    """Launches and teardowns for a canary rollout: the canary version at `canary_replicas`, the
    stable (and any older) version's replicas all kept while `keep_stable`, else all torn down."""
    live = [r for r in replicas if not st.is_terminal(r.status)]
    canary = [r for r in live if r.version == canary_version]
    others = [r for r in live if r.version != canary_version]
    launch = 0 if stopped else max(decision.canary_replicas - len(canary), 0)
    victims = st.scale_down_victims(canary, len(canary) - decision.canary_replicas)
    if not decision.keep_stable:
        victims += list(others)
    return scaling.ScalePlan(launch=launch, teardown=tuple(r.replica_id for r in victims))

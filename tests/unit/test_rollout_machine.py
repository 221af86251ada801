"""The canary rollout state machine, table-driven: steps, pauses, analysis, the progress deadline,
automatic rollback, promote and abort."""

from __future__ import annotations

import pytest

from services.controller.domain import analysis
from services.controller.domain import rollout as ro
from services.controller.domain import status as st

P, S, RB, F = ro.Phase.PROGRESSING, ro.Phase.SUCCEEDED, ro.Phase.ROLLED_BACK, ro.Phase.FAILED
CONFIG = ro.Config(steps=(ro.Step(10, 60.0), ro.Step(50, 60.0)), progress_deadline_s=600.0)


def verdict(outcome: analysis.Outcome, reason: str = "why") -> analysis.Verdict:
    return analysis.Verdict(outcome, reason, analysis.Sample(), analysis.Sample())


FAIL = verdict(analysis.Outcome.FAIL, "error rate 48.0 % over the last 30 s (125 requests) is above 0.5 % + 5 points")
PASS = verdict(analysis.Outcome.PASS)
THIN = verdict(analysis.Outcome.NOT_ENOUGH_DATA)


def run(
    moments: list[tuple[float, int, analysis.Verdict | None]], config: ro.Config = CONFIG, target: int = 4
) -> list[ro.Decision]:
    state = ro.start(1, 2, 0.0)
    out = []
    for now, ready, v in moments:
        d = ro.decide(state, config, ro.Observed(now=now, target=target, canary_ready=ready, verdict=v))
        out.append(d)
        state = d.state
    return out


def brief(d: ro.Decision) -> tuple[ro.Phase, int, dict[int, int], int, bool, ro.Action]:
    return (d.state.phase, d.state.step, d.weights, d.canary_replicas, d.keep_stable, d.action)


def test_a_good_canary_goes_through_every_step_to_all_the_traffic() -> None:
    got = run([(0, 0, None), (5, 1, PASS), (64, 1, PASS), (65, 1, PASS), (70, 2, PASS), (130, 2, PASS), (140, 4, PASS)])
    assert [brief(d) for d in got] == [
        (P, 1, {1: 900, 2: 100}, 1, True, ro.Action.NONE),  # waiting for 1 canary replica
        (P, 1, {1: 900, 2: 100}, 1, True, ro.Action.NONE),  # ready at 5: pause until 65
        (P, 1, {1: 900, 2: 100}, 1, True, ro.Action.NONE),
        (P, 2, {1: 500, 2: 500}, 2, True, ro.Action.NONE),  # 50 % needs 2 of 4
        (P, 2, {1: 500, 2: 500}, 2, True, ro.Action.NONE),
        (P, 3, {1: 0, 2: 1000}, 4, True, ro.Action.NONE),  # the final step: the full target
        (S, 3, {}, 4, False, ro.Action.COMPLETE),
    ]
    assert got[1].wake_at == 65 and got[0].wake_at == 600
    assert got[1].events == (("RolloutStep", "step 1/2: 10 % of the requests to version 2"),)
    assert [r for d in got for r, _ in d.events] == ["RolloutStep", "RolloutStep", "RolloutSucceeded"]
    assert got[-1].state.message == "succeeded: version 2 has all the traffic"
    assert got[2].state.message == "step 1/2 (10 %): pausing until 1 s from now"


@pytest.mark.parametrize(
    ("moments", "message"),
    [
        ([(0, 0, None), (5, 1, FAIL)], "rolled back: analysis failed: error rate 48.0 %"),
        ([(0, 0, None), (599, 0, None), (600, 0, None)], "rolled back: progress deadline: 0/1 replicas of version 2"),
        ([(0, 0, None), (5, 1, None), (65, 1, None), (665, 1, None)], "rolled back: progress deadline: 1/2 replicas"),
    ],
)
def test_a_failed_rollout_sends_every_request_back_to_the_stable_version(
    moments: list[tuple[float, int, analysis.Verdict | None]], message: str
) -> None:
    last = run(moments)[-1]
    assert brief(last) == (RB, last.state.step, {1: 1000}, 0, True, ro.Action.ROLLBACK)
    assert last.state.message.startswith(message), last.state.message
    assert last.events[0][0] == "RolloutRolledBack"
    assert last.state.ended_at == moments[-1][0]


def test_the_deadline_counts_from_each_step_start_and_not_through_pauses() -> None:
    slow = ro.Config(steps=(ro.Step(10, 1000.0),), progress_deadline_s=600.0)
    got = run([(0, 0, None), (500, 1, None), (1400, 1, None), (1500, 1, None), (2000, 3, None)], slow)
    assert [d.state.phase for d in got] == [P, P, P, P, P]
    assert got[-1].state.step == 2
    assert ro.decide(got[-1].state, slow, ro.Observed(now=2100, target=4, canary_ready=3)).state.phase is RB


def test_not_enough_data_never_blocks_a_step_and_a_pass_is_shown() -> None:
    got = run([(0, 1, THIN), (60, 1, THIN)])
    assert got[-1].state.step == 2 and got[-1].state.analysis == "why"


def test_the_stop_rule_rolls_back() -> None:
    state = ro.start(1, 2, 0.0)
    seen = ro.Observed(now=3, target=2, canary_ready=0, canary_stopped="version 2 failed before ever being ready")
    d = ro.decide(state, CONFIG, seen)
    assert (d.state.phase, d.action) == (RB, ro.Action.ROLLBACK)
    assert d.state.message == "rolled back: version 2 failed before ever being ready"


def test_without_auto_rollback_a_failed_rollout_holds_until_a_person_acts() -> None:
    config = ro.Config(steps=CONFIG.steps, auto_rollback=False)
    d = run([(0, 1, FAIL)], config)[-1]
    assert brief(d) == (F, 1, {1: 900, 2: 100}, 1, True, ro.Action.NONE)
    assert d.state.message.endswith("(auto_rollback is off: promote, abort or update)")
    held = ro.decide(d.state, config, ro.Observed(now=100, target=4, canary_ready=1, verdict=FAIL))
    assert brief(held) == brief(d)
    promoted = ro.promote(d.state, config, 101, full=False)
    assert (promoted.phase, promoted.step, promoted.analysis_off) == (P, 2, True)
    after = ro.decide(promoted, config, ro.Observed(now=102, target=4, canary_ready=2, verdict=FAIL))
    assert after.state.phase is P  # analysis is off after a promote
    aborted = ro.abort(d.state, config, 103, target=4)
    assert (aborted.state.phase, aborted.action, aborted.state.message) == (
        RB,
        ro.Action.ROLLBACK,
        "rolled back: aborted by a user",
    )


@pytest.mark.parametrize(("step", "full", "want"), [(1, False, 2), (1, True, 3), (2, False, 3), (3, False, 3)])
def test_promote_moves_to_the_next_or_the_final_step(step: int, full: bool, want: int) -> None:
    state = ro.State(1, 2, step=step, step_ready_at=5.0)
    promoted = ro.promote(state, CONFIG, 10.0, full=full)
    assert (promoted.step, promoted.step_ready_at, promoted.progress_at == 10.0 or step == 3) == (
        want,
        None if step < 3 else 5.0,
        True,
    )


@pytest.mark.parametrize("phase", [S, RB])
def test_an_ended_rollout_cannot_be_promoted_or_aborted(phase: ro.Phase) -> None:
    state = ro.State(1, 2, phase=phase)
    with pytest.raises(ValueError, match="has ended"):
        ro.promote(state, CONFIG, 1.0, full=True)
    with pytest.raises(ValueError, match="has ended"):
        ro.abort(state, CONFIG, 1.0, target=1)


@pytest.mark.parametrize(
    ("weight", "target", "want"), [(10, 4, 1), (50, 4, 2), (51, 4, 3), (100, 4, 4), (10, 0, 1), (1, 1000, 10)]
)
def test_replicas_a_weight_needs(weight: int, target: int, want: int) -> None:
    assert ro.replicas_for(weight, target) == want


def test_the_state_survives_a_round_trip_and_ignores_unknown_keys() -> None:
    state = ro.State(1, 2, phase=F, step=2, started_at=1.5, step_ready_at=3.0, message="m", analysis_off=True)
    assert ro.State.load(state.dump()) == state
    assert ro.State.load(b'{"stable_version": 1, "canary_version": 2, "later": 1}') == ro.State(1, 2)


def view(rid: int, version: int, status: st.ReplicaStatus = st.ReplicaStatus.READY) -> st.ReplicaView:
    return st.ReplicaView(replica_id=rid, version=version, status=status)


@pytest.mark.parametrize(
    ("keep_stable", "canary_replicas", "stopped", "launch", "teardown"),
    [
        (True, 2, False, 1, ()),  # one canary running, two wanted; stable kept
        (True, 0, False, 0, (3,)),  # rolled back: canary gone, stable kept
        (False, 1, False, 0, (1, 2)),  # complete: the stable replicas go
        (True, 3, True, 0, ()),  # the stop rule: nothing launched
    ],
)
def test_scale_for_a_rollout(
    keep_stable: bool, canary_replicas: int, stopped: bool, launch: int, teardown: tuple[int, ...]
) -> None:
    replicas = [view(1, 1), view(2, 1), view(3, 2), view(4, 2, st.ReplicaStatus.FAILED)]
    decision = ro.Decision(ro.State(1, 2), {}, canary_replicas, keep_stable)
    plan = ro.scale(replicas, decision, canary_version=2, stopped=stopped)
    assert (plan.launch, tuple(sorted(plan.teardown))) == (launch, teardown)


def test_a_rollouts_scale_plan_replaces_the_rolling_one_in_the_pass_and_still_pauses() -> None:
    from services.controller import planner
    from services.controller.domain import autoscaler, failures, scaling

    replicas = [view(1, 1), view(2, 1), view(3, 2)]
    kwargs = {
        "policy": autoscaler.Policy(min_replicas=2, max_replicas=2),
        "adopted_target": 2,
        "latest_version": 2,
        "stopped": False,
        "blue_green": False,
        "now": 100.5,
        "torn_down": {},
    }
    rolling = planner.plan(replicas, backoff=failures.Backoff(), **kwargs)  # type: ignore[arg-type]
    assert (rolling.launch, rolling.teardown) == (1, (2,))  # rolling would replace a stable replica
    canary = scaling.ScalePlan(launch=1, teardown=())
    p = planner.plan(replicas, backoff=failures.Backoff(), rollout=canary, **kwargs)  # type: ignore[arg-type]
    assert (p.launch, p.teardown, p.launch_wanted) == (1, (), True)
    paused = failures.Backoff().failed(100.0, "HTTP 503")
    p = planner.plan(replicas, backoff=paused, rollout=canary, **kwargs)  # type: ignore[arg-type]
    assert (p.launch, p.launch_wanted) == (0, True)

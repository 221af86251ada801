"""Service-level decisions as tables: service status and message, record removal, manual
termination, the update plan, launches per pass, the blue-green switch and the fallback mix."""

from __future__ import annotations

import hypothesis
import pytest
from hypothesis import strategies as hst

from services.controller.domain import autoscaler, placer, scaling
from services.controller.domain import status as st
from services.controller.domain.status import Facts
from services.controller.domain.status import ReplicaStatus as S
from services.controller.domain.status import ReplicaView as R
from services.controller.domain.status import ServiceFacts as SF
from services.controller.domain.status import ServiceStatus as SS
from services.controller.domain.status import TeardownPhase as TP

STOPPED = "scaling stopped: version 2 failed before ever being ready (replica 3: app exited with code 1)"
PAUSED = "launches paused for 4 s after an infrastructure failure: launch failed: HTTP 503"

# (name, replica statuses, service facts, status, message)
SERVICE_TABLE = [
    ("not resumed yet", [S.READY], SF(started=False, target=1), SS.CONTROLLER_INIT, "1/1 ready, target 1"),
    ("ready", [S.READY, S.STARTING], SF(target=2), SS.READY, "1/2 ready, target 2"),
    ("starting", [S.STARTING], SF(target=1), SS.REPLICA_INIT, "0/1 ready, target 1"),
    ("about to launch", [], SF(target=1), SS.REPLICA_INIT, "0/0 ready, target 1"),
    ("scaled to zero", [], SF(target=0), SS.NO_REPLICA, "0/0 ready, target 0"),
    # SkyPilot's NO_REPLICA and 0/0 once a version failed before ever being ready
    ("stopped", [S.FAILED], SF(target=1, stopped_message=STOPPED), SS.NO_REPLICA, STOPPED),
    ("stopped, an old replica serving", [S.READY, S.FAILED], SF(target=1, stopped_message=STOPPED), SS.READY, STOPPED),
    # issue 19: an infrastructure failure pauses launches and says so, never stops
    (
        "paused",
        [S.FAILED_PROVISION],
        SF(target=1, pause_message=PAUSED),
        SS.REPLICA_INIT,
        f"0/0 ready, target 1; {PAUSED}",
    ),
    (
        "probing stale",
        [S.READY],
        SF(target=1, probing_stale=True),
        SS.READY,
        "probing is stale: no prober reachable, readiness may be out of date",
    ),
    (
        "deleting",
        [S.SHUTTING_DOWN] * 2,
        SF(deleting=True, replicas_left=2),
        SS.SHUTTING_DOWN,
        "shutting down: 2 replica(s) left",
    ),
    (
        "cleanup failed",
        [S.FAILED_CLEANUP],
        SF(deleting=True, cleanup_failed=True, cleanup_message=st.cleanup_message([4, 2])),
        SS.FAILED_CLEANUP,
        "teardown failed for replica(s) 2, 4; delete with purge to forget them",
    ),
]


@pytest.mark.parametrize(
    ("name", "statuses", "svc", "status", "message"), SERVICE_TABLE, ids=[t[0] for t in SERVICE_TABLE]
)
def test_service_status_and_message(name: str, statuses: list[S], svc: SF, status: SS, message: str) -> None:
    assert st.service_status_of(statuses, svc) is status
    assert st.status_message(statuses, svc) == message


ok_fail = Facts(launch=st.LaunchPhase.SUCCEEDED, teardown=TP.SUCCEEDED, user_app_failed=True)


@pytest.mark.parametrize(
    ("facts", "version", "deleting", "removed"),
    [
        (ok_fail, 2, False, False),  # kept for the user to read why
        (ok_fail, 1, False, True),  # outdated
        (ok_fail, 2, True, True),  # the service goes
        (Facts(launch=st.LaunchPhase.SUCCEEDED, teardown=TP.FAILED), 2, True, False),  # left: FAILED_CLEANUP
        (Facts(launch=st.LaunchPhase.SUCCEEDED, teardown=TP.FAILED, purged=True), 2, True, True),
        (Facts(launch=st.LaunchPhase.SUCCEEDED, teardown=TP.SUCCEEDED, is_scale_down=True), 2, False, True),
        (Facts(launch=st.LaunchPhase.SUCCEEDED, teardown=TP.FAILED, is_scale_down=True), 2, False, False),
    ],
)
def test_record_removed(facts: Facts, version: int, deleting: bool, removed: bool) -> None:
    assert st.record_removed(facts, version=version, latest_version=2, deleting=deleting) is removed


T = st.Termination


@pytest.mark.parametrize(
    ("status", "tearing_down", "purge", "outcome"),
    [
        (S.READY, False, False, T.DRAIN_AND_TEAR_DOWN),
        (S.STARTING, False, True, T.DRAIN_AND_TEAR_DOWN),  # purge of a live replica: a teardown, then gone
        (S.SHUTTING_DOWN, True, False, T.REFUSED_SHUTTING_DOWN),
        (S.PREEMPTED, True, True, T.REFUSED_SHUTTING_DOWN),
        (S.FAILED, False, False, T.REFUSED_FAILED),
        (S.FAILED, False, True, T.PURGE),
        (S.FAILED_CLEANUP, True, True, T.PURGE),  # a failure whose teardown is still running
        (S.FAILED_CLEANUP, False, False, T.REFUSED_FAILED),
    ],
)
def test_termination(status: S, tearing_down: bool, purge: bool, outcome: st.Termination) -> None:
    assert st.termination(status, tearing_down=tearing_down, purge=purge) is outcome


@pytest.mark.parametrize(
    ("live", "keepable", "target", "plan"),
    [
        # spec.md 7.2: 2 running, min_replicas 3, only the service section changed: 1 launch
        ([R(1, 1, S.READY), R(2, 1, S.READY)], {1, 2}, 3, scaling.UpdatePlan(kept=(1, 2), launch=1)),
        # 2 running, target 1: one teardown, victims in status order
        ([R(1, 1, S.READY), R(2, 1, S.STARTING)], {1, 2}, 1, scaling.UpdatePlan(kept=(1,), teardown=(2,))),
        # run changed: everything replaced
        ([R(1, 1, S.READY), R(2, 1, S.READY)], set(), 2, scaling.UpdatePlan(launch=2, replaced=(1, 2), in_place=False)),
        # a mix (replica 2 runs a version with another setup)
        (
            [R(1, 2, S.READY), R(2, 1, S.READY)],
            {1},
            2,
            scaling.UpdatePlan(kept=(1,), launch=1, replaced=(2,), in_place=False),
        ),
    ],
)
def test_update_plan(live: list[R], keepable: set[int], target: int, plan: scaling.UpdatePlan) -> None:
    assert scaling.update_plan(live, keepable=keepable, target=target) == plan


@pytest.mark.parametrize(
    ("plan", "pause", "launches"),
    [
        (scaling.ScalePlan(), 0.0, scaling.Launches()),
        (scaling.ScalePlan(teardown=(1,)), 5.0, scaling.Launches()),
        (scaling.ScalePlan(launch=3), 0.0, scaling.Launches(regular=3)),
        (scaling.ScalePlan(launch=3), 2.5, scaling.Launches(again_in_s=2.5)),  # paused: none now
        (scaling.ScalePlan(launch=120), 0.0, scaling.Launches(regular=50, again_in_s=0.0)),  # the rest next pass
        (scaling.ScalePlan(launch=30, launch_ondemand=30), 0.0, scaling.Launches(30, 20, again_in_s=0.0)),
        (scaling.ScalePlan(launch_ondemand=2), 0.0, scaling.Launches(ondemand=2)),
    ],
)
def test_launches_now(plan: scaling.ScalePlan, pause: float, launches: scaling.Launches) -> None:
    assert scaling.launches_now(plan, pause_s=pause) == launches


@pytest.mark.parametrize(("records", "batch"), [(0, 50), (999, 50), (2_000, 100), (10_000, 500), (30_000, 1_500)])
def test_a_pass_of_a_large_service_launches_a_share_of_it(records: int, batch: int) -> None:
    # Passes of a large service are spaced by its size (passes.py): launches per second must
    # not shrink as it grows (issue 24: 250 a second at 10,000 with a batch of 50).
    assert scaling.launch_batch(records) == batch
    wanted = scaling.ScalePlan(launch=100_000)
    assert scaling.launches_now(wanted, batch=scaling.launch_batch(records)).regular == batch


@pytest.mark.parametrize(
    ("active", "blue_green", "removed"),
    [
        ([2], True, [1, 3]),  # switched: the old version's failure records go
        ([1], True, []),  # not yet
        ([1, 2], False, []),
        ([2], False, []),  # rolling keeps them until they are outdated by the rule after teardown
    ],
)
def test_removed_at_switch(active: list[int], blue_green: bool, removed: list[int]) -> None:
    torn_down = {1: 1, 3: 1, 4: 2}
    assert scaling.removed_at_switch(torn_down, active=active, latest_version=2, blue_green=blue_green) == removed


# (name, replicas, target, blue_green, launch, teardown, active)
UPDATE_TABLE = [
    ("rolling: new ones first", [R(1, 1, S.READY), R(2, 1, S.READY)], 2, False, 2, (), [1]),
    (
        "rolling: one old goes per new READY",
        [R(1, 1, S.READY), R(2, 1, S.READY), R(3, 2, S.READY), R(4, 2, S.STARTING)],
        2,
        False,
        0,
        (2,),
        [1, 2],
    ),
    (
        "blue-green: old kept until the new has the target READY",
        [R(1, 1, S.READY), R(2, 1, S.READY), R(3, 2, S.READY), R(4, 2, S.STARTING)],
        2,
        True,
        0,
        (),
        [1],
    ),
    (
        "blue-green: switch, every old one at once",
        [R(1, 1, S.READY), R(2, 1, S.STARTING), R(3, 2, S.READY), R(4, 2, S.READY)],
        2,
        True,
        0,
        (2, 1),
        [2],
    ),
    ("failed new replicas are replaced", [R(1, 1, S.READY), R(3, 2, S.FAILED)], 1, False, 1, (), [1]),
]


@pytest.mark.parametrize(
    ("name", "replicas", "target", "blue_green", "launch", "teardown", "active"),
    UPDATE_TABLE,
    ids=[t[0] for t in UPDATE_TABLE],
)
def test_rollout_tables(
    name: str,
    replicas: list[R],
    target: int,
    blue_green: bool,
    launch: int,
    teardown: tuple[int, ...],
    active: list[int],
) -> None:
    p = scaling.plan(replicas, target=target, latest_version=2, blue_green=blue_green)
    assert (p.launch, p.teardown) == (launch, teardown)
    assert scaling.active_versions(replicas, latest_version=2, target=target, blue_green=blue_green) == active


SPOT = autoscaler.Policy(min_replicas=3, max_replicas=3, use_spot=True, base_ondemand=1, dynamic_fallback=True)


@pytest.mark.parametrize(
    ("replicas", "spot", "ondemand", "teardown"),
    [
        ([], 2, 3, ()),  # dynamic: a stand-in for each spot replica not READY, at most the target
        ([R(1, 1, S.READY, is_spot=True), R(2, 1, S.READY, is_spot=True)], 0, 1, ()),
        (
            [R(1, 1, S.READY, is_spot=True), R(2, 1, S.READY, is_spot=True), R(3, 1, S.READY), R(4, 1, S.STARTING)],
            0,
            0,
            (4,),  # a dynamic stand-in goes as the spot replicas become READY
        ),
    ],
)
def test_fallback_mix(replicas: list[R], spot: int, ondemand: int, teardown: tuple[int, ...]) -> None:
    p = scaling.plan(replicas, target=3, latest_version=1, fallback=(SPOT, 3))
    assert (p.launch, p.launch_ondemand, p.teardown) == (spot, ondemand, teardown)


D = st.OnDelete
LIVE = Facts(launch=st.LaunchPhase.SUCCEEDED)


@pytest.mark.parametrize(
    ("facts", "tearing_down", "purge", "outcome"),
    [
        (LIVE, False, False, D.TEAR_DOWN),
        (Facts(launch=st.LaunchPhase.RUNNING), False, False, D.TEAR_DOWN),  # the launch is cancelled
        (Facts(launch=st.LaunchPhase.SUCCEEDED, teardown=TP.SCHEDULED), True, True, D.MARK),
        (ok_fail, False, False, D.REMOVE),  # a kept failure record
        (Facts(launch=st.LaunchPhase.SUCCEEDED, teardown=TP.FAILED), False, False, D.TEAR_DOWN),  # once more
        (Facts(launch=st.LaunchPhase.SUCCEEDED, teardown=TP.FAILED), False, True, D.REMOVE),
    ],
)
def test_on_delete(facts: Facts, tearing_down: bool, purge: bool, outcome: st.OnDelete) -> None:
    assert st.on_delete(facts, tearing_down=tearing_down, purge=purge) is outcome


def test_gone_from_snapshot() -> None:
    names = ["a", "b", "c", "d"]
    launched_in = {"c": 3, "d": 2}  # c finished launching after watch 3 began: the snapshot may be older
    assert st.gone_from_snapshot(names, {"a"}, launched_in, 3) == ["b", "d"]


ZONES = [("us-a", 1.0), ("us-b", 0.5), ("eu-a", 0.2)]


@pytest.mark.parametrize(
    ("places", "spot", "spot_placer", "marks", "used", "zone"),
    [
        ([("", "")], False, False, {}, set(), ""),  # unconstrained on-demand: the backend picks
        ([("", "us")], False, False, {}, set(), "us-b"),  # cheapest allowed
        ([("", "us")], True, False, {}, set(), "us-b"),  # spot without a placer: as on-demand
        ([("", "")], True, True, {}, set(), "eu-a"),  # cheapest active
        ([("", "")], True, True, {}, {"eu-a"}, "us-b"),  # one not used by another spot replica
        ([("", "")], True, True, {"eu-a": placer.PREEMPTIVE}, set(), "us-b"),
        ([("", "us")], True, True, {}, set(), "us-b"),  # the spec's region narrows the placer
        ([("zz-1", "")], True, True, {}, set(), "zz-1"),  # no known zone fits: the spec's own
    ],
)
def test_launch_zone(
    places: list[tuple[str, str]], spot: bool, spot_placer: bool, marks: dict[str, str], used: set[str], zone: str
) -> None:
    got = placer.launch_zone(ZONES, places, spot=spot, spot_placer=spot_placer, marks=marks, used=used)
    assert got == zone


# ---- properties of the scale plan over any fleet ----------------------------------------------

_replicas = hst.lists(
    hst.tuples(hst.integers(1, 3), hst.sampled_from([s for s in S if s is not S.UNSPECIFIED]), hst.booleans()),
    max_size=12,
).map(lambda rows: [R(i + 1, v, s, is_spot=spot) for i, (v, s, spot) in enumerate(rows)])


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(replicas=_replicas, target=hst.integers(0, 6), blue_green=hst.booleans(), stopped=hst.booleans())
def test_any_fleet_gets_a_sane_plan(replicas: list[R], target: int, blue_green: bool, stopped: bool) -> None:
    """Victims are live replicas, each once; the latest version ends at the target; old replicas
    go only as new ones are READY (rolling) or all at once after the switch (blue-green); a
    stopped version launches nothing; traffic goes only to versions with READY replicas."""
    p = scaling.plan(replicas, target=target, latest_version=3, stopped=stopped, blue_green=blue_green)
    live = {r.replica_id: r for r in replicas if not st.is_terminal(r.status)}
    assert len(set(p.teardown)) == len(p.teardown) and set(p.teardown) <= set(live)
    latest = [r for r in live.values() if r.version == 3]
    old = [r for r in live.values() if r.version != 3]
    latest_victims = [i for i in p.teardown if live[i].version == 3]
    old_victims = [i for i in p.teardown if live[i].version != 3]
    assert p.launch_ondemand == 0
    if stopped:
        assert p.launch == 0
    else:
        assert len(latest) + p.launch - len(latest_victims) == target
    assert p.launch == 0 or not latest_victims  # never launch and tear down the latest at once
    new_ready = sum(1 for r in latest if r.status is S.READY)
    if blue_green:
        assert len(old_victims) == (len(old) if new_ready >= target else 0)
    else:
        assert len(old) - len(old_victims) == min(len(old), max(target - new_ready, 0))
    active = scaling.active_versions(replicas, latest_version=3, target=target, blue_green=blue_green)
    assert set(active) <= {r.version for r in replicas if r.status is S.READY}


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(replicas=_replicas, target=hst.integers(0, 5), base=hst.integers(0, 3), dynamic=hst.booleans())
def test_any_fleet_runs_the_fallback_mix(replicas: list[R], target: int, base: int, dynamic: bool) -> None:
    """With spot fallback, the latest version ends at exactly the spot and on-demand counts the
    policy asks for, whatever it runs now."""
    policy = autoscaler.Policy(
        min_replicas=target, max_replicas=target, use_spot=True, base_ondemand=base, dynamic_fallback=dynamic
    )
    p = scaling.plan(replicas, target=policy.final(target), latest_version=3, fallback=(policy, target))
    latest = {r.replica_id: r for r in replicas if r.version == 3 and not st.is_terminal(r.status)}
    spot_ready = sum(1 for r in latest.values() if r.is_spot and r.status is S.READY)
    want_spot, want_ondemand = autoscaler.fallback_counts(policy, target=target, spot_ready=spot_ready)
    gone = [latest[i] for i in p.teardown if i in latest]
    spot_now = sum(1 for r in latest.values() if r.is_spot) - sum(1 for r in gone if r.is_spot)
    ondemand_now = sum(1 for r in latest.values() if not r.is_spot) - sum(1 for r in gone if not r.is_spot)
    assert spot_now + p.launch == want_spot
    assert ondemand_now + p.launch_ondemand == want_ondemand

"""Fixed-size scaling decisions."""

from __future__ import annotations

from services.controller.domain import scaling
from services.controller.domain.status import ReplicaStatus as S
from services.controller.domain.status import ReplicaView as R


def test_launches_up_to_target() -> None:
    assert scaling.plan([], target=2, latest_version=1) == scaling.ScalePlan(launch=2)
    assert scaling.plan([R(1, 1, S.READY)], target=2, latest_version=1).launch == 1


def test_terminal_replicas_do_not_count_so_failures_are_replaced() -> None:
    replicas = [R(1, 1, S.FAILED_PROBING), R(2, 1, S.READY), R(3, 1, S.SHUTTING_DOWN)]
    assert scaling.plan(replicas, target=2, latest_version=1) == scaling.ScalePlan(launch=1)


def test_stop_rule_launches_nothing() -> None:
    assert scaling.plan([R(1, 1, S.FAILED)], target=2, latest_version=1, stopped=True).launch == 0


def test_scale_down_picks_victims_in_order() -> None:
    replicas = [R(1, 1, S.READY), R(2, 1, S.STARTING), R(3, 1, S.READY)]
    assert scaling.plan(replicas, target=1, latest_version=1).teardown == (2, 3)


def test_rolling_keeps_old_until_new_ready() -> None:
    old = [R(1, 1, S.READY), R(2, 1, S.READY)]
    p = scaling.plan(old, target=2, latest_version=2)
    assert p == scaling.ScalePlan(launch=2)
    p = scaling.plan([*old, R(3, 2, S.READY), R(4, 2, S.STARTING)], target=2, latest_version=2)
    assert p == scaling.ScalePlan(launch=0, teardown=(2,))
    p = scaling.plan([*old, R(3, 2, S.READY), R(4, 2, S.READY)], target=2, latest_version=2)
    assert p.teardown == (2, 1)


def test_blue_green_keeps_old_until_new_has_target_ready_then_switches() -> None:
    old = [R(1, 1, S.READY), R(2, 1, S.READY)]
    p = scaling.plan([*old, R(3, 2, S.READY), R(4, 2, S.STARTING)], target=2, latest_version=2, blue_green=True)
    assert p == scaling.ScalePlan(launch=0, teardown=())
    assert scaling.active_versions(
        [*old, R(3, 2, S.READY), R(4, 2, S.STARTING)], latest_version=2, target=2, blue_green=True
    ) == [1]
    ready = [*old, R(3, 2, S.READY), R(4, 2, S.READY)]
    assert set(scaling.plan(ready, target=2, latest_version=2, blue_green=True).teardown) == {1, 2}
    assert scaling.active_versions(ready, latest_version=2, target=2, blue_green=True) == [2]


def test_rolling_active_versions_mix() -> None:
    replicas = [R(1, 1, S.READY), R(2, 2, S.READY), R(3, 2, S.STARTING)]
    assert scaling.active_versions(replicas, latest_version=2, target=2, blue_green=False) == [1, 2]

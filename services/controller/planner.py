"""One pass's plan for one service, from the whole current state: pure, no I/O.

It only combines domain rules (`scaling.plan`, `scaling.launches_now`, `scaling.removed_at_switch`,
`failures.launch_pause`), so what a pass does can be read and tested in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from services.controller.domain import autoscaler, failures, pool_scaling, scaling
from services.controller.domain import status as st


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a pass does.

    Attributes:
        launch: new replicas now (spot if the policy uses spot).
        launch_ondemand: new forced on-demand replicas now (spot fallback).
        teardown: scale-down and replacement victims (drained).
        remove: records that go (blue-green switched: the old versions' kept failures).
        again_in_s: run another pass this soon (more launches, or a launch pause ending).
        launch_wanted: launches are wanted (paused or not).
    """

    launch: int = 0
    launch_ondemand: int = 0
    teardown: tuple[int, ...] = ()
    remove: tuple[int, ...] = ()
    again_in_s: float | None = None
    launch_wanted: bool = False


def plan(
    views: Sequence[st.ReplicaView],
    *,
    policy: autoscaler.Policy,
    adopted_target: int,
    latest_version: int,
    stopped: bool,
    blue_green: bool,
    backoff: failures.Backoff,
    now: float,
    torn_down: Mapping[int, int],
    busy: frozenset[int] | None = None,
    rollout: scaling.ScalePlan | None = None,
    ready_by_version: Mapping[int, int] | None = None,
) -> Plan:
    """The plan of one pass.

    Args:
        views: every replica record.
        policy: the latest version's policy.
        adopted_target: the autoscaler's target without overprovision.
        latest_version: the newest version.
        stopped: the stop rule fired for the latest version.
        blue_green: the service updates blue-green.
        backoff: the launch pause after infrastructure failures (monotonic clock).
        now: monotonic now.
        torn_down: replica id -> version of each record whose teardown finished.
        busy: for a pool, the workers running a job: the pool's own rules size it
            (`pool_scaling.plan`: no busy worker is ever a victim); None for a service.
        rollout: a canary rollout's launches and teardowns, which replace the rolling ones.
        ready_by_version: how many READY replicas each version has, when the caller keeps the
            count (`tally.Views`); else counted from `views`.
    """
    target = policy.final(adopted_target)
    if rollout is not None:
        scale = rollout
    elif busy is not None:
        pool = pool_scaling.plan(
            views, set(busy), target=adopted_target, latest_version=latest_version, stopped=stopped
        )
        scale = scaling.ScalePlan(launch=pool.launch, teardown=pool.teardown)
    else:
        scale = scaling.plan(
            views,
            target=target,
            latest_version=latest_version,
            stopped=stopped,
            blue_green=blue_green,
            fallback=(policy, adopted_target) if policy.kind == autoscaler.FALLBACK else None,
        )
    launches = scaling.launches_now(
        scale, pause_s=failures.launch_pause(backoff, now), batch=scaling.launch_batch(len(views))
    )
    if ready_by_version is None:
        active = scaling.active_versions(views, latest_version=latest_version, target=target, blue_green=blue_green)
    else:
        active = scaling.active_versions_of(
            ready_by_version, latest_version=latest_version, target=target, blue_green=blue_green
        )
    remove = scaling.removed_at_switch(torn_down, active=active, latest_version=latest_version, blue_green=blue_green)
    return Plan(
        launch=launches.regular,
        launch_ondemand=launches.ondemand,
        teardown=scale.teardown,
        remove=tuple(remove),
        again_in_s=launches.again_in_s,
        launch_wanted=bool(scale.launch + scale.launch_ondemand),
    )

"""Fixed-size scaling and rolling replacement decisions (spec.md sections 6 and 7.1)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from services.controller.domain import autoscaler
from services.controller.domain import status as st


@dataclasses.dataclass(frozen=True)
class ScalePlan:
    """What to do now: launch `launch` latest-version replicas (plus `launch_ondemand` forced
    on-demand ones, for spot fallback) and tear down `teardown` ids."""

    launch: int = 0
    teardown: tuple[int, ...] = ()
    launch_ondemand: int = 0


def plan(
    replicas: Sequence[st.ReplicaView],
    *,
    target: int,
    latest_version: int,
    stopped: bool = False,
    blue_green: bool = False,
    fallback: tuple[autoscaler.Policy, int] | None = None,
) -> ScalePlan:
    """Decide launches and scale-down victims for one service.

    Keeps `target` non-terminal latest-version replicas, and old-version replicas while the new
    version is not READY yet (rolling: old kept = target - new READY).

    Args:
        replicas: every replica record of the service.
        target: replicas wanted.
        latest_version: the newest version; only it is launched.
        stopped: the stop rule fired for the latest version: launch nothing.
        blue_green: keep every old replica until the new version has `target` READY, then
            remove them all at once.
        fallback: (policy, adopted target without overprovision) of a spot service with
            on-demand fallback: the latest version runs the spot/on-demand mix it asks for.
    """
    live = [r for r in replicas if not st.is_terminal(r.status)]
    latest = [r for r in live if r.version == latest_version]
    old = [r for r in live if r.version != latest_version]
    launch_ondemand = 0
    if fallback is None:
        launch = max(target - len(latest), 0)
        victims = st.scale_down_victims(latest, len(latest) - target)
    else:
        mix = autoscaler.fallback_plan(fallback[0], latest, target=fallback[1])
        launch, launch_ondemand = mix.spot_launch, mix.ondemand_launch
        by_id = {r.replica_id: r for r in latest}
        victims = [by_id[i] for i in mix.victims]
    if stopped:
        launch = launch_ondemand = 0
    new_ready = sum(1 for r in latest if r.status is st.ReplicaStatus.READY)
    if blue_green:
        keep_old = len(old) if new_ready < target else 0
    else:
        keep_old = max(target - new_ready, 0)
    victims += st.scale_down_victims(old, len(old) - keep_old)
    return ScalePlan(launch=launch, teardown=tuple(r.replica_id for r in victims), launch_ondemand=launch_ondemand)


def active_versions(
    replicas: Sequence[st.ReplicaView], *, latest_version: int, target: int, blue_green: bool
) -> list[int]:
    """Versions that may get traffic (spec.md section 7.1).

    Rolling: every version with a READY replica. Blue-green: the old versions until the latest
    has `target` READY replicas, then the latest alone.
    """
    ready = [r for r in replicas if r.status is st.ReplicaStatus.READY]
    versions = sorted({r.version for r in ready})
    if not blue_green:
        return versions
    latest_ready = sum(1 for r in ready if r.version == latest_version)
    old = [v for v in versions if v != latest_version]
    if latest_ready >= max(target, 1) or not old:
        return [latest_version] if latest_ready else []
    return old

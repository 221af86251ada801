"""Scaling and update decisions (spec.md sections 6 and 7): how many replicas to launch and
which to tear down (`plan`: target, rolling or blue-green replacement, the spot/on-demand
fallback mix, victims in status order), which versions get traffic and when blue-green switches
(`active_versions`, `removed_at_switch`), how many launches one pass starts (`launches_now`),
and what an update keeps, launches and tears down (`update_plan`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

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
    ready: dict[int, int] = {}
    for r in replicas:
        if r.status is st.ReplicaStatus.READY:
            ready[r.version] = ready.get(r.version, 0) + 1
    return active_versions_of(ready, latest_version=latest_version, target=target, blue_green=blue_green)


def active_versions_of(
    ready_by_version: Mapping[int, int], *, latest_version: int, target: int, blue_green: bool
) -> list[int]:
    """`active_versions` from how many READY replicas each version has."""
    versions = sorted(v for v, n in ready_by_version.items() if n > 0)
    if not blue_green:
        return versions
    latest_ready = ready_by_version.get(latest_version, 0)
    old = [v for v in versions if v != latest_version]
    if latest_ready >= max(target, 1) or not old:
        return [latest_version] if latest_ready else []
    return old


def removed_at_switch(
    torn_down: Mapping[int, int], *, active: Sequence[int], latest_version: int, blue_green: bool
) -> list[int]:
    """Records removed when blue-green switches (spec.md section 7.1): once traffic goes to the
    latest version alone, the older versions' kept failure records go with them.

    Args:
        torn_down: replica id -> version of each record whose teardown finished.
        active: `active_versions(...)`.
        latest_version: the newest version.
        blue_green: the service updates blue-green.
    """
    if not (blue_green and list(active) == [latest_version]):
        return []
    return sorted(rid for rid, version in torn_down.items() if version != latest_version)


# New replicas one pass starts at most (two store writes each); a larger scale-up takes several
# passes, so the controller keeps answering while a big service starts.
LAUNCH_BATCH = 50
# ... or this share of the service's records, if more: passes of a large service are spaced in
# proportion to its size (passes.py), so its launches per second must not shrink as it grows.
LAUNCH_SHARE = 20


def launch_batch(records: int) -> int:
    """The most one pass of a service holding `records` replica records starts."""
    return max(LAUNCH_BATCH, records // LAUNCH_SHARE)


@dataclasses.dataclass(frozen=True)
class Launches:
    """What one pass launches: `regular` replicas (spot if the policy uses spot), `ondemand`
    forced on-demand ones; `again_in_s` asks for another pass that soon (None: not needed)."""

    regular: int = 0
    ondemand: int = 0
    again_in_s: float | None = None


def launches_now(p: ScalePlan, *, pause_s: float = 0.0, batch: int = LAUNCH_BATCH) -> Launches:
    """Launches this pass starts of plan `p`.

    Args:
        p: the scale plan.
        pause_s: `failures.launch_pause(...)`: while launches are paused, none start and the
            pass asks to run again when the pause ends.
        batch: the most one pass starts; the rest come in the next pass, at once.
    """
    wanted = p.launch + p.launch_ondemand
    if not wanted:
        return Launches()
    if pause_s > 0:
        return Launches(again_in_s=pause_s)
    regular = min(p.launch, batch)
    ondemand = min(p.launch_ondemand, batch - regular)
    return Launches(regular, ondemand, 0.0 if regular + ondemand < wanted else None)


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """What an update does (spec.md section 7.2), ids sorted.

    Attributes:
        kept: replicas kept and bumped to the new version in place.
        launch: new replicas to launch beside the kept ones.
        teardown: kept-eligible replicas beyond the new target, in victim order's choice.
        replaced: replicas that cannot be kept; rolling or blue-green replaces them.
        in_place: every live replica is kept: nothing is replaced.
    """

    kept: tuple[int, ...] = ()
    launch: int = 0
    teardown: tuple[int, ...] = ()
    replaced: tuple[int, ...] = ()
    in_place: bool = True


def update_plan(live: Sequence[st.ReplicaView], *, keepable: Collection[int], target: int) -> UpdatePlan:
    """Plan an update.

    Args:
        live: the service's non-terminal replicas.
        keepable: ids of those whose version differs from the new spec only where an in-place
            update allows (`spec.is_in_place_update`).
        target: the new version's final target.
    """
    kept = [r for r in live if r.replica_id in keepable]
    victims = {v.replica_id for v in st.scale_down_victims(kept, len(kept) - target)}
    return UpdatePlan(
        kept=tuple(sorted(r.replica_id for r in kept if r.replica_id not in victims)),
        launch=max(target - len(kept), 0),
        teardown=tuple(sorted(victims)),
        replaced=tuple(sorted(r.replica_id for r in live if r.replica_id not in keepable)),
        in_place=len(kept) == len(live),
    )

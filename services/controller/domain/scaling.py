"""Fixed-size scaling and rolling replacement decisions (spec.md sections 6 and 7.1)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from services.controller.domain import status as st


@dataclasses.dataclass(frozen=True)
class ScalePlan:
    """What to do now: launch `launch` latest-version replicas and tear down `teardown` ids."""

    launch: int = 0
    teardown: tuple[int, ...] = ()


def plan(replicas: Sequence[st.ReplicaView], *, target: int, latest_version: int, stopped: bool = False) -> ScalePlan:
    """Decide launches and scale-down victims for one service.

    Keeps `target` non-terminal latest-version replicas, and old-version replicas while the new
    version is not READY yet (rolling: old kept = target - new READY).

    Args:
        replicas: every replica record of the service.
        target: replicas wanted.
        latest_version: the newest version; only it is launched.
        stopped: the stop rule fired for the latest version: launch nothing.
    """
    live = [r for r in replicas if not st.is_terminal(r.status)]
    latest = [r for r in live if r.version == latest_version]
    old = [r for r in live if r.version != latest_version]
    launch = 0 if stopped else max(target - len(latest), 0)
    victims = st.scale_down_victims(latest, len(latest) - target)
    new_ready = sum(1 for r in latest if r.status is st.ReplicaStatus.READY)
    keep_old = max(target - new_ready, 0)
    victims += st.scale_down_victims(old, len(old) - keep_old)
    return ScalePlan(launch=launch, teardown=tuple(r.replica_id for r in victims))

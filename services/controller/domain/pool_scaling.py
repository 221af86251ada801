"""A pool's size from its job queue (SkyPilot's queue-length autoscaler), and which workers go.

SkyPilot's rule (reference 8.6), relative to the adopted target: an empty queue asks for 0; more
queued jobs than `queue_length_threshold` ask for one worker more; fewer ask for one less; as
many hold. A queue that is not empty never asks for 0. The candidate is clipped to
[min_workers, max_workers] and goes through the same time-based hysteresis as a service's
target (`autoscaler.decide`): a pool at 0 grows at once, other changes wait for the up/downscale
delay.

Scale-down never removes a busy worker: idle READY workers go first, then workers that are not
READY (still launching, or in a failure streak), each group older version first, then highest
id first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from services.controller.domain import autoscaler
from services.controller.domain import status as st


@dataclasses.dataclass(frozen=True)
class PoolPolicy:
    """The `pool:` section of the latest version, as plain values."""

    min_workers: int = 1
    max_workers: int = 1
    queue_length_threshold: int = 1
    upscale_delay_s: float = 300.0
    downscale_delay_s: float = 1200.0

    def clip(self, n: int) -> int:
        """`n` within [min_workers, max_workers]."""
        return max(self.min_workers, min(max(self.max_workers, self.min_workers), n))

    def as_autoscaler(self) -> autoscaler.Policy:
        """The same sizes and delays in the service autoscaler's terms, for its hysteresis."""
        return autoscaler.Policy(
            min_replicas=self.min_workers,
            max_replicas=max(self.max_workers, self.min_workers),
            upscale_delay_s=self.upscale_delay_s,
            downscale_delay_s=self.downscale_delay_s,
        )


def candidate(policy: PoolPolicy, target: int, queued: int) -> int:
    """The target the queue asks for, one step from the adopted `target`, clipped.

    Args:
        policy: the pool's policy.
        target: the adopted target.
        queued: jobs waiting for a worker.
    """
    threshold = max(policy.queue_length_threshold, 1)
    if queued == 0:
        wanted = 0
    elif queued > threshold:
        wanted = target + 1
    elif queued < threshold:
        wanted = target - 1
    else:
        wanted = target
    if wanted <= 0 and queued > 0:
        wanted = 1
    return policy.clip(wanted)


def decide(
    policy: PoolPolicy,
    state: autoscaler.Hysteresis,
    queued: int,
    now: float,
    *,
    interval_s: float = autoscaler.DECISION_INTERVAL_S,
    zero_interval_s: float = autoscaler.ZERO_DECISION_INTERVAL_S,
) -> autoscaler.Decision:
    """One decision: the queue's candidate through the up/downscale delays.

    A decision that adopts a new target while the queue still asks for more is due again at
    once (`next_in_s` 0 when the delay is 0), so a pool with no upscale delay grows one worker
    per decision without waiting for the cadence.
    """
    wanted = candidate(policy, state.target, queued)
    d = autoscaler.decide(
        policy.as_autoscaler(), state, wanted, now, interval_s=interval_s, zero_interval_s=zero_interval_s
    )
    if d.state.target != state.target and candidate(policy, d.state.target, queued) != d.state.target:
        delay = policy.upscale_delay_s if wanted > state.target else policy.downscale_delay_s
        return dataclasses.replace(d, next_in_s=min(d.next_in_s, max(delay, 0.0)))
    return d


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to do to a pool's workers."""

    launch: int = 0
    teardown: tuple[int, ...] = ()


def victims(workers: Iterable[st.ReplicaView], busy: set[int], count: int) -> list[int]:
    """Up to `count` workers to remove, never a busy one.

    Idle READY workers first, then workers that are not READY (in scale-down status order),
    each group older version first, then highest id first.
    """
    if count <= 0:
        return []
    rank: dict[st.ReplicaStatus, int] = {st.ReplicaStatus.READY: 0}
    rank.update((s, i + 1) for i, s in enumerate(st.SCALE_DOWN_ORDER) if s is not st.ReplicaStatus.READY)
    idle = [w for w in workers if w.replica_id not in busy and w.status in rank]
    idle.sort(key=lambda w: (rank[w.status], w.version, -w.replica_id))
    return [w.replica_id for w in idle[:count]]


def plan(
    workers: Sequence[st.ReplicaView], busy: set[int], *, target: int, latest_version: int, stopped: bool = False
) -> Plan:
    """Launches and teardowns that move a pool toward `target` workers of the latest version.

    Workers of older versions have no traffic to hand over: an idle one goes at once, a busy one
    once its job has ended (its job is never cut). Latest-version workers beyond the target go
    by `victims`. `stopped` (the version failed for the user's fault) launches nothing.

    Args:
        workers: every worker record.
        busy: replica ids of workers running a job.
        target: the adopted target.
        latest_version: the pool's newest version.
        stopped: launches are stopped for this version.
    """
    live = [w for w in workers if not st.is_terminal(w.status)]
    old = [w for w in live if w.version != latest_version and w.replica_id not in busy]
    latest = [w for w in live if w.version == latest_version]
    extra = victims(latest, busy, len(latest) - target)
    launch = 0 if stopped else max(target - len(latest), 0)
    return Plan(launch=launch, teardown=tuple(sorted(w.replica_id for w in old)) + tuple(extra))

"""Replica facts, the status they map to (spec.md section 2), and the rules built on statuses."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Iterable, Mapping, Sequence


class LaunchPhase(enum.IntEnum):
    """Where a launch stands. Values match replicaplane.controller.v1.LaunchPhase."""

    UNSPECIFIED = 0
    SCHEDULED = 1
    RUNNING = 2
    SUCCEEDED = 3
    INTERRUPTED = 4
    FAILED = 5


class TeardownPhase(enum.IntEnum):
    """Where a teardown stands; NONE means no teardown. Values match TeardownPhase."""

    NONE = 0
    SCHEDULED = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4


class ReplicaStatus(enum.IntEnum):
    """Replica status. Values match replicaplane.controller.v1.ReplicaStatus."""

    UNSPECIFIED = 0
    PENDING = 1
    PROVISIONING = 2
    STARTING = 3
    READY = 4
    NOT_READY = 5
    SHUTTING_DOWN = 6
    FAILED = 7
    FAILED_INITIAL_DELAY = 8
    FAILED_PROBING = 9
    FAILED_PROVISION = 10
    FAILED_CLEANUP = 11
    PREEMPTED = 12
    UNKNOWN = 13


class ServiceStatus(enum.IntEnum):
    """Service status. Values match replicaplane.controller.v1.ServiceStatus."""

    UNSPECIFIED = 0
    CONTROLLER_INIT = 1
    REPLICA_INIT = 2
    READY = 3
    NO_REPLICA = 4
    SHUTTING_DOWN = 5
    FAILED = 6
    FAILED_CLEANUP = 7
    CONTROLLER_FAILED = 8


FAILED_STATUSES = frozenset(
    {
        ReplicaStatus.FAILED,
        ReplicaStatus.FAILED_CLEANUP,
        ReplicaStatus.FAILED_INITIAL_DELAY,
        ReplicaStatus.FAILED_PROBING,
        ReplicaStatus.FAILED_PROVISION,
        ReplicaStatus.UNKNOWN,
    }
)
TERMINAL_STATUSES = FAILED_STATUSES | {ReplicaStatus.SHUTTING_DOWN, ReplicaStatus.PREEMPTED}

# Scale-down victims come from the front of this order (spec.md section 2).
SCALE_DOWN_ORDER: tuple[ReplicaStatus, ...] = (
    ReplicaStatus.PENDING,
    ReplicaStatus.PROVISIONING,
    ReplicaStatus.STARTING,
    ReplicaStatus.NOT_READY,
    ReplicaStatus.READY,
)


@dataclasses.dataclass(frozen=True)
class Facts:
    """The persisted facts a replica's status is derived from.

    `first_ready_time` is None until the first passed probe; `initial_delay_exceeded` is the
    sentinel SkyPilot encodes as first_ready_time == -1.
    """

    launch: LaunchPhase = LaunchPhase.SCHEDULED
    teardown: TeardownPhase = TeardownPhase.NONE
    user_app_failed: bool = False
    ready_now: bool = False
    first_ready_time: float | None = None
    initial_delay_exceeded: bool = False
    is_scale_down: bool = False
    preempted: bool = False
    purged: bool = False
    failed_spot_availability: bool = False


def replica_status(f: Facts) -> ReplicaStatus:
    """Map facts to a status: the first matching row of spec.md section 2 wins."""
    td = f.teardown
    if f.launch in (LaunchPhase.SCHEDULED, LaunchPhase.UNSPECIFIED):
        return ReplicaStatus.PENDING  # 1
    if f.launch is LaunchPhase.RUNNING:
        if td is TeardownPhase.FAILED:
            return ReplicaStatus.FAILED_CLEANUP  # 2
        if td is TeardownPhase.SUCCEEDED:
            return ReplicaStatus.UNKNOWN  # 3
        return ReplicaStatus.PROVISIONING  # 4
    if f.launch is LaunchPhase.INTERRUPTED:
        # Fix over SkyPilot: a failed teardown of an interrupted launch is a leak to clean up,
        # not a teardown in progress forever.
        if td is TeardownPhase.FAILED:
            return ReplicaStatus.FAILED_CLEANUP  # 5a
        return ReplicaStatus.SHUTTING_DOWN  # 5
    if td is not TeardownPhase.NONE and f.preempted:
        return ReplicaStatus.PREEMPTED  # 6
    if td in (TeardownPhase.SCHEDULED, TeardownPhase.RUNNING):
        return ReplicaStatus.SHUTTING_DOWN  # 7
    if td is TeardownPhase.FAILED:
        return ReplicaStatus.FAILED_CLEANUP  # 8
    if td is TeardownPhase.SUCCEEDED:
        if f.user_app_failed:
            return ReplicaStatus.FAILED  # 9
        if f.launch is LaunchPhase.FAILED:
            return ReplicaStatus.FAILED_PROVISION  # 10
        if f.initial_delay_exceeded:
            return ReplicaStatus.FAILED_INITIAL_DELAY  # 12 (the sentinel is checked first so
        if f.first_ready_time is None:  # a never-ready replica can still carry it)
            return ReplicaStatus.SHUTTING_DOWN  # 11
        if not f.ready_now:
            return ReplicaStatus.FAILED_PROBING  # 13
        return ReplicaStatus.UNKNOWN  # 14
    if f.launch is LaunchPhase.FAILED or f.user_app_failed:
        return ReplicaStatus.FAILED_CLEANUP  # 15: teardown should already be scheduled
    if f.ready_now:
        return ReplicaStatus.READY  # 16
    if f.first_ready_time is not None:
        return ReplicaStatus.NOT_READY  # 17
    return ReplicaStatus.STARTING  # 18


def is_terminal(status: ReplicaStatus) -> bool:
    """Terminal replicas do not count toward a service's size."""
    return status in TERMINAL_STATUSES


def should_probe(f: Facts) -> bool:
    """Launched, not tearing down, app not failed, not preempted or purged (spec.md section 5)."""
    return (
        f.launch is LaunchPhase.SUCCEEDED
        and f.teardown is TeardownPhase.NONE
        and not (f.user_app_failed or f.preempted or f.purged)
    )


def removed_after_teardown(f: Facts, *, version: int, latest_version: int) -> bool:
    """Whether a finished teardown removes the record (True) or keeps it for the user.

    Fix over SkyPilot: a scale-down whose teardown failed is kept as FAILED_CLEANUP instead of
    silently dropped, since the replica may still be running somewhere.
    """
    if f.teardown is TeardownPhase.FAILED and not f.purged:
        return False
    return f.is_scale_down or version != latest_version or f.purged or f.failed_spot_availability


@dataclasses.dataclass(frozen=True)
class ReplicaView:
    """What scaling and service-status rules need to know of one replica."""

    replica_id: int
    version: int
    status: ReplicaStatus
    is_spot: bool = False
    accelerator: str = ""


def scale_down_victims(replicas: Iterable[ReplicaView], count: int) -> list[ReplicaView]:
    """Pick `count` victims: status order, then older version first, then highest id first."""
    if count <= 0:
        return []
    rank = {s: i for i, s in enumerate(SCALE_DOWN_ORDER)}
    candidates = [r for r in replicas if r.status in rank]
    candidates.sort(key=lambda r: (rank[r.status], r.version, -r.replica_id))
    return candidates[: max(count, 0)]


Statuses = Sequence[ReplicaStatus] | Mapping[ReplicaStatus, int]
"""Replica statuses: one per replica, or how many replicas are in each (`tally.Views.statuses`)."""


def _counts(statuses: Statuses) -> Mapping[ReplicaStatus, int]:
    if isinstance(statuses, Mapping):
        return statuses
    counts: dict[ReplicaStatus, int] = {}
    for s in statuses:
        counts[s] = counts.get(s, 0) + 1
    return counts


def service_status(statuses: Statuses, *, launching: bool = False) -> ServiceStatus:
    """READY with any READY replica; REPLICA_INIT while some are on their way (or about to be
    launched: `launching`); else NO_REPLICA."""
    counts = _counts(statuses)
    if counts.get(ReplicaStatus.READY, 0) > 0:
        return ServiceStatus.READY
    if launching or any(n > 0 and not is_terminal(s) for s, n in counts.items()):
        return ServiceStatus.REPLICA_INIT
    return ServiceStatus.NO_REPLICA


def ready_and_total(statuses: Statuses) -> tuple[int, int]:
    """`ready/total` where total counts replicas neither failed nor shutting down (a replica
    draining after a scale-down is on its way out, not part of the service's size)."""
    counts = _counts(statuses)
    ready = counts.get(ReplicaStatus.READY, 0)
    total = sum(n for s, n in counts.items() if s not in FAILED_STATUSES and s is not ReplicaStatus.SHUTTING_DOWN)
    return ready, total


# ---- service status, removals, terminations -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServiceFacts:
    """What a service's status and message derive from, beside its replicas' statuses.

    Attributes:
        started: the controller resumed the service (CONTROLLER_INIT before).
        deleting: a delete is in progress.
        cleanup_failed: the delete left replicas whose teardown failed (FAILED_CLEANUP).
        cleanup_message: the message stored when the cleanup failed.
        replicas_left: records left while deleting.
        target: the final target (with overprovision).
        stopped_message: the stop rule's message for the latest version; "" if not stopped.
        pause_message: `failures.pause_message(...)` while launches wait after an
            infrastructure failure and some are wanted; "" otherwise.
        probing_stale: no prober is reachable.
    """

    started: bool = True
    deleting: bool = False
    cleanup_failed: bool = False
    cleanup_message: str = ""
    replicas_left: int = 0
    target: int = 0
    stopped_message: str = ""
    pause_message: str = ""
    probing_stale: bool = False


def service_status_of(statuses: Statuses, svc: ServiceFacts) -> ServiceStatus:
    """The service's status (spec.md section 9): the delete's, CONTROLLER_INIT until resumed,
    else derived from the replicas. A stopped version launches nothing: NO_REPLICA once its
    replicas are gone, as SkyPilot. Paused launches still count as launching: REPLICA_INIT."""
    if svc.deleting:
        return ServiceStatus.FAILED_CLEANUP if svc.cleanup_failed else ServiceStatus.SHUTTING_DOWN
    if not svc.started:
        return ServiceStatus.CONTROLLER_INIT
    return service_status(statuses, launching=svc.target > 0 and not svc.stopped_message)


def status_message(statuses: Statuses, svc: ServiceFacts) -> str:
    """The one line that says why the service is where it is: the failed cleanup, the delete's
    progress, the stop rule, stale probing, else the counts (with the launch pause, if any)."""
    if svc.deleting:
        if svc.cleanup_failed:
            return svc.cleanup_message
        return f"shutting down: {svc.replicas_left} replica(s) left"
    if svc.stopped_message:
        return svc.stopped_message
    if svc.probing_stale:
        return "probing is stale: no prober reachable, readiness may be out of date"
    ready, total = ready_and_total(statuses)
    counts = f"{ready}/{total} ready, target {svc.target}"
    return f"{counts}; {svc.pause_message}" if svc.pause_message else counts


def record_removed(f: Facts, *, version: int, latest_version: int, deleting: bool) -> bool:
    """Whether a finished teardown removes the replica's record: while the service is deleted,
    every replica torn down (or purged) goes; otherwise `removed_after_teardown` decides."""
    if deleting:
        return f.teardown is TeardownPhase.SUCCEEDED or f.purged
    return removed_after_teardown(f, version=version, latest_version=latest_version)


def cleanup_message(left: Iterable[int]) -> str:
    """The FAILED_CLEANUP message of a delete that left replicas it could not tear down."""
    ids = ", ".join(str(i) for i in sorted(left))
    return f"teardown failed for replica(s) {ids}; delete with purge to forget them"


class Termination(enum.Enum):
    """What a user's request to terminate one replica does (spec.md section 4)."""

    DRAIN_AND_TEAR_DOWN = "torn down after the drain, as a scale-down"
    PURGE = "the failed record is purged (its cleanup tried once more if it never finished)"
    REFUSED_SHUTTING_DOWN = "refused: already shutting down"
    REFUSED_FAILED = "refused: failed, and tearing it down could leak resources; purge removes it"


def termination(status: ReplicaStatus, *, tearing_down: bool, purge: bool) -> Termination:
    """Decide a manual termination.

    Args:
        status: the replica's status.
        tearing_down: a teardown of it is in motion.
        purge: the user asked to purge.
    """
    failed = status in FAILED_STATUSES
    if status is ReplicaStatus.SHUTTING_DOWN or (tearing_down and not failed):
        return Termination.REFUSED_SHUTTING_DOWN
    if failed:
        return Termination.PURGE if purge else Termination.REFUSED_FAILED
    return Termination.DRAIN_AND_TEAR_DOWN


class OnDelete(enum.Enum):
    """What deleting the service does to one replica (spec.md section 9: down never drains)."""

    MARK = "its teardown runs already: it is only marked (purged) and a drain in progress ends now"
    REMOVE = "its record goes now (torn down already, or a failed cleanup with purge)"
    TEAR_DOWN = "torn down now without drain (a failed cleanup is tried once more)"


def on_delete(f: Facts, *, tearing_down: bool, purge: bool) -> OnDelete:
    """Decide one replica's fate when its service is deleted.

    Args:
        f: the replica's facts.
        tearing_down: a teardown of it is in motion.
        purge: the delete asked to purge.
    """
    if tearing_down:
        return OnDelete.MARK
    if f.teardown is TeardownPhase.SUCCEEDED or (purge and f.teardown is TeardownPhase.FAILED):
        return OnDelete.REMOVE
    return OnDelete.TEAR_DOWN


def gone_from_snapshot(
    names: Iterable[str], snapshot: Collection[str], launched_in: Mapping[str, int], generation: int
) -> list[str]:
    """Replicas a provisioner snapshot does not list, and so are gone.

    A replica whose launch finished after this watch started (`launched_in[name] >= generation`)
    may be missing only because the snapshot was older: it is left to live events and probes.

    Args:
        names: replica names the controller has records of.
        snapshot: names in the provisioner's snapshot.
        launched_in: name -> the watch generation its launch finished in.
        generation: the generation of the watch that sent the snapshot.
    """
    return [n for n in names if n not in snapshot and launched_in.get(n, -1) < generation]

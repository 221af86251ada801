"""Whose fault a replica failure was, and what it does to its version and to launches.

Decides three things, each in one function:

- `counts_toward_stop`: only the user's failures count toward the stop rule (issue 19: a
  transient API server 503 used to stop a version for good).
- `stops_version`: SkyPilot's stop rule, restricted to those failures: the latest version stops
  scaling when one of its replicas fails by the user's fault before the version was ever READY.
- `Backoff` / `launch_pause`: infrastructure failures of a launch pause further launches of the
  service, 1 s doubling to 60 s, and the service's status message says so.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Sequence

from services.controller.domain import status as st


class Cause(enum.IntEnum):
    """Whose fault a failure was. Values match replicaplane.provisioner.v1.FailureCause."""

    UNSPECIFIED = 0
    """Not reported (an older provisioner): treated as the user's, as the contract says."""
    USER = 1
    INFRASTRUCTURE = 2


class Kind(enum.Enum):
    """What failed. Each kind has the cause it takes when nobody reports one (`default_cause`)."""

    SETUP_EXITED = "setup exited non-zero"
    APP_EXITED = "the app exited non-zero"
    NEVER_READY = "not ready within the initial delay"
    PROBE_WINDOW = "probes failed for the whole failure window"
    LAUNCH_FAILED = "the provisioner could not launch the replica"
    LAUNCH_REFUSED = "the provisioner refused the launch as asked (bad spec)"
    CAPACITY = "no capacity in the zone"
    LAUNCH_CANCELLED = "the launch was cancelled at the provisioner"
    PROVISIONER_UNREACHABLE = "the provisioner did not answer"
    PREEMPTED = "the replica was preempted"
    VANISHED = "the replica vanished without a teardown of ours"


_DEFAULT_CAUSE = {
    Kind.SETUP_EXITED: Cause.USER,
    Kind.APP_EXITED: Cause.USER,
    Kind.NEVER_READY: Cause.USER,
    Kind.PROBE_WINDOW: Cause.USER,
    Kind.LAUNCH_FAILED: Cause.USER,  # what an unclassified launch failure meant before causes
    Kind.LAUNCH_REFUSED: Cause.USER,
    Kind.CAPACITY: Cause.INFRASTRUCTURE,
    Kind.LAUNCH_CANCELLED: Cause.INFRASTRUCTURE,
    Kind.PROVISIONER_UNREACHABLE: Cause.INFRASTRUCTURE,
    Kind.PREEMPTED: Cause.INFRASTRUCTURE,
    Kind.VANISHED: Cause.INFRASTRUCTURE,
}

# Kinds whose cause is fixed whatever a report says: a lack of capacity, a preemption or a
# cancel is never the user's fault. (A replica never ready within its delay is the app's
# unless a caller reports otherwise: NEVER_READY takes a report.)
_FIXED = frozenset({Kind.CAPACITY, Kind.PREEMPTED, Kind.LAUNCH_CANCELLED})

# Infrastructure failures of these kinds pause the service's launches. A cancelled launch
# (someone else's decision) and a preemption (the spot placer moves on) do not.
_PAUSING = frozenset({Kind.LAUNCH_FAILED, Kind.CAPACITY, Kind.PROVISIONER_UNREACHABLE})


def cause_of(kind: Kind, reported: Cause = Cause.UNSPECIFIED) -> Cause:
    """The cause of a failure of `kind`: the reported one where the kind allows it, else the
    kind's own; UNSPECIFIED becomes the user's (the contract's reading of an old provisioner)."""
    if kind in _FIXED or reported is Cause.UNSPECIFIED:
        return _DEFAULT_CAUSE[kind]
    return reported


@dataclasses.dataclass(frozen=True)
class Failure:
    """One failure of one replica.

    Attributes:
        kind: what failed.
        cause: whose fault (already resolved by `cause_of`).
        message: the human-readable detail shown as the replica's failure reason.
        ever_ready: the replica had passed a probe before it failed.
    """

    kind: Kind
    cause: Cause
    message: str = ""
    ever_ready: bool = False

    @classmethod
    def of(
        cls, kind: Kind, message: str = "", *, reported: Cause = Cause.UNSPECIFIED, ever_ready: bool = False
    ) -> Failure:
        """A failure whose cause comes from `cause_of(kind, reported)`."""
        return cls(kind, cause_of(kind, reported), message, ever_ready)


def counts_toward_stop(cause: Cause) -> bool:
    """Only the user's failures (and unreported ones, read as the user's) count toward the stop
    rule; the infrastructure's are retried."""
    return cause is not Cause.INFRASTRUCTURE


def version_ever_ready(version: int, ever_ready_versions: Iterable[int], replicas: Iterable[st.ReplicaView]) -> bool:
    """Whether `version` was ever READY: remembered so, or any of its replicas READY now
    (SkyPilot's check: a replica kept READY through an in-place update counts)."""
    if version in set(ever_ready_versions):
        return True
    return any(r.version == version and r.status is st.ReplicaStatus.READY for r in replicas)


def stops_version(failure: Failure, *, version: int, latest_version: int, ever_ready: bool) -> bool:
    """The stop rule (spec.md section 6, SkyPilot's `unrecoverable_failure`), issue 19's way.

    A failure stops its version's scaling when it is the user's, happened before the replica
    was ever ready, the version is the latest, and the version was never READY. An outdated
    version's failure changes nothing (the latest decides); an infrastructure failure pauses
    launches instead (`Backoff`).

    Args:
        failure: the replica's failure.
        version: the failed replica's version.
        latest_version: the service's newest version.
        ever_ready: `version_ever_ready(version, ...)`.
    """
    if not counts_toward_stop(failure.cause) or failure.ever_ready:
        return False
    return version == latest_version and not ever_ready


def stop_message(version: int, replica_id: int, reason: str) -> str:
    """The status message a stopped version shows (spec.md section 9)."""
    return f"scaling stopped: version {version} failed before ever being ready (replica {replica_id}: {reason})"


def pauses_launches(failure: Failure) -> bool:
    """Whether a failure pauses the service's launches: an infrastructure failure of a launch
    (capacity, quota, API server errors, an unreachable provisioner)."""
    return failure.cause is Cause.INFRASTRUCTURE and failure.kind in _PAUSING


BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 60.0


@dataclasses.dataclass(frozen=True)
class Backoff:
    """The launch pause after infrastructure failures: 1 s, doubling per failure, at most 60 s.

    Times are the caller's monotonic clock. A success resets the delay (the next failure pauses
    1 s again) but not a pause already running, as before.

    Attributes:
        delay_s: the last pause's length; 0 after a success or before any failure.
        not_before: no launch before this time.
        reason: the failure that started the pause, for the status message.
    """

    delay_s: float = 0.0
    not_before: float = 0.0
    reason: str = ""

    def failed(self, now: float, reason: str = "") -> Backoff:
        """After an infrastructure failure at `now`."""
        delay = min(max(self.delay_s * 2, BACKOFF_INITIAL_S), BACKOFF_MAX_S)
        return Backoff(delay, now + delay, reason)

    def succeeded(self) -> Backoff:
        """After a launch that reached RUNNING."""
        return dataclasses.replace(self, delay_s=0.0)


def launch_pause(backoff: Backoff, now: float) -> float:
    """Seconds launches must still wait at `now` (0: launch now)."""
    return max(backoff.not_before - now, 0.0)


def pause_message(backoff: Backoff, now: float) -> str:
    """What the status message says while launches are paused; "" when they are not."""
    left = launch_pause(backoff, now)
    if left <= 0:
        return ""
    why = f": {backoff.reason}" if backoff.reason else ""
    return f"launches paused for {math.ceil(left)} s after an infrastructure failure{why}"


@dataclasses.dataclass(frozen=True)
class Reaction:
    """What a replica's failure does to its service: `stop` is the stop rule's message ("" when
    the version goes on), `backoff` the launch pause after it."""

    stop: str = ""
    backoff: Backoff = Backoff()


def react(
    failure: Failure,
    *,
    replica_id: int,
    version: int,
    latest_version: int,
    ever_ready: bool,
    backoff: Backoff,
    now: float,
) -> Reaction:
    """The service-level consequences of one failure, in one place: the stop rule for the
    user's failures, the launch pause for the infrastructure's (`now` on the backoff's clock).
    A version already stopped keeps its first message (the caller keeps the one it has)."""
    stop = ""
    if stops_version(failure, version=version, latest_version=latest_version, ever_ready=ever_ready):
        stop = stop_message(version, replica_id, failure.message)
    if pauses_launches(failure):
        backoff = backoff.failed(now, failure.message)
    return Reaction(stop, backoff)


EVER_READY_KEPT = 16


def remember_ready(ever_ready_versions: Sequence[int], version: int) -> list[int]:
    """The versions remembered as READY once, after a replica of `version` was READY: the stop
    rule's "ever ready", whether it passed its first probe under the version or was kept READY
    through an in-place update. The last 16 are enough: only the latest version is ever stopped."""
    if version in ever_ready_versions:
        return list(ever_ready_versions)
    return [*ever_ready_versions[-(EVER_READY_KEPT - 1) :], version]

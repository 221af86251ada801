"""The events a replica's lifecycle takes and the actions `lifecycle.step` returns.

Plain values, no behaviour: a driver or an event handler builds an event from what it heard
(a launch stream, the provisioner's watch, a probe result, a user's request), and carries out
the actions. `lifecycle` re-exports every name here.
"""

from __future__ import annotations

import dataclasses

from services.controller.domain.failures import Cause, Failure

# ---- events --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LaunchProvisioning:
    """The provisioner started working on the launch."""


@dataclasses.dataclass(frozen=True)
class LaunchAttemptFailed:
    """One attempt failed; the provisioner tries again."""

    attempt: int
    message: str


@dataclasses.dataclass(frozen=True)
class LaunchRunning:
    """The launch finished: the replica runs."""


@dataclasses.dataclass(frozen=True)
class LaunchFailed:
    """The launch is over without a replica.

    Attributes:
        message: what the provisioner said.
        cause: whose fault, as reported.
        capacity: the zone had no (spot) capacity.
        refused: the provisioner refused the request itself (a permanent gRPC error).
        cancelled: cancelled at the provisioner by someone else.
    """

    message: str
    cause: Cause = Cause.UNSPECIFIED
    capacity: bool = False
    refused: bool = False
    cancelled: bool = False


@dataclasses.dataclass(frozen=True)
class AppExited:
    """The provisioner saw the app exit."""

    code: int
    cause: Cause = Cause.UNSPECIFIED


@dataclasses.dataclass(frozen=True)
class Gone:
    """The replica vanished, or was preempted, without a teardown of ours; `message` is the
    provisioner's word on how (for the failure reason)."""

    preempted: bool = False
    message: str = ""


@dataclasses.dataclass(frozen=True)
class Probed:
    """A probe result. `informative` False (the prober could not probe, or the target was
    invalid) says nothing about the replica: never a failure."""

    ready: bool
    time: float
    error: str = ""
    http_code: int = 0
    informative: bool = True


@dataclasses.dataclass(frozen=True)
class TeardownAsked:
    """Someone decided this replica goes: a scale-down, the user, a service deletion."""

    drain_s: float = 0.0
    keep_logs: bool = False
    scale_down: bool = False
    purge: bool = False
    reason: str = "asked"


@dataclasses.dataclass(frozen=True)
class TeardownRunning:
    """The provisioner started the teardown."""


@dataclasses.dataclass(frozen=True)
class TeardownFinished:
    """The teardown is over: the replica is gone (`ok`), or could not be removed."""

    ok: bool
    message: str = ""


Event = (
    LaunchProvisioning
    | LaunchAttemptFailed
    | LaunchRunning
    | LaunchFailed
    | AppExited
    | Gone
    | Probed
    | TeardownAsked
    | TeardownRunning
    | TeardownFinished
)


# ---- actions -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CancelLaunch:
    """Stop following (and cancel) the replica's launch."""


@dataclasses.dataclass(frozen=True)
class StartTeardown:
    """Tear the replica down after `drain_s`; keep its logs if `keep_logs`; `reason` says why."""

    drain_s: float
    keep_logs: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class MarkZone:
    """Spot placer bookkeeping: the replica's zone worked, or failed or preempted it."""

    preempted: bool


@dataclasses.dataclass(frozen=True)
class Failed:
    """A failure for the service-level rules: the stop rule and the launch pause (`failures`)."""

    failure: Failure


@dataclasses.dataclass(frozen=True)
class LaunchSucceeded:
    """A launch reached RUNNING: the launch backoff resets."""


Action = CancelLaunch | StartTeardown | MarkZone | Failed | LaunchSucceeded

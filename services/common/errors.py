"""Domain errors. Plain Python: domain code raises these, one interceptor maps them to gRPC."""

from __future__ import annotations

import dataclasses

MAX_LISTED_VIOLATIONS = 10
"""Violations named in an error's message and details; the rest are only counted, so a request
with thousands of bad entries still gets a small INVALID_ARGUMENT (statuses travel in a trailer)."""


@dataclasses.dataclass(frozen=True)
class FieldViolation:
    """One bad field: `field` is a dotted path such as `service.replica_policy.max_replicas`."""

    field: str
    description: str


class ReplicaplaneError(Exception):
    """Base of every error the API reports on purpose.

    Attributes:
        reason: UPPER_SNAKE_CASE machine-readable reason (AIP-193 ErrorInfo.reason).
        metadata: values named in the message, for clients that branch on them.
    """

    reason = "ERROR"

    def __init__(self, message: str, *, reason: str | None = None, **metadata: object) -> None:
        super().__init__(message)
        self.message = message
        if reason:
            self.reason = reason
        self.metadata = {k: str(v) for k, v in metadata.items()}


class ValidationError(ReplicaplaneError):
    """Bad input. Carries every violation found, not just the first."""

    reason = "INVALID_ARGUMENT"

    def __init__(self, violations: list[FieldViolation], *, subject: str = "request") -> None:
        self.violations = list(violations)
        listed = self.violations[:MAX_LISTED_VIOLATIONS]
        lines = "; ".join(f"{v.field}: {v.description}" for v in listed)
        if len(self.violations) > len(listed):
            lines += f"; and {len(self.violations) - len(listed)} more ({len(self.violations)} violations)"
        super().__init__(f"invalid {subject}: {lines}")


class NotFoundError(ReplicaplaneError):
    """The named resource does not exist."""

    reason = "NOT_FOUND"


class AlreadyExistsError(ReplicaplaneError):
    """A resource with that name already exists."""

    reason = "ALREADY_EXISTS"


class FailedPreconditionError(ReplicaplaneError):
    """The resource is not in a state that allows the call; wait for it to change."""

    reason = "FAILED_PRECONDITION"

    def __init__(
        self, message: str, *, reason: str | None = None, subject: str = "", type_: str = "STATE", **metadata: object
    ) -> None:
        super().__init__(message, reason=reason, **metadata)
        self.subject = subject
        self.type_ = type_


class ResourceExhaustedError(ReplicaplaneError):
    """A limit was reached: a quota of the server (free some of it, or raise the limit), or of the
    caller's own use (a watch fell too far behind, for one).

    Attributes:
        subject: for a quota, the request field that asks for too much, such as `service.replicas`.
        limit_name: for a quota, the setting that sets the limit, such as `max_replicas_total`
            ("" for other limits: no QuotaFailure detail then).
        limit: its value.
    """

    reason = "RESOURCE_EXHAUSTED"

    def __init__(
        self,
        message: str,
        *,
        subject: str = "",
        limit_name: str = "",
        limit: int = 0,
        reason: str | None = None,
        **metadata: object,
    ) -> None:
        quota: dict[str, object] = {"field": subject, "limit_name": limit_name, "limit": limit} if limit_name else {}
        super().__init__(message, reason=reason, **quota, **metadata)
        self.subject = subject
        self.limit_name = limit_name
        self.limit = limit


class AbortedError(ReplicaplaneError):
    """A concurrent change won; redo the read-modify-write."""

    reason = "ABORTED"


class UnavailableError(ReplicaplaneError):
    """A dependency is down or timed out; retry the call."""

    reason = "UNAVAILABLE"


class StartupError(RuntimeError):
    """A service cannot start: the message names the setting or resource at fault (a port in
    use, an address of another host). A user's mistake, not a bug, so it is reported in one line
    without a traceback (logs.setup)."""


def require(violations: list[FieldViolation], *, subject: str = "request") -> None:
    """Raise ValidationError if any violation was collected."""
    if violations:
        raise ValidationError(violations, subject=subject)

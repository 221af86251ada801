"""Load reports from balancers: applied exactly once, and placed in time without a shared clock.

A balancer that names itself (`balancer_id`) numbers its reports and sends a report it got no
answer for again, unchanged, with the same number; the ledger keeps the last number applied from
each balancer, so a resend, or a late copy of an older report, counts nothing. Requests carry
their age when the report was sent, and land at the controller's clock minus that age, so a
balancer whose clock is minutes off still reports the right load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from services.controller.domain import autoscaler

MAX_BALANCERS = 64
"""Balancers remembered per service, the most recently seen; beyond this the oldest is forgotten
(a balancer that restarts takes a new id, so ids of dead balancers pile up otherwise)."""


@dataclasses.dataclass(frozen=True)
class Report:
    """One load report as plain values (already validated)."""

    balancer_id: str = ""
    """Empty for a sender without identity: its reports are applied every time they arrive."""
    sequence: int = 0
    ages: Sequence[float] = ()
    """Seconds between each request's arrival and the sending of the report."""
    times: Sequence[float] = ()
    """Legacy arrival times on the sender's clock (POSIX seconds)."""
    count: int = 0
    """Requests without a time, counted when the report arrives."""


@dataclasses.dataclass(frozen=True)
class Applied:
    """The load window and ledger after a report, and what the report added."""

    window: dict[int, int]
    ledger: dict[str, int]
    counted: int
    """Requests of the report that landed in the window."""
    already_applied: bool
    """The report (or a later one from its balancer) was applied before; nothing changed."""


def already_applied(ledger: Mapping[str, int], balancer_id: str, sequence: int) -> bool:
    """Whether a report numbered `sequence` from `balancer_id` was applied before."""
    if not balancer_id:
        return False
    last = ledger.get(balancer_id)
    return last is not None and sequence <= last


def remember(
    ledger: Mapping[str, int], balancer_id: str, sequence: int, *, capacity: int = MAX_BALANCERS
) -> dict[str, int]:
    """The ledger after applying `sequence` from `balancer_id`, in order of last report (oldest
    first), keeping the `capacity` most recent balancers."""
    out = {b: s for b, s in ledger.items() if b != balancer_id}
    out[balancer_id] = sequence
    for gone in list(out)[: max(len(out) - capacity, 0)]:
        del out[gone]
    return out


def arrivals(report: Report, now: float) -> list[float]:
    """Arrival times on the controller's clock (`now`).

    An age is subtracted from `now`. A legacy time is the sender's clock; one ahead of `now` is
    taken as `now` (the sender's clock runs ahead; the request did arrive). One behind `now` cannot
    be told from an old request and is taken as it is.
    """
    return [now - age for age in report.ages] + [min(t, now) for t in report.times]


def apply(
    window: Mapping[int, int],
    ledger: Mapping[str, int],
    report: Report,
    now: float,
    *,
    window_s: float,
    capacity: int = MAX_BALANCERS,
) -> Applied:
    """Count a report into the per-second load window unless it was applied before.

    Args:
        window: second -> request count (not changed).
        ledger: balancer id -> last sequence applied (not changed).
        report: the report.
        now: the controller's clock.
        window_s: the window length; older requests count nothing.
        capacity: balancers the ledger keeps.
    """
    if already_applied(ledger, report.balancer_id, report.sequence):
        return Applied(dict(window), dict(ledger), 0, already_applied=True)
    new_window = dict(window)
    counted = autoscaler.add_load(new_window, arrivals(report, now), report.count, now, window_s=window_s)
    new_ledger = (
        remember(ledger, report.balancer_id, report.sequence, capacity=capacity) if report.balancer_id else dict(ledger)
    )
    return Applied(new_window, new_ledger, counted, already_applied=False)

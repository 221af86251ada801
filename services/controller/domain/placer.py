"""Spot placer `dynamic_fallback` (spec.md section 8): which zone a spot replica launches in.

Zones are ACTIVE or PREEMPTIVE. A launch goes to the cheapest ACTIVE zone no other spot replica
uses (else the cheapest ACTIVE zone); a capacity failure or a preemption marks its zone
PREEMPTIVE and a successful launch marks it ACTIVE; when fewer than 2 zones would stay ACTIVE,
every zone is ACTIVE again.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

ACTIVE = "ACTIVE"
PREEMPTIVE = "PREEMPTIVE"


def select(zones: Sequence[tuple[str, float]], marks: Mapping[str, str], used: Collection[str]) -> str:
    """The zone for the next spot launch, or "" when no zone is known (the backend picks).

    Args:
        zones: (name, hourly price) of every zone.
        marks: zone -> ACTIVE or PREEMPTIVE; zones not in it are ACTIVE.
        used: zones of the other live spot replicas.
    """
    active = [z for z in zones if marks.get(z[0], ACTIVE) == ACTIVE] or list(zones)
    free = [z for z in active if z[0] not in used] or active
    if not free:
        return ""
    return min(free, key=lambda z: z[1])[0]


def mark(zones: Sequence[tuple[str, float]], marks: Mapping[str, str], zone: str, *, preempted: bool) -> dict[str, str]:
    """The marks after a launch success (`preempted` False) or a failure/preemption in `zone`."""
    out = {name: marks.get(name, ACTIVE) for name, _ in zones}
    if zone not in out:
        return out
    out[zone] = PREEMPTIVE if preempted else ACTIVE
    if sum(1 for v in out.values() if v == ACTIVE) < 2:
        out = dict.fromkeys(out, ACTIVE)
    return out

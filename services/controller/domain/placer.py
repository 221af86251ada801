"""Spot placer `dynamic_fallback` (spec.md section 8): which zone a spot replica launches in.

Zones are ACTIVE or PREEMPTIVE. A launch goes to the cheapest ACTIVE zone no other spot replica
uses (else the cheapest ACTIVE zone); a capacity failure or a preemption marks its zone
PREEMPTIVE and a successful launch marks it ACTIVE; when fewer than 2 zones would stay ACTIVE,
every zone is ACTIVE again.

A spec's `resources.zone` / `resources.region` (per any_of/ordered entry) narrow the zones a
replica may use, spot or on-demand, as SkyPilot filters its candidate locations. Zones carry no
region here, so a zone is in a region when its name starts with the region's (cloud naming:
`us-east-1a` is in `us-east-1`, `us-central1-a` in `us-central1`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

ACTIVE = "ACTIVE"
PREEMPTIVE = "PREEMPTIVE"


Place = tuple[str, str]
"""(zone, region) one resources alternative asks for; empty strings place no limit."""


def in_place(zone_name: str, place: Place) -> bool:
    """Whether zone `zone_name` satisfies one alternative's zone and region."""
    zone, region = place
    return (not zone or zone_name == zone) and (not region or zone_name.startswith(region))


def allowed(zones: Sequence[tuple[str, float]], places: Sequence[Place]) -> list[tuple[str, float]]:
    """The zones a replica may launch in: those some alternative accepts (all when one is open)."""
    if not places or any(place == ("", "") for place in places):
        return list(zones)
    return [z for z in zones if any(in_place(z[0], place) for place in places)]


def fixed_zone(zones: Sequence[tuple[str, float]], places: Sequence[Place]) -> str:
    """The zone of a launch the placer does not steer (on-demand, or spot without a placer).

    Unconstrained: "" (the backend picks, as SkyPilot's optimizer does). Constrained: the
    cheapest allowed zone; with zones unknown (or none allowed), the first zone the spec names,
    so the backend places it there or refuses.
    """
    if not places or any(place == ("", "") for place in places):
        return ""
    fits = allowed(zones, places)
    if fits:
        return min(fits, key=lambda z: z[1])[0]
    return next((zone for zone, _ in places if zone), "")


def problems(zones: Sequence[tuple[str, float]], places: Sequence[tuple[str, Place]]) -> list[tuple[str, str]]:
    """(field, description) for every alternative no known zone satisfies.

    Args:
        zones: the provisioner's zones; none known means nothing to check against.
        places: (YAML path of the resources alternative, its place).
    """
    if not zones:
        return []
    names = [name for name, _ in zones]
    have = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    out: list[tuple[str, str]] = []
    for path, (zone, region) in places:
        if zone and zone not in names:
            why = f"the provisioner has no zone {zone!r} (it has: {have}); {_zones_hint(zone)}"
            out.append((f"{path}.zone", why))
        elif region and not any(in_place(name, (zone, region)) for name in names):
            if zone:
                why = f"zone {zone!r} is not in region {region!r} (a zone's name starts with its region's)"
            else:
                why = (
                    f"no zone of the provisioner is in region {region!r} (it has: {have}); {_zones_hint(region + '-a')}"
                )
            out.append((f"{path}.region", why))
    return out


def _zones_hint(zone: str) -> str:
    # Only a local provisioner lists zones, and they are simulated: say how to have this one.
    # Short: a violation's description is clipped at 240 characters.
    return f"to run this here: REPLICAPLANE_PROVISIONER_ZONES={zone}:1.00 (its zones setting, name:price,...)"


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


def launch_zone(
    zones: Sequence[tuple[str, float]],
    places: Sequence[Place],
    *,
    spot: bool,
    spot_placer: bool,
    marks: Mapping[str, str],
    used: Collection[str],
) -> str:
    """The zone a new replica launches in ("" lets the backend pick).

    A spot replica of a service with the placer goes where `select` says among the allowed
    zones (the spec's zone when no zone is known). As SkyPilot, on-demand replicas and spot ones
    without a placer go where the spec allows and the backend prefers (`fixed_zone`); they
    neither avoid nor count as the placer's zones.

    Args:
        zones: (name, hourly price) of the provisioner's zones.
        places: the latest version's resources alternatives.
        spot: the replica is spot.
        spot_placer: the latest version uses `dynamic_fallback`.
        marks: the placer's marks.
        used: zones of the live spot replicas.
    """
    if spot and spot_placer:
        return select(allowed(zones, places), marks, used) or fixed_zone(zones, places)
    return fixed_zone(zones, places)

"""Simulated placement zones with prices and launch refusal windows (a test and chaos tool)."""

from __future__ import annotations

import dataclasses

from services.common import errors
from services.provisioner import model

DEFAULT_ZONES = "zone-a:1.00,zone-b:1.20,zone-c:1.50"
MAX_REFUSAL_S = 365 * 86400.0


def parse(text: str) -> list[model.Zone]:
    """Parse zones written as `name:price,name:price`, for example "zone-a:1.00,zone-b:1.20".

    Args:
        text: the zones setting.

    Returns:
        The zones, cheapest first (ties keep their written order).

    Raises:
        errors.ValidationError: a malformed entry, a negative price or a duplicate name.
    """
    zones: list[model.Zone] = []
    violations: list[errors.FieldViolation] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, price_text = entry.partition(":")
        name = name.strip()
        try:
            price = float(price_text) if sep else 0.0
        except ValueError:
            violations.append(errors.FieldViolation("zones", f"{entry!r}: price is not a number"))
            continue
        if not name or price < 0:
            violations.append(errors.FieldViolation("zones", f"{entry!r}: expected name:price with price >= 0"))
        elif any(z.name == name for z in zones):
            violations.append(errors.FieldViolation("zones", f"{name!r} is listed twice"))
        else:
            zones.append(model.Zone(name=name, price_per_hour=price))
    if not zones and not violations:
        violations.append(errors.FieldViolation("zones", "at least one zone is needed"))
    errors.require(violations, subject="zones setting")
    return sorted(zones, key=lambda z: z.price_per_hour)


class NoCapacityError(Exception):
    """No zone (or not the asked one) accepts launches now."""


class UnknownZoneError(Exception):
    """The asked zone does not exist."""


class ZoneTable:
    """The zones of a backend and their refusal windows; in memory only."""

    def __init__(self, zones: list[model.Zone]) -> None:
        self._zones = {z.name: z for z in sorted(zones, key=lambda z: z.price_per_hour)}

    def list(self) -> list[model.Zone]:
        """Zones, cheapest first."""
        return list(self._zones.values())

    def get(self, name: str) -> model.Zone:
        """The zone called `name`.

        Raises:
            errors.NotFoundError: no such zone.
        """
        zone = self._zones.get(name)
        if zone is None:
            raise errors.NotFoundError(f"zone {name!r} not found", reason="ZONE_NOT_FOUND", zone=name)
        return zone

    def pick(self, requested: str, now: float) -> model.Zone:
        """The zone a launch goes to: `requested`, or the cheapest accepting zone when empty.

        Raises:
            UnknownZoneError: `requested` is not a zone.
            NoCapacityError: the zone refuses launches, or every zone does.
        """
        if requested:
            zone = self._zones.get(requested)
            if zone is None:
                raise UnknownZoneError(f"zone {requested!r} does not exist")
            if zone.refusing(now):
                raise NoCapacityError(f"zone {requested} has no capacity (refusing launches)")
            return zone
        for zone in self._zones.values():
            if not zone.refusing(now):
                return zone
        raise NoCapacityError("no zone has capacity (every zone refuses launches)")

    def set_refusal(self, name: str, refuse_for_s: float, now: float) -> model.Zone:
        """Make zone `name` refuse launches for `refuse_for_s` seconds; 0 accepts again.

        Raises:
            errors.NotFoundError: no such zone.
            errors.ValidationError: a negative duration.
        """
        if refuse_for_s < 0:
            raise errors.ValidationError([errors.FieldViolation("refuse_for", "must not be negative")])
        if refuse_for_s > MAX_REFUSAL_S:
            raise errors.ValidationError(
                [errors.FieldViolation("refuse_for", f"must be at most {MAX_REFUSAL_S:.0f} s (one year)")]
            )
        zone = dataclasses.replace(self.get(name), refuse_until=now + refuse_for_s if refuse_for_s else 0.0)
        self._zones[name] = zone
        return zone

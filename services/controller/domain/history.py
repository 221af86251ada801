"""Which version a rollback goes back to."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

# Outcome values match replicaplane.controller.v1.VersionOutcome.
ACTIVE = 1
SUPERSEDED = 2
ROLLED_BACK = 3
FAILED = 4


@dataclasses.dataclass(frozen=True)
class Kept:
    """A version in the history: its number and outcome."""

    version: int
    outcome: int


class NoTarget(Exception):
    """There is no version to go back to; the message says why."""


def rollback_target(history: Sequence[Kept], latest: int, to: int = 0) -> int:
    """The version a rollback restores.

    Args:
        history: the kept versions.
        latest: the service's latest version.
        to: the version asked for; 0 for the newest version before the latest that was neither
            rolled back nor failed (the one that served before).

    Raises:
        NoTarget: `to` is the latest version or not kept, or nothing qualifies.
    """
    kept = {k.version: k for k in history}
    if to:
        if to == latest:
            raise NoTarget(f"version {to} is the latest version already")
        if to not in kept or to > latest:
            raise NoTarget(f"version {to} is not in the history (kept: {_listed(kept)})")
        return to
    for k in sorted(history, key=lambda k: -k.version):
        if k.version < latest and k.outcome not in (ROLLED_BACK, FAILED):
            return k.version
    raise NoTarget("no earlier version that served to go back to")


def _listed(kept: dict[int, Kept]) -> str:
    versions = sorted(kept)
    if not versions:
        return "none"
    return f"{versions[0]}..{versions[-1]}" if len(versions) > 2 else ", ".join(map(str, versions))

"""A service's event log, as Kubernetes Events: bounded, with repeats counted in one entry.

`EventLog` is plain data: it numbers entries, folds a repeat of a recent entry (same type,
reason, object and message within `AGGREGATE_S`) into it, and forgets the oldest beyond its
bound. `replica_change` and `service_change` say which event a published change is, from plain
values, so the rules are table-tested without a controller.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import re

KEPT = 500
"""Entries kept per service."""
AGGREGATE_S = 600.0
"""A repeat within this long of the entry's last occurrence is counted in it (Kubernetes: 10 min)."""


class EventType(enum.IntEnum):
    """Values match replicaplane.controller.v1.EventType."""

    NORMAL = 1
    WARNING = 2


@dataclasses.dataclass(frozen=True)
class Draft:
    """An event before it is numbered."""

    type: EventType
    reason: str
    message: str
    object: str = "service"

    @property
    def key(self) -> tuple[int, str, str, str]:
        """What makes two occurrences the same event."""
        return (int(self.type), self.reason, self.object, self.message)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One numbered entry of the log."""

    sequence: int
    draft: Draft
    count: int
    first_time: float
    last_time: float


class EventLog:
    """One service's entries, oldest first, at most `kept`."""

    def __init__(self, entries: list[Entry] | None = None, *, kept: int = KEPT) -> None:
        self.kept = kept
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self._by_key: dict[tuple[int, str, str, str], int] = {}
        self.last_sequence = 0
        for e in sorted(entries or [], key=lambda e: e.sequence)[-kept:]:
            self._put(e)

    def _put(self, entry: Entry) -> None:
        self._entries[entry.sequence] = entry
        self._by_key[entry.draft.key] = entry.sequence
        self.last_sequence = max(self.last_sequence, entry.sequence)

    def record(self, draft: Draft, now: float) -> tuple[Entry, int | None]:
        """Add an occurrence.

        Returns:
            The new or updated entry (always under a new, higher sequence), and the sequence of
            the entry it replaces when it counted a repeat (None for a new entry).
        """
        replaced: int | None = None
        previous = self._entries.get(self._by_key.get(draft.key, -1))
        self.last_sequence += 1
        if previous is not None and now - previous.last_time <= AGGREGATE_S:
            replaced = previous.sequence
            del self._entries[replaced]
            entry = Entry(self.last_sequence, draft, previous.count + 1, previous.first_time, now)
        else:
            entry = Entry(self.last_sequence, draft, 1, now, now)
        self._put(entry)
        while len(self._entries) > self.kept:
            _, oldest = self._entries.popitem(last=False)
            if self._by_key.get(oldest.draft.key) == oldest.sequence:
                del self._by_key[oldest.draft.key]
        return entry, replaced

    def entries(self, after: int = 0) -> list[Entry]:
        """Entries with a sequence above `after`, oldest first."""
        return [e for s, e in self._entries.items() if s > after]

    def __len__(self) -> int:
        return len(self._entries)


# ---- which event a change is ---------------------------------------------------------------

_FAILED = frozenset(
    {"FAILED", "FAILED_CLEANUP", "FAILED_INITIAL_DELAY", "FAILED_PROBING", "FAILED_PROVISION", "UNKNOWN"}
)


def replica_change(
    replica_id: int, version: int, before: str | None, after: str | None, *, failure_reason: str = ""
) -> Draft | None:
    """The event of a replica's status change, or None for a change not worth an entry.

    Args:
        replica_id: the replica.
        version: the version it runs.
        before: its status name before (`READY`), None when the record is new.
        after: its status name now, None when the record was removed.
        failure_reason: why it failed, for failed statuses.
    """
    obj = f"replica/{replica_id}"
    if after == before:
        return None
    if after is None:
        return Draft(EventType.NORMAL, "ReplicaRemoved", f"replica {replica_id} (version {version}) removed", obj)
    if before is None and after in ("PENDING", "PROVISIONING", "STARTING"):
        return Draft(EventType.NORMAL, "ReplicaLaunching", f"launching replica {replica_id} (version {version})", obj)
    if after == "READY":
        again = " again" if before == "NOT_READY" else ""
        return Draft(EventType.NORMAL, "ReplicaReady", f"replica {replica_id} (version {version}) is ready{again}", obj)
    if after == "NOT_READY":
        return Draft(EventType.WARNING, "ReplicaNotReady", f"replica {replica_id} failed a readiness probe", obj)
    if after in _FAILED:
        why = f": {failure_reason}" if failure_reason else ""
        return Draft(
            EventType.WARNING,
            "ReplicaFailed",
            f"replica {replica_id} (version {version}) {after.lower().replace('_', ' ')}{why}",
            obj,
        )
    if after == "PREEMPTED":
        return Draft(EventType.WARNING, "ReplicaPreempted", f"replica {replica_id} was preempted", obj)
    if after == "SHUTTING_DOWN" and before not in _FAILED:
        return Draft(EventType.NORMAL, "ReplicaTerminating", f"tearing down replica {replica_id}", obj)
    return None


# Status messages that only count replicas: the replica events say the same, one by one.
_ROUTINE = re.compile(r"^(\d+/\d+ ready\b.*|shutting down: \d+ replica\(s\) left)$")


def service_change(
    *,
    before_message: str,
    after_message: str,
    before_target: int | None,
    after_target: int,
    decision: str,
) -> list[Draft]:
    """Events of a service-level change: a new status message, a new autoscaler target."""
    out = []
    if after_message and after_message != before_message and not _ROUTINE.match(after_message):
        warning = after_message.startswith(("scaling stopped", "launches paused"))
        kind = EventType.WARNING if warning else EventType.NORMAL
        out.append(Draft(kind, "StatusChanged", after_message))
    if before_target is not None and after_target != before_target:
        why = f": {decision}" if decision else ""
        out.append(Draft(EventType.NORMAL, "TargetChanged", f"target replicas {before_target} -> {after_target}{why}"))
    return out

"""The dashboard's picture of the fleet: services, replicas with their status history, and recent
events, built from the controller's watch changes. Plain Python, no gRPC: the bridge converts
each WatchService message into a `Change` and the page receives the dicts made here as JSON.

Times are milliseconds since the epoch on the dashboard's clock, except the replica timestamps
the controller reports, which only seed the history of a replica first seen in a snapshot.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

# Lifecycle order, for reading a replica's past from its timestamps.
_RANK = {"PENDING": 0, "PROVISIONING": 1, "STARTING": 2, "READY": 3, "NOT_READY": 4}
_TERMINAL_RANK = 5
_STREAK = {"NOT_READY", "FAILED_PROBING"}
_HAS_ENDPOINT = {"STARTING", "READY", "NOT_READY"}
_FAILED = {
    "FAILED",
    "FAILED_CLEANUP",
    "FAILED_INITIAL_DELAY",
    "FAILED_PROBING",
    "FAILED_PROVISION",
    "PREEMPTED",
    "UNKNOWN",
}
_SERVICE_FAILED = {"FAILED", "FAILED_CLEANUP", "CONTROLLER_FAILED"}


@dataclasses.dataclass
class ReplicaInfo:
    """One replica as the controller reports it."""

    replica_id: int
    status: str
    version: int = 0
    endpoint: str = ""
    failure_reason: str = ""
    zone: str = ""
    is_spot: bool = False
    create_ms: int | None = None
    launch_ms: int | None = None
    first_ready_ms: int | None = None
    streak_start_ms: int | None = None
    """First failure of the current failure streak of a once-ready replica."""


@dataclasses.dataclass
class ServiceInfo:
    """One service as the controller reports it."""

    name: str
    status: str
    uid: str = ""
    message: str = ""
    ready: int = 0
    total: int = 0
    target: int = 0
    active_versions: list[int] = dataclasses.field(default_factory=list)
    latest_version: int = 0
    load_balancer_url: str = ""
    endpoints: list[str] = dataclasses.field(default_factory=list)
    probing_stale: bool = False
    autoscaler: dict[str, Any] = dataclasses.field(default_factory=dict)
    create_ms: int | None = None
    uptime_start_ms: int | None = None


@dataclasses.dataclass
class Change:
    """One WatchService message."""

    service: ServiceInfo
    replicas: list[ReplicaInfo] = dataclasses.field(default_factory=list)
    removed: list[int] = dataclasses.field(default_factory=list)
    snapshot: bool = False
    """Every replica of the service is listed; those not listed are gone."""
    deleted: bool = False


@dataclasses.dataclass
class _Row:
    service: str
    uid: str
    info: ReplicaInfo
    history: list[dict[str, Any]]
    removed_ms: int | None = None

    @property
    def key(self) -> str:
        return f"{self.service}/{self.uid}/{self.info.replica_id}"


def inferred_history(info: ReplicaInfo, now_ms: int) -> list[dict[str, Any]]:
    """The status history of a replica first seen now, read from its timestamps.

    Creation starts PROVISIONING (a PENDING spell is usually brief and leaves no timestamp), the
    launch STARTING, the first passed probe READY, and for a replica failing probes the start of
    its failure streak NOT_READY; only steps before the current status count. A current status no
    timestamp dates (FAILED, SHUTTING_DOWN, ...) starts now. Entries read from timestamps are
    marked `inferred`: what happened between them is unknown.
    """
    rank = _RANK.get(info.status, _TERMINAL_RANK)
    dated: list[tuple[str, int | None]] = [
        ("PROVISIONING", info.create_ms),
        ("STARTING", info.launch_ms),
        ("READY", info.first_ready_ms),
    ]
    if info.status in _STREAK:
        dated.append(("NOT_READY", info.streak_start_ms))
    history: list[dict[str, Any]] = []
    last = 0
    for status, at in dated:
        if status == "PROVISIONING" and info.status == "PENDING":
            status = "PENDING"
        if at is None or _RANK[status] > rank:
            continue
        since = min(max(at, last), now_ms)  # another machine's clock: keep the order, never the future
        history.append({"status": status, "since": since, "inferred": True})
        last = since
    if not history or history[-1]["status"] != info.status:
        history.append({"status": info.status, "since": now_ms, "inferred": False})
    return history


class Fleet:
    """Services and replicas as the dashboard last heard of them, and what happened recently."""

    def __init__(
        self,
        *,
        max_history: int = 100,
        max_events: int = 500,
        max_removed: int = 500,
        keep_removed_ms: int = 3_600_000,
    ) -> None:
        self.max_history = max_history
        self.max_removed = max_removed
        self.keep_removed_ms = keep_removed_ms
        self.services: dict[str, ServiceInfo] = {}
        self._rows: dict[tuple[str, str, int], _Row] = {}
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_events)

    # ---- reading ----------------------------------------------------------------------------

    def snapshot(self, now_ms: int) -> dict[str, Any]:
        """Everything, for a page that just connected."""
        self._prune(now_ms)
        return {
            "services": [service_dict(self.services[n]) for n in sorted(self.services)],
            "replicas": [self._row_dict(r) for r in self._sorted_rows()],
            "events": list(self._events),
        }

    # ---- changes ----------------------------------------------------------------------------

    def apply(self, change: Change, now_ms: int) -> dict[str, Any]:
        """Apply one watch message.

        Returns:
            What changed, for the pages: `service` (or None), `deleted` (the name, or None),
            `replicas` (changed rows), `events` (new events).
        """
        svc = change.service
        events: list[dict[str, Any]] = []
        touched: dict[tuple[str, str, int], _Row] = {}
        known = self.services.get(svc.name)
        if known is not None and svc.uid != known.uid:
            # Deleted and created again while the watch was away: the old rows ended.
            self._end_rows(svc.name, now_ms, touched, uid=known.uid)
            known = None
        counts = f"({svc.ready}/{svc.total} ready)"
        gone = set(change.removed)
        if change.snapshot:  # every replica is listed: the ones we had and it lacks are gone
            listed = {r.replica_id for r in change.replicas}
            gone |= {k[2] for k in self._rows if k[:2] == (svc.name, svc.uid) and k[2] not in listed}
        for replica_id in sorted(gone):
            key = (svc.name, svc.uid, replica_id)
            old = self._rows.get(key)
            if old is not None and old.removed_ms is None:
                old.removed_ms = now_ms
                touched[key] = old
                text = f"replica {replica_id} removed {counts}"
                events.append(self._event(now_ms, svc.name, replica_id, "REMOVED", text))
        for info in sorted(change.replicas, key=lambda r: r.replica_id):
            key = (svc.name, svc.uid, info.replica_id)
            row, changed = self._update_row(key, info, now_ms)
            touched[key] = row
            if changed:
                events.append(self._replica_event(svc.name, info, counts, now_ms))
        deleted = None
        if change.deleted:
            deleted = svc.name
            self._end_rows(svc.name, now_ms, touched)
            self.services.pop(svc.name, None)
            events.append(self._event(now_ms, svc.name, None, "DELETED", "deleted"))
        else:
            events += self._service_events(known, svc, now_ms)
            self.services[svc.name] = svc
        self._events.extend(events)
        self._prune(now_ms)
        return {
            "service": None if deleted else service_dict(svc),
            "deleted": deleted,
            "replicas": [self._row_dict(r) for r in touched.values()],
            "events": events,
        }

    def _update_row(self, key: tuple[str, str, int], info: ReplicaInfo, now_ms: int) -> tuple[_Row, bool]:
        """The replica's row with `info` applied, and whether its status changed (or it is new)."""
        row = self._rows.get(key)
        if row is None or row.removed_ms is not None:
            row = _Row(key[0], key[1], info, inferred_history(info, now_ms))
            self._rows[key] = row
            return row, True
        changed = row.info.status != info.status
        if changed:
            row.history.append({"status": info.status, "since": now_ms, "inferred": False})
            del row.history[: -self.max_history]
        row.info = info
        return row, changed

    def forget(self, name: str, now_ms: int) -> dict[str, Any] | None:
        """The service is gone without a last message (NOT_FOUND): as if it was deleted.

        Returns:
            What changed (as apply() says it), or None if the service was not known.
        """
        known = self.services.get(name)
        if known is None:
            return None
        return self.apply(Change(service=known, deleted=True), now_ms)

    # ---- helpers ----------------------------------------------------------------------------

    def _end_rows(
        self, name: str, now_ms: int, touched: dict[tuple[str, str, int], _Row], uid: str | None = None
    ) -> None:
        for key, row in self._rows.items():
            if key[0] == name and (uid is None or key[1] == uid) and row.removed_ms is None:
                row.removed_ms = now_ms
                touched[key] = row

    def _sorted_rows(self) -> list[_Row]:
        return sorted(self._rows.values(), key=lambda r: (r.service, r.info.create_ms or 0, r.uid, r.info.replica_id))

    def _prune(self, now_ms: int) -> None:
        removed = sorted(
            ((row.removed_ms, key) for key, row in self._rows.items() if row.removed_ms is not None),
            reverse=True,
        )
        for i, (at, key) in enumerate(removed):
            if i >= self.max_removed or now_ms - at > self.keep_removed_ms:
                del self._rows[key]

    def _row_dict(self, row: _Row) -> dict[str, Any]:
        info = row.info
        return {
            "key": row.key,
            "service": row.service,
            "id": info.replica_id,
            "version": info.version,
            "status": info.status,
            "endpoint": info.endpoint,
            "failure_reason": info.failure_reason,
            "zone": info.zone,
            "spot": info.is_spot,
            "created": info.create_ms,
            "launched": info.launch_ms,
            "ready_since": info.first_ready_ms,
            "removed": row.removed_ms,
            "history": list(row.history),
        }

    def _event(self, now_ms: int, service: str, replica_id: int | None, status: str, text: str) -> dict[str, Any]:
        if status in _FAILED or (replica_id is None and status in _SERVICE_FAILED):
            level = "error"
        elif status in ("NOT_READY", "SHUTTING_DOWN", "NO_REPLICA", "REMOVED", "DELETED"):
            level = "warning"
        else:
            level = "info"
        return {
            "t": now_ms,
            "service": service,
            "replica_id": replica_id,
            "status": status,
            "level": level,
            "text": f"{service}: {text}",
        }

    def _replica_event(self, name: str, info: ReplicaInfo, counts: str, now_ms: int) -> dict[str, Any]:
        text = f"replica {info.replica_id} {info.status}"
        if info.status in _HAS_ENDPOINT and info.endpoint:
            text += f" at {info.endpoint}"
        if info.status in _FAILED and info.failure_reason:
            text += f" ({info.failure_reason})"
        return self._event(now_ms, name, info.replica_id, info.status, f"{text} {counts}")

    def _service_events(self, known: ServiceInfo | None, svc: ServiceInfo, now_ms: int) -> list[dict[str, Any]]:
        events = []
        versions = ",".join(str(v) for v in svc.active_versions) or "-"
        if known is not None and svc.latest_version > known.latest_version:
            events.append(self._event(now_ms, svc.name, None, "UPDATED", f"version {svc.latest_version} created"))
        if known is None or known.status != svc.status:
            text = f"service {svc.status} ({svc.ready}/{svc.total} ready, versions {versions})"
            if svc.message:
                text += f": {svc.message}"
            events.append(self._event(now_ms, svc.name, None, svc.status, text))
        elif known.active_versions != svc.active_versions:
            events.append(self._event(now_ms, svc.name, None, "VERSIONS", f"versions {versions} take traffic"))
        if svc.load_balancer_url and (known is None or known.load_balancer_url != svc.load_balancer_url):
            text = f"endpoint {svc.load_balancer_url} (load balancer)"
            events.append(self._event(now_ms, svc.name, None, "ENDPOINT", text))
        return events


def service_dict(svc: ServiceInfo) -> dict[str, Any]:
    """A service as the page reads it."""
    return {
        "name": svc.name,
        "uid": svc.uid,
        "status": svc.status,
        "message": svc.message,
        "ready": svc.ready,
        "total": svc.total,
        "target": svc.target,
        "versions": list(svc.active_versions),
        "latest_version": svc.latest_version,
        "endpoint": svc.load_balancer_url,
        "endpoints": list(svc.endpoints),
        "probing_stale": svc.probing_stale,
        "autoscaler": dict(svc.autoscaler),
        "created": svc.create_ms,
        "uptime_since": svc.uptime_start_ms,
    }

"""The store's tables for rollouts: version history, the event log and canary rollout state.

Schema migration 6 adds them. `HistoryTables` is mixed into `store.Store`: its methods join the
store's transactions like every other store call. The statements use SQL that PostgreSQL takes
too (no `INSERT OR REPLACE`, no numbered parameters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import pbtime
from services.common import spec as spec_mod

HISTORY_KEPT = 100
"""Versions kept in a service's history; older ones are dropped (their spec with them)."""
EVENTS_KEPT = 500
"""Entries kept in a service's event log; the oldest go first."""

_NAMES_PER_QUERY = 500  # names in one IN (...) at most
_ROWS_PER_INSERT = 200  # rows in one INSERT at most (3 parameters each)


def migrate_6(db: Any) -> None:
    """Version history with outcomes, a bounded event log and canary rollout state."""
    db.execute(
        """CREATE TABLE history (
            service TEXT NOT NULL REFERENCES services(name) ON DELETE CASCADE,
            version INTEGER NOT NULL,
            spec BLOB NOT NULL,
            digest TEXT NOT NULL,
            create_time REAL NOT NULL,
            update_mode INTEGER NOT NULL DEFAULT 0,
            outcome INTEGER NOT NULL,
            reason TEXT NOT NULL DEFAULT '',
            end_time REAL,
            rollback_of INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (service, version)
        ) STRICT"""
    )
    db.execute(
        """CREATE TABLE events (
            service TEXT NOT NULL REFERENCES services(name) ON DELETE CASCADE,
            sequence INTEGER NOT NULL,
            data BLOB NOT NULL,
            PRIMARY KEY (service, sequence)
        ) STRICT"""
    )
    db.execute(
        """CREATE TABLE rollout_state (
            service TEXT PRIMARY KEY REFERENCES services(name) ON DELETE CASCADE,
            state BLOB NOT NULL
        ) STRICT"""
    )
    # Versions stored before history existed: the latest is active, the others superseded.
    rows = db.execute(
        "SELECT v.service, v.version, v.spec, s.create_time, s.latest_version "
        "FROM versions v JOIN services s ON s.name = v.service"
    ).fetchall()
    for service, version, blob, created, latest in rows:
        parsed = spec_pb2.ServiceSpec()
        parsed.ParseFromString(blob)
        active = int(version) == int(latest)
        db.execute(
            "INSERT INTO history (service, version, spec, digest, create_time, outcome, end_time) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                service,
                version,
                blob,
                spec_digest(parsed),
                float(created),
                res.VERSION_OUTCOME_ACTIVE if active else res.VERSION_OUTCOME_SUPERSEDED,
                None if active else float(created),
            ),
        )


def spec_digest(spec: spec_pb2.ServiceSpec) -> str:
    """12 hex digits of the SHA-256 of the spec with secrets redacted and its YAML text left out.

    Redacted, so a digest never helps guess a secret; without the text, so comments and
    spacing do not make two equal specs differ.
    """
    shown = spec_mod.redacted(spec, with_yaml=False)
    return hashlib.sha256(shown.SerializeToString(deterministic=True)).hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class HistoryRow:
    """One version in a service's history."""

    version: int
    spec: spec_pb2.ServiceSpec
    digest: str
    create_time: float
    update_mode: int
    outcome: int
    reason: str
    end_time: float | None
    rollback_of: int


class HistoryTables:
    """Version history, event log and rollout state methods of the store."""

    _db: Any  # the store's connection

    def transaction(self) -> contextlib.AbstractContextManager[Any]:
        """The store's transaction (see `store.Store.transaction`)."""
        raise NotImplementedError

    def _read(self) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def _history_insert(
        self, name: str, version: int, spec: spec_pb2.ServiceSpec, *, now: float, mode: int, rollback_of: int
    ) -> None:
        """Record a new version as active; the versions active before it are superseded.

        Called inside the transaction that stores the version.
        """
        self._db.execute(
            "UPDATE history SET outcome = ?, end_time = ? WHERE service = ? AND outcome = ?",
            (res.VERSION_OUTCOME_SUPERSEDED, float(now), name, res.VERSION_OUTCOME_ACTIVE),
        )
        self._db.execute("DELETE FROM history WHERE service = ? AND version = ?", (name, version))
        self._db.execute(
            "INSERT INTO history (service, version, spec, digest, create_time, update_mode, outcome, "
            "rollback_of) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                name,
                version,
                spec.SerializeToString(),
                spec_digest(spec),
                float(now),
                int(mode),
                res.VERSION_OUTCOME_ACTIVE,
                int(rollback_of),
            ),
        )
        self._db.execute(
            "DELETE FROM history WHERE service = ? AND version <= "
            "(SELECT MAX(version) FROM history WHERE service = ?) - ?",
            (name, name, HISTORY_KEPT),
        )

    def set_version_outcome(self, name: str, version: int, outcome: int, reason: str, *, now: float) -> None:
        """Record what became of a version (rolled back or failed, and why); a no-op if not kept."""
        with self.transaction():
            self._db.execute(
                "UPDATE history SET outcome = ?, reason = ?, end_time = ? WHERE service = ? AND version = ?",
                (int(outcome), reason, None if outcome == res.VERSION_OUTCOME_ACTIVE else float(now), name, version),
            )

    def note_version(self, name: str, version: int, *, mode: int, rollback_of: int = 0) -> None:
        """Record how a version was created: its update mode, and the version a rollback restores."""
        with self.transaction():
            self._db.execute(
                "UPDATE history SET update_mode = ?, rollback_of = ? WHERE service = ? AND version = ?",
                (int(mode), int(rollback_of), name, version),
            )

    def list_history(self, name: str) -> list[HistoryRow]:
        """A service's kept versions, oldest first."""
        with self._read() as db:
            rows = db.execute(
                "SELECT version, spec, digest, create_time, update_mode, outcome, reason, end_time, rollback_of "
                "FROM history WHERE service = ? ORDER BY version",
                (name,),
            ).fetchall()
        return [_history_row(r) for r in rows]

    def get_history(self, name: str, version: int) -> HistoryRow | None:
        """One version of a service's history, or None when it is not kept."""
        with self._read() as db:
            row = db.execute(
                "SELECT version, spec, digest, create_time, update_mode, outcome, reason, end_time, rollback_of "
                "FROM history WHERE service = ? AND version = ?",
                (name, version),
            ).fetchone()
        return None if row is None else _history_row(row)

    # ---- events --------------------------------------------------------------------------

    def put_events(self, name: str, events: Sequence[res.Event], *, replaced: Sequence[int] = ()) -> None:
        """Write events of a service, drop the entries they replace, keep the last EVENTS_KEPT.

        Events of a service that is gone are dropped silently: the writer runs behind the API.

        Args:
            name: the service name.
            events: new entries, or entries counted again (under their new sequence).
            replaced: sequences of earlier entries that `events` carry on.
        """
        self.put_events_of({name: (events, replaced)})

    def put_events_of(self, batch: Mapping[str, tuple[Sequence[res.Event], Sequence[int]]]) -> None:
        """`put_events` for several services at once, in a few statements for the whole batch
        (the event log writes every service's events of the last moment together)."""
        with self.transaction():
            db = self._db
            names = list(batch)
            live: set[str] = set()
            for start in range(0, len(names), _NAMES_PER_QUERY):
                chunk = names[start : start + _NAMES_PER_QUERY]
                marks = ", ".join(["?"] * len(chunk))
                live.update(r[0] for r in db.execute(f"SELECT name FROM services WHERE name IN ({marks})", chunk))
            gone: list[tuple[str, int]] = []
            rows: list[tuple[str, int, bytes]] = []
            trim: list[str] = []
            for name in names:
                if name not in live:
                    continue
                events, replaced = batch[name]
                dropped = set(replaced)
                kept = [e for e in events if e.sequence not in dropped]  # replaced within the batch
                gone.extend((name, s) for s in replaced)
                rows.extend((name, e.sequence, e.SerializeToString()) for e in kept)
                # Sequences count from 1, so a log whose newest is within EVENTS_KEPT needs no trim.
                if kept and max(e.sequence for e in kept) > EVENTS_KEPT:
                    trim.append(name)
            if gone:
                db.executemany("DELETE FROM events WHERE service = ? AND sequence = ?", gone)
            for start in range(0, len(rows), _ROWS_PER_INSERT):
                chunk_rows = rows[start : start + _ROWS_PER_INSERT]
                db.execute(
                    "INSERT INTO events (service, sequence, data) VALUES "
                    + ", ".join(["(?, ?, ?)"] * len(chunk_rows))
                    + " ON CONFLICT (service, sequence) DO UPDATE SET data = excluded.data",
                    [v for row in chunk_rows for v in row],
                )
            for name in trim:
                db.execute(
                    "DELETE FROM events WHERE service = ? AND sequence NOT IN "
                    "(SELECT sequence FROM events WHERE service = ? ORDER BY sequence DESC LIMIT ?)",
                    (name, name, EVENTS_KEPT),
                )

    def list_events(self, name: str) -> list[res.Event]:
        """A service's kept events, oldest first."""
        with self._read() as db:
            rows = db.execute("SELECT data FROM events WHERE service = ? ORDER BY sequence", (name,)).fetchall()
        return list(_events(rows))

    # ---- rollout state -------------------------------------------------------------------

    def put_rollout_state(self, name: str, state: bytes | None) -> None:
        """Replace (or with None remove) a service's opaque rollout state."""
        with self.transaction():
            db = self._db
            db.execute("DELETE FROM rollout_state WHERE service = ?", (name,))
            if state is not None:
                db.execute("INSERT INTO rollout_state (service, state) VALUES (?, ?)", (name, bytes(state)))

    def get_rollout_state(self, name: str) -> bytes | None:
        """A service's rollout state, or None."""
        with self._read() as db:
            row = db.execute("SELECT state FROM rollout_state WHERE service = ?", (name,)).fetchone()
        return None if row is None else bytes(row[0])


def version_proto(row: HistoryRow) -> res.ServiceVersion:
    """A history row as the API's ServiceVersion."""
    out = res.ServiceVersion(
        version=row.version,
        spec_digest=row.digest,
        create_time=pbtime.timestamp(row.create_time),
        outcome=row.outcome,  # type: ignore[arg-type]
        reason=row.reason,
        update_mode=row.update_mode,  # type: ignore[arg-type]
        rollback_of=row.rollback_of,
    )
    if row.end_time is not None:
        out.end_time.CopyFrom(pbtime.timestamp(row.end_time))
    if row.rollback_of and not row.reason:
        out.reason = f"rollback to version {row.rollback_of}"
    return out


def _history_row(row: tuple[Any, ...]) -> HistoryRow:
    version, blob, digest, created, mode, outcome, reason, end, rollback_of = row
    parsed = spec_pb2.ServiceSpec()
    parsed.ParseFromString(blob)
    return HistoryRow(
        version=int(version),
        spec=parsed,
        digest=digest,
        create_time=float(created),
        update_mode=int(mode),
        outcome=int(outcome),
        reason=reason,
        end_time=None if end is None else float(end),
        rollback_of=int(rollback_of),
    )


def _events(rows: list[tuple[Any, ...]]) -> Iterator[res.Event]:
    for (blob,) in rows:
        event = res.Event()
        event.ParseFromString(blob)
        yield event

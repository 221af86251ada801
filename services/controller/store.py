"""The controller's SQLite store: services, versions, replicas and autoscaler state."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2
from services.common import errors
from services.controller import store_history, store_jobs

log = logging.getLogger(__name__)

DB_FILE = "state.db"

# Columns update_service may change. latest_version and next_replica_id are owned by
# add_version and allocate_replica_id, so ids and versions only ever move forward.
_UPDATABLE = frozenset({"status", "status_message", "uptime_start", "update_mode", "deleting", "request_id"})

_SERVICE_COLUMNS = (
    "name, create_time, status, status_message, uptime_start, update_mode, latest_version, "
    "next_replica_id, deleting, request_id, uid"
)


@dataclasses.dataclass(frozen=True)
class ServiceRow:
    """One row of the services table.

    Attributes:
        name: the service name (primary key).
        create_time: seconds since the epoch when the service was created.
        status: a `resources_pb2.ServiceStatus` value.
        status_message: one line saying why the service is in its status.
        uptime_start: when the first replica became ready, or None.
        update_mode: a `resources_pb2.UpdateMode` value, of the last update.
        latest_version: the newest version.
        next_replica_id: the id the next `allocate_replica_id` returns.
        deleting: the service is being torn down.
        request_id: the request id of the create call, for retries.
        uid: unique to this incarnation of the name; part of every replica name.
    """

    name: str
    create_time: float
    status: int
    status_message: str
    uptime_start: float | None
    update_mode: int
    latest_version: int
    next_replica_id: int
    deleting: bool
    request_id: str
    uid: str


def _service_row(row: tuple[Any, ...]) -> ServiceRow:
    (name, create_time, status, message, uptime, mode, latest, next_id, deleting, request_id, uid) = row
    return ServiceRow(
        name=name,
        create_time=float(create_time),
        status=int(status),
        status_message=message,
        uptime_start=None if uptime is None else float(uptime),
        update_mode=int(mode),
        latest_version=int(latest),
        next_replica_id=int(next_id),
        deleting=bool(deleting),
        request_id=request_id,
        uid=uid,
    )


# ---- schema ------------------------------------------------------------------------------
# Each migration moves the schema from version i to i+1 (its index + 1) and runs in one
# transaction together with the PRAGMA user_version bump, so a crash leaves either the old or
# the new schema. Never edit a shipped migration; append a new one.


def _migrate_1(db: sqlite3.Connection) -> None:
    """Initial schema."""
    db.execute(
        """CREATE TABLE services (
            name TEXT PRIMARY KEY,
            create_time REAL NOT NULL,
            status INTEGER NOT NULL DEFAULT 0,
            status_message TEXT NOT NULL DEFAULT '',
            uptime_start REAL,
            update_mode INTEGER NOT NULL DEFAULT 0,
            latest_version INTEGER NOT NULL DEFAULT 0,
            next_replica_id INTEGER NOT NULL DEFAULT 1,
            deleting INTEGER NOT NULL DEFAULT 0
        ) STRICT"""
    )
    db.execute(
        """CREATE TABLE versions (
            service TEXT NOT NULL REFERENCES services(name) ON DELETE CASCADE,
            version INTEGER NOT NULL,
            spec BLOB NOT NULL,
            yaml TEXT NOT NULL DEFAULT '',
            PRIMARY KEY (service, version)
        ) STRICT"""
    )
    db.execute(
        """CREATE TABLE replicas (
            service TEXT NOT NULL REFERENCES services(name) ON DELETE CASCADE,
            replica_id INTEGER NOT NULL,
            status INTEGER NOT NULL,
            version INTEGER NOT NULL,
            data BLOB NOT NULL,
            PRIMARY KEY (service, replica_id)
        ) STRICT"""
    )
    db.execute("CREATE INDEX replicas_by_version ON replicas (service, version)")
    db.execute(
        """CREATE TABLE autoscaler_state (
            service TEXT PRIMARY KEY REFERENCES services(name) ON DELETE CASCADE,
            state BLOB NOT NULL
        ) STRICT"""
    )


def _migrate_2(db: sqlite3.Connection) -> None:
    """Create-request idempotency key and a status index for replica queries."""
    db.execute("ALTER TABLE services ADD COLUMN request_id TEXT NOT NULL DEFAULT ''")
    db.execute("CREATE INDEX replicas_by_status ON replicas (service, status)")


def _migrate_3(db: sqlite3.Connection) -> None:
    """A uid per service incarnation, so replica names of a re-created service never repeat."""
    db.execute("ALTER TABLE services ADD COLUMN uid TEXT NOT NULL DEFAULT ''")
    db.execute("UPDATE services SET uid = lower(hex(randomblob(4))) WHERE uid = ''")


def _migrate_4(db: sqlite3.Connection) -> None:
    """A small key-value table; `heartbeat` proves the store takes writes."""
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) STRICT")


MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (
    _migrate_1,
    _migrate_2,
    _migrate_3,
    _migrate_4,
    store_jobs.migrate_jobs,
    store_history.migrate_6,
)
"""Ordered forward migrations; the schema version is the number applied (PRAGMA user_version)."""

SCHEMA_VERSION = len(MIGRATIONS)


class SchemaError(Exception):
    """The database file has a newer schema than this code knows; refuse to touch it."""


def migrate(db: sqlite3.Connection, *, target: int = SCHEMA_VERSION) -> int:
    """Apply the pending migrations up to `target`, each in its own transaction.

    Args:
        db: a connection in autocommit mode (isolation_level=None).
        target: schema version to reach; tests pass a lower one to build an old database.

    Returns:
        The schema version after migrating.

    Raises:
        SchemaError: the file's schema is newer than `SCHEMA_VERSION`.
    """
    current = int(db.execute("PRAGMA user_version").fetchone()[0])
    if current > SCHEMA_VERSION:
        raise SchemaError(f"store schema version {current} is newer than this controller ({SCHEMA_VERSION})")
    while current < target:
        # BEGIN IMMEDIATE, then re-read: another process may have migrated meanwhile.
        db.execute("BEGIN IMMEDIATE")
        try:
            current = int(db.execute("PRAGMA user_version").fetchone()[0])
            if current < target:
                MIGRATIONS[current](db)
                current += 1
                db.execute(f"PRAGMA user_version = {current:d}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    return current


# ---- the store -----------------------------------------------------------------------------


class Store(store_history.HistoryTables, store_jobs.JobTables):
    """SQLite store of services, versions, replicas and autoscaler state.

    Synchronous and fast: each call is one short transaction. Calls made inside a
    `with store.transaction():` block join that transaction. Do not `await` inside such a
    block: another task using the store meanwhile is refused with RuntimeError rather than
    silently joining someone else's transaction.
    """

    def __init__(self, path: str, *, synchronous: str = "FULL", busy_timeout_s: float = 5.0) -> None:
        """Open (creating if needed) the database at `path` and migrate it.

        Args:
            path: the database file; its directory is created (mode 0700).
            synchronous: SQLite `synchronous` setting: FULL (the default) fsyncs every commit,
                so an acknowledged write survives power loss and a failing disk is reported
                before the write is acknowledged; NORMAL survives process crashes only, and
                is several times faster (docs/store.md has the figures).
            busy_timeout_s: how long a write waits for another process's lock.

        Raises:
            SchemaError: the file was written by a newer controller.
            ValueError: `synchronous` is not NORMAL or FULL.
        """
        if synchronous.upper() not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, got {synchronous!r}")
        self.path = os.path.abspath(path)
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        # Specs carry probe headers and secrets: create the file private. SQLite gives the
        # -wal and -shm files the same permissions as the database.
        # Only when the file is new: closing any descriptor of an open SQLite file drops every
        # POSIX lock this process holds on it, so a second connection (the writer's) opening an
        # existing store would silently break the first one's locking.
        if not os.path.exists(self.path):
            os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600))
        self._db = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000):d}")
        mode = self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise RuntimeError(f"could not put {self.path} in WAL mode (got {mode})")
        self._db.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        self._db.execute("PRAGMA foreign_keys = ON")
        self._lock = threading.RLock()
        self._depth = 0
        self._owner: object = None
        self.writable = True
        self._last_failure = ""  # the detail last logged, so a failing heartbeat logs it once
        self._on_writable: Callable[[bool], None] | None = None
        self._on_write: Callable[[float, bool], None] | None = None
        try:
            migrate(self._db)
        except BaseException:
            self._db.close()
            raise

    @classmethod
    def in_state_dir(cls, state_dir: str, *, synchronous: str = "FULL", busy_timeout_s: float = 5.0) -> Store:
        """Open `state.db` under `state_dir` (`~` expanded).

        Args:
            state_dir: the controller's state directory.
            synchronous: as for the constructor.
            busy_timeout_s: as for the constructor.

        Returns:
            The open store.
        """
        path = os.path.join(os.path.expanduser(state_dir), DB_FILE)
        return cls(path, synchronous=synchronous, busy_timeout_s=busy_timeout_s)

    def close(self) -> None:
        """Close the database; the store is unusable afterwards."""
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def on_writable_change(self, callback: Callable[[bool], None]) -> None:
        """Call `callback(writable)` whenever writes start failing or work again."""
        self._on_writable = callback

    def on_write(self, callback: Callable[[float, bool], None]) -> None:
        """Call `callback(seconds, committed)` after each write transaction (metrics): its time
        from BEGIN to COMMIT, or to the failure the store reported. A block that raised its own
        error (nothing was meant to be written) is not reported."""
        self._on_write = callback

    def _wrote(self, started: float, ok: bool) -> None:
        if self._on_write is not None:
            self._on_write(time.perf_counter() - started, ok)

    def _set_writable(self, ok: bool) -> None:
        if ok == self.writable:
            return
        self.writable = ok
        if ok:
            self._last_failure = ""
            log.info("the store takes writes again")
        else:
            log.error("the store does not take writes: %s", self.path)
        if self._on_writable is not None:
            self._on_writable(ok)

    def check_writable(self) -> bool:
        """Make one small write (a heartbeat); True if the store took it."""
        try:
            with self.transaction():
                self._db.execute(
                    "INSERT OR REPLACE INTO meta (key, value) VALUES ('heartbeat', strftime('%Y-%m-%dT%H:%M:%fZ'))"
                )
        except errors.UnavailableError:
            return False
        return True

    def controller_id(self) -> str:
        """This controller's stable identity, created on first use and kept in `meta`.

        The provisioner records it as the owner of every replica this controller launches, so
        two controllers sharing a provisioner never tear down each other's replicas.
        """
        query = "SELECT value FROM meta WHERE key = 'controller_id'"
        with self._read() as db:
            row = db.execute(query).fetchone()
        if row is None:  # first start: the only write, so a store that takes none still opens later
            with self.transaction():
                self._db.execute(
                    "INSERT OR IGNORE INTO meta (key, value) VALUES ('controller_id', ?)", (secrets.token_hex(16),)
                )
                row = self._db.execute(query).fetchone()
        return str(row[0])

    def stored_controller_id(self) -> str:
        """The controller id kept in `meta`, or "" when there is none (nothing is written)."""
        with self._read() as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'controller_id'").fetchone()
        return "" if row is None else str(row[0])

    def set_controller_id(self, controller_id: str) -> None:
        """Keep `controller_id` in `meta` (a second copy: identity.py's file is the first)."""
        with self.transaction():
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('controller_id', ?)", (controller_id,))

    def schema_version(self) -> int:
        """The schema version of the open database."""
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    # ---- transactions --------------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Store]:
        """Atomic read-modify-write: BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on exception.

        Nested blocks (and every store call inside the block) join the outer transaction; a
        nested block that raises rolls back only its own changes (a savepoint).

        Yields:
            This store.

        Raises:
            errors.UnavailableError: the store did not take the write: another process held
                the write lock past the busy timeout, or the disk failed (reason
                STORE_UNAVAILABLE). `writable` turns false until a write succeeds again.
            RuntimeError: another asyncio task tried to use the store while a transaction
                was open (an `await` inside the block).
        """
        with self._lock:
            owner = _current_owner()
            if self._depth and owner is not self._owner:
                raise RuntimeError("store transaction held across an await by another task")
            if self._depth == 0:
                started = time.perf_counter()
                try:
                    self._db.execute("BEGIN IMMEDIATE")
                except sqlite3.Error as exc:
                    self._wrote(started, False)
                    raise self._unavailable(exc) from exc
                self._owner = owner
                self._depth = 1
                try:
                    yield self
                    self._db.execute("COMMIT")
                except sqlite3.Error as exc:
                    self._rollback()
                    self._wrote(started, False)
                    raise self._unavailable(exc) from exc
                except BaseException:
                    self._rollback()
                    raise
                finally:
                    self._depth = 0
                    self._owner = None
                self._wrote(started, True)
                self._set_writable(True)
            else:
                name = f"sp{self._depth}"
                self._db.execute(f"SAVEPOINT {name}")
                self._depth += 1
                try:
                    yield self
                except BaseException:
                    # An I/O error can end the whole transaction (and its savepoints) at once;
                    # the original error is the one to report, not "no such savepoint".
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute(f"ROLLBACK TO {name}")
                        self._db.execute(f"RELEASE {name}")
                    raise
                else:
                    self._db.execute(f"RELEASE {name}")
                finally:
                    self._depth -= 1

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):  # a failed COMMIT may have ended it already
            self._db.execute("ROLLBACK")

    def _unavailable(self, exc: sqlite3.Error, *, writing: bool = True) -> errors.UnavailableError:
        """The API's error for a failed store call: what failed, in the user's words.

        SQLite's own text names internals and can quote statements or paths, so it goes to
        the log (once per distinct failure, not every heartbeat) and never into the message.
        """
        cause, words = _cause(exc)
        detail = f"{type(exc).__name__}: {exc}"
        operation = "write" if writing else "read"
        if detail != self._last_failure:
            self._last_failure = detail
            log.error("the store could not %s %s: %s", operation, self.path, detail)
        else:
            log.debug("the store could not %s %s again: %s", operation, self.path, detail)
        if writing:
            self._set_writable(False)
            message = f"the controller could not save the change: {words}; nothing was changed, try again later"
        else:
            message = f"the controller could not read its state: {words}; try again later"
        return errors.UnavailableError(message, reason="STORE_UNAVAILABLE", cause=cause, operation=operation)

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        # A single SELECT is atomic on its own; the lock keeps threads off a half-open
        # transaction and the owner check keeps other tasks out of one.
        with self._lock:
            if self._depth and _current_owner() is not self._owner:
                raise RuntimeError("store transaction held across an await by another task")
            try:
                yield self._db
            except sqlite3.Error as exc:
                raise self._unavailable(exc, writing=False) from exc

    # ---- services ------------------------------------------------------------------------

    def create_service(self, name: str, spec: spec_pb2.ServiceSpec, *, now: float, request_id: str = "") -> ServiceRow:
        """Create a service with `spec` as version 1.

        Args:
            name: the service name.
            spec: the validated spec of version 1.
            now: creation time, seconds since the epoch.
            request_id: the create request's id, kept so a retried create can be recognised.

        Returns:
            The new row (status CONTROLLER_INIT, latest_version 1, next_replica_id 1).

        Raises:
            errors.AlreadyExistsError: a service with that name exists.
        """
        with self.transaction():
            if self._exists(name):
                raise errors.AlreadyExistsError(
                    f"service {name!r} already exists", reason="SERVICE_ALREADY_EXISTS", service=name
                )
            self._db.execute(
                "INSERT INTO services (name, create_time, status, latest_version, request_id, uid) "
                "VALUES (?, ?, ?, 1, ?, ?)",
                (name, float(now), resources_pb2.SERVICE_STATUS_CONTROLLER_INIT, request_id, secrets.token_hex(4)),
            )
            self._insert_version(name, 1, spec)
            self._history_insert(name, 1, spec, now=now, mode=0, rollback_of=0)
            return self._get_service(name)  # type: ignore[return-value]

    def get_service(self, name: str) -> ServiceRow | None:
        """The service row, or None if there is no such service."""
        with self._read():
            return self._get_service(name)

    def list_services(self) -> list[ServiceRow]:
        """Every service row, in name order."""
        with self._read() as db:
            rows = db.execute(f"SELECT {_SERVICE_COLUMNS} FROM services ORDER BY name").fetchall()
        return [_service_row(r) for r in rows]

    def update_service(self, name: str, /, **fields: object) -> ServiceRow:
        """Set some columns of a service row.

        Args:
            name: the service name.
            **fields: any of status, status_message, uptime_start, update_mode, deleting,
                request_id.

        Returns:
            The updated row.

        Raises:
            errors.NotFoundError: no such service.
            ValueError: a field that is unknown or not updatable (latest_version and
                next_replica_id only move through add_version and allocate_replica_id).
        """
        bad = sorted(set(fields) - _UPDATABLE)
        if bad:
            raise ValueError(f"update_service cannot set {', '.join(bad)}")
        with self.transaction():
            if fields:
                columns = sorted(fields)
                values = [_column_value(c, fields[c]) for c in columns]
                sets = ", ".join(f"{c} = ?" for c in columns)
                cur = self._db.execute(f"UPDATE services SET {sets} WHERE name = ?", (*values, name))
                if cur.rowcount == 0:
                    raise _not_found(name)
            row = self._get_service(name)
            if row is None:
                raise _not_found(name)
            return row

    def delete_service(self, name: str) -> None:
        """Remove a service with its versions, replicas and autoscaler state.

        Deleting a service that is not there is a no-op, so recovery can repeat it.
        """
        with self.transaction():
            for table in ("replicas", "versions", "autoscaler_state", "history", "events", "rollout_state"):
                self._db.execute(f"DELETE FROM {table} WHERE service = ?", (name,))
            self._db.execute("DELETE FROM services WHERE name = ?", (name,))

    # ---- versions ------------------------------------------------------------------------

    def add_version(
        self,
        name: str,
        spec: spec_pb2.ServiceSpec,
        *,
        now: float | None = None,
        mode: int = 0,
        rollback_of: int = 0,
    ) -> int:
        """Store `spec` as the next version and make it the latest, atomically.

        The history records it as active and the version active before as superseded.

        Args:
            name: the service name.
            spec: the validated spec.
            now: when, for the history (default: the clock).
            mode: the update mode, for the history.
            rollback_of: the version whose spec this restores, for a rollback.

        Returns:
            The new version number (previous latest + 1).

        Raises:
            errors.NotFoundError: no such service.
        """
        with self.transaction():
            row = self._db.execute(
                "SELECT MAX(latest_version, IFNULL((SELECT MAX(version) FROM versions "
                "WHERE service = ?1), 0)) FROM services WHERE name = ?1",
                (name,),
            ).fetchone()
            if row is None:
                raise _not_found(name)
            version = int(row[0]) + 1
            self._insert_version(name, version, spec)
            when = time.time() if now is None else now
            self._history_insert(name, version, spec, now=when, mode=mode, rollback_of=rollback_of)
            self._db.execute("UPDATE services SET latest_version = ? WHERE name = ?", (version, name))
            return version

    def get_version(self, name: str, version: int) -> spec_pb2.ServiceSpec | None:
        """The spec of one version, or None if it is not stored (or deleted)."""
        with self._read() as db:
            row = db.execute("SELECT spec FROM versions WHERE service = ? AND version = ?", (name, version)).fetchone()
        if row is None:
            return None
        spec = spec_pb2.ServiceSpec()
        spec.ParseFromString(row[0])
        return spec

    def list_versions(self, name: str) -> list[int]:
        """The stored versions of a service, ascending."""
        with self._read() as db:
            rows = db.execute("SELECT version FROM versions WHERE service = ? ORDER BY version", (name,)).fetchall()
        return [int(r[0]) for r in rows]

    def delete_unreferenced_versions(self, name: str) -> list[int]:
        """Delete every version but the newest that no replica record references (spec §7.3).

        Returns:
            The deleted versions, ascending.
        """
        with self.transaction():
            rows = self._db.execute(
                """DELETE FROM versions
                   WHERE service = ?1
                     AND version < (SELECT latest_version FROM services WHERE name = ?1)
                     AND version NOT IN (SELECT version FROM replicas WHERE service = ?1)
                   RETURNING version""",
                (name,),
            ).fetchall()
        return sorted(int(r[0]) for r in rows)

    # ---- replica ids ---------------------------------------------------------------------

    def allocate_replica_id(self, name: str) -> int:
        """Take the next replica id of a service. Ids start at 1 and are never handed out twice.

        Raises:
            errors.NotFoundError: no such service.
        """
        with self.transaction():
            row = self._db.execute(
                "UPDATE services SET next_replica_id = next_replica_id + 1 WHERE name = ? "
                "RETURNING next_replica_id - 1",
                (name,),
            ).fetchone()
            if row is None:
                raise _not_found(name)
            return int(row[0])

    # ---- replicas ------------------------------------------------------------------------

    def put_replica(self, replica: resources_pb2.Replica) -> None:
        """Insert or replace a replica record (keyed by service and replica_id).

        Raises:
            errors.NotFoundError: the replica's service does not exist.
            ValueError: replica_id < 1.
        """
        self.put_replicas((replica,))

    def put_replicas(self, replicas: Iterable[resources_pb2.Replica]) -> None:
        """Insert or replace several replica records in one transaction.

        A record whose id was never allocated also moves the service's id counter past it,
        so that id is never handed out again.

        Raises:
            errors.NotFoundError: a replica's service does not exist (nothing is written).
            ValueError: a replica_id < 1 (nothing is written).
        """
        with self.transaction():
            for replica in replicas:
                if replica.replica_id < 1:
                    raise ValueError(f"replica_id must be >= 1, got {replica.replica_id}")
                cur = self._db.execute(
                    "UPDATE services SET next_replica_id = MAX(next_replica_id, ?) WHERE name = ?",
                    (replica.replica_id + 1, replica.service),
                )
                if cur.rowcount == 0:
                    raise _not_found(replica.service)
                self._db.execute(
                    "INSERT OR REPLACE INTO replicas (service, replica_id, status, version, data) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (
                        replica.service,
                        replica.replica_id,
                        int(replica.status),
                        replica.version,
                        replica.SerializeToString(),
                    ),
                )

    def get_replica(self, name: str, replica_id: int) -> resources_pb2.Replica | None:
        """One replica record, or None."""
        with self._read() as db:
            row = db.execute(
                "SELECT data FROM replicas WHERE service = ? AND replica_id = ?", (name, replica_id)
            ).fetchone()
        return None if row is None else _replica(row[0])

    def list_replicas(self, name: str, *, statuses: Iterable[int] | None = None) -> list[resources_pb2.Replica]:
        """The replica records of a service in id order, optionally only those in `statuses`."""
        sql = "SELECT data FROM replicas WHERE service = ?"
        params: list[object] = [name]
        if statuses is not None:
            wanted = [int(s) for s in statuses]
            sql += f" AND status IN ({', '.join('?' * len(wanted))})"
            params += wanted
        with self._read() as db:
            rows = db.execute(sql + " ORDER BY replica_id", params).fetchall()
        return [_replica(r[0]) for r in rows]

    def delete_replica(self, name: str, replica_id: int) -> None:
        """Remove a replica record; a no-op if it is not there. Its id is not reused."""
        with self.transaction():
            self._db.execute("DELETE FROM replicas WHERE service = ? AND replica_id = ?", (name, replica_id))

    # ---- autoscaler state ----------------------------------------------------------------

    def put_autoscaler_state(self, name: str, state: bytes) -> None:
        """Replace a service's opaque autoscaler state.

        Raises:
            errors.NotFoundError: no such service.
        """
        with self.transaction():
            if not self._exists(name):
                raise _not_found(name)
            self._db.execute(
                "INSERT OR REPLACE INTO autoscaler_state (service, state) VALUES (?, ?)", (name, bytes(state))
            )

    def get_autoscaler_state(self, name: str) -> bytes | None:
        """A service's autoscaler state, or None if none was stored."""
        with self._read() as db:
            row = db.execute("SELECT state FROM autoscaler_state WHERE service = ?", (name,)).fetchone()
        return None if row is None else bytes(row[0])

    # ---- helpers -------------------------------------------------------------------------

    def _exists(self, name: str) -> bool:
        return self._db.execute("SELECT 1 FROM services WHERE name = ?", (name,)).fetchone() is not None

    def _get_service(self, name: str) -> ServiceRow | None:
        row = self._db.execute(f"SELECT {_SERVICE_COLUMNS} FROM services WHERE name = ?", (name,)).fetchone()
        return None if row is None else _service_row(row)

    def _insert_version(self, name: str, version: int, spec: spec_pb2.ServiceSpec) -> None:
        self._db.execute(
            "INSERT INTO versions (service, version, spec, yaml) VALUES (?, ?, ?, ?)",
            (name, version, spec.SerializeToString(), spec.yaml),
        )


# What a failed call tells the caller, by SQLite's primary result code: (cause, words).
_CAUSES = {
    "SQLITE_BUSY": ("busy", "its state store is busy (another process holds its lock)"),
    "SQLITE_LOCKED": ("busy", "its state store is busy (another process holds its lock)"),
    "SQLITE_FULL": ("disk_full", "its disk is full"),
    "SQLITE_READONLY": ("read_only", "its state store is read-only"),
    "SQLITE_IOERR": ("disk_error", "its disk reported an error"),
    "SQLITE_CANTOPEN": ("disk_error", "its disk reported an error"),
    "SQLITE_CORRUPT": ("damaged", "its state store is damaged"),
    "SQLITE_NOTADB": ("damaged", "its state store is damaged"),
}


def _cause(exc: sqlite3.Error) -> tuple[str, str]:
    """(cause, words) for a SQLite error; extended codes (SQLITE_IOERR_WRITE) by their primary."""
    name = str(getattr(exc, "sqlite_errorname", "") or "")
    primary = "_".join(name.split("_")[:2])
    return _CAUSES.get(primary, ("error", "its state store failed"))


def _current_owner() -> object:
    """Who is using the store: the running asyncio task, else the thread."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        task = None
    return task if task is not None else threading.current_thread()


def _column_value(column: str, value: Any) -> Any:
    """Normalise a value for its column (enums to int, bools to 0/1)."""
    if column == "deleting":
        return int(bool(value))
    if column in ("status", "update_mode"):
        return int(value)
    if column == "uptime_start":
        return None if value is None else float(value)
    return str(value)


def _replica(data: bytes) -> resources_pb2.Replica:
    replica = resources_pb2.Replica()
    replica.ParseFromString(data)
    return replica


def _not_found(name: str) -> errors.NotFoundError:
    return errors.NotFoundError(f"service {name!r} not found", reason="SERVICE_NOT_FOUND", service=name)

"""The store on PostgreSQL (psycopg 3): several controllers on one database, one of them leading.

The same tables and queries as SQLite (schema.py, base.py). What differs is kept here: the
connection, one writer at a time through a transaction-scoped advisory lock (what SQLite's
BEGIN IMMEDIATE gives), the schema version in a table, and how errors read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import psycopg
from psycopg import conninfo
from psycopg import errors as pg_errors

from services.common import errors
from services.controller.store import base, schema

SCHEMES = ("postgresql://", "postgres://")

# pg_advisory_xact_lock keys: every write transaction takes WRITER (one writer at a time, as
# SQLite's file lock does); migrations take MIGRATE. Any two constants this database's other
# users do not take.
WRITER_LOCK = 0x5265706C  # "Repl"
MIGRATE_LOCK = 0x5265706D


def is_url(location: str) -> bool:
    """True for a postgresql:// (or postgres://) URL."""
    return location.startswith(SCHEMES)


def printable(url: str) -> str:
    """The URL without its password (or anything else that is not where the database is)."""
    try:
        parts = conninfo.conninfo_to_dict(url)
    except psycopg.Error:
        return "postgresql://(unreadable URL)"
    user = f"{parts['user']}@" if parts.get("user") else ""
    host = str(parts.get("host") or "")
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{user}{host}{port}/{parts.get('dbname') or ''}"


def migrate(db: psycopg.Connection[Any], *, target: int | None = None) -> int:
    """Apply the pending migrations up to `target`, each in one transaction with the version bump.

    Args:
        db: an autocommit connection.
        target: schema version to reach (default: the newest).

    Returns:
        The schema version after migrating.

    Raises:
        schema.SchemaError: the database's schema is newer than this code knows.
    """
    migrations = schema.POSTGRES
    target = len(migrations) if target is None else target
    with db.transaction():
        db.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        db.execute("INSERT INTO schema_version SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM schema_version)")
    current = _version(db)
    if current > len(migrations):
        raise schema.SchemaError(f"store schema version {current} is newer than this controller ({len(migrations)})")
    while current < target:
        with db.transaction():  # re-read under the lock: another controller may have migrated
            db.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
            current = _version(db)
            if current < target:
                migrations[current](db)
                current += 1
                db.execute("UPDATE schema_version SET version = %s", (current,))
    return current


def _version(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT version FROM schema_version").fetchone()
    return 0 if row is None else int(row[0])


class PostgresStore(base.Store):
    """The store in a PostgreSQL database; one connection, reconnected after it breaks."""

    leases_ddl = schema.LEASES_POSTGRES
    db_errors = (psycopg.Error,)
    integrity_errors = (psycopg.IntegrityError,)
    greatest = "GREATEST"

    @staticmethod
    def opens(path: str) -> bool:
        """A postgresql:// (or postgres://) URL."""
        return is_url(path)

    def __init__(
        self, path: str, *, synchronous: str = "FULL", busy_timeout_s: float = 5.0, idle_timeout_s: float = 2.0
    ) -> None:
        """Connect to the database at the URL `path` and migrate it.

        Args:
            path: a postgresql:// URL (libpq's form; it may carry a password, never logged).
            synchronous: FULL waits for each commit to be durable (synchronous_commit on);
                NORMAL does not (a server crash may lose the last commits, never corrupt).
            busy_timeout_s: how long a write waits for another writer's lock (lock_timeout).
            idle_timeout_s: a session that sits this long inside a transaction is ended by the
                server, so a stopped controller cannot hold the writer lock (and its lease row).

        Raises:
            SchemaError: the database was written by a newer controller.
            ValueError: `synchronous` is not NORMAL or FULL.
            errors.StartupError: the database cannot be reached (the message names it, without
                the password).
        """
        if synchronous.upper() not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, got {synchronous!r}")
        self._setup()
        self.path = path
        self.location = printable(path)
        self._synchronous = synchronous.upper()
        self._busy_timeout_s = busy_timeout_s
        self._idle_timeout_s = idle_timeout_s
        try:
            self._db = _Session(self)
        except psycopg.Error as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise errors.StartupError(f"cannot reach the PostgreSQL store at {self.location}: {first}") from None
        try:
            migrate(self._db.raw)
        except BaseException:
            self._db.close()
            raise

    def _connect(self) -> psycopg.Connection[Any]:
        extra: dict[str, Any] = {}
        given = conninfo.conninfo_to_dict(self.path)
        if "connect_timeout" not in given:
            extra["connect_timeout"] = max(2, int(self._busy_timeout_s))
        if "application_name" not in given:  # who is who in pg_stat_activity (and the drill's audit)
            extra["application_name"] = f"replicaplane:{os.getpid()}"
        db = psycopg.connect(self.path, autocommit=True, **extra)
        try:
            db.execute(f"SET lock_timeout = {int(self._busy_timeout_s * 1000):d}")
            db.execute(f"SET idle_in_transaction_session_timeout = {max(1, int(self._idle_timeout_s * 1000)):d}")
            db.execute(f"SET synchronous_commit = {'on' if self._synchronous == 'FULL' else 'off'}")
            db.execute("SET client_min_messages = warning")
        except BaseException:
            db.close()
            raise
        return db

    def _open_again(self, synchronous: str | None = None) -> PostgresStore:
        """Another connection to the same database, with the same settings (`synchronous` aside)."""
        return PostgresStore(
            self.path,
            synchronous=synchronous or self._synchronous,
            busy_timeout_s=self._busy_timeout_s,
            idle_timeout_s=self._idle_timeout_s,
        )

    def _db_now(self) -> float:
        # The server's clock: controllers on several machines measure leases on one clock.
        return float(self._db.execute("SELECT extract(epoch from clock_timestamp())").fetchone()[0])

    def _begin(self) -> None:
        self._db.execute("BEGIN")
        self._db.execute("SELECT pg_advisory_xact_lock(?)", (WRITER_LOCK,))

    def _close(self) -> None:
        self._db.close()

    def schema_version(self) -> int:
        """The schema version of the open database."""
        with self._read():
            return int(self._db.execute("SELECT version FROM schema_version").fetchone()[0])

    def _cause(self, exc: BaseException) -> tuple[str, str]:
        for kinds, cause in _CAUSES:
            if isinstance(exc, kinds):
                return cause
        return ("error", "its state store failed")


# What a failed call tells the caller, by psycopg's exception class: (cause, words).
_CAUSES: tuple[tuple[tuple[type[BaseException], ...], tuple[str, str]], ...] = (
    (
        (pg_errors.LockNotAvailable, pg_errors.QueryCanceled, pg_errors.DeadlockDetected),
        ("busy", "its state store is busy (another controller holds its lock)"),
    ),
    ((pg_errors.DiskFull,), ("disk_full", "its database server's disk is full")),
    ((pg_errors.ReadOnlySqlTransaction,), ("read_only", "its state store is read-only")),
    ((pg_errors.DataCorrupted, pg_errors.IndexCorrupted), ("damaged", "its state store is damaged")),
    ((psycopg.OperationalError,), ("unreachable", "its database server cannot be reached")),
)


_PLACEHOLDERS: dict[str, str] = {}


class _Session:
    """The store's PostgreSQL connection, spoken to as SQLite's is: `execute(sql, params)` with
    `?` placeholders. A broken connection (a server restart, the network, a session the server
    ended) is replaced by the next statement outside a transaction; inside one, the error stands
    and the transaction is rolled back."""

    def __init__(self, store: PostgresStore) -> None:
        self._store = store
        self.raw = store._connect()

    def execute(self, sql: str, params: Iterable[Any] = ()) -> Any:
        """Run one statement; returns psycopg's cursor (fetchone, fetchall, rowcount)."""
        if self.raw.closed and self._store._depth == 0:
            self.raw = self._store._connect()
        query = _PLACEHOLDERS.get(sql)
        if query is None:
            query = _PLACEHOLDERS[sql] = sql.replace("%", "%%").replace("?", "%s")
        return self.raw.execute(query, tuple(params))

    def executemany(self, sql: str, params: Iterable[Iterable[Any]]) -> None:
        """Run one statement once per parameter tuple."""
        if self.raw.closed and self._store._depth == 0:
            self.raw = self._store._connect()
        query = sql.replace("%", "%%").replace("?", "%s")
        with self.raw.cursor() as cur:
            cur.executemany(query, [tuple(p) for p in params])

    def close(self) -> None:
        """Close the connection."""
        self.raw.close()

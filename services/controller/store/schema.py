"""The store's schema on both backends, as numbered forward migrations.

Migration N moves a database from schema version N-1 to N, on SQLite (`SQLITE[N-1]`) and on
PostgreSQL (`POSTGRES[N-1]`): the two lists always have the same length, so a version number
means the same tables on both. To add one, append a function to each list (never edit a shipped
one); tests/unit/test_store.py checks the lengths match and runs the store tests on both.
Each migration runs in one transaction together with the version bump.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.controller import store_history, store_jobs

Migration = Callable[[Any], None]
"""Takes a connection (sqlite3 or psycopg, in a transaction) and runs statements on it."""


class SchemaError(Exception):
    """The database has a newer schema than this code knows; refuse to touch it."""


# ---- SQLite ----------------------------------------------------------------------------------
# The version is PRAGMA user_version. Tables are STRICT.


def _sqlite_1(db: Any) -> None:
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


def _sqlite_2(db: Any) -> None:
    """Create-request idempotency key and a status index for replica queries."""
    db.execute("ALTER TABLE services ADD COLUMN request_id TEXT NOT NULL DEFAULT ''")
    db.execute("CREATE INDEX replicas_by_status ON replicas (service, status)")


def _sqlite_3(db: Any) -> None:
    """A uid per service incarnation, so replica names of a re-created service never repeat."""
    db.execute("ALTER TABLE services ADD COLUMN uid TEXT NOT NULL DEFAULT ''")
    db.execute("UPDATE services SET uid = lower(hex(randomblob(4))) WHERE uid = ''")


def _sqlite_4(db: Any) -> None:
    """A small key-value table; `heartbeat` proves the store takes writes."""
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) STRICT")


def _sqlite_7(db: Any) -> None:
    """Leases: who leads the controllers sharing this store (docs/ha.md)."""
    db.execute(LEASES_SQLITE)


SQLITE: tuple[Migration, ...] = (
    _sqlite_1,
    _sqlite_2,
    _sqlite_3,
    _sqlite_4,
    store_jobs.migrate_jobs,
    store_history.migrate_6,
    _sqlite_7,
)
"""SQLite's forward migrations; the schema version is the number applied (PRAGMA user_version)."""


# ---- PostgreSQL ------------------------------------------------------------------------------
# The version is the one row of table schema_version. The same tables and columns as SQLite's:
# REAL is DOUBLE PRECISION, BLOB is BYTEA, counters are BIGINT.


def _postgres_1(db: Any) -> None:
    """Initial schema."""
    db.execute(
        """CREATE TABLE services (
            name TEXT PRIMARY KEY,
            create_time DOUBLE PRECISION NOT NULL,
            status INTEGER NOT NULL DEFAULT 0,
            status_message TEXT NOT NULL DEFAULT '',
            uptime_start DOUBLE PRECISION,
            update_mode INTEGER NOT NULL DEFAULT 0,
            latest_version BIGINT NOT NULL DEFAULT 0,
            next_replica_id BIGINT NOT NULL DEFAULT 1,
            deleting INTEGER NOT NULL DEFAULT 0
        )"""
    )
    db.execute(
        """CREATE TABLE versions (
            service TEXT NOT NULL REFERENCES services(name) ON DELETE CASCADE,
            version BIGINT NOT NULL,
            spec BYTEA NOT NULL,
            yaml TEXT NOT NULL DEFAULT '',
            PRIMARY KEY (service, version)
        )"""
    )
    db.execute(
        """CREATE TABLE replicas (
            service TEXT NOT NULL REFERENCES services(name) ON DELETE CASCADE,
            replica_id BIGINT NOT NULL,
            status INTEGER NOT NULL,
            version BIGINT NOT NULL,
            data BYTEA NOT NULL,
            PRIMARY KEY (service, replica_id)
        )"""
    )
    db.execute("CREATE INDEX replicas_by_version ON replicas (service, version)")
    db.execute(
        """CREATE TABLE autoscaler_state (
            service TEXT PRIMARY KEY REFERENCES services(name) ON DELETE CASCADE,
            state BYTEA NOT NULL
        )"""
    )


def _postgres_2(db: Any) -> None:
    """Create-request idempotency key and a status index for replica queries."""
    db.execute("ALTER TABLE services ADD COLUMN request_id TEXT NOT NULL DEFAULT ''")
    db.execute("CREATE INDEX replicas_by_status ON replicas (service, status)")


def _postgres_3(db: Any) -> None:
    """A uid per service incarnation (no rows can exist yet on a new PostgreSQL store)."""
    db.execute("ALTER TABLE services ADD COLUMN uid TEXT NOT NULL DEFAULT ''")
    db.execute("UPDATE services SET uid = substr(md5(random()::text), 1, 8) WHERE uid = ''")


def _postgres_4(db: Any) -> None:
    """A small key-value table; `heartbeat` proves the store takes writes."""
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")


def _postgres_6(db: Any) -> None:
    """`store_history.migrate_6` on PostgreSQL: version history, the event log, rollout state.
    (No rows to carry over: no PostgreSQL store predates it.)"""
    db.execute(
        """CREATE TABLE history (
            service TEXT NOT NULL REFERENCES services(name) ON DELETE CASCADE,
            version BIGINT NOT NULL,
            spec BYTEA NOT NULL,
            digest TEXT NOT NULL,
            create_time DOUBLE PRECISION NOT NULL,
            update_mode INTEGER NOT NULL DEFAULT 0,
            outcome INTEGER NOT NULL,
            reason TEXT NOT NULL DEFAULT '',
            end_time DOUBLE PRECISION,
            rollback_of BIGINT NOT NULL DEFAULT 0,
            PRIMARY KEY (service, version)
        )"""
    )
    db.execute(
        """CREATE TABLE events (
            service TEXT NOT NULL REFERENCES services(name) ON DELETE CASCADE,
            sequence BIGINT NOT NULL,
            data BYTEA NOT NULL,
            PRIMARY KEY (service, sequence)
        )"""
    )
    db.execute(
        """CREATE TABLE rollout_state (
            service TEXT PRIMARY KEY REFERENCES services(name) ON DELETE CASCADE,
            state BYTEA NOT NULL
        )"""
    )


def _postgres_7(db: Any) -> None:
    """Leases: who leads the controllers sharing this store (docs/ha.md)."""
    db.execute(LEASES_POSTGRES)


POSTGRES: tuple[Migration, ...] = (
    _postgres_1,
    _postgres_2,
    _postgres_3,
    _postgres_4,
    store_jobs.migrate_jobs_postgres,
    _postgres_6,
    _postgres_7,
)
"""PostgreSQL's forward migrations, number for number the same schema as `SQLITE`."""

SCHEMA_VERSION = len(SQLITE)
"""The schema version this code writes, on either backend."""

# ---- the lease table -------------------------------------------------------------------------
# Who leads the controllers sharing a store (docs/ha.md): migration 7. IF NOT EXISTS: a store
# that took part in an election before the migration existed made it on first use.

LEASES_SQLITE = """CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    address TEXT NOT NULL DEFAULT '',
    expires REAL NOT NULL
) STRICT"""

LEASES_POSTGRES = """CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    epoch BIGINT NOT NULL,
    address TEXT NOT NULL DEFAULT '',
    expires DOUBLE PRECISION NOT NULL
)"""

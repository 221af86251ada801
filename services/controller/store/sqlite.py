"""The store on one SQLite file (the default: one controller on one machine)."""

from __future__ import annotations

import os
import sqlite3

from services.controller.store import base, schema


def migrate(db: sqlite3.Connection, *, target: int | None = None) -> int:
    """Apply the pending migrations up to `target`, each in its own transaction.

    Args:
        db: a connection in autocommit mode (isolation_level=None).
        target: schema version to reach (default: the newest); tests pass a lower one to
            build an old database.

    Returns:
        The schema version after migrating.

    Raises:
        schema.SchemaError: the file's schema is newer than this code knows.
    """
    migrations = schema.SQLITE
    target = len(migrations) if target is None else target
    current = int(db.execute("PRAGMA user_version").fetchone()[0])
    if current > len(migrations):
        raise schema.SchemaError(f"store schema version {current} is newer than this controller ({len(migrations)})")
    while current < target:
        # BEGIN IMMEDIATE, then re-read: another process may have migrated meanwhile.
        db.execute("BEGIN IMMEDIATE")
        try:
            current = int(db.execute("PRAGMA user_version").fetchone()[0])
            if current < target:
                migrations[current](db)
                current += 1
                db.execute(f"PRAGMA user_version = {current:d}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    return current


class SqliteStore(base.Store):
    """The store in a SQLite file in WAL mode; writers take the file's lock up front."""

    leases_ddl = schema.LEASES_SQLITE
    db_errors = (sqlite3.Error,)
    integrity_errors = (sqlite3.IntegrityError,)

    @staticmethod
    def opens(path: str) -> bool:
        """A file path, or `sqlite:PATH`."""
        return path.startswith("sqlite:") or "://" not in path

    def __init__(self, path: str, *, synchronous: str = "FULL", busy_timeout_s: float = 5.0) -> None:
        """Open (creating if needed) the database at `path` and migrate it.

        Args:
            path: the database file (a `sqlite:` prefix is allowed); its directory is created
                (mode 0700).
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
        self._setup()
        self._synchronous = synchronous
        self._busy_timeout_s = busy_timeout_s
        self.path = self.location = os.path.abspath(path.removeprefix("sqlite:"))
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        if not os.path.exists(self.path):
            # Specs carry probe headers and secrets: create the file private. SQLite gives the
            # -wal and -shm files the same permissions as the database. An existing file is left
            # alone: another connection in this process may have it open, and touching it
            # (re-creating, truncating) could lose that connection's commits.
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
            os.close(fd)
        self._db = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        try:
            self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000):d}")
            mode = self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise RuntimeError(f"could not put {self.path} in WAL mode (got {mode})")
            self._db.execute(f"PRAGMA synchronous = {synchronous.upper()}")
            self._db.execute("PRAGMA foreign_keys = ON")
            migrate(self._db)
        except BaseException:
            self._db.close()
            raise

    def _open_again(self, synchronous: str | None = None) -> SqliteStore:
        """Another connection to the same file, with the same settings (`synchronous` aside)."""
        return SqliteStore(self.path, synchronous=synchronous or self._synchronous, busy_timeout_s=self._busy_timeout_s)

    def _begin(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def _close(self) -> None:
        self._db.close()

    def schema_version(self) -> int:
        """The schema version of the open database."""
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _cause(self, exc: BaseException) -> tuple[str, str]:
        """(cause, words) for a SQLite error; extended codes (SQLITE_IOERR_WRITE) by their primary."""
        name = str(getattr(exc, "sqlite_errorname", "") or "")
        primary = "_".join(name.split("_")[:2])
        return _CAUSES.get(primary, ("error", "its state store failed"))


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

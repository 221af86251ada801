"""The controller's store: services, versions, replicas and autoscaler state.

One API (`Store`, base.py) on two backends: a SQLite file (sqlite.py, the default for one
controller on one machine) and PostgreSQL (postgres.py, for several controllers sharing one
database). `open_store` picks one from the `store_url` setting.
"""

from __future__ import annotations

import os

from services.controller.store import schema
from services.controller.store.base import DB_FILE, Store
from services.controller.store.leases import LEASE, FencedError, Lease
from services.controller.store.postgres import PostgresStore
from services.controller.store.rows import ServiceRow
from services.controller.store.schema import SchemaError
from services.controller.store.sqlite import SqliteStore, migrate

MIGRATIONS = schema.SQLITE
"""SQLite's migrations (schema.py has both backends')."""
SCHEMA_VERSION = schema.SCHEMA_VERSION

__all__ = [
    "DB_FILE",
    "LEASE",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "FencedError",
    "Lease",
    "PostgresStore",
    "SchemaError",
    "ServiceRow",
    "SqliteStore",
    "Store",
    "migrate",
    "open_store",
    "url_problem",
]


def url_problem(url: str) -> str:
    """Why `url` cannot name a store ("" when it can). Never quotes the URL (it may hold a password)."""
    if not url or url.startswith(("sqlite:", "postgresql://", "postgres://")):
        return ""
    if "://" in url:
        return "must be empty (a SQLite file in state_dir), sqlite:PATH or postgresql://..."
    return ""  # a plain path: a SQLite file


def open_store(url: str, *, state_dir: str, synchronous: str = "FULL", busy_timeout_s: float = 5.0) -> Store:
    """Open the store `url` names.

    Args:
        url: "" for `state.db` under `state_dir`; `sqlite:PATH` or a plain path for that
            SQLite file; `postgresql://user:password@host:port/db` for PostgreSQL.
        state_dir: the controller's state directory (`~` expanded).
        synchronous: FULL or NORMAL (see each backend).
        busy_timeout_s: how long a write waits for another writer.

    Returns:
        The open, migrated store.
    """
    if not url:
        url = os.path.join(os.path.expanduser(state_dir), DB_FILE)
    return Store(url, synchronous=synchronous, busy_timeout_s=busy_timeout_s)

"""The controller store's API and everything both backends share: transactions, errors, queries.

A backend (sqlite.py, postgres.py) supplies the connection: how a statement runs, how a write
transaction starts (one writer at a time on either backend), and how its errors read. The
queries below are written once, in SQL both SQLite and PostgreSQL accept; `?` placeholders
(the PostgreSQL backend turns them into its own) and `{greatest}` for the two-argument max.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from services.common import errors
from services.controller import store_history, store_jobs
from services.controller.store import catalog, leases, replicas
from services.controller.store.leases import Fence, FencedError

log = logging.getLogger("services.controller.store")

DB_FILE = "state.db"

_BACKENDS: list[type[Store]] = []
"""The backends in the order they are asked (PostgreSQL's URLs first; SQLite takes the rest)."""


class Store(
    catalog.ServiceTables, leases.LeaseTables, replicas.ReplicaTables, store_history.HistoryTables, store_jobs.JobTables
):
    """Store of services, versions, replicas and autoscaler state, on SQLite or PostgreSQL.

    `Store(path_or_url, ...)` opens the backend the argument names (see `open_store`); the
    annotations elsewhere use this class for either. Synchronous and fast: each call is one
    short transaction. Calls made inside a `with store.transaction():` block join that
    transaction. Do not `await` inside such a block: another task using the store meanwhile is
    refused with RuntimeError rather than silently joining someone else's transaction.
    """

    path: str
    """What opens this database again: a file path (SQLite) or the URL (PostgreSQL; it may hold
    a password, so never log it: `location` is the printable form)."""
    location: str
    """The database as logs name it (a path, or the URL without its password)."""
    greatest = "MAX"
    """The SQL function that returns the larger of two values."""
    leases_ddl = ""
    """The statement that creates the lease table (schema.py)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A backend is known once its module is imported (the package imports both), so this
        # module needs none of them: `Store(path)` asks each whether the path is its own.
        super().__init_subclass__(**kwargs)
        _BACKENDS.append(cls)

    def __new__(cls, path: str, **kwargs: Any) -> Store:
        """Open a PostgreSQL store for a postgresql:// URL, else a SQLite file."""
        if cls is not Store:
            return object.__new__(cls)
        for backend in _BACKENDS:
            if backend.opens(path):
                return object.__new__(backend)
        raise ValueError("no store backend opens this location")

    @staticmethod
    def opens(path: str) -> bool:
        """Whether this backend stores at `path` (a file path or a URL)."""
        return False

    @classmethod
    def in_state_dir(cls, state_dir: str, *, synchronous: str = "FULL", busy_timeout_s: float = 5.0) -> Store:
        """Open the SQLite file `state.db` under `state_dir` (`~` expanded).

        Args:
            state_dir: the controller's state directory.
            synchronous: as for the constructor.
            busy_timeout_s: as for the constructor.

        Returns:
            The open store.
        """
        path = os.path.join(os.path.expanduser(state_dir), DB_FILE)
        return cls(path, synchronous=synchronous, busy_timeout_s=busy_timeout_s)

    def _setup(self) -> None:
        """State every backend keeps; called by each backend's constructor first."""
        self._lock = threading.RLock()
        self._depth = 0
        self._owner: object = None
        self.writable = True
        self._last_failure = ""  # the detail last logged, so a failing heartbeat logs it once
        self._on_writable: Callable[[bool], None] | None = None
        self._on_write: Callable[[float, bool], None] | None = None
        self._fence: Fence | None = None
        self._leases_ready = False

    # ---- what a backend provides -----------------------------------------------------------

    db_errors: tuple[type[BaseException], ...] = ()
    """The backend's database exceptions (each becomes UnavailableError)."""
    integrity_errors: tuple[type[BaseException], ...] = ()
    """The backend's constraint violations (a row referring to a missing one)."""

    _db: Any
    """The connection: `execute(sql, params)` with `?` placeholders returns a cursor (fetchone,
    fetchall, rowcount). SQLite's own connection, or PostgreSQL's through a small adapter, so
    code written for one runs on the other where its SQL is portable."""

    def _begin(self) -> None:
        """Start a write transaction, waiting for any other writer first."""
        raise NotImplementedError

    def _cause(self, exc: BaseException) -> tuple[str, str]:
        """(cause, words) for a failed call: a short code, and what failed in a user's words."""
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    def schema_version(self) -> int:
        """The schema version of the open database."""
        raise NotImplementedError

    def _open_again(self, synchronous: str | None = None) -> Store:
        """Another connection to the same database, with the same settings (`synchronous` aside)."""
        raise NotImplementedError

    def _db_now(self) -> float:
        """The clock leases are measured on (the database server's, where it has one)."""
        return time.time()

    def reopen(self, *, fenced: bool = True, synchronous: str | None = None) -> Store:
        """Another connection to the same database, with the same settings (a thread wants its own).

        Args:
            fenced: the new connection's writes check the same lease epoch as this one's.
            synchronous: FULL or NORMAL for the new connection; None keeps this one's.
        """
        other = self._open_again(synchronous)
        if fenced:
            other._fence = self._fence
        return other

    # ---- opening and closing ---------------------------------------------------------------

    def close(self) -> None:
        """Close the database; the store is unusable afterwards."""
        with self._lock:
            self._close()

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
            log.error("the store does not take writes: %s", self.location)
        if self._on_writable is not None:
            self._on_writable(ok)

    def check_writable(self) -> bool:
        """Make one small write (a heartbeat); True if the store took it."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            with self.transaction():
                self._put_meta("heartbeat", stamp)
        except errors.UnavailableError:
            return False
        return True

    def controller_id(self) -> str:
        """This controller's stable identity, created on first use and kept in `meta`.

        The provisioner records it as the owner of every replica this controller launches, so
        two controllers sharing a provisioner never tear down each other's replicas.
        """
        query = "SELECT value FROM meta WHERE key = 'controller_id'"
        with self._read():
            row = self._db.execute(query).fetchone()
        if row is None:  # first start: the only write, so a store that takes none still opens later
            with self.transaction():
                self._db.execute(
                    "INSERT INTO meta (key, value) VALUES ('controller_id', ?) ON CONFLICT (key) DO NOTHING",
                    (secrets.token_hex(16),),
                )
                row = self._db.execute(query).fetchone()
        return str(row[0])

    def stored_controller_id(self) -> str:
        """The controller id kept in `meta`, or "" when there is none (nothing is written)."""
        with self._read():
            row = self._db.execute("SELECT value FROM meta WHERE key = 'controller_id'").fetchone()
        return "" if row is None else str(row[0])

    def set_controller_id(self, controller_id: str) -> None:
        """Keep `controller_id` in `meta` (a second copy: identity.py's file is the first)."""
        with self.transaction():
            self._put_meta("controller_id", controller_id)

    def _put_meta(self, key: str, value: str) -> None:
        self._db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    # ---- transactions --------------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Store]:
        """Atomic read-modify-write: one writer at a time, COMMIT, or ROLLBACK on exception.

        Nested blocks (and every store call inside the block) join the outer transaction; a
        nested block that raises rolls back only its own changes (a savepoint).

        Yields:
            This store.

        Raises:
            errors.UnavailableError: the store did not take the write: another writer held
                the lock past the busy timeout, the disk or the database server failed (reason
                STORE_UNAVAILABLE). `writable` turns false until a write succeeds again.
            RuntimeError: another asyncio task tried to use the store while a transaction
                was open (an `await` inside the block).
        """
        with self._lock:
            owner = _current_owner()
            if self._depth and owner is not self._owner:
                raise RuntimeError("store transaction held across an await by another task")
            if self._depth == 0:
                fence = self._fence
                if fence is not None and fence.lost:
                    raise FencedError()
                started = time.perf_counter()
                try:
                    self._begin()
                    if fence is not None:
                        self._check_fence(fence)
                except self.db_errors as exc:
                    self._rollback()
                    self._wrote(started, False)
                    raise self._unavailable(exc) from exc
                except BaseException:
                    self._rollback()
                    raise
                self._owner = owner
                self._depth = 1
                try:
                    yield self
                    self._db.execute("COMMIT")
                except self.db_errors as exc:
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
                    with contextlib.suppress(*self.db_errors):
                        self._db.execute(f"ROLLBACK TO SAVEPOINT {name}")
                        self._db.execute(f"RELEASE SAVEPOINT {name}")
                    raise
                else:
                    self._db.execute(f"RELEASE SAVEPOINT {name}")
                finally:
                    self._depth -= 1

    def _rollback(self) -> None:
        with contextlib.suppress(*self.db_errors):  # a failed COMMIT may have ended it already
            self._db.execute("ROLLBACK")

    def _unavailable(self, exc: BaseException, *, writing: bool = True) -> errors.UnavailableError:
        """The API's error for a failed store call: what failed, in the user's words.

        The database's own text names internals and can quote statements, paths or addresses,
        so it goes to the log (once per distinct failure, not every heartbeat) and never into
        the message.
        """
        cause, words = self._cause(exc)
        detail = f"{type(exc).__name__}: {exc}"
        operation = "write" if writing else "read"
        if detail != self._last_failure:
            self._last_failure = detail
            log.error("the store could not %s %s: %s", operation, self.location, detail)
        else:
            log.debug("the store could not %s %s again: %s", operation, self.location, detail)
        if writing:
            self._set_writable(False)
            message = f"the controller could not save the change: {words}; nothing was changed, try again later"
        else:
            message = f"the controller could not read its state: {words}; try again later"
        return errors.UnavailableError(message, reason="STORE_UNAVAILABLE", cause=cause, operation=operation)

    @contextlib.contextmanager
    def _read(self) -> Iterator[Any]:
        # A single SELECT is atomic on its own; the lock keeps threads off a half-open
        # transaction and the owner check keeps other tasks out of one.
        with self._lock:
            if self._depth and _current_owner() is not self._owner:
                raise RuntimeError("store transaction held across an await by another task")
            try:
                yield self._db
            except self.db_errors as exc:
                raise self._unavailable(exc, writing=False) from exc


def _current_owner() -> object:
    """Who is using the store: the running asyncio task, else the thread."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        task = None
    return task if task is not None else threading.current_thread()

"""The controller store's API and everything both backends share: transactions, errors, queries.

A backend (sqlite.py, postgres.py) supplies the connection: how a statement runs, how a write
transaction starts (one writer at a time on either backend), and how its errors read. The
queries below are written once, in SQL both SQLite and PostgreSQL accept; `?` placeholders
(the PostgreSQL backend turns them into its own) and `{greatest}` for the two-argument max.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2
from services.common import errors
from services.controller import store_history, store_jobs
from services.controller.store import rows

log = logging.getLogger("services.controller.store")

DB_FILE = "state.db"

LEASE = "controller"
"""The name of the lease the controllers sharing a store compete for."""

_ROWS_PER_INSERT = 100
"""Rows in one INSERT at most (5 parameters each: well under SQLite's limit of 32,766)."""


class FencedError(errors.UnavailableError):
    """A write of a controller that no longer leads: another took the lease (a newer epoch)."""

    def __init__(self) -> None:
        super().__init__(
            "this controller no longer leads (another controller took over); nothing was changed, try again",
            reason="NOT_LEADER",
        )


@dataclasses.dataclass(frozen=True)
class Lease:
    """The lease row: who leads, since which epoch, where it is reached, until when.

    Attributes:
        holder: the leading process's unique name (not the controller id, which they share).
        epoch: bumped each time the lease changes hands; every write of the leader checks it.
        address: host:port where the leader serves the API (standbys forward to it).
        expires: the database's clock, seconds since the epoch, when the lease lapses unless
            renewed.
        now: the database's clock when the row was read.
    """

    holder: str
    epoch: int
    address: str
    expires: float
    now: float

    @property
    def lapsed(self) -> bool:
        """True once nobody renewed it in time."""
        return self.now >= self.expires


@dataclasses.dataclass
class Fence:
    """What the leader's writes must find in the lease row; shared by a store and its reopen()s."""

    holder: str
    epoch: int
    on_lost: Callable[[], None] | None = None
    lost: bool = False


class Store(store_history.HistoryTables, store_jobs.JobTables):
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

    def __new__(cls, path: str, **kwargs: Any) -> Store:
        """Open a PostgreSQL store for a postgresql:// URL, else a SQLite file."""
        if cls is Store:
            from services.controller.store import postgres, sqlite  # the backends build on this module

            return object.__new__(postgres.PostgresStore if postgres.is_url(path) else sqlite.SqliteStore)
        return object.__new__(cls)

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

    # ---- leases and fencing ----------------------------------------------------------------

    def fence(self, holder: str, epoch: int, *, on_lost: Callable[[], None] | None = None) -> None:
        """From now on every write first checks that `holder` still holds the lease at `epoch`.

        A write that finds another holder or epoch raises FencedError and changes nothing; so
        does every write after it, and `on_lost` is called once (from the writing thread).
        """
        self._ensure_leases()
        self._fence = Fence(holder, epoch, on_lost)

    @property
    def fenced_out(self) -> bool:
        """True once a write found that this store's leader was deposed."""
        return self._fence is not None and self._fence.lost

    def _check_fence(self, fence: Fence) -> None:
        # Inside the write transaction, after the writer lock: a takeover (a write itself) is
        # either wholly before this check or wholly after this transaction.
        row = self._db.execute("SELECT holder, epoch FROM leases WHERE name = ?", (LEASE,)).fetchone()
        if row is not None and (str(row[0]), int(row[1])) == (fence.holder, fence.epoch):
            return
        first = not fence.lost
        fence.lost = True
        if first:
            log.error(
                "deposed: the lease is no longer %s's at epoch %d; nothing more is written", fence.holder, fence.epoch
            )
            if fence.on_lost is not None:
                fence.on_lost()
        raise FencedError()

    def _ensure_leases(self) -> None:
        if self._leases_ready:
            return
        with self.transaction():  # the writer lock keeps two controllers from creating it at once
            self._db.execute(self.leases_ddl)
        self._leases_ready = True

    def read_lease(self) -> Lease | None:
        """The lease row, or None before anyone took it."""
        self._ensure_leases()
        with self._read():
            now = self._db_now()
            row = self._db.execute(
                "SELECT holder, epoch, address, expires FROM leases WHERE name = ?", (LEASE,)
            ).fetchone()
        return None if row is None else Lease(str(row[0]), int(row[1]), str(row[2]), float(row[3]), now)

    def acquire_lease(self, holder: str, address: str, duration_s: float) -> Lease:
        """Take the lease if it is free, lapsed or already `holder`'s; renew it if it is ours.

        Returns:
            The lease after the attempt: `holder` leads if `lease.holder == holder`. Taking it
            from someone else (or for the first time) bumps the epoch.
        """
        self._ensure_leases()
        with self.transaction():
            now = self._db_now()
            row = self._db.execute("SELECT holder, epoch, expires FROM leases WHERE name = ?", (LEASE,)).fetchone()
            if row is None:
                self._db.execute(
                    "INSERT INTO leases (name, holder, epoch, address, expires) VALUES (?, ?, 1, ?, ?)",
                    (LEASE, holder, address, now + duration_s),
                )
            elif str(row[0]) == holder or float(row[2]) <= now:
                epoch = int(row[1]) + (str(row[0]) != holder)
                self._db.execute(
                    "UPDATE leases SET holder = ?, epoch = ?, address = ?, expires = ? WHERE name = ?",
                    (holder, epoch, address, now + duration_s, LEASE),
                )
            found = self._db.execute(
                "SELECT holder, epoch, address, expires FROM leases WHERE name = ?", (LEASE,)
            ).fetchone()
        return Lease(str(found[0]), int(found[1]), str(found[2]), float(found[3]), now)

    def renew_lease(self, holder: str, epoch: int, duration_s: float) -> bool:
        """Extend `holder`'s lease at `epoch`; False if it is no longer theirs (deposed)."""
        with self.transaction():
            cur = self._db.execute(
                "UPDATE leases SET expires = ? WHERE name = ? AND holder = ? AND epoch = ?",
                (self._db_now() + duration_s, LEASE, holder, epoch),
            )
            return bool(cur.rowcount)

    def release_lease(self, holder: str, epoch: int) -> None:
        """Let the lease lapse now, if it is still `holder`'s at `epoch` (a clean shutdown)."""
        with self.transaction():
            self._db.execute(
                "UPDATE leases SET expires = 0 WHERE name = ? AND holder = ? AND epoch = ?", (LEASE, holder, epoch)
            )

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

    # ---- services ------------------------------------------------------------------------

    def create_service(
        self, name: str, spec: spec_pb2.ServiceSpec, *, now: float, request_id: str = ""
    ) -> rows.ServiceRow:
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

    def get_service(self, name: str) -> rows.ServiceRow | None:
        """The service row, or None if there is no such service."""
        with self._read():
            return self._get_service(name)

    def list_services(self) -> list[rows.ServiceRow]:
        """Every service row, in name order."""
        with self._read():
            found = self._db.execute(f"SELECT {rows.SERVICE_COLUMNS} FROM services ORDER BY name").fetchall()
        return [rows.service_row(r) for r in found]

    def update_service(self, name: str, /, **fields: object) -> rows.ServiceRow:
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
        bad = sorted(set(fields) - rows.UPDATABLE)
        if bad:
            raise ValueError(f"update_service cannot set {', '.join(bad)}")
        with self.transaction():
            if fields:
                columns = sorted(fields)
                values = [rows.column_value(c, fields[c]) for c in columns]
                sets = ", ".join(f"{c} = ?" for c in columns)
                cur = self._db.execute(f"UPDATE services SET {sets} WHERE name = ?", (*values, name))
                if cur.rowcount == 0:
                    raise rows.not_found(name)
            row = self._get_service(name)
            if row is None:
                raise rows.not_found(name)
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
                f"SELECT {self.greatest}(latest_version, COALESCE((SELECT MAX(version) FROM versions "
                "WHERE service = ?), 0)) FROM services WHERE name = ?",
                (name, name),
            ).fetchone()
            if row is None:
                raise rows.not_found(name)
            version = int(row[0]) + 1
            self._insert_version(name, version, spec)
            when = time.time() if now is None else now
            self._history_insert(name, version, spec, now=when, mode=mode, rollback_of=rollback_of)
            self._db.execute("UPDATE services SET latest_version = ? WHERE name = ?", (version, name))
            return version

    def get_version(self, name: str, version: int) -> spec_pb2.ServiceSpec | None:
        """The spec of one version, or None if it is not stored (or deleted)."""
        with self._read():
            row = self._db.execute(
                "SELECT spec FROM versions WHERE service = ? AND version = ?", (name, version)
            ).fetchone()
        if row is None:
            return None
        spec = spec_pb2.ServiceSpec()
        spec.ParseFromString(bytes(row[0]))
        return spec

    def list_versions(self, name: str) -> list[int]:
        """The stored versions of a service, ascending."""
        with self._read() as db:
            found = db.execute("SELECT version FROM versions WHERE service = ? ORDER BY version", (name,)).fetchall()
        return [int(r[0]) for r in found]

    def delete_unreferenced_versions(self, name: str) -> list[int]:
        """Delete every version but the newest that no replica record references (spec §7.3).

        Returns:
            The deleted versions, ascending.
        """
        with self.transaction():
            found = self._db.execute(
                """DELETE FROM versions
                   WHERE service = ?
                     AND version < (SELECT latest_version FROM services WHERE name = ?)
                     AND version NOT IN (SELECT version FROM replicas WHERE service = ?)
                   RETURNING version""",
                (name, name, name),
            ).fetchall()
        return sorted(int(r[0]) for r in found)

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
                raise rows.not_found(name)
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
        # Two statements for the whole batch, not two per replica: the writer thread gives up the
        # GIL on every statement step and waits for it again behind the event loop.
        # A record given twice: the last one counts (one statement may not touch a row twice).
        top: dict[str, int] = {}
        latest: dict[tuple[str, int], tuple[str, int, int, int, bytes]] = {}
        for replica in replicas:
            if replica.replica_id < 1:
                raise ValueError(f"replica_id must be >= 1, got {replica.replica_id}")
            top[replica.service] = max(top.get(replica.service, 0), replica.replica_id)
            latest[replica.service, replica.replica_id] = (
                replica.service,
                replica.replica_id,
                int(replica.status),
                replica.version,
                replica.SerializeToString(),
            )
        values = list(latest.values())
        with self.transaction():
            for service, replica_id in top.items():
                cur = self._db.execute(
                    f"UPDATE services SET next_replica_id = {self.greatest}(next_replica_id, ?) WHERE name = ?",
                    (replica_id + 1, service),
                )
                if cur.rowcount == 0:
                    raise rows.not_found(service)
            for start in range(0, len(values), _ROWS_PER_INSERT):
                chunk = values[start : start + _ROWS_PER_INSERT]
                self._db.execute(
                    "INSERT INTO replicas (service, replica_id, status, version, data) VALUES "
                    + ", ".join(["(?, ?, ?, ?, ?)"] * len(chunk))
                    + " ON CONFLICT (service, replica_id) DO UPDATE SET "
                    "status = excluded.status, version = excluded.version, data = excluded.data",
                    [v for row in chunk for v in row],
                )

    def get_replica(self, name: str, replica_id: int) -> resources_pb2.Replica | None:
        """One replica record, or None."""
        with self._read():
            row = self._db.execute(
                "SELECT data FROM replicas WHERE service = ? AND replica_id = ?", (name, replica_id)
            ).fetchone()
        return None if row is None else rows.replica(row[0])

    def list_replicas(self, name: str, *, statuses: Iterable[int] | None = None) -> list[resources_pb2.Replica]:
        """The replica records of a service in id order, optionally only those in `statuses`."""
        sql = "SELECT data FROM replicas WHERE service = ?"
        params: list[object] = [name]
        if statuses is not None:
            wanted = [int(s) for s in statuses]
            if not wanted:
                return []
            sql += f" AND status IN ({', '.join('?' * len(wanted))})"
            params += wanted
        with self._read():
            found = self._db.execute(sql + " ORDER BY replica_id", params).fetchall()
        return [rows.replica(r[0]) for r in found]

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
                raise rows.not_found(name)
            self._db.execute(
                "INSERT INTO autoscaler_state (service, state) VALUES (?, ?) "
                "ON CONFLICT (service) DO UPDATE SET state = excluded.state",
                (name, bytes(state)),
            )

    def get_autoscaler_state(self, name: str) -> bytes | None:
        """A service's autoscaler state, or None if none was stored."""
        with self._read():
            row = self._db.execute("SELECT state FROM autoscaler_state WHERE service = ?", (name,)).fetchone()
        return None if row is None else bytes(row[0])

    # ---- helpers -------------------------------------------------------------------------

    def _exists(self, name: str) -> bool:
        return self._db.execute("SELECT 1 FROM services WHERE name = ?", (name,)).fetchone() is not None

    def _get_service(self, name: str) -> rows.ServiceRow | None:
        row = self._db.execute(f"SELECT {rows.SERVICE_COLUMNS} FROM services WHERE name = ?", (name,)).fetchone()
        return None if row is None else rows.service_row(row)

    def _insert_version(self, name: str, version: int, spec: spec_pb2.ServiceSpec) -> None:
        self._db.execute(
            "INSERT INTO versions (service, version, spec, yaml) VALUES (?, ?, ?, ?)",
            (name, version, spec.SerializeToString(), spec.yaml),
        )


def _current_owner() -> object:
    """Who is using the store: the running asyncio task, else the thread."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        task = None
    return task if task is not None else threading.current_thread()

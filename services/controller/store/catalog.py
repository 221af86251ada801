"""The store's services and their versions. `ServiceTables` is mixed into `Store`: its methods
join the store's transactions like every other store call."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable
from typing import Any

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2
from services.common import errors
from services.controller.store import rows


class ServiceTables:
    """The service and version methods of the store."""

    _db: Any  # the store's connection
    greatest: str
    _history_insert: Callable[..., None]  # store_history.HistoryTables, mixed in beside this

    def transaction(self) -> contextlib.AbstractContextManager[Any]:
        """The store's transaction (see `store.Store.transaction`)."""
        raise NotImplementedError

    def _read(self) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

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

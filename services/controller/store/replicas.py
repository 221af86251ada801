"""The store's replica records, replica id counter and autoscaler state. `ReplicaTables` is mixed
into `Store`: its methods join the store's transactions like every other store call."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

from replicaplane.controller.v1 import resources_pb2
from services.controller.store import rows

_ROWS_PER_INSERT = 100
"""Rows in one INSERT at most (5 parameters each: well under SQLite's limit of 32,766)."""


class ReplicaTables:
    """The replica and autoscaler-state methods of the store."""

    _db: Any  # the store's connection
    greatest: str
    _exists: Callable[[str], bool]  # catalog.ServiceTables, mixed in beside this

    def transaction(self) -> contextlib.AbstractContextManager[Any]:
        """The store's transaction (see `store.Store.transaction`)."""
        raise NotImplementedError

    def _read(self) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

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

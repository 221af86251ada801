"""What one service changed in memory and has not stored yet.

Memory holds the working copy of every record (what the controller knows now); the book lists
the rows that differ from the stored ones. A pass takes them as one `Batch`, written in one
transaction by the writer; a batch the store did not take goes back into the book and is
written with the next one, so nothing is lost and nothing runs ahead: drivers act on a change
only once its batch is stored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2 as res
from services.controller import store


@dataclasses.dataclass
class Batch:
    """The writes of one pass of one service."""

    service: str
    puts: list[res.Replica] = dataclasses.field(default_factory=list)
    deletes: list[int] = dataclasses.field(default_factory=list)
    state: bytes | None = None
    row: dict[str, Any] = dataclasses.field(default_factory=dict)
    versions: list[tuple[int, spec_pb2.ServiceSpec]] = dataclasses.field(default_factory=list)
    logs: list[str] = dataclasses.field(default_factory=list)  # logs to delete once stored

    def apply(self, db: store.Store) -> list[int]:
        """Write it (the caller holds the transaction); return the versions no longer needed.

        A batch of a service that is gone is dropped: its delete was stored after it was taken.
        """
        if db.get_service(self.service) is None:
            return []
        for version, spec in self.versions:
            got = db.add_version(self.service, spec)
            if got != version:
                raise RuntimeError(f"version {version} of {self.service} was stored as {got}")
        if self.puts:
            db.put_replicas(self.puts)
        for rid in self.deletes:
            db.delete_replica(self.service, rid)
        if self.state is not None:
            db.put_autoscaler_state(self.service, self.state)
        if self.row:
            db.update_service(self.service, **self.row)
        return db.delete_unreferenced_versions(self.service) if self.deletes else []

    @property
    def replica_ids(self) -> list[int]:
        return [r.replica_id for r in self.puts]


class Book:
    """Rows of one service changed since they were last stored."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._puts: set[int] = set()
        self._deletes: set[int] = set()
        self._state: bytes | None = None
        self._row: dict[str, Any] = {}
        self._versions: list[tuple[int, spec_pb2.ServiceSpec]] = []
        self._logs: list[str] = []

    def put(self, rid: int) -> None:
        self._puts.add(rid)
        self._deletes.discard(rid)

    def delete(self, rid: int, *, logs: str = "") -> None:
        self._puts.discard(rid)
        self._deletes.add(rid)
        if logs:
            self._logs.append(logs)

    def state(self, data: bytes) -> None:
        self._state = data

    def row(self, **fields: Any) -> None:
        self._row.update(fields)

    def version(self, version: int, spec: spec_pb2.ServiceSpec) -> None:
        self._versions.append((version, spec))

    def copy(self) -> Book:
        other = Book(self.service)
        other._puts, other._deletes, other._state = set(self._puts), set(self._deletes), self._state
        other._row, other._versions, other._logs = dict(self._row), list(self._versions), list(self._logs)
        return other

    def empty(self) -> bool:
        return not (self._puts or self._deletes or self._state is not None or self._row or self._versions)

    def take(self, replicas: dict[int, res.Replica]) -> Batch:
        """Everything pending as one batch (records copied as they are now); the book empties."""
        puts = []
        for rid in sorted(self._puts):
            r = replicas.get(rid)
            if r is not None:
                copy = res.Replica()
                copy.CopyFrom(r)
                puts.append(copy)
        batch = Batch(
            self.service,
            puts=puts,
            deletes=sorted(self._deletes),
            state=self._state,
            row=dict(self._row),
            versions=list(self._versions),
            logs=list(self._logs),
        )
        self.__init__(self.service)  # type: ignore[misc]
        return batch

    def restore(self, batch: Batch) -> None:
        """Put a batch the store did not take back; what changed since stays newer."""
        for rid in batch.replica_ids:
            if rid not in self._deletes:
                self._puts.add(rid)
        for rid in batch.deletes:
            if rid not in self._puts:
                self._deletes.add(rid)
        if self._state is None:
            self._state = batch.state
        self._row = {**batch.row, **self._row}
        self._versions = batch.versions + self._versions
        self._logs = batch.logs + self._logs

"""Rows of the controller store as Python values, and the conversions both backends share."""

from __future__ import annotations

import dataclasses
from typing import Any

from replicaplane.controller.v1 import resources_pb2
from services.common import errors

# Columns update_service may change. latest_version and next_replica_id are owned by
# add_version and allocate_replica_id, so ids and versions only ever move forward.
UPDATABLE = frozenset({"status", "status_message", "uptime_start", "update_mode", "deleting", "request_id"})

SERVICE_COLUMNS = (
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


def service_row(row: tuple[Any, ...]) -> ServiceRow:
    """A ServiceRow from a `SELECT SERVICE_COLUMNS` result."""
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


def column_value(column: str, value: Any) -> Any:
    """Normalise a value for its column (enums to int, bools to 0/1)."""
    if column == "deleting":
        return int(bool(value))
    if column in ("status", "update_mode"):
        return int(value)
    if column == "uptime_start":
        return None if value is None else float(value)
    return str(value)


def replica(data: bytes) -> resources_pb2.Replica:
    """A Replica from its stored bytes."""
    out = resources_pb2.Replica()
    out.ParseFromString(bytes(data))
    return out


def not_found(name: str) -> errors.NotFoundError:
    """The error of a write that needs a service that is not there."""
    return errors.NotFoundError(f"service {name!r} not found", reason="SERVICE_NOT_FOUND", service=name)

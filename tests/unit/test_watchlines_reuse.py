"""A service deleted and created again under the same name is printed afresh."""

from __future__ import annotations

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import watchlines


def _message(*replicas: res.Replica, deleted: bool = False, snapshot: bool = False) -> pb.WatchServiceResponse:
    svc = res.Service(name="web", status=res.SERVICE_STATUS_READY, total_replicas=1, ready_replicas=1)
    return pb.WatchServiceResponse(service=svc, replicas=replicas, deleted=deleted, snapshot=snapshot)


def test_a_service_created_again_under_its_name_is_printed_again() -> None:
    printer = watchlines.WatchPrinter()
    ready = res.Replica(service="web", replica_id=1, status=res.REPLICA_STATUS_READY, endpoint="http://127.77.0.1:8080")
    assert "web: replica 1 READY at http://127.77.0.1:8080 (1/1 ready)" in printer.lines(_message(ready, snapshot=True))
    # The deletion ends the stream before the replica's own removal is seen.
    assert printer.lines(_message(deleted=True)) == ["web: deleted"]
    again = printer.lines(_message(ready, snapshot=True))
    assert "web: replica 1 READY at http://127.77.0.1:8080 (1/1 ready)" in again
    assert "web: service READY (1/1 ready, versions -)" in again

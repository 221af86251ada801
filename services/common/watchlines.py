"""One readable line per replica or service status change of a WatchService stream."""

from __future__ import annotations

from typing import Any

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import resources_pb2


def enum_label(enum: Any, value: int, prefix: str) -> str:
    """`READY` for REPLICA_STATUS_READY; a value this client does not know shows as its number."""
    try:
        return str(enum.Name(value)).removeprefix(prefix)
    except ValueError:
        return f"UNKNOWN_{value}"


_FAILED = {
    resources_pb2.REPLICA_STATUS_FAILED,
    resources_pb2.REPLICA_STATUS_FAILED_CLEANUP,
    resources_pb2.REPLICA_STATUS_FAILED_INITIAL_DELAY,
    resources_pb2.REPLICA_STATUS_FAILED_PROBING,
    resources_pb2.REPLICA_STATUS_FAILED_PROVISION,
    resources_pb2.REPLICA_STATUS_UNKNOWN,
}
_HAS_ENDPOINT = {
    resources_pb2.REPLICA_STATUS_STARTING,
    resources_pb2.REPLICA_STATUS_READY,
    resources_pb2.REPLICA_STATUS_NOT_READY,
}


class WatchPrinter:
    """Turns WatchService messages into one line per replica or service status change."""

    def __init__(self) -> None:
        self._service_status: dict[str, int] = {}
        self._replica_status: dict[tuple[str, int], int] = {}
        self._reason: dict[tuple[str, int], str] = {}
        self._balancer_url: dict[str, str] = {}

    def lines(self, resp: pb.WatchServiceResponse) -> list[str]:
        """The lines for one message; empty when nothing visible changed."""
        svc = resp.service
        name = svc.name
        out: list[str] = []
        counts = f"({svc.ready_replicas}/{svc.total_replicas} ready)"
        if resp.snapshot:
            # A snapshot lists every replica: the ones we knew that are missing are gone.
            present = {r.replica_id for r in resp.replicas}
            for key in sorted(k for k in self._replica_status if k[0] == name and k[1] not in present):
                del self._replica_status[key]
                self._reason.pop(key, None)
                out.append(f"{name}: replica {key[1]} removed {counts}")
        for replica in sorted(resp.replicas, key=lambda r: r.replica_id):
            key = (name, replica.replica_id)
            reason = replica.failure_reason
            # A new reason in the same status is news too: a launch attempt that failed and is
            # being retried, an app that exited while its probes still pass.
            news = bool(reason) and self._reason.get(key) != reason and replica.status not in _FAILED
            if self._replica_status.get(key) == replica.status and not news:
                self._reason[key] = reason
                continue
            self._replica_status[key] = replica.status
            self._reason[key] = reason
            status = enum_label(resources_pb2.ReplicaStatus, replica.status, "REPLICA_STATUS_")
            line = f"{name}: replica {replica.replica_id} {status}"
            if replica.status in _HAS_ENDPOINT and replica.endpoint:
                line += f" at {replica.endpoint}"
            if replica.status in _FAILED and reason:
                line += f" ({reason})"
            elif reason:
                line += f": {reason}"
            out.append(f"{line} {counts}")
        for replica_id in sorted(resp.removed_replica_ids):
            self._reason.pop((name, replica_id), None)
            if self._replica_status.pop((name, replica_id), None) is not None:
                out.append(f"{name}: replica {replica_id} removed {counts}")
        if resp.deleted:
            # Forget it whole: a service created again under this name starts afresh.
            self._service_status.pop(name, None)
            self._balancer_url.pop(name, None)
            for key in [k for k in self._replica_status if k[0] == name]:
                del self._replica_status[key]
                self._reason.pop(key, None)
            out.append(f"{name}: deleted")
        elif self._service_status.get(name) != svc.status:
            self._service_status[name] = svc.status
            status = enum_label(resources_pb2.ServiceStatus, svc.status, "SERVICE_STATUS_")
            versions = ",".join(str(v) for v in svc.active_versions) or "-"
            line = f"{name}: service {status} {counts[:-1]}, versions {versions})"
            if svc.status_message:
                line += f": {svc.status_message}"
            out.append(line)
        if not resp.deleted and svc.load_balancer_url and self._balancer_url.get(name) != svc.load_balancer_url:
            self._balancer_url[name] = svc.load_balancer_url
            out.append(f"{name}: endpoint {svc.load_balancer_url} (load balancer)")
        return out

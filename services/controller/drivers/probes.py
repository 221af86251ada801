"""Probe driver: keeps the prober fleet's targets equal to the replicas that should be probed."""

from __future__ import annotations

from typing import Protocol

from replicaplane.prober.v1 import prober_service_pb2 as prober_pb


class ProbeSink(Protocol):
    """The part of the probe fleet a service uses."""

    def upsert(self, target: prober_pb.ProbeTarget) -> None: ...
    def remove(self, target_id: str) -> None: ...


def target_id(service: str, replica_id: int) -> str:
    """Probe target id of a replica: keyed by id, never by URL."""
    return f"{service}/{replica_id}"


class Probes:
    """The probe targets of one service."""

    def __init__(self, service: str, sink: ProbeSink) -> None:
        self._service = service
        self._sink = sink
        self._targets: dict[int, prober_pb.ProbeTarget] = {}

    def __contains__(self, rid: int) -> bool:
        return rid in self._targets

    def set(self, rid: int, target: prober_pb.ProbeTarget | None) -> None:
        """Probe `rid` with `target`, or stop probing it (None)."""
        if target is not None:
            if self._targets.get(rid) != target:
                self._targets[rid] = target
                self._sink.upsert(target)
        elif self._targets.pop(rid, None) is not None:
            self._sink.remove(target_id(self._service, rid))

    def clear(self) -> None:
        for rid in list(self._targets):
            self.set(rid, None)

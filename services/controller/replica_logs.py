"""Replica logs through the public API: checked, then streamed from the provisioner."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.common import errors, spec

if TYPE_CHECKING:
    from services.controller.reconciler import ServiceReconciler

_LOG_KINDS: dict[int, prov_res.LogKind.ValueType] = {
    api.REPLICA_LOG_KIND_UNSPECIFIED: prov_res.LOG_KIND_APP,
    api.REPLICA_LOG_KIND_APP: prov_res.LOG_KIND_APP,
    api.REPLICA_LOG_KIND_LAUNCH: prov_res.LOG_KIND_LAUNCH,
}


async def stream(
    provisioner: prov_grpc.ProvisionerServiceStub,
    find: Callable[[str], ServiceReconciler],
    name: str,
    replica_id: int,
    kind: int,
    *,
    follow: bool,
) -> AsyncIterator[bytes]:
    """A replica's log (app output or launch log) as the provisioner streams it.

    Raises:
        errors.ValidationError: empty or too long service name, replica id below 1, unknown kind.
        errors.NotFoundError: no such service or replica, or the provisioner has no log of it.
        errors.UnavailableError: the provisioner could not be reached.
    """
    violations = []
    if not name:
        violations.append(errors.FieldViolation("service_name", "required"))
    elif len(name) > spec.MAX_NAME_LEN:
        violations.append(errors.FieldViolation("service_name", f"at most {spec.MAX_NAME_LEN} characters"))
    if replica_id < 1:
        violations.append(errors.FieldViolation("replica_id", f"must be >= 1, got {replica_id}"))
    if kind not in _LOG_KINDS:
        violations.append(errors.FieldViolation("kind", f"unknown log kind {kind}"))
    errors.require(violations)
    replica = find(name).replica(replica_id)
    request = prov_pb.StreamLogsRequest(name=replica.replica_name, kind=_LOG_KINDS[kind], follow=follow)
    try:
        async for chunk in provisioner.StreamLogs(request):
            yield chunk.data
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            raise errors.NotFoundError(
                f"no logs of replica {replica_id} of service {name!r}",
                reason="LOGS_NOT_FOUND",
                service=name,
                replica_id=replica_id,
            ) from None
        if exc.code() == grpc.StatusCode.CANCELLED:
            return
        raise errors.UnavailableError(
            f"could not read the logs from the provisioner: {exc.code().name}", reason="PROVISIONER_UNAVAILABLE"
        ) from None

"""Log cleanup driver: a failed replica's logs were kept for the user; they go with its record."""

from __future__ import annotations

import asyncio
import logging

import grpc
import tenacity

from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from services.controller import retries
from services.controller.drivers.launches import PERMANENT_CODES

log = logging.getLogger(__name__)


class Logs:
    """Deletes replicas' logs at the provisioner, in the background."""

    def __init__(self, provisioner: prov_grpc.ProvisionerServiceStub, *, policy: retries.Policy = retries.LOGS) -> None:
        self._prov = provisioner
        self._policy = policy
        self._tasks: set[asyncio.Task[None]] = set()

    def delete(self, name: str) -> None:
        task = asyncio.create_task(self._delete(name), name=f"delete logs of {name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _delete(self, name: str) -> None:
        try:
            async for attempt in self._policy.retrying(grpc.aio.AioRpcError):
                with attempt:
                    try:
                        await self._prov.DeleteLogs(prov_pb.DeleteLogsRequest(name=name), timeout=10)
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() in PERMANENT_CODES:
                            log.info("logs of %s not deleted: %s", name, exc.code().name)
                            return
                        raise
        except (grpc.aio.AioRpcError, tenacity.RetryError):
            log.warning("could not delete the logs of %s: the provisioner is unreachable", name)

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

"""Launch driver: follows one `Provisioner.Launch` stream per replica, re-attaching by name when
it breaks, and hands every event back. Launch streams of the whole controller share a slot
pool (`max_launches_in_flight`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.controller import retries
from services.controller.drivers import tasks

log = logging.getLogger(__name__)

# Provisioner answers that retrying the same launch cannot fix.
PERMANENT_CODES = frozenset(
    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}
)


class Broke(Exception):
    """A stream ended or broke before its last event: open it again."""


class Launches:
    """The launch streams of one service."""

    def __init__(
        self,
        provisioner: prov_grpc.ProvisionerServiceStub,
        slots: asyncio.Semaphore,
        *,
        policy: retries.Policy = retries.STREAM,
    ) -> None:
        self._prov = provisioner
        self._slots = slots
        self._policy = policy
        self.tasks = tasks.Tasks()

    def start(
        self,
        rid: int,
        request: Callable[[], prov_pb.LaunchRequest | None],
        on_event: Callable[[prov_res.LaunchEvent], bool],
        on_refused: Callable[[str], None],
        metadata: Callable[[prov_pb.LaunchRequest], tuple[tuple[str, str], ...]] = lambda _: (),
    ) -> None:
        """Follow the launch of `rid` unless already followed.

        Args:
            rid: the replica id.
            request: the request to send now, or None when the launch is no longer wanted.
            on_event: applies one event; True when the launch is over.
            on_refused: the provisioner refused the request itself (a permanent error).
            metadata: gRPC metadata for the call (the trace context).
        """
        if rid not in self.tasks:
            self.tasks.start(rid, self._follow(rid, request, on_event, on_refused, metadata), f"launch {rid}")

    async def _follow(
        self,
        rid: int,
        request: Callable[[], prov_pb.LaunchRequest | None],
        on_event: Callable[[prov_res.LaunchEvent], bool],
        on_refused: Callable[[str], None],
        metadata: Callable[[prov_pb.LaunchRequest], tuple[tuple[str, str], ...]],
    ) -> None:
        async with self._slots:
            async for attempt in self._policy.retrying(Broke):
                with attempt:
                    wanted = request()
                    if wanted is None:
                        return
                    try:
                        async for response in self._prov.Launch(wanted, metadata=metadata(wanted)):
                            if on_event(response.event):
                                return
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() in PERMANENT_CODES:
                            on_refused(exc.details() or exc.code().name)
                            return
                        log.info("launch of %s broke (%s); re-attaching", wanted.name, exc.code().name)
                        raise Broke from exc
                    except Exception as exc:
                        log.exception("following the launch of %s failed; re-attaching", wanted.name)
                        raise Broke from exc
                    raise Broke  # the stream ended without saying how the launch ended

"""Launch driver: follows each replica's launch at the provisioner, re-attaching by name when its
stream breaks, and hands every event back. Launches go over one shared `LaunchBatches` stream
(`mux.Mux`); a launch carrying a trace context, or any launch when the provisioner has no
`LaunchBatches`, gets a `Launch` stream of its own. Launches of the whole controller share a slot
pool (`max_launches_in_flight`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable

import grpc

from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.controller import retries
from services.controller.drivers import mux, tasks
from services.controller.drivers.mux import Broke, Refused, Superseded

log = logging.getLogger(__name__)

# Provisioner answers that retrying the same launch cannot fix.
PERMANENT_CODES = frozenset(
    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}
)
LaunchMux = mux.Mux[prov_pb.LaunchRequest, prov_pb.LaunchManyRequest, prov_res.LaunchEvent]


def launch_mux(provisioner: prov_grpc.ProvisionerServiceStub) -> LaunchMux:
    """Every launch of the controller on one `LaunchBatches` stream."""
    return mux.Mux(provisioner.LaunchBatches, prov_pb.LaunchBatchesRequest, prov_pb.LaunchManyRequest, "launch")


class Launches:
    """The launches of one service."""

    def __init__(
        self,
        provisioner: prov_grpc.ProvisionerServiceStub,
        slots: asyncio.Semaphore,
        *,
        policy: retries.Policy = retries.STREAM,
        mux: LaunchMux | None = None,
    ) -> None:
        self._prov = provisioner
        self._slots = slots
        self._policy = policy
        self._mux = mux
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
            metadata: gRPC metadata for the call (the trace context): a launch with some goes
                on a stream of its own, so the provisioner's span of it has the right parent.
        """
        if rid not in self.tasks:
            self.tasks.start(rid, self._follow(rid, request, on_event, on_refused, metadata), f"launch {rid}")

    def _events(
        self, wanted: prov_pb.LaunchRequest, metadata: tuple[tuple[str, str], ...]
    ) -> AsyncGenerator[prov_res.LaunchEvent, None]:
        if self._mux is not None and self._mux.supported and not metadata:
            return self._mux.follow(wanted)
        return self._own_stream(wanted, metadata)

    async def _own_stream(
        self, wanted: prov_pb.LaunchRequest, metadata: tuple[tuple[str, str], ...]
    ) -> AsyncGenerator[prov_res.LaunchEvent, None]:
        async for response in self._prov.Launch(wanted, metadata=metadata):
            yield response.event

    async def _follow(
        self,
        rid: int,
        request: Callable[[], prov_pb.LaunchRequest | None],
        on_event: Callable[[prov_res.LaunchEvent], bool],
        on_refused: Callable[[str], None],
        metadata: Callable[[prov_pb.LaunchRequest], tuple[tuple[str, str], ...]],
    ) -> None:
        async with self._slots:
            await self._policy.run(lambda _: self._attempt(request, on_event, on_refused, metadata), Broke)

    async def _attempt(
        self,
        request: Callable[[], prov_pb.LaunchRequest | None],
        on_event: Callable[[prov_res.LaunchEvent], bool],
        on_refused: Callable[[str], None],
        metadata: Callable[[prov_pb.LaunchRequest], tuple[tuple[str, str], ...]],
    ) -> None:
        """Follow the launch once, until it ends.

        Raises:
            Broke: the stream broke first: follow it again.
        """
        wanted = request()
        if wanted is None:
            return
        try:
            async with contextlib.aclosing(self._events(wanted, metadata(wanted))) as events:
                async for event in events:
                    if on_event(event):
                        return
        except Refused as exc:
            if exc.code in PERMANENT_CODES:
                on_refused(exc.details or exc.code.name)
                return
            log.info("launch of %s broke (%s); re-attaching", wanted.name, exc.code.name)
            raise Broke from exc
        except grpc.aio.AioRpcError as exc:
            if exc.code() in PERMANENT_CODES:
                on_refused(exc.details() or exc.code().name)
                return
            log.info("launch of %s broke (%s); re-attaching", wanted.name, exc.code().name)
            raise Broke from exc
        except Superseded:
            return
        except Broke:
            raise
        except Exception as exc:
            log.exception("following the launch of %s failed; re-attaching", wanted.name)
            raise Broke from exc
        raise Broke  # the stream ended without saying how the launch ended

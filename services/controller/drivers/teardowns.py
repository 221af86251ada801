"""Teardown driver: follows each replica's teardown at the provisioner until the replica is gone or
the teardown failed, following it again (without drain) when its stream breaks. Teardowns go over
one shared `TerminateBatches` stream (`mux.Mux`); when the provisioner has none, each gets a
`Terminate` stream of its own."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Callable

import grpc

from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.common import pbtime
from services.controller import retries
from services.controller.drivers import mux, tasks
from services.controller.drivers.mux import Broke

log = logging.getLogger(__name__)

TE = prov_res.TerminateEventType


TeardownMux = mux.Mux[prov_pb.TerminateRequest, prov_pb.TerminateManyRequest, prov_res.TerminateEvent]


def teardown_mux(provisioner: prov_grpc.ProvisionerServiceStub) -> TeardownMux:
    """Every teardown of the controller on one `TerminateBatches` stream."""
    return mux.Mux(
        provisioner.TerminateBatches, prov_pb.TerminateBatchesRequest, prov_pb.TerminateManyRequest, "terminate"
    )


class Teardowns:
    """The teardowns of one service."""

    def __init__(
        self,
        provisioner: prov_grpc.ProvisionerServiceStub,
        *,
        policy: retries.Policy = retries.STREAM,
        mux: TeardownMux | None = None,
    ) -> None:
        self._prov = provisioner
        self._policy = policy
        self._mux = mux
        self.tasks = tasks.Tasks()

    def start(
        self,
        rid: int,
        name: str,
        *,
        drain_s: float,
        keep_logs: bool,
        on_event: Callable[[prov_res.TerminateEvent], bool],
        on_end: Callable[[int], None],
    ) -> None:
        """Tear `name` down unless already under way; `on_event` applies one event (True when
        the teardown is over), `on_end(rid)` runs once the task has ended, whatever the reason, and left
        `tasks`."""
        if rid not in self.tasks:
            self.tasks.start(
                rid, self._follow(name, drain_s, keep_logs, on_event), f"teardown {name}", on_done=lambda: on_end(rid)
            )

    async def _follow(
        self,
        name: str,
        drain_s: float,
        keep_logs: bool,
        on_event: Callable[[prov_res.TerminateEvent], bool],
    ) -> None:
        async def attempt(n: int) -> None:
            # The replica already left the ready set on the first try: never drain twice.
            drain = pbtime.duration(drain_s if n == 1 else 0.0)
            await self._attempt(prov_pb.TerminateRequest(name=name, drain=drain, keep_logs=keep_logs), on_event)

        await self._policy.run(attempt, Broke)

    async def _attempt(
        self, request: prov_pb.TerminateRequest, on_event: Callable[[prov_res.TerminateEvent], bool]
    ) -> None:
        """Follow the teardown once, until it ends.

        Raises:
            Broke: the stream broke (or the provisioner failed the call) first: follow it again.
        """
        try:
            async with contextlib.aclosing(self._events(request)) as events:
                async for event in events:
                    if on_event(event):
                        return
        except mux.Superseded:
            return
        except mux.Refused as exc:
            log.info("teardown of %s broke (%s); retrying", request.name, exc.code.name)
            raise Broke from exc
        except grpc.aio.AioRpcError as exc:
            log.info("teardown of %s broke (%s); retrying", request.name, exc.code().name)
            raise Broke from exc
        except Broke:
            raise
        except Exception as exc:
            log.exception("following the teardown of %s failed; retrying", request.name)
            raise Broke from exc
        raise Broke  # the stream ended without saying how the teardown ended

    def _events(self, request: prov_pb.TerminateRequest) -> AsyncGenerator[prov_res.TerminateEvent, None]:
        if self._mux is not None and self._mux.supported:
            return self._mux.follow(request)
        return self._own_stream(request)

    async def _own_stream(self, request: prov_pb.TerminateRequest) -> AsyncGenerator[prov_res.TerminateEvent, None]:
        async for response in self._prov.Terminate(request):
            yield response.event

    async def end_drain(self, name: str) -> None:
        """Ask again without drain: the provisioner cuts the drain in progress short; the
        teardown's own stream follows it to its end."""
        try:
            async for _ in self._prov.Terminate(prov_pb.TerminateRequest(name=name), timeout=120):
                pass
        except grpc.aio.AioRpcError as exc:
            log.info("could not end the drain of %s early: %s", name, exc.code().name)

"""Teardown driver: follows one `Provisioner.Terminate` stream per replica until the replica is
gone or the teardown failed, re-opening it (without drain) when it breaks."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.common import pbtime
from services.controller import retries
from services.controller.drivers import tasks
from services.controller.drivers.launches import Broke

log = logging.getLogger(__name__)

TE = prov_res.TerminateEventType


class Teardowns:
    """The teardown streams of one service."""

    def __init__(
        self, provisioner: prov_grpc.ProvisionerServiceStub, *, policy: retries.Policy = retries.STREAM
    ) -> None:
        self._prov = provisioner
        self._policy = policy
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
        async for attempt in self._policy.retrying(Broke):
            with attempt:
                request = prov_pb.TerminateRequest(name=name, drain=pbtime.duration(drain_s), keep_logs=keep_logs)
                drain_s = 0.0  # the replica already left the ready set; never drain twice
                try:
                    async for response in self._prov.Terminate(request):
                        if on_event(response.event):
                            return
                except grpc.aio.AioRpcError as exc:
                    log.info("teardown of %s broke (%s); retrying", name, exc.code().name)
                    raise Broke from exc
                except Exception as exc:
                    log.exception("following the teardown of %s failed; retrying", name)
                    raise Broke from exc
                raise Broke

    async def end_drain(self, name: str) -> None:
        """Ask again without drain: the provisioner cuts the drain in progress short; the
        teardown's own stream follows it to its end."""
        try:
            async for _ in self._prov.Terminate(prov_pb.TerminateRequest(name=name), timeout=120):
                pass
        except grpc.aio.AioRpcError as exc:
            log.info("could not end the drain of %s early: %s", name, exc.code().name)

"""The provisioner's `WatchReplicas` stream: every replica event routed to its service's loop as
a fact, orphans of this controller torn down, and the provisioner's zones for the spot placer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.controller import events, retries
from services.controller.drivers.mux import Broke

if TYPE_CHECKING:
    from services.controller.reconciler import ServiceReconciler

log = logging.getLogger(__name__)

RUNNING_STATES = (prov_res.REPLICA_STATE_QUEUED, prov_res.REPLICA_STATE_PROVISIONING, prov_res.REPLICA_STATE_RUNNING)


class ProvisionerWatch:
    """Follows the provisioner's replica events for every service of this controller."""

    def __init__(
        self,
        provisioner: prov_grpc.ProvisionerServiceStub,
        *,
        controller_id: str,
        services: Callable[[], dict[str, ServiceReconciler]],
        policy: retries.Policy = retries.STREAM,
    ) -> None:
        self._prov = provisioner
        self._controller_id = controller_id
        self._services = services
        self._policy = policy
        self.generation = 0
        self.zones: list[tuple[str, float]] = []
        self.zones_answered = False  # the provisioner answered ListZones (perhaps with none)
        self._foreign_logged: set[str] = set()
        self._orphan_tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Follow the stream for ever, re-opening it (from a snapshot) when it breaks."""
        async for attempt in self._policy.retrying(Broke):
            with attempt:
                await self._follow()

    async def _follow(self) -> None:
        seen: set[str] = set()
        self.generation += 1
        generation = self.generation
        try:
            # Always start from a snapshot: a restarted provisioner numbers events anew.
            async for response in self._prov.WatchReplicas(prov_pb.WatchReplicasRequest()):
                ev = response.event
                if ev.type == prov_res.REPLICA_EVENT_TYPE_SNAPSHOT_END:
                    for rec in self._services().values():
                        events.on_missing(rec, seen, generation)
                    continue
                if ev.type == prov_res.REPLICA_EVENT_TYPE_SNAPSHOT:
                    seen.add(ev.replica.name)
                self._route(ev)
        except grpc.aio.AioRpcError as exc:
            log.info("provisioner watch broke (%s); reconnecting", exc.code().name)
            raise Broke from exc
        except Exception as exc:
            log.exception("provisioner watch failed; reconnecting")
            raise Broke from exc
        raise Broke

    def _route(self, ev: prov_res.ReplicaEvent) -> None:
        if ev.replica.owner and ev.replica.owner != self._controller_id:
            # Another controller's replica on a shared provisioner: neither ours to reap nor
            # to apply (its service may share a name and replica id with one of ours).
            if ev.replica.name not in self._foreign_logged:
                self._foreign_logged.add(ev.replica.name)
                log.debug("ignoring replica %s: another controller owns it", ev.replica.name)
            return
        rec = self._services().get(ev.replica.service)
        if rec is not None and ev.replica.replica_id in rec.replicas:
            events.on_provisioner_event(rec, ev.replica.replica_id, ev)
        elif ev.type == prov_res.REPLICA_EVENT_TYPE_SNAPSHOT and ev.replica.state in RUNNING_STATES:
            # Ours (or launched before owners existed), running with no record: a leak.
            log.warning("tearing down replica %s: no controller record refers to it", ev.replica.name)
            task = asyncio.create_task(self._terminate_orphan(ev.replica.name))
            self._orphan_tasks.add(task)
            task.add_done_callback(self._orphan_tasks.discard)

    async def _terminate_orphan(self, name: str) -> None:
        try:
            async for _ in self._prov.Terminate(prov_pb.TerminateRequest(name=name)):
                pass
        except grpc.aio.AioRpcError as exc:
            log.warning("could not tear down orphan %s: %s", name, exc.code().name)

    async def load_zones(self) -> None:
        """The provisioner's zones, for the spot placer; left empty (the backend picks) while
        the provisioner does not answer, and asked again by the resync."""
        try:
            response = await self._prov.ListZones(prov_pb.ListZonesRequest(), timeout=2)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.zones_answered = True  # it has no zones to offer: as an empty answer
            log.info("zones not known yet (%s); the provisioner places spot replicas", exc.code().name)
            return
        self.zones = [(z.name, z.price_per_hour) for z in response.zones]
        self.zones_answered = True

    async def stop(self) -> None:
        tasks = list(self._orphan_tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

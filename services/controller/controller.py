"""The controller: the registry of service loops and the public operations on them (thin: the
checks are in `admission`, the work in each service's loop and `actions`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.prober.v1 import prober_service_pb2 as prober_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from services.common import errors, spec
from services.controller import (
    actions,
    admission,
    budget,
    events,
    hooks,
    orphans,
    pools,
    pools_api,
    provisioner_watch,
    reconciler,
    replica_api,
    resync,
    retries,
    store,
    traces,
    versions,
    view,
    wiring,
    writer,
)
from services.controller.drivers import launches, probes, teardowns

log = logging.getLogger(__name__)


class Controller(replica_api.ReplicaCalls):
    """Owns every service's loop, the provisioner watch, and probe result routing."""

    def __init__(
        self,
        *,
        db: store.Store,
        db_writer: writer.Writer,
        provisioner: prov_grpc.ProvisionerServiceStub,
        probes: probes.ProbeSink,
        tuning: reconciler.Tuning,
        controller_id: str = "",
        hub_observers: Sequence[Callable[[api.WatchServiceResponse], None]] = (),
        on_pass: Callable[[float], None] | None = None,
    ) -> None:
        self._db = db  # reads only: at start, and to read a service back after a refused write
        self._writer = db_writer
        self._prov = provisioner
        self._probes = probes
        self._tuning = tuning
        self._services: dict[str, reconciler.ServiceReconciler] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._probing_stale = False
        self.hooks = hooks.Hooks()
        if on_pass is not None:
            self.hooks.on_pass.append(lambda _service, seconds: on_pass(seconds))
        self.traces = traces.ReplicaTraces()
        # Each sees every change every service publishes.
        self._hub_observers = (*hub_observers, self.traces.published)
        # Sent with every launch; only replicas carrying it (or no owner) count as our orphans.
        # Kept outside the store (identity.py), so a lost store still knows its replicas.
        self.controller_id = controller_id or db.controller_id()
        self._launch_slots = asyncio.Semaphore(tuning.max_launches_in_flight)
        self._launch_mux = launches.launch_mux(provisioner)  # every service's launches on one stream
        self._teardown_mux = teardowns.teardown_mux(provisioner)  # and every teardown on another
        policy = retries.STREAM.with_times(tuning.reconnect_initial_s, tuning.reconnect_max_s)
        self.watch = provisioner_watch.ProvisionerWatch(
            provisioner, controller_id=self.controller_id, services=lambda: self._services, policy=policy
        )
        self.orphans = orphans.Orphans(provisioner=provisioner, controller_id=self.controller_id, records=self._records)
        self.budget = budget.Budget(self._services, tuning.max_replicas_total)
        self.versions = versions.Versions(db, db_writer, self._services, self._check_runnable, self.budget)
        self.jobs = pools_api.Jobs(lambda: self._services)

    @property
    def services(self) -> dict[str, reconciler.ServiceReconciler]:
        """Every service's loop by name (read only)."""
        return self._services

    async def start(self) -> None:
        """Recover every stored service, then follow the provisioner's replica events."""
        await self.watch.load_zones()
        for row in self._db.list_services():
            self._new_loop(reconciler.Loaded.read(self._db, row.name), created=False).start()
        reserved = self.budget.held()
        if reserved > self._tuning.max_replicas_total:
            log.warning(
                "the services hold %d replicas, more than max_replicas_total (%d): they keep running, "
                "but nothing may grow until they shrink",
                reserved,
                self._tuning.max_replicas_total,
            )
        self._tasks = [
            asyncio.create_task(self.watch.run(), name="provisioner watch"),
            asyncio.create_task(
                resync.run(
                    interval_s=self._tuning.sweep_interval_s,
                    services=lambda: self._services,
                    db_writer=self._writer,
                    before=self._zones_if_none,
                ),
                name="resync",
            ),
        ]

    async def _zones_if_unknown(self) -> None:
        # Before each create: until the provisioner has answered once (an answer with no zones
        # is asked again by the resync, not by every create).
        await (self.watch.load_zones() if not self.watch.zones_answered else asyncio.sleep(0))

    async def _zones_if_none(self) -> None:
        await (self.watch.load_zones() if not self.watch.zones else asyncio.sleep(0))

    async def stop(self) -> None:
        """Stop following; replicas and records stay for the next start."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.stop() for r in self._services.values()))
        await self._launch_mux.close()
        await self._teardown_mux.close()
        await self.watch.stop()
        await self.orphans.close()
        self.versions.close()

    def _records(self) -> orphans.Records:
        """Every replica record: service name -> replica id -> replica name."""
        return {name: {i: r.replica_name for i, r in rec.replicas.items()} for name, rec in self._services.items()}

    def _new_loop(self, loaded: reconciler.Loaded, *, created: bool) -> reconciler.ServiceReconciler:
        deps = reconciler.Deps(
            writer=self._writer,
            reader=self._db,
            provisioner=self._prov,
            probes=self._probes,
            tuning=self._tuning,
            on_gone=self._forget,
            hooks=self.hooks,
            watch_generation=lambda: self.watch.generation,
            zones=lambda: self.watch.zones,
            owner=self.controller_id,
            launch_slots=self._launch_slots,
            launch_mux=self._launch_mux,
            teardown_mux=self._teardown_mux,
            traces=self.traces,
            held_changed=self.budget.touched,
        )
        rec = reconciler.ServiceReconciler(loaded, deps)
        for observer in self._hub_observers:
            rec.hub.observe(observer)
        rec.probing_stale = self._probing_stale
        self._services[rec.name] = rec
        self.versions.attach(rec, created=created)
        return rec

    def _forget(self, name: str) -> None:
        self._services.pop(name, None)
        self.budget.touched(name)

    def _get(self, name: str) -> reconciler.ServiceReconciler:
        rec = self._services.get(name)
        if rec is None:
            raise errors.NotFoundError(f"service {name!r} not found", reason="SERVICE_NOT_FOUND", service=name)
        return rec

    async def _check_runnable(self, parsed: spec_pb2.ServiceSpec) -> None:
        await self._zones_if_unknown()
        await admission.check_runnable(self._prov, parsed, self.watch.zones)

    # ---- services ------------------------------------------------------------------------

    async def create_service(self, name: str, yaml_text: str, *, request_id: str = "") -> res.Service:
        """Validate and store a new service, then start its loop. A retry of the same request id
        returns the existing service; a store that refuses it leaves nothing behind."""
        parsed = spec.parse(yaml_text, name=name, require_name=True, replica_cap=self._tuning.max_replicas_per_service)
        name = spec.effective_name(parsed, name)
        existing = self._services.get(name)
        if existing is not None and request_id and existing.row.request_id == request_id:
            return existing.service()
        await self._check_runnable(parsed)
        # A name taken is refused by the store (ALREADY_EXISTS): no budget to check then.
        taken = name in self._services
        with contextlib.nullcontext() if taken else self.budget.reserve(name, parsed):
            loaded = await self._writer.submit(lambda db: wiring.create(db, name, parsed, request_id=request_id))
            if name in self._services:  # created meanwhile by a retry of the same request
                return self._services[name].service()
            rec = self._new_loop(loaded, created=True)
        rec.start()
        return rec.service()

    def get_service(self, name: str) -> res.Service:
        """A service."""
        return self._get(name).service()

    def list_services(self, page_size: int, page_token: str) -> tuple[list[res.Service], str]:
        """A page of services in name order; the token holds the last name of the page."""
        names, token = admission.page(
            sorted(self._services), page_size, page_token, kind="services", scope="", position_type=str
        )
        return [self._services[n].service() for n in names], token

    async def delete_service(self, name: str, *, purge: bool) -> res.Service:
        """Start deleting a service."""
        rec = self._get(name)
        await actions.delete(rec, purge=purge)
        return rec.service()

    async def update_service(
        self, name: str, yaml_text: str, *, mode: int, dry_run: bool
    ) -> tuple[res.Service, res.UpdatePlan]:
        """Update a service to a new spec (a new version), or return the plan on a dry run."""
        errors.require(admission.check_mode(mode))
        self._get(name)
        parsed = spec.parse(yaml_text, name=name, replica_cap=self._tuning.max_replicas_per_service)
        await self._check_runnable(parsed)
        rec = self._get(name)  # it may have gone while the check ran
        pools.check_update(rec, parsed)
        with self.budget.reserve(name, parsed):
            plan = await self.versions.update(rec, parsed, mode=mode, dry_run=dry_run)
        return rec.service(), plan

    # ---- replicas ------------------------------------------------------------------------

    # ---- streams and load ----------------------------------------------------------------

    def watchers(self) -> int:
        """WatchService and WatchEndpoints streams open over every service."""
        return sum(rec.hub.watchers for rec in self._services.values())

    def queue_depth(self) -> int:
        """Services whose pass is due and has not run yet."""
        return sum(1 for rec in self._services.values() if rec.passes.due)

    async def watch_service(self, name: str, after_sequence: int) -> AsyncIterator[api.WatchServiceResponse]:
        """A snapshot then every change of a service."""
        rec = self._get(name)
        async for msg in rec.hub.watch(after_sequence, lambda: view.snapshot(rec)):
            yield msg

    async def watch_endpoints(self, name: str, after_version: int) -> AsyncIterator[api.WatchEndpointsResponse]:
        """The ready endpoint set now and on every change."""
        rec = self._get(name)
        async for msg in rec.hub.watch_endpoints(after_version):
            yield msg

    def report_load(self, request: api.ReportLoadRequest) -> api.ReportLoadResponse:
        """Record a load report unless applied before (a bad field: nothing); answer the QPS seen."""
        report = admission.report_of(request)
        return self.versions.report(self._get(request.service_name), request, report)

    # ---- probe fleet callbacks -----------------------------------------------------------

    def on_probe_results(self, results: list[prober_pb.ProbeResult]) -> None:
        """Route probe results to their service's loop."""
        events.route_probe_results(self._services, results)

    def on_probe_stale(self, stale: bool) -> None:
        """No prober reachable (or reachable again)."""
        if stale:
            log.warning("no prober reachable: readiness is stale, nothing is torn down for it")
        self._probing_stale = stale
        for rec in self._services.values():
            if rec.probing_stale != stale:
                rec.probing_stale = stale
                rec.show()

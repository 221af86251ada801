"""The controller: the registry of service loops and the public operations on them (thin: the
checks are in `admission`, the work in each service's loop and `actions`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.prober.v1 import prober_service_pb2 as prober_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.common import errors, pagetoken, spec
from services.controller import (
    actions,
    admission,
    autoscaling,
    convert,
    events,
    hooks,
    orphans,
    provisioner_watch,
    reconciler,
    resync,
    retries,
    store,
    view,
    writer,
)
from services.controller.drivers import probes

log = logging.getLogger(__name__)

_MAX_PAGE = 1000


_LOG_KINDS: dict[int, prov_res.LogKind.ValueType] = {
    api.REPLICA_LOG_KIND_UNSPECIFIED: prov_res.LOG_KIND_APP,
    api.REPLICA_LOG_KIND_APP: prov_res.LOG_KIND_APP,
    api.REPLICA_LOG_KIND_LAUNCH: prov_res.LOG_KIND_LAUNCH,
}


class Controller:
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
        # Sent with every launch; only replicas carrying it (or no owner) count as our orphans.
        # Kept outside the store (identity.py), so a lost store still knows its replicas.
        self.controller_id = controller_id or db.controller_id()
        self._launch_slots = asyncio.Semaphore(tuning.max_launches_in_flight)
        policy = retries.STREAM.with_times(tuning.reconnect_initial_s, tuning.reconnect_max_s)
        self.watch = provisioner_watch.ProvisionerWatch(
            provisioner, controller_id=self.controller_id, services=lambda: self._services, policy=policy
        )
        self.orphans = orphans.Orphans(provisioner=provisioner, controller_id=self.controller_id, records=self._records)

    @property
    def services(self) -> dict[str, reconciler.ServiceReconciler]:
        """Every service's loop by name (read only)."""
        return self._services

    async def start(self) -> None:
        """Recover every stored service, then follow the provisioner's replica events."""
        await self.watch.load_zones()
        for row in self._db.list_services():
            self._new_loop(reconciler.Loaded.read(self._db, row.name)).start()
        reserved = sum(r.reserved_replicas() for r in self._services.values())
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
                    before=self._zones_if_unknown,
                ),
                name="resync",
            ),
        ]

    async def _zones_if_unknown(self) -> None:
        if not self.watch.zones:
            await self.watch.load_zones()

    async def stop(self) -> None:
        """Stop following; replicas and records stay for the next start."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.stop() for r in self._services.values()))
        await self.watch.stop()
        await self.orphans.close()

    def _records(self) -> orphans.Records:
        """Every replica record: service name -> replica id -> replica name."""
        return {name: {i: r.replica_name for i, r in rec.replicas.items()} for name, rec in self._services.items()}

    def _new_loop(self, loaded: reconciler.Loaded) -> reconciler.ServiceReconciler:
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
        )
        rec = reconciler.ServiceReconciler(loaded, deps)
        rec.probing_stale = self._probing_stale
        self._services[rec.name] = rec
        return rec

    def _forget(self, name: str) -> None:
        self._services.pop(name, None)

    def _get(self, name: str) -> reconciler.ServiceReconciler:
        rec = self._services.get(name)
        if rec is None:
            raise errors.NotFoundError(f"service {name!r} not found", reason="SERVICE_NOT_FOUND", service=name)
        return rec

    def _check_budget(self, name: str, parsed: spec_pb2.ServiceSpec) -> None:
        current = self._services.get(name)
        admission.check_budget(
            name,
            parsed,
            limit=self._tuning.max_replicas_total,
            current_most=None if current is None else current.most_replicas(),
            others=sum(rec.reserved_replicas() for other, rec in self._services.items() if other != name),
        )

    async def _check_runnable(self, parsed: spec_pb2.ServiceSpec) -> None:
        await self._zones_if_unknown()
        await admission.check_runnable(self._prov, parsed, self.watch.zones)

    # ---- services ------------------------------------------------------------------------

    async def create_service(self, name: str, yaml_text: str, *, request_id: str = "") -> res.Service:
        """Validate and store a new service, then start its loop.

        Raises:
            errors.ValidationError: every problem in the name and spec, nothing stored.
            errors.AlreadyExistsError: the name is taken (unless it is a retry of the same
                request id, which returns the existing service).
            errors.UnavailableError: the store did not take it; nothing was stored.
        """
        parsed = spec.parse(yaml_text, name=name, require_name=True, replica_cap=self._tuning.max_replicas_per_service)
        name = spec.effective_name(parsed, name)
        existing = self._services.get(name)
        if existing is not None and request_id and existing.row.request_id == request_id:
            return existing.service()
        await self._check_runnable(parsed)
        if name not in self._services:  # else the store says ALREADY_EXISTS
            self._check_budget(name, parsed)
        state = reconciler.facts.ScalerState(target=convert_min(parsed))

        def create(db: store.Store) -> reconciler.Loaded:
            # The row and the service's first state commit together.
            row = db.create_service(name, parsed, now=time.time(), request_id=request_id)
            db.put_autoscaler_state(name, state.dump())
            return reconciler.Loaded(row, {1: parsed}, state.dump(), [])

        loaded = await self._writer.submit(create)
        if name in self._services:  # created meanwhile by a retry of the same request
            return self._services[name].service()
        rec = self._new_loop(loaded)
        rec.start()
        return rec.service()

    def get_service(self, name: str) -> res.Service:
        """A service."""
        return self._get(name).service()

    def list_services(self, page_size: int, page_token: str) -> tuple[list[res.Service], str]:
        """A page of services in name order; the token holds the last name of the page."""
        admission.check_page_size(page_size)
        after = str(pagetoken.decode(page_token, "services", "", position_type=str)) if page_token else ""
        size = min(page_size or 100, _MAX_PAGE)
        names = sorted(n for n in self._services if n > after)
        page = names[:size]
        token = pagetoken.encode("services", "", page[-1]) if len(names) > size else ""
        return [self._services[n].service() for n in page], token

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
        self._check_budget(name, parsed)
        plan = await actions.update(rec, parsed, mode=mode, dry_run=dry_run)
        return rec.service(), plan

    # ---- replicas ------------------------------------------------------------------------

    def list_replicas(self, name: str, page_size: int, page_token: str) -> tuple[list[res.Replica], str]:
        """A page of a service's replicas in id order; the token holds the last id of the page."""
        admission.check_page_size(page_size)
        after = int(pagetoken.decode(page_token, "replicas", name, position_type=int)) if page_token else 0
        rec = self._get(name)
        size = min(page_size or 100, _MAX_PAGE)
        ids = sorted(i for i in rec.shown if i > after)
        page = ids[:size]
        token = pagetoken.encode("replicas", name, page[-1]) if len(ids) > size else ""
        return [rec.shown[i] for i in page], token

    def get_replica(self, name: str, replica_id: int) -> res.Replica:
        """One replica."""
        return self._get(name).replica(replica_id)

    async def terminate_replica(self, name: str, replica_id: int, *, purge: bool) -> res.Replica:
        """Terminate one replica (drained), or purge a failed record."""
        return await actions.terminate_replica(self._get(name), replica_id, purge=purge)

    async def purge_replicas(self, name: str) -> list[int]:
        """Purge every failed replica of a service."""
        return await actions.purge_failed(self._get(name))

    # ---- streams and load ----------------------------------------------------------------

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
        """Record a load report (and the reporting balancer's URL, if given) unless the same report
        was applied before; answer the QPS seen.

        Raises:
            errors.ValidationError: a malformed field (see `admission.report_of`); nothing is recorded.
            errors.NotFoundError: no such service.
        """
        report = admission.report_of(request)
        rec = self._get(request.service_name)
        if request.load_balancer_url:
            self.set_load_balancer_url(rec, request.load_balancer_url)
        qps, applied = autoscaling.report_load(rec, report, time.time())
        return api.ReportLoadResponse(
            qps=qps, already_applied=applied.already_applied, counted_requests=applied.counted
        )

    @staticmethod
    def set_load_balancer_url(rec: reconciler.ServiceReconciler, url: str) -> None:
        """Show `url` (the balancer that reports this service's load) as the service's endpoint."""
        if url != rec.load_balancer_url:
            rec.load_balancer_url = url  # memory only: the balancer reports again within seconds
            rec.show()

    async def stream_replica_logs(self, name: str, replica_id: int, kind: int, *, follow: bool) -> AsyncIterator[bytes]:
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
        replica = self._get(name).replica(replica_id)
        request = prov_pb.StreamLogsRequest(name=replica.replica_name, kind=_LOG_KINDS[kind], follow=follow)
        try:
            async for chunk in self._prov.StreamLogs(request):
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

    # ---- probe fleet callbacks -----------------------------------------------------------

    def on_probe_results(self, results: list[prober_pb.ProbeResult]) -> None:
        """Route probe results to their service's loop."""
        for result in results:
            service, _, rid = result.target_id.rpartition("/")
            rec = self._services.get(service)
            if rec is not None and rid.isdigit():
                try:
                    events.on_probe_result(rec, int(rid), result)
                except Exception:
                    # Probes repeat: one failure never drops the rest of the batch.
                    log.exception("could not apply a probe result of %s", result.target_id)

    def on_probe_stale(self, stale: bool) -> None:
        """No prober reachable (or reachable again)."""
        if stale:
            log.warning("no prober reachable: readiness is stale, nothing is torn down for it")
        self._probing_stale = stale
        for rec in self._services.values():
            if rec.probing_stale != stale:
                rec.probing_stale = stale
                rec.show()


def convert_min(parsed: spec_pb2.ServiceSpec) -> int:
    """The first target of a new service: its policy's minimum."""
    return convert.policy_of(parsed).min_replicas

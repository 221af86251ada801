"""The controller: the registry of service reconcilers and the public operations on them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.prober.v1 import prober_service_pb2 as prober_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.common import errors, localpaths, pagetoken, pbtime, spec
from services.controller import (
    convert,
    event_log,
    orphans,
    pools,
    pools_api,
    reconciler,
    store,
    store_history,
    traces,
)
from services.controller.domain import autoscaler, history, load, placer

log = logging.getLogger(__name__)

_MAX_PAGE = 1000
_CHECK_TIMEOUT_S = 5.0
_MAX_URL = 2048
_MAX_BALANCER_ID = 128


def _load_balancer_url_violations(url: str) -> list[errors.FieldViolation]:
    if not url:
        return []
    if len(url) > _MAX_URL or not url.startswith(("http://", "https://")) or not url.isprintable() or " " in url:
        return [
            errors.FieldViolation(
                "load_balancer_url", f"must be an http:// or https:// URL of at most {_MAX_URL} characters"
            )
        ]
    return []


def _report_of(request: api.ReportLoadRequest) -> load.Report:
    """A load report as plain values.

    Raises:
        errors.ValidationError: with every malformed field: a negative count, a time or age out of
            protobuf's range (or a negative age), a bad balancer identity or URL.
    """
    violations = []
    if request.request_count < 0:
        violations.append(errors.FieldViolation("request_count", f"must not be negative, got {request.request_count}"))
    violations += [
        errors.FieldViolation(f"request_times[{i}]", problem)
        for i, t in enumerate(request.request_times)
        if (problem := pbtime.timestamp_problem(t))
    ]
    violations += [
        errors.FieldViolation(f"request_ages[{i}]", problem)
        for i, d in enumerate(request.request_ages)
        if (problem := pbtime.duration_problem(d, negative=False))
    ]
    balancer_id, sequence = request.balancer_id, request.sequence
    if len(balancer_id) > _MAX_BALANCER_ID or not balancer_id.isprintable() or any(c.isspace() for c in balancer_id):
        violations.append(
            errors.FieldViolation("balancer_id", f"at most {_MAX_BALANCER_ID} printable characters without spaces")
        )
    if balancer_id and sequence < 1:
        violations.append(errors.FieldViolation("sequence", f"must be at least 1 with balancer_id, got {sequence}"))
    if not balancer_id and sequence:
        violations.append(errors.FieldViolation("balancer_id", "required when sequence is set"))
    violations += _load_balancer_url_violations(request.load_balancer_url)
    errors.require(violations, subject="load report")
    return load.Report(
        balancer_id=balancer_id,
        sequence=sequence,
        ages=[pbtime.seconds(d) for d in request.request_ages],
        times=[pbtime.from_timestamp(t) for t in request.request_times],
        count=request.request_count,
    )


_LOG_KINDS: dict[int, prov_res.LogKind.ValueType] = {
    api.REPLICA_LOG_KIND_UNSPECIFIED: prov_res.LOG_KIND_APP,
    api.REPLICA_LOG_KIND_APP: prov_res.LOG_KIND_APP,
    api.REPLICA_LOG_KIND_LAUNCH: prov_res.LOG_KIND_LAUNCH,
}


class Controller:
    """Owns every service's reconciler, the provisioner watch, and probe result routing."""

    def __init__(
        self,
        *,
        db: store.Store,
        provisioner: prov_grpc.ProvisionerServiceStub,
        probes: reconciler.ProbeSink,
        tuning: reconciler.Tuning,
        controller_id: str = "",
        hub_observers: Sequence[Callable[[api.WatchServiceResponse], None]] = (),
        on_pass: Callable[[float], None] | None = None,
    ) -> None:
        self._on_pass = on_pass
        self._db = db
        self.traces = traces.ReplicaTraces()
        # Each sees every change every service publishes.
        self._hub_observers = (*hub_observers, self.traces.published)
        self._prov = provisioner
        self._probes = probes
        self._tuning = tuning
        self._services: dict[str, reconciler.ServiceReconciler] = {}
        self._watch_task: asyncio.Task[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None
        self._probing_stale = False
        self._orphan_tasks: set[asyncio.Task[None]] = set()
        self._watch_generation = 0
        self._zones: list[tuple[str, float]] = []
        # Sent with every launch; only replicas carrying it (or no owner) count as our orphans.
        # Kept outside the store (identity.py), so a lost store still knows its replicas.
        self.controller_id = controller_id or db.controller_id()
        self._foreign_logged: set[str] = set()
        self._launch_slots = asyncio.Semaphore(tuning.max_launches_in_flight)
        self.orphans = orphans.Orphans(provisioner=provisioner, controller_id=self.controller_id, records=self._records)
        self.event_log = event_log.Events(db=db)
        # The pool side of each pool, by name (services have none).
        self._pools: dict[str, pools.PoolSide] = {}
        self.jobs = pools_api.Jobs(
            exists=lambda name: name in self._services,
            pool=self._pools.get,
            deleting=lambda name: (
                name in self._services
                and self._services[name].service().status
                in (res.SERVICE_STATUS_SHUTTING_DOWN, res.SERVICE_STATUS_FAILED_CLEANUP)
            ),
        )

    async def start(self) -> None:
        """Recover every stored service, then follow the provisioner's replica events."""
        await self._load_zones()
        for row in self._db.list_services():
            rec = self._new_reconciler(row.name)
            self.event_log.open(row.name, rec.replicas, rec.service())  # as recovered: no events for them
            rec.start()
        reserved = sum(r.reserved_replicas() for r in self._services.values())
        if reserved > self._tuning.max_replicas_total:
            log.warning(
                "the services hold %d replicas, more than max_replicas_total (%d): they keep running, "
                "but nothing may grow until they shrink",
                reserved,
                self._tuning.max_replicas_total,
            )
        self._watch_task = asyncio.create_task(self._watch_provisioner(), name="provisioner watch")
        self._sweep_task = asyncio.create_task(self._sweep(), name="sweep")

    async def stop(self) -> None:
        """Stop following; replicas and records stay for the next start."""
        for task in (self._watch_task, self._sweep_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*(r.stop() for r in self._services.values()))
        await self.orphans.close()
        await asyncio.to_thread(self.event_log.close)

    def _records(self) -> orphans.Records:
        """Every replica record: service name -> replica id -> replica name."""
        return {name: {i: r.replica_name for i, r in rec.replicas.items()} for name, rec in self._services.items()}

    def _new_reconciler(self, name: str) -> reconciler.ServiceReconciler:
        rec = reconciler.ServiceReconciler(
            name,
            db=self._db,
            provisioner=self._prov,
            probes=self._probes,
            tuning=self._tuning,
            on_gone=self._forget,
            watch_generation=lambda: self._watch_generation,
            zones=lambda: self._zones,
            owner=self.controller_id,
            launch_slots=self._launch_slots,
            traces=self.traces,
            on_pass=self._on_pass,
        )
        for observer in self._hub_observers:
            rec.hub.observe(observer)
        rec.set_probing_stale(self._probing_stale)
        rec.hub.observe(self.event_log.observe)
        self._services[name] = rec
        return rec

    def _forget(self, name: str) -> None:
        self._services.pop(name, None)
        self.event_log.forget(name)

    def _get(self, name: str) -> reconciler.ServiceReconciler:
        rec = self._services.get(name)
        if rec is None:
            raise errors.NotFoundError(f"service {name!r} not found", reason="SERVICE_NOT_FOUND", service=name)
        return rec

    # ---- services ------------------------------------------------------------------------

    async def create_service(self, name: str, yaml_text: str, *, request_id: str = "") -> res.Service:
        """Validate and store a new service, then start reconciling it.

        Raises:
            errors.ValidationError: every problem in the name and spec, nothing stored.
            errors.AlreadyExistsError: the name is taken (unless it is a retry of the same
                request id, which returns the existing service).
        """
        parsed = spec.parse(yaml_text, name=name, require_name=True, replica_cap=self._tuning.max_replicas_per_service)
        name = spec.effective_name(parsed, name)
        existing = self._db.get_service(name)
        if existing is not None and request_id and existing.request_id == request_id:
            return self._get(name).service()
        await self._check_runnable(parsed)
        if name not in self._services:  # else the store says ALREADY_EXISTS
            self._check_budget(name, parsed)
        # The row and the first writes of its reconciler commit together: a create answered
        # UNAVAILABLE ("nothing was changed") must not leave a service behind.
        rec: reconciler.ServiceReconciler | None = None
        try:
            with self._db.transaction():
                self._db.create_service(name, parsed, now=time.time(), request_id=request_id)
                rec = self._new_reconciler(name)
                self.event_log.open(name, {})
                rec.start()
        except BaseException:
            if rec is not None:
                self._forget(name)
                await rec.stop()
            raise
        self.event_log.record(name, event_log.Draft(event_log.NORMAL, "ServiceCreated", "created with version 1"))
        return rec.service()

    async def _check_runnable(self, parsed: spec_pb2.ServiceSpec) -> None:
        """Refuse a spec the provisioner cannot run (accelerators, missing workdir), naming fields.

        An unreachable provisioner does not block the API: the launch reports the problem then.
        A zone or region no zone of the provisioner matches is refused too (when its zones are
        known: backends that list none, such as kubernetes, place by the zone label instead).
        A relative workdir or file mount source is refused whatever the provisioner says.
        """
        relative = localpaths.relative_problems(parsed.workdir, parsed.file_mounts)
        hidden = spec.secret_values(parsed)  # a mount destination may hold a substituted secret
        errors.require(
            [errors.FieldViolation(spec.mask_secrets(v.field, hidden), v.description) for v in relative],
            subject="service spec",
        )
        try:
            answer = await self._prov.CheckSpec(prov_pb.CheckSpecRequest(spec=parsed), timeout=_CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not check the spec with the provisioner (%s); accepting it", exc.code().name)
            return
        if not self._zones:
            await self._load_zones()
        errors.require(
            [
                errors.FieldViolation(spec.mask_secrets(p.field, hidden), spec.mask_secrets(p.description, hidden))
                for p in answer.problems
            ]
            + [
                errors.FieldViolation(field, spec.mask_secrets(description, hidden))
                for field, description in placer.problems(self._zones, convert.places_of(parsed))
            ],
            subject="service spec",
        )

    def _check_budget(self, name: str, parsed: spec_pb2.ServiceSpec) -> None:
        """Refuse a spec that would take the services past max_replicas_total.

        Each service holds the most replicas its policy can run (or the replicas it still has,
        if more), so the autoscalers never need to ask. An update that does not raise its
        service's most always passes, even when the limit was lowered below what is held.

        Raises:
            errors.ResourceExhaustedError: naming the spec field that asks for too much.
        """
        limit = self._tuning.max_replicas_total
        want = autoscaler.most_replicas(convert.policy_of(parsed))
        current = self._services.get(name)
        if current is not None and want <= current.most_replicas():
            return
        others = sum(rec.reserved_replicas() for other, rec in self._services.items() if other != name)
        if others + want <= limit:
            return
        fixed = parsed.service.fixed_replicas_shorthand
        field = "service.replicas" if fixed else "service.replica_policy.max_replicas"
        raise errors.ResourceExhaustedError(
            f"{field}: the service may run up to {want} replicas, but other services hold {others} of the "
            f"controller's max_replicas_total ({limit}), so {max(limit - others, 0)} are left; shrink or "
            "delete a service, or raise the setting",
            reason="REPLICA_BUDGET_EXCEEDED",
            subject=field,
            limit_name="max_replicas_total",
            limit=limit,
            service=name,
            requested=want,
            held_by_others=others,
        )

    def get_service(self, name: str) -> res.Service:
        """A service."""
        return self._get(name).service()

    def list_services(self, page_size: int, page_token: str) -> tuple[list[res.Service], str]:
        """A page of services in name order; the token holds the last name of the page."""
        _check_page_size(page_size)
        after = str(pagetoken.decode(page_token, "services", "", position_type=str)) if page_token else ""
        size = min(page_size or 100, _MAX_PAGE)
        names = sorted(n for n in self._services if n > after)
        page = names[:size]
        token = pagetoken.encode("services", "", page[-1]) if len(names) > size else ""
        return [self._services[n].service() for n in page], token

    def delete_service(self, name: str, *, purge: bool) -> res.Service:
        """Start deleting a service."""
        rec = self._get(name)
        rec.delete(purge=purge)
        self.event_log.record(name, event_log.Draft(event_log.NORMAL, "DeleteRequested", "tearing down every replica"))
        return rec.service()

    async def update_service(
        self, name: str, yaml_text: str, *, mode: int, dry_run: bool
    ) -> tuple[res.Service, res.UpdatePlan]:
        """Update a service to a new spec (a new version), or return the plan on a dry run."""
        errors.require(_check_mode(mode))
        self._get(name)
        parsed = spec.parse(yaml_text, name=name, replica_cap=self._tuning.max_replicas_per_service)
        await self._check_runnable(parsed)
        rec = self._get(name)  # it may have gone while the check ran
        self._check_budget(name, parsed)
        plan = rec.update(parsed, mode=mode, dry_run=dry_run)
        if not dry_run:
            self._updated(name, plan, mode=mode)
        return rec.service(), plan

    def _updated(self, name: str, plan: res.UpdatePlan, *, mode: int, rollback_of: int = 0) -> None:
        """Note an applied update in the history and the event log."""
        mode = mode or res.UPDATE_MODE_ROLLING
        version = plan.new_version
        self._db.note_version(name, version, mode=mode, rollback_of=rollback_of)
        mode_name = res.UpdateMode.Name(mode)  # type: ignore[arg-type]
        how = "in place" if plan.in_place else mode_name.removeprefix("UPDATE_MODE_").lower()
        if rollback_of:
            message = f"rolled back to the spec of version {rollback_of} as version {version} ({how})"
            self.event_log.record(name, event_log.Draft(event_log.WARNING, "RolledBack", message, f"version/{version}"))
        else:
            message = f"updated to version {version} ({how})"
            draft = event_log.Draft(event_log.NORMAL, "ServiceUpdated", message, f"version/{version}")
            self.event_log.record(name, draft)

    async def rollback_service(
        self, name: str, to_version: int, *, dry_run: bool
    ) -> tuple[res.Service, res.UpdatePlan, int]:
        """Update a service to an earlier version's spec (a new version), or plan it on a dry run.

        The version rolled back from is marked rolled back in the history.

        Raises:
            errors.ValidationError: a negative `to_version`.
            errors.NotFoundError: no such service, or `to_version` is not in the history.
            errors.FailedPreconditionError: no earlier version to go back to; shutting down.
        """
        if to_version < 0:
            raise errors.ValidationError([errors.FieldViolation("to_version", f"must be >= 0, got {to_version}")])
        rec = self._get(name)
        latest = rec.service().latest_version
        kept = self._db.list_history(name)
        try:
            target = history.rollback_target([history.Kept(h.version, h.outcome) for h in kept], latest, to_version)
        except history.NoTarget as exc:
            if to_version and to_version != latest:
                raise errors.NotFoundError(
                    str(exc), reason="VERSION_NOT_FOUND", service=name, version=to_version
                ) from None
            raise errors.FailedPreconditionError(
                str(exc), reason="NO_ROLLBACK_TARGET", subject=f"services/{name}", service=name
            ) from None
        old = next(h.spec for h in kept if h.version == target)
        await self._check_runnable(old)
        rec = self._get(name)
        self._check_budget(name, old)
        plan = rec.update(old, mode=res.UPDATE_MODE_ROLLING, dry_run=dry_run)
        if not dry_run:
            self._db.set_version_outcome(
                name,
                latest,
                res.VERSION_OUTCOME_ROLLED_BACK,
                f"rolled back to version {target} by a user",
                now=time.time(),
            )
            self._updated(name, plan, mode=res.UPDATE_MODE_ROLLING, rollback_of=target)
        return rec.service(), plan, target

    def list_versions(self, name: str) -> list[res.ServiceVersion]:
        """A service's version history, oldest first."""
        self._get(name)
        return [store_history.version_proto(h) for h in self._db.list_history(name)]

    def list_events(self, name: str, page_size: int, page_token: str) -> tuple[list[res.Event], str]:
        """A page of a service's events, oldest first."""
        return self.event_log.list(name, page_size, page_token)

    async def watch_events(self, name: str, after_sequence: int) -> AsyncIterator[res.Event]:
        """A service's events after `after_sequence`, then each new one."""
        async for event in self.event_log.watch(name, after_sequence):
            yield event

    def promote_rollout(self, name: str, *, full: bool) -> res.Service:
        """Move a canary rollout on.

        Raises:
            errors.FailedPreconditionError: no canary rollout in progress (none can run yet).
        """
        rec = self._get(name)
        raise _no_rollout(name, rec.service())

    def abort_rollout(self, name: str) -> res.Service:
        """Abort a canary rollout.

        Raises:
            errors.FailedPreconditionError: no canary rollout in progress (none can run yet).
        """
        rec = self._get(name)
        raise _no_rollout(name, rec.service())

    # ---- replicas ------------------------------------------------------------------------

    def list_replicas(self, name: str, page_size: int, page_token: str) -> tuple[list[res.Replica], str]:
        """A page of a service's replicas in id order; the token holds the last id of the page."""
        _check_page_size(page_size)
        after = int(pagetoken.decode(page_token, "replicas", name, position_type=int)) if page_token else 0
        rec = self._get(name)
        size = min(page_size or 100, _MAX_PAGE)
        ids = sorted(i for i in rec.replicas if i > after)
        page = ids[:size]
        token = pagetoken.encode("replicas", name, page[-1]) if len(ids) > size else ""
        return [rec.replicas[i] for i in page], token

    def get_replica(self, name: str, replica_id: int) -> res.Replica:
        """One replica."""
        return self._get(name).replica(replica_id)

    def terminate_replica(self, name: str, replica_id: int, *, purge: bool) -> res.Replica:
        """Terminate one replica (drained), or purge a failed record."""
        return self._get(name).terminate_replica(replica_id, purge=purge)

    def purge_replicas(self, name: str) -> list[int]:
        """Purge every failed replica of a service."""
        return self._get(name).purge_failed()

    # ---- streams and load ----------------------------------------------------------------

    def watchers(self) -> int:
        """WatchService and WatchEndpoints streams open over every service."""
        return sum(rec.hub.watchers for rec in self._services.values())

    def queue_depth(self) -> int:
        """Services whose reconcile pass is due and has not run yet."""
        return sum(1 for rec in self._services.values() if rec.pass_due)

    async def watch_service(self, name: str, after_sequence: int) -> AsyncIterator[api.WatchServiceResponse]:
        """A snapshot then every change of a service."""
        rec = self._get(name)
        async for msg in rec.hub.watch(after_sequence, rec.snapshot):
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
            errors.ValidationError: a malformed field (see `_report_of`); nothing is recorded.
            errors.NotFoundError: no such service.
        """
        report = _report_of(request)
        rec = self._get(request.service_name)
        if request.load_balancer_url:
            rec.set_load_balancer_url(request.load_balancer_url)
        qps, applied = rec.report_load(report, time.time())
        return api.ReportLoadResponse(
            qps=qps, already_applied=applied.already_applied, counted_requests=applied.counted
        )

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
        """Route probe results to their service's reconciler."""
        for result in results:
            service, _, rid = result.target_id.rpartition("/")
            rec = self._services.get(service)
            if rec is not None and rid.isdigit():
                try:
                    rec.on_probe_result(int(rid), result)
                except Exception:
                    # Probes repeat: the next result of this replica is applied once the store
                    # takes writes again. One failure never drops the rest of the batch.
                    log.exception("could not apply a probe result of %s", result.target_id)

    def on_probe_stale(self, stale: bool) -> None:
        """No prober reachable (or reachable again)."""
        if stale:
            log.warning("no prober reachable: readiness is stale, nothing is torn down for it")
        self._probing_stale = stale
        for rec in self._services.values():
            rec.set_probing_stale(stale)

    # ---- provisioner watch ---------------------------------------------------------------

    async def _watch_provisioner(self) -> None:
        delay = self._tuning.reconnect_initial_s
        while True:
            seen: set[str] = set()
            self._watch_generation += 1
            generation = self._watch_generation
            try:
                # Always start from a snapshot: a restarted provisioner numbers events anew.
                async for response in self._prov.WatchReplicas(prov_pb.WatchReplicasRequest()):
                    delay = self._tuning.reconnect_initial_s
                    ev = response.event
                    if ev.type == prov_res.REPLICA_EVENT_TYPE_SNAPSHOT_END:
                        self._after_snapshot(seen, generation)
                        continue
                    if ev.type == prov_res.REPLICA_EVENT_TYPE_SNAPSHOT:
                        seen.add(ev.replica.name)
                    self._route(ev)
            except grpc.aio.AioRpcError as exc:
                log.info("provisioner watch broke (%s); reconnecting", exc.code().name)
            except Exception:
                # A store error while applying an event: the next snapshot replays the state.
                log.exception("provisioner watch failed; reconnecting")
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._tuning.reconnect_max_s)

    async def _load_zones(self) -> None:
        """The provisioner's zones, for the spot placer; left empty (the backend picks) while
        the provisioner does not answer, and asked again by the sweep."""
        try:
            response = await self._prov.ListZones(prov_pb.ListZonesRequest(), timeout=2)
        except grpc.aio.AioRpcError as exc:
            log.info("zones not known yet (%s); the provisioner places spot replicas", exc.code().name)
            return
        self._zones = [(z.name, z.price_per_hour) for z in response.zones]

    async def _sweep(self) -> None:
        """The level-triggered pass: events can be lost (a failed write, a dead task); every
        `sweep_interval_s` whatever should be in motion and is not gets going again."""
        while True:
            await asyncio.sleep(self._tuning.sweep_interval_s)
            if not self._zones:
                await self._load_zones()
            self._db.check_writable()
            for rec in list(self._services.values()):
                try:
                    rec.resync()
                except Exception:
                    log.exception("resync of service %s failed", rec.name)
                await asyncio.sleep(0)  # one service per step: the loop answers calls in between

    def _route(self, ev: prov_res.ReplicaEvent) -> None:
        if ev.replica.owner and ev.replica.owner != self.controller_id:
            # Another controller's replica on a shared provisioner: neither ours to reap nor
            # to apply (its service may share a name and replica id with one of ours).
            if ev.replica.name not in self._foreign_logged:
                self._foreign_logged.add(ev.replica.name)
                log.debug("ignoring replica %s: another controller owns it", ev.replica.name)
            return
        rec = self._services.get(ev.replica.service)
        if rec is not None and ev.replica.replica_id in rec.replicas:
            rec.on_provisioner_event(ev.replica.replica_id, ev)
        elif ev.type == prov_res.REPLICA_EVENT_TYPE_SNAPSHOT and ev.replica.state in (
            prov_res.REPLICA_STATE_QUEUED,
            prov_res.REPLICA_STATE_PROVISIONING,
            prov_res.REPLICA_STATE_RUNNING,
        ):
            # Ours (or launched before owners existed), running with no record: a leak. Tear it down.
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

    def _after_snapshot(self, seen: set[str], generation: int) -> None:
        for rec in self._services.values():
            rec.on_missing(seen, generation)


def _no_rollout(name: str, service: res.Service) -> errors.FailedPreconditionError:
    return errors.FailedPreconditionError(
        f"service {name!r} has no canary rollout in progress",
        reason="NO_ROLLOUT_IN_PROGRESS",
        subject=f"services/{name}",
        service=name,
        latest_version=service.latest_version,
    )


def _check_page_size(page_size: int) -> None:
    if page_size < 0:
        raise errors.ValidationError([errors.FieldViolation("page_size", f"must be >= 0, got {page_size}")])


def _check_mode(mode: int) -> list[errors.FieldViolation]:
    if mode in (res.UPDATE_MODE_UNSPECIFIED, res.UPDATE_MODE_ROLLING, res.UPDATE_MODE_BLUE_GREEN):
        return []
    return [errors.FieldViolation("mode", f"must be UPDATE_MODE_ROLLING or UPDATE_MODE_BLUE_GREEN, got {mode}")]

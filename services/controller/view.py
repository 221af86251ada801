"""What a service shows: the `Service` message (status derived by the domain), its endpoints,
the autoscaler's status, the probe target of a replica."""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.prober.v1 import prober_service_pb2 as prober_pb
from services.common import pbtime, spec
from services.controller.domain import autoscaler, failures, scaling
from services.controller.domain import status as st
from services.controller.drivers import probes

if TYPE_CHECKING:
    from services.controller.reconciler import ServiceReconciler

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Cache:
    """What is rebuilt only when it changes."""

    redacted: tuple[int, spec_pb2.ServiceSpec] = (0, spec_pb2.ServiceSpec())
    published_version: int = 0

    def without_unchanged_spec(self, svc: res.Service) -> res.Service:
        # The watch history holds ~1,000 messages per service: the spec (up to 1 MiB of YAML)
        # travels with the snapshot and with the change that brings a new version only.
        if svc.latest_version == self.published_version:
            svc.ClearField("spec")
        self.published_version = svc.latest_version
        return svc


def _service_facts(rec: ServiceReconciler) -> st.ServiceFacts:
    row = rec.row
    latest = str(row.latest_version)
    pause = failures.pause_message(rec.backoff, time.monotonic()) if rec.launch_wanted else ""
    return st.ServiceFacts(
        started=rec.started,
        deleting=row.deleting,
        cleanup_failed=row.status == res.SERVICE_STATUS_FAILED_CLEANUP,
        cleanup_message=row.status_message,
        replicas_left=len(rec.shown),
        target=rec.final_target(),
        stopped_message=rec.state.stopped.get(latest, ""),
        pause_message=pause,
        probing_stale=rec.probing_stale,
    )


class Endpoints:
    """The endpoint of every READY replica as stored, kept in step with each stored batch.

    The endpoints of the active versions are kept, by replica id, in two messages changed in
    place (an insert or a delete per change), so a service of 10,000 replicas shows them with one
    C-level copy instead of 10,000 Python calls; they are built again only when the active
    versions change. `generation` counts the changes.
    """

    def __init__(self, shown: Mapping[int, res.Replica]) -> None:
        self._by_id: dict[int, res.Endpoint] = {}
        self._active: tuple[int, ...] = ()
        self._ids: list[int] = []  # replica ids in the messages, in order
        self.service_part = res.Service()
        """A `Service` with only the endpoints of the active versions."""
        self.watch_part = api.WatchEndpointsResponse()
        """A `WatchEndpointsResponse` with only the same endpoints."""
        self.generation = 0
        self.stored(shown.values(), [])

    def stored(self, puts: Iterable[res.Replica], deletes: Iterable[int]) -> None:
        """These records were stored (`puts`) or removed (`deletes`)."""
        for r in puts:
            rid = r.replica_id
            if r.status == res.REPLICA_STATUS_READY:
                ep = self._by_id.get(rid)
                accelerator = r.accelerator or "unknown"
                if ep is None or (ep.url, ep.version, ep.accelerator) != (r.endpoint, r.version, accelerator):
                    self._drop(rid)
                    ep = res.Endpoint(replica_id=rid, url=r.endpoint, version=r.version, accelerator=accelerator)
                    self._by_id[rid] = ep
                    if ep.version in self._active:
                        at = bisect.bisect_left(self._ids, rid)
                        self._ids.insert(at, rid)
                        self.service_part.endpoints.insert(at, ep)
                        self.watch_part.endpoints.insert(at, ep)
                    self.generation += 1
            else:
                self._drop(rid)
        for rid in deletes:
            self._drop(rid)

    def _drop(self, rid: int) -> None:
        if self._by_id.pop(rid, None) is None:
            return
        self.generation += 1
        at = bisect.bisect_left(self._ids, rid)
        if at < len(self._ids) and self._ids[at] == rid:
            del self._ids[at]
            del self.service_part.endpoints[at]
            del self.watch_part.endpoints[at]

    def activate(self, active: Sequence[int]) -> None:
        """Keep the endpoints of `active` versions (built again only when they changed)."""
        key = tuple(active)
        if key == self._active:
            return
        self._active = key
        self._ids = sorted(rid for rid, ep in self._by_id.items() if ep.version in key)
        kept = [self._by_id[rid] for rid in self._ids]
        self.service_part = res.Service(endpoints=kept)
        self.watch_part = api.WatchEndpointsResponse(endpoints=kept)
        self.generation += 1

    def into(self, svc: res.Service, active: Sequence[int]) -> None:
        """Add the endpoints of the `active` versions to `svc`."""
        self.activate(active)
        svc.MergeFrom(self.service_part)


def service(rec: ServiceReconciler) -> res.Service:
    """The service as the API shows it: from the records as stored (their counts kept in step)."""
    statuses = rec.shown_views.statuses
    ready, total = st.ready_and_total(statuses)
    active = scaling.active_versions_of(
        rec.shown_views.ready_by_version,
        latest_version=rec.row.latest_version,
        target=rec.final_target(),
        blue_green=rec.row.update_mode == res.UPDATE_MODE_BLUE_GREEN,
    )
    sf = _service_facts(rec)
    row = rec.row
    svc = res.Service(
        name=rec.name,
        status=int(st.service_status_of(statuses, sf)),  # type: ignore[arg-type]
        status_message=st.status_message(statuses, sf),
        ready_replicas=ready,
        total_replicas=total,
        active_versions=active,
        latest_version=row.latest_version,
        spec=_shown_spec(rec),
        create_time=pbtime.timestamp(row.create_time),
        target_replicas=rec.final_target(),
        probing_stale=rec.probing_stale,
        update_mode=row.update_mode,  # type: ignore[arg-type]
        uid=row.uid,
        load_balancer_url=rec.load_balancer_url,
    )
    rec.endpoints.into(svc, active)
    if row.uptime_start is not None:
        svc.uptime_start_time.CopyFrom(pbtime.timestamp(row.uptime_start))
    svc.autoscaler.CopyFrom(_autoscaler_status(rec))
    if rec.pool is not None:
        rec.pool.show_service(svc)
    else:
        svc.kind = spec_pb2.FLEET_KIND_SERVICE
    if rec.rollout is not None:
        rec.rollout.decorate(svc)
    return svc


def snapshot(rec: ServiceReconciler) -> api.WatchServiceResponse:
    """The whole service for a new watcher."""
    from services.controller import pools

    replicas = pools.shown(rec, [rec.shown[i] for i in sorted(rec.shown)])
    return api.WatchServiceResponse(service=service(rec), replicas=replicas)


def store_status(rec: ServiceReconciler) -> None:
    """Keep the stored status and message equal to the derived ones (written with the batch)."""
    if rec.row.deleting or not rec.started:
        return
    statuses = rec.views.statuses
    sf = _service_facts(rec)
    status, message = int(st.service_status_of(statuses, sf)), st.status_message(statuses, sf)
    if status != rec.row.status or message != rec.row.status_message:
        rec.row = dataclasses.replace(rec.row, status=status, status_message=message)
        rec.book.row(status=status, status_message=message)


def _shown_spec(rec: ServiceReconciler) -> spec_pb2.ServiceSpec:
    # Probe headers and secrets never leave the controller in full.
    version = rec.row.latest_version
    if rec.view_cache.redacted[0] != version:
        rec.view_cache.redacted = (version, spec.redacted(rec.spec(version)))
    return rec.view_cache.redacted[1]


def _autoscaler_status(rec: ServiceReconciler) -> res.AutoscalerStatus:
    policy = rec.policy()
    out = res.AutoscalerStatus(
        kind=policy.kind,
        target_replicas=rec.final_target(),
        min_replicas=policy.min_replicas,
        max_replicas=policy.max_replicas,
        qps=autoscaler.qps(rec.state.window(), time.time(), window_s=rec.tuning.qps_window_s),
        last_decision_reason=rec.state.reason,
    )
    if rec.state.decided_at:
        out.last_decision_time.CopyFrom(pbtime.timestamp(rec.state.decided_at))
    return out


def probe_target(rec: ServiceReconciler, r: res.Replica) -> prober_pb.ProbeTarget:
    """A replica's probe target: path, body, headers, timeout from its own version; interval
    from the latest."""
    probe = rec.spec(r.version).service.readiness_probe
    latest = rec.spec(rec.row.latest_version).service.readiness_probe
    return prober_pb.ProbeTarget(
        target_id=probes.target_id(rec.name, r.replica_id),
        url=r.endpoint,
        path=probe.path or "/",
        method=prober_pb.PROBE_METHOD_POST if probe.post_data_json else prober_pb.PROBE_METHOD_GET,
        post_data_json=probe.post_data_json,
        headers=dict(probe.headers),
        timeout=probe.timeout,
        interval=latest.probe_interval,
        fast_interval=pbtime.duration(rec.tuning.probe_fast_interval_s),
        starting=not r.facts.HasField("first_ready_time"),
        traceparent=rec.deps.traces.traceparent(r),
    )

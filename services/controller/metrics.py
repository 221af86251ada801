"""The controller's own metrics: the fleet by status, launches and teardowns, launch to READY,
the autoscaler, watch streams, reconcile passes and store writes.

Two sources, so no metric needs bookkeeping inside the reconciler:

- gauges are read at scrape time from the controller's public reads (services, replicas) and
  from callables the composition root hands over (watch streams, queue depth, probing stale);
- counters and histograms of things that happen are fed by hooks: every change a service's hub
  publishes (the same messages `WatchService` streams carry) goes through `Transitions`, which
  turns a replica's facts moving (launch succeeded, failed; teardown done) into counts; the
  store reports each write, the reconciler each pass.

Labels are bounded: service names, versions, statuses, outcomes and causes; never a replica id,
URL or message.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res

log = logging.getLogger(__name__)

LP = res.LaunchPhase
TP = res.TeardownPhase

# A local replica is READY in about a second; a cloud VM or a large image in minutes.
LAUNCH_TO_READY_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)
# A pass over a few replicas takes tens of microseconds; thousands, tens of milliseconds.
PASS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# A write with synchronous=FULL is one or two fsyncs (a millisecond or so); a locked store waits
# up to its busy timeout (5 s by default).
WRITE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

_LAUNCHING = (LP.LAUNCH_PHASE_SCHEDULED, LP.LAUNCH_PHASE_RUNNING)
_TEARING_DOWN = (TP.TEARDOWN_PHASE_SCHEDULED, TP.TEARDOWN_PHASE_RUNNING)


def status_label(status: int) -> str:
    """A replica status as `replicactl` shows it: READY, FAILED_PROBING, ..."""
    return str(res.ReplicaStatus.Name(status)).removeprefix("REPLICA_STATUS_")  # type: ignore[arg-type]


def launch_cause(r: res.Replica) -> str:
    """Whose fault a failed launch was: `infrastructure` or `user`.

    A replica that records the cause says it; otherwise a launch refused for capacity is the
    infrastructure's and any other failure is counted as the user's (the setup or image)."""
    field = r.facts.DESCRIPTOR.fields_by_name.get("failure_cause")  # the controller core records it
    if field is not None and field.enum_type is not None and (cause := int(getattr(r.facts, "failure_cause", 0))):
        return "infrastructure" if "INFRA" in field.enum_type.values_by_number[cause].name else "user"
    return "infrastructure" if r.facts.failed_spot_availability else "user"


@dataclasses.dataclass
class _Seen:
    """What the last published change said about one replica."""

    launch: int
    teardown: int
    ready: bool


@dataclasses.dataclass(frozen=True)
class Event:
    """Something that happened to a replica, as `Transitions` saw it.

    Attributes:
        kind: `launch`, `teardown` or `ready`.
        outcome: for launches `succeeded` or `failed`; for teardowns `succeeded` or `failed`.
        cause: for failed launches, `user` or `infrastructure`; else `none`.
        seconds: for `ready`, the replica's launch (its record's creation) to its first READY.
    """

    kind: str
    outcome: str = ""
    cause: str = "none"
    seconds: float = 0.0


class Transitions:
    """Turns the changes a service publishes into what happened to its replicas.

    Only moves it has seen count: a replica first seen with its launch already over (recovered
    after a restart) counts only if its record was created after `since`, so a restart does not
    count the fleet's launches again.
    """

    def __init__(self, since: float | None = None) -> None:
        self._since = time.time() if since is None else since
        self._seen: dict[int, _Seen] = {}
        self._causes: dict[int, str] = {}  # replica id -> the cause the core reported, until its launch counts

    def failed(self, replica_id: int, cause: str) -> None:
        """The core says whose fault a replica's failure was (`user` or `infrastructure`); a
        launch failure seen next for it carries that cause."""
        if cause in ("user", "infrastructure"):
            self._causes[replica_id] = cause

    def changes(self, replicas: Iterable[res.Replica], removed: Iterable[int]) -> list[Event]:
        """Events of one published change: `replicas` changed, `removed` are gone."""
        out: list[Event] = []
        for r in replicas:
            out += self._replica(r)
        for rid in removed:
            self._causes.pop(rid, None)
            seen = self._seen.pop(rid, None)
            if seen is None:
                continue
            if seen.teardown in _TEARING_DOWN:
                out.append(Event("teardown", "succeeded"))
            elif seen.teardown == TP.TEARDOWN_PHASE_UNSPECIFIED and seen.launch in _LAUNCHING:
                # A launch whose record went without a teardown: refused for capacity (spec.md §4).
                out.append(Event("launch", "failed", "infrastructure"))
        return out

    def forget(self) -> None:
        """The service is gone."""
        self._seen.clear()
        self._causes.clear()

    def _replica(self, r: res.Replica) -> list[Event]:
        f = r.facts
        ready = f.HasField("first_ready_time")
        now = _Seen(launch=f.launch_phase, teardown=f.teardown_phase, ready=ready)
        before = self._seen.get(r.replica_id)
        self._seen[r.replica_id] = now
        if before is None:
            if r.create_time.ToSeconds() < self._since and r.create_time.seconds:
                return []  # known from before this process: its past is not news
            before = _Seen(launch=LP.LAUNCH_PHASE_SCHEDULED, teardown=TP.TEARDOWN_PHASE_UNSPECIFIED, ready=False)
        out: list[Event] = []
        if now.launch != before.launch:
            if now.launch == LP.LAUNCH_PHASE_SUCCEEDED:
                out.append(Event("launch", "succeeded"))
            elif now.launch == LP.LAUNCH_PHASE_FAILED:
                out.append(Event("launch", "failed", self._causes.pop(r.replica_id, "") or launch_cause(r)))
        if ready and not before.ready and r.create_time.seconds:
            seconds = f.first_ready_time.ToNanoseconds() / 1e9 - r.create_time.ToNanoseconds() / 1e9
            out.append(Event("ready", seconds=max(seconds, 0.0)))
        if now.teardown != before.teardown:
            if now.teardown == TP.TEARDOWN_PHASE_SUCCEEDED:
                out.append(Event("teardown", "succeeded"))
            elif now.teardown == TP.TEARDOWN_PHASE_FAILED:
                out.append(Event("teardown", "failed"))
        return out


@dataclasses.dataclass(frozen=True)
class Fleet:
    """What the gauges read at scrape time (each callable runs on the controller's loop).

    Attributes:
        services: every service with its replicas.
        watchers: open WatchService and WatchEndpoints streams.
        queue_depth: services waiting for a reconcile pass.
        probing_stale: no prober stream is live.
    """

    services: Callable[[], Iterable[tuple[res.Service, Iterable[res.Replica]]]]
    watchers: Callable[[], int]
    queue_depth: Callable[[], int] = lambda: 0
    probing_stale: Callable[[], bool] = lambda: False


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas = GaugeMetricFamily(
            "replicaplane_controller_replicas",
            "Replicas by service, version and status (the status as replicactl shows it).",
            labels=["service", "version", "status"],
        )
        target = GaugeMetricFamily(
            "replicaplane_controller_autoscaler_target_replicas",
            "Replicas the autoscaler wants for the service now.",
            labels=["service"],
        )
        current = GaugeMetricFamily(
            "replicaplane_controller_autoscaler_current_replicas",
            "Replicas the service has that are not failed (launching, starting, ready, draining).",
            labels=["service"],
        )
        qps = GaugeMetricFamily(
            "replicaplane_controller_autoscaler_qps",
            "Requests per second the autoscaler decides on (over its QPS window).",
            labels=["service"],
        )
        for svc, reps in self._fleet.services():
            counts: dict[tuple[str, str], int] = {}
            for r in reps:
                key = (str(r.version), status_label(r.status))
                counts[key] = counts.get(key, 0) + 1
            for (version, status), n in sorted(counts.items()):
                replicas.add_metric([svc.name, version, status], n)
            target.add_metric([svc.name], svc.autoscaler.target_replicas)
            current.add_metric([svc.name], svc.total_replicas)
            qps.add_metric([svc.name], svc.autoscaler.qps)
        yield from (replicas, target, current, qps)
        yield GaugeMetricFamily(
            "replicaplane_controller_watch_subscribers",
            "WatchService and WatchEndpoints streams open now.",
            value=self._fleet.watchers(),
        )
        yield GaugeMetricFamily(
            "replicaplane_controller_queue_depth",
            "Services whose reconcile pass is due and has not run yet.",
            value=self._fleet.queue_depth(),
        )
        yield GaugeMetricFamily(
            "replicaplane_controller_probing_stale",
            "1 while no prober stream is live (readiness is not being checked), else 0.",
            value=1 if self._fleet.probing_stale() else 0,
        )


class ControllerMetrics:
    """The controller's metric families in `registry`."""

    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        self._registry = registry
        self._launches = prometheus_client.Counter(
            "replicaplane_controller_launches_total",
            "Replica launches that ended, by service, outcome (succeeded, failed) and, for failures, "
            "whose fault it was (user, infrastructure; none for successes).",
            ["service", "outcome", "cause"],
            registry=registry,
        )
        self._teardowns = prometheus_client.Counter(
            "replicaplane_controller_teardowns_total",
            "Replica teardowns that ended, by service and outcome (succeeded, failed).",
            ["service", "outcome"],
            registry=registry,
        )
        self._to_ready = prometheus_client.Histogram(
            "replicaplane_controller_launch_to_ready_seconds",
            "From a replica's launch (its record created) to its first READY.",
            buckets=LAUNCH_TO_READY_BUCKETS,
            registry=registry,
        )
        self.pass_seconds = prometheus_client.Histogram(
            "replicaplane_controller_pass_duration_seconds",
            "One reconcile pass of one service.",
            buckets=PASS_BUCKETS,
            registry=registry,
        )
        self._write_seconds = prometheus_client.Histogram(
            "replicaplane_controller_store_write_seconds",
            "One store write (a transaction), from its start to its commit or failure.",
            buckets=WRITE_BUCKETS,
            registry=registry,
        )
        self._write_errors = prometheus_client.Counter(
            "replicaplane_controller_store_write_errors_total",
            "Store writes that failed (the store was locked past its busy timeout, or the disk failed).",
            registry=registry,
        )
        self._transitions: dict[str, Transitions] = {}

    def watch(self, fleet: Fleet) -> None:
        """Report the gauges `fleet` reads at scrape time."""
        self._registry.register(_FleetCollector(fleet))

    def published(self, msg: api.WatchServiceResponse) -> None:
        """A hub observer: count what one published change of a service says happened."""
        name = msg.service.name
        if msg.deleted:
            self._transitions.pop(name, None)
            for counter in (self._launches, self._teardowns):
                for labels in [k for k in counter._metrics if k[0] == name]:  # no public way to list children
                    counter.remove(*labels)
            return
        transitions = self._transitions.get(name)
        if transitions is None:
            transitions = self._transitions[name] = Transitions()
        for event in transitions.changes(msg.replicas, msg.removed_replica_ids):
            if event.kind == "launch":
                self._launches.labels(name, event.outcome, event.cause).inc()
            elif event.kind == "teardown":
                self._teardowns.labels(name, event.outcome).inc()
            else:
                self._to_ready.observe(event.seconds)

    def failed(self, service: str, replica_id: int, cause: str) -> None:
        """A failure hook: whose fault a replica's failure was, as the core decided it."""
        transitions = self._transitions.get(service)
        if transitions is None:
            transitions = self._transitions[service] = Transitions()
        transitions.failed(replica_id, cause)

    def store_write(self, seconds: float, ok: bool) -> None:
        """A store observer: one write took `seconds`, and committed or not."""
        self._write_seconds.observe(seconds)
        if not ok:
            self._write_errors.inc()

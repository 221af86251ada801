"""The load balancer's own metrics: requests, latency, retries, 503s, held requests, replicas.

Labels are bounded. `service` is the service balanced (one, or each service of a fleet); `version` is the service
version of the replica that answered (`none` when the balancer answered itself), so it grows by
one per update; `code` is the HTTP status sent (`499`, as nginx counts it: the client went away
before the answer's headers went out). Request paths and replica URLs are never labels. Replica ids label only the two
per-replica families, which hold the ready replicas and the ones still finishing requests (at
most the service's replica cap plus the draining ones) and drop a replica when it is gone, so
their series come and go with replicas and never pile up.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.loadbalancer import connections, policies

# A proxied answer takes milliseconds; a streamed one may run for the spec's stream timeout.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# A held request waits for a first replica to start: seconds to minutes.
HOLD_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)

NO_VERSION = "none"
CLIENT_CLOSED = "499"
RETRY_REASONS = ("not_reached", "connection_broken")
HOLD_OUTCOMES = ("released", "timed_out", "cancelled")


@dataclasses.dataclass(frozen=True)
class _Sources:
    in_flight: Callable[[], policies.InFlight]
    ready: Callable[[], int]
    held: Callable[[], int]
    tracker: Callable[[], connections.Tracker | None]


class _Live(Collector):
    """Values read at scrape time from the bookkeeping of every service the process balances (one,
    or each service of a fleet)."""

    def __init__(self) -> None:
        self.services: dict[str, _Sources] = {}

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        services = sorted(self.services.items())
        ready = GaugeMetricFamily(
            "replicaplane_loadbalancer_ready_replicas", "Ready replicas the balancer routes to.", labels=["service"]
        )
        held = GaugeMetricFamily(
            "replicaplane_loadbalancer_held_requests",
            "Requests waiting now for a first ready replica (a service that scales from zero).",
            labels=["service"],
        )
        sent = CounterMetricFamily(
            "replicaplane_loadbalancer_replica_requests",
            "Request attempts sent to each replica (ready ones, and gone ones until their last request ends).",
            labels=["service", "replica"],
        )
        busy = GaugeMetricFamily(
            "replicaplane_loadbalancer_replica_in_flight_requests",
            "Request attempts in flight to each replica.",
            labels=["service", "replica"],
        )
        trackers = []
        for service, src in services:
            ready.add_metric([service], src.ready())
            held.add_metric([service], src.held())
            in_flight = src.in_flight()
            for replica_id, total in sorted(in_flight.totals.items()):
                sent.add_metric([service, str(replica_id)], total)
            for replica_id, count in sorted(in_flight.counts.items()):
                busy.add_metric([service, str(replica_id)], count)
            if (tracker := src.tracker()) is not None:
                trackers.append(tracker)
        yield from (ready, held, sent, busy)
        if trackers:
            yield GaugeMetricFamily(
                "replicaplane_loadbalancer_client_connections",
                "Client connections open now.",
                value=sum(t.open for t in trackers),
            )
            yield CounterMetricFamily(
                "replicaplane_loadbalancer_refused_connections",
                "Client connections refused (503, then closed) because max_connections were open.",
                value=sum(t.refused for t in trackers),
            )


class _Families:
    """The metric families of one registry, shared by every service balanced in the process."""

    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        self.requests = prometheus_client.Counter(
            "replicaplane_loadbalancer_requests_total",
            "Client requests answered, by the answering replica's service version and the HTTP status sent.",
            ["service", "version", "code"],
            registry=registry,
        )
        self.latency = prometheus_client.Histogram(
            "replicaplane_loadbalancer_request_duration_seconds",
            "Time from a request's arrival to the end of its response (retries and holding included).",
            ["service", "version"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_flight = prometheus_client.Gauge(
            "replicaplane_loadbalancer_in_flight_requests",
            "Client requests being handled now.",
            ["service"],
            registry=registry,
        )
        self.retries = prometheus_client.Counter(
            "replicaplane_loadbalancer_retries_total",
            "Attempts sent to another replica after one failed: not_reached (no connection) or "
            "connection_broken (an idempotent request whose connection broke).",
            ["service", "reason"],
            registry=registry,
        )
        self.unavailable = prometheus_client.Counter(
            "replicaplane_loadbalancer_no_ready_replica_total",
            "503 answers because no replica was ready: none_ready, hold_timeout (a held request waited "
            "hold_timeout_s in vain) or hold_full (hold_max_requests were already held).",
            ["service", "reason"],
            registry=registry,
        )
        self.held = prometheus_client.Counter(
            "replicaplane_loadbalancer_holds_total",
            "Requests held for a first ready replica, by how the hold ended.",
            ["service", "outcome"],
            registry=registry,
        )
        self.hold_time = prometheus_client.Histogram(
            "replicaplane_loadbalancer_hold_duration_seconds",
            "How long held requests waited for a first ready replica (scale from zero), by how the hold ended.",
            ["service", "outcome"],
            buckets=HOLD_BUCKETS,
            registry=registry,
        )
        self.live = _Live()
        registry.register(self.live)


_FAMILIES: weakref.WeakKeyDictionary[prometheus_client.CollectorRegistry, _Families] = weakref.WeakKeyDictionary()


class BalancerMetrics:
    """The load balancer's metric families in `registry`, for one service it serves (a fleet makes
    one per service, all in the same families)."""

    def __init__(self, registry: prometheus_client.CollectorRegistry, service: str) -> None:
        self.registry = registry
        self.service = service
        families = _FAMILIES.get(registry)
        if families is None:
            families = _FAMILIES[registry] = _Families(registry)
        self._families = families
        self._requests = families.requests
        self._latency = families.latency
        self.in_flight = families.in_flight.labels(service)
        self._retries = {r: families.retries.labels(service, r) for r in RETRY_REASONS}
        self._unavailable = {
            r: families.unavailable.labels(service, r) for r in ("none_ready", "hold_timeout", "hold_full")
        }
        self._held: dict[str, tuple[prometheus_client.Counter, prometheus_client.Histogram]] = {
            o: (families.held.labels(service, o), families.hold_time.labels(service, o)) for o in HOLD_OUTCOMES
        }

    def watch(
        self,
        *,
        in_flight: Callable[[], policies.InFlight],
        ready: Callable[[], int],
        held: Callable[[], int],
        tracker: Callable[[], connections.Tracker | None] = lambda: None,
    ) -> None:
        """Report what these callables read, at scrape time."""
        self._families.live.services[self.service] = _Sources(in_flight, ready, held, tracker)

    def unwatch(self) -> None:
        """The service is no longer balanced here: its live values go (its counters stay)."""
        self._families.live.services.pop(self.service, None)

    def request_finished(self, version: str, code: str, seconds: float) -> None:
        """A client request was answered (or its client went away: code 499)."""
        self._requests.labels(self.service, version, code).inc()
        self._latency.labels(self.service, version).observe(seconds)

    def retried(self, reason: str) -> None:
        """An attempt failed and the request goes to another replica."""
        self._retries[reason].inc()

    def no_ready_replica(self, reason: str) -> None:
        """A 503 because no replica was ready."""
        self._unavailable[reason].inc()

    def hold_ended(self, outcome: str, seconds: float) -> None:
        """A held request got a replica (released), waited in vain (timed_out), or its client left (cancelled)."""
        counter, histogram = self._held[outcome]
        counter.inc()
        histogram.observe(seconds)

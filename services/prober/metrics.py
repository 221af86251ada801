"""The prober's own metrics: probes, their latency and failures, and the replicas it holds.

Labels are bounded: an outcome, or a failure kind; never a target, URL or path. Which prober a
series comes from is the scrape's `instance` label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.prober import probing

# A probe on loopback answers in a millisecond; the default probe timeout is 15 s.
PROBE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30)


class _Held(Collector):
    """Streams and targets read at scrape time from whoever holds them (no bookkeeping)."""

    def __init__(self, streams: Callable[[], int], targets: Callable[[], int]) -> None:
        self._streams = streams
        self._targets = targets

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "replicaplane_prober_assigned_replicas",
            "Replicas this prober is probing now (targets over all its streams).",
            value=self._targets(),
        )
        yield GaugeMetricFamily(
            "replicaplane_prober_streams", "Probe streams open now (one or more per controller).", value=self._streams()
        )


class ProberMetrics:
    """The prober's metric families in `registry`."""

    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        self._registry = registry
        probes = prometheus_client.Counter(
            "replicaplane_prober_probes_total",
            "Probes finished (and targets refused as invalid), by outcome; its rate is probes per second.",
            ["outcome"],
            registry=registry,
        )
        latency = prometheus_client.Histogram(
            "replicaplane_prober_probe_duration_seconds",
            "Time from sending a probe to its answer or failure, by outcome.",
            ["outcome"],
            buckets=PROBE_BUCKETS,
            registry=registry,
        )
        failures = prometheus_client.Counter(
            "replicaplane_prober_probe_failures_total",
            "Failed probes by kind: http_status (answered, not 200), timeout, connection_refused, ...",
            ["kind"],
            registry=registry,
        )
        self.dropped = prometheus_client.Counter(
            "replicaplane_prober_results_dropped_total",
            "Results dropped because a stream's reader fell too far behind (newer ones supersede them).",
            registry=registry,
        )
        # Children resolved once: the prober records thousands of probes a second.
        self._probes = {o: probes.labels(o.value) for o in probing.Outcome}
        self._latency: dict[probing.Outcome, prometheus_client.Histogram] = {
            o: latency.labels(o.value) for o in probing.Outcome if o is not probing.Outcome.INVALID_TARGET
        }
        self._failures = {k: failures.labels(k.value) for k in probing.FailureKind}

    def watch(self, *, streams: Callable[[], int], targets: Callable[[], int]) -> None:
        """Report the open streams and held targets that these callables count."""
        self._registry.register(_Held(streams, targets))

    def probed(self, result: probing.Result) -> None:
        """Count one result."""
        self._probes[result.outcome].inc()
        latency = self._latency.get(result.outcome)
        if latency is not None:
            latency.observe(result.latency_s)
        if result.outcome is probing.Outcome.INVALID_TARGET:
            self._failures[probing.FailureKind.INVALID_TARGET].inc()
        elif result.outcome is not probing.Outcome.READY:
            self._failures[result.failure or probing.FailureKind.OTHER].inc()

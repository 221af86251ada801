"""The provisioner's own metrics: launch and teardown durations, replicas by state, backend API
errors. Labels are bounded: the backend's name, an outcome, a state, an HTTP status."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# A local launch takes well under a second; a Pod that pulls an image can take many minutes.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

LAUNCH_OUTCOMES = ("succeeded", "failed", "cancelled")
TEARDOWN_OUTCOMES = ("succeeded", "failed")
STATES = ("queued", "provisioning", "running", "app_ended", "terminating", "terminated", "failed")
"""Replica states as the gauge reports them: `running` is a replica whose app runs, `app_ended`
one whose app exited, vanished or was preempted and that is not torn down yet."""


class _Replicas(Collector):
    def __init__(self, backend: str, count: Callable[[], Mapping[str, int]]) -> None:
        self._backend = backend
        self._count = count

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "replicaplane_provisioner_replicas",
            "Replicas this provisioner holds, by state (`running`: the app runs).",
            labels=["backend", "state"],
        )
        counts = self._count()
        for state in STATES:
            family.add_metric([self._backend, state], counts.get(state, 0))
        yield family


class ProvisionerMetrics:
    """The provisioner's metric families in `registry`, for one backend."""

    def __init__(self, registry: prometheus_client.CollectorRegistry, backend: str) -> None:
        self._registry = registry
        self._backend = backend
        launch = prometheus_client.Histogram(
            "replicaplane_provisioner_launch_duration_seconds",
            "Time from a launch's start to its end (RUNNING, FAILED or CANCELLED), every attempt, "
            "backoff and wait for a launch slot included.",
            ["backend", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        teardown = prometheus_client.Histogram(
            "replicaplane_provisioner_teardown_duration_seconds",
            "Time from a teardown's start, after any drain, to its end, retries included.",
            ["backend", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        attempts = prometheus_client.Counter(
            "replicaplane_provisioner_launch_attempts_total",
            "Launch attempts by outcome (capacity_unavailable: the zone had none; failed: any other failure).",
            ["backend", "outcome"],
            registry=registry,
        )
        self._api_errors = prometheus_client.Counter(
            "replicaplane_provisioner_backend_api_errors_total",
            "Failed calls to the backend's API (each try), by HTTP status; `none` when no answer came.",
            ["backend", "code"],
            registry=registry,
        )
        self._launch = {o: launch.labels(backend, o) for o in LAUNCH_OUTCOMES}
        self._teardown = {o: teardown.labels(backend, o) for o in TEARDOWN_OUTCOMES}
        self._attempts = {o: attempts.labels(backend, o) for o in ("succeeded", "failed", "capacity_unavailable")}

    def watch(self, count: Callable[[], Mapping[str, int]]) -> None:
        """Report the replicas by state that `count` returns (called at scrape time)."""
        self._registry.register(_Replicas(self._backend, count))

    def launch_finished(self, outcome: str, seconds: float) -> None:
        """A launch ended: succeeded, failed or cancelled."""
        self._launch[outcome].observe(seconds)

    def teardown_finished(self, outcome: str, seconds: float) -> None:
        """A teardown ended: succeeded or failed."""
        self._teardown[outcome].observe(seconds)

    def attempt_finished(self, outcome: str) -> None:
        """A launch attempt ended: succeeded, failed or capacity_unavailable."""
        self._attempts[outcome].inc()

    def api_error(self, status: int) -> None:
        """A call to the backend's API failed with HTTP `status` (0: no answer)."""
        # HTTP statuses are three digits: the label stays bounded whatever a server sends.
        code = str(status) if 100 <= status <= 599 else "none"
        self._api_errors.labels(self._backend, code).inc()

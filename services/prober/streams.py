"""Probe streams: each client's targets, probed on their own schedules, results in batches."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import prometheus_client
from opentelemetry import trace

from services.common import errors, tracing, waits
from services.prober import metrics, probing

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StreamSettings:
    """How streams batch results and bound their work."""

    batch_max: int = 500
    """Results per batch at most."""
    flush_interval_s: float = 0.002
    """After the first result of a batch, wait this long for more before sending."""
    max_targets: int = 50_000
    """Targets one stream may hold; more are refused as invalid."""
    max_buffered: int = 100_000
    """Results held for a slow reader; beyond it the oldest are dropped (newer ones supersede)."""


class ProbeStream:
    """The targets of one client stream. Each target has its own task, so a slow replica
    never delays the probes of another.

    Args:
        prober: makes the HTTP probes.
        defaults: values for fields a target leaves unset.
        settings: batching and limits.
        stats: where results are counted; by default a registry nobody scrapes.
    """

    def __init__(
        self,
        prober: probing.HttpProber,
        defaults: probing.Defaults,
        settings: StreamSettings,
        stats: metrics.ProberMetrics | None = None,
    ) -> None:
        self._prober = prober
        self._defaults = defaults
        self._settings = settings
        self._stats = stats or metrics.ProberMetrics(prometheus_client.CollectorRegistry())
        self._targets: dict[str, probing.Target] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._buffer: list[probing.Result] = []
        self._wakeup = asyncio.Event()
        self._closed = False
        self._dropped = 0

    @property
    def target_count(self) -> int:
        """How many targets are being probed."""
        return len(self._targets)

    def upsert(self, spec: probing.TargetSpec) -> None:
        """Add a target or change it. A new or changed target is probed at once.

        An invalid target is not probed (and stops being probed, if it was); a result with
        outcome INVALID_TARGET says which fields are wrong. Re-sending an unchanged target
        keeps its schedule.
        """
        if self._closed:
            return
        try:
            if spec.target_id not in self._targets and len(self._targets) >= self._settings.max_targets:
                raise errors.ValidationError(
                    [errors.FieldViolation("target_id", f"stream already holds {self._settings.max_targets}")],
                    subject="probe target",
                )
            target = probing.make_target(spec, self._defaults)
        except errors.ValidationError as exc:
            self.remove(spec.target_id)
            self._emit(
                probing.Result(
                    spec.target_id,
                    probing.Outcome.INVALID_TARGET,
                    0,
                    0.0,
                    exc.message,
                    time.time(),
                    probing.FailureKind.INVALID_TARGET,
                )
            )
            return
        old = self._targets.get(target.target_id)
        if old == target:
            return
        self._stop_task(target.target_id)
        self._targets[target.target_id] = target
        self._tasks[target.target_id] = asyncio.get_running_loop().create_task(self._run(target))

    def remove(self, target_id: str) -> None:
        """Stop probing `target_id`; results not yet sent for it are dropped."""
        self._targets.pop(target_id, None)
        self._stop_task(target_id)
        if self._buffer:
            self._buffer = [r for r in self._buffer if r.target_id != target_id]

    def close(self) -> None:
        """Stop every probe; next_batch() then returns what is buffered, then None."""
        self._closed = True
        for target_id in list(self._tasks):
            self._stop_task(target_id)
        self._targets.clear()
        self._wakeup.set()

    async def next_batch(self, timeout: float | None = None) -> list[probing.Result] | None:
        """Wait for results and return a batch of them; None once the stream is closed, and
        an empty batch when `timeout` passes with none (the caller's heartbeat)."""
        while not self._buffer:
            if self._closed:
                return None
            self._wakeup.clear()
            if not await waits.wait_event(self._wakeup, timeout):
                return []
        if len(self._buffer) < self._settings.batch_max and self._settings.flush_interval_s > 0:
            # Let results that complete at nearly the same time share one message.
            await asyncio.sleep(self._settings.flush_interval_s)
        size = self._settings.batch_max
        batch, self._buffer = self._buffer[:size], self._buffer[size:]
        return batch

    def _stop_task(self, target_id: str) -> None:
        task = self._tasks.pop(target_id, None)
        if task is not None:
            task.cancel()

    def _emit(self, result: probing.Result) -> None:
        self._stats.probed(result)
        self._buffer.append(result)
        if len(self._buffer) > self._settings.max_buffered:
            excess = len(self._buffer) - self._settings.max_buffered
            del self._buffer[:excess]
            if not self._dropped:
                log.warning("stream reader is slow: dropping the oldest results")
            self._dropped += excess
            self._stats.dropped.inc(excess)
        self._wakeup.set()

    async def _run(self, target: probing.Target) -> None:
        """Probe `target` at once, then every fast_interval until its first success while
        starting, then every interval (measured start to start)."""
        loop = asyncio.get_running_loop()
        fast = target.starting
        last: probing.Outcome | None = None
        while True:
            started = loop.time()
            try:
                result = await self._prober.probe(target)
            except Exception as exc:
                # A bug, not a replica failure: say nothing about the replica, keep the schedule.
                log.error("probe of %s raised %s", target.target_id, exc.__class__.__name__)
                await asyncio.sleep(target.interval_s)
                continue
            if self._targets.get(target.target_id) is not target:
                return
            self._emit(result)
            if target.traceparent and result.outcome is not last:
                _trace(target, result)  # the first probe, and each change of outcome
            last = result.outcome
            if result.outcome is probing.Outcome.READY:
                fast = False
            delay = (target.fast_interval_s if fast else target.interval_s) - (loop.time() - started)
            # Sleep even when late, so a tight schedule cannot starve the loop.
            await asyncio.sleep(max(delay, 0.0))


def _trace(target: probing.Target, result: probing.Result) -> None:
    """A span for a probe of a traced target (a child of the replica's start)."""
    tracing_ = tracing.current()
    if not tracing_.enabled:
        return
    span = tracing_.start(
        "probe",
        parent=tracing.parent_of(target.traceparent),
        kind=trace.SpanKind.CLIENT,
        attributes={
            "replicaplane.target_id": target.target_id,
            "replicaplane.probe.outcome": result.outcome.value,
            "http.response.status_code": result.http_code,
            "replicaplane.component": "prober",
        },
        start_time_s=result.probe_time,
    )
    if result.outcome is not probing.Outcome.READY:
        span.set_status(trace.Status(trace.StatusCode.ERROR, (result.failure or probing.FailureKind.OTHER).value))
    span.end(end_time=int((result.probe_time + result.latency_s) * 1e9))


class Engine:
    """Every stream of one prober process, sharing one HTTP client.

    Args:
        prober: the shared HTTP prober.
        defaults: values for fields a target leaves unset.
        settings: batching and limits for every stream.
        stats: where probes are counted; by default a registry nobody scrapes.
    """

    def __init__(
        self,
        prober: probing.HttpProber,
        defaults: probing.Defaults,
        settings: StreamSettings,
        *,
        stats: metrics.ProberMetrics | None = None,
    ) -> None:
        self._prober = prober
        self._defaults = defaults
        self._settings = settings
        self._streams: set[ProbeStream] = set()
        self._closing = False
        self._stats = stats or metrics.ProberMetrics(prometheus_client.CollectorRegistry())
        self._stats.watch(streams=lambda: len(self._streams), targets=self.target_count)

    def target_count(self) -> int:
        """Targets held over every stream."""
        return sum(s.target_count for s in self._streams)

    @property
    def stream_count(self) -> int:
        """Open streams."""
        return len(self._streams)

    def open_stream(self) -> ProbeStream:
        """A new, empty stream.

        Raises:
            errors.UnavailableError: the prober is shutting down; go to another one.
        """
        if self._closing:
            raise errors.UnavailableError("prober is shutting down")
        stream = ProbeStream(self._prober, self._defaults, self._settings, self._stats)
        self._streams.add(stream)
        return stream

    def close_stream(self, stream: ProbeStream) -> None:
        """Stop the probes of `stream` and forget it."""
        stream.close()
        self._streams.discard(stream)

    def drain(self) -> None:
        """End every stream, so that clients move their targets to other probers at once."""
        self._closing = True
        for stream in list(self._streams):
            stream.close()

    async def close(self) -> None:
        """Drain and close the HTTP client."""
        self.drain()
        await asyncio.sleep(0)
        with contextlib.suppress(Exception):
            await self._prober.close()

"""The balancer's link to the controller: endpoints in (WatchEndpoints), load out (ReportLoad).

Both loops outlive controller restarts: the watch reconnects with backoff and keeps the last known
endpoint set meanwhile; load that could not be reported stays counted and goes later.

Load reports are exactly once and need no shared clock: each carries this balancer's random id and
a sequence number, and a report that got no answer is sent again unchanged, with the same number
(the controller drops a report it already applied); requests go as their ages at send time. The
per-version outcomes of the attempts that ended since the last report ride in the same report, so
they too count once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping

import grpc

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import pbtime, waits
from services.loadbalancer import balancer as bal
from services.loadbalancer import policies, versions

log = logging.getLogger(__name__)

_POLICY_NAMES = {
    spec_pb2.LOAD_BALANCING_POLICY_ROUND_ROBIN: policies.ROUND_ROBIN,
    spec_pb2.LOAD_BALANCING_POLICY_LEAST_LOAD: policies.LEAST_LOAD,
    spec_pb2.LOAD_BALANCING_POLICY_INSTANCE_AWARE_LEAST_LOAD: policies.INSTANCE_AWARE,
}


def config_of(service: res.Service) -> bal.Config:
    """What the balancer takes from a service's (latest) spec."""
    section = service.spec.service
    stream = (
        pbtime.seconds(section.load_balancer.stream_timeout)
        if section.load_balancer.HasField("stream_timeout")
        else 120.0
    )
    return bal.Config(
        policy=_POLICY_NAMES.get(section.load_balancing_policy, policies.DEFAULT),
        target_qps=dict(section.replica_policy.target_qps_per_accelerator),
        scales_from_zero=section.replica_policy.min_replicas == 0,
        stream_timeout_s=stream,
    )


@dataclasses.dataclass(frozen=True)
class Report:
    """A load report taken from the balancer: sent, and resent unchanged, until answered."""

    sequence: int
    times: list[float]
    """Arrival times on the balancer's clock."""
    count: int
    """Arrivals without a time."""
    stats: Mapping[int, versions.Stats] = dataclasses.field(default_factory=dict)
    """Outcomes of attempts per version that ended before the report was taken."""

    @property
    def requests(self) -> int:
        """Requests in the report."""
        return len(self.times) + self.count


def request_of(
    report: Report,
    *,
    service: str,
    balancer_id: str,
    url: str,
    now: float,
    in_flight: Mapping[int, int] | None = None,
    endpoints_version: int = 0,
    closing: bool = False,
) -> api.ReportLoadRequest:
    """The ReportLoad request for `report`, with each arrival as its age at `now` (the balancer's
    clock): never negative (the clock may step back), at most the longest Duration.

    The requests in flight per replica and the endpoint version are the balancer's state when the
    request is made (a resent report carries the current ones: they are not counted, only read).
    """
    ages = [pbtime.duration(min(max(now - t, 0.0), pbtime.MAX_DURATION_S)) for t in report.times]
    return api.ReportLoadRequest(
        service_name=service,
        balancer_id=balancer_id,
        sequence=report.sequence,
        request_ages=ages,
        request_count=report.count,
        load_balancer_url=url,
        version_stats=[version_stats_of(v, s) for v, s in sorted(report.stats.items())],
        in_flight=[
            api.ReplicaInFlight(replica_id=rid, requests=n) for rid, n in sorted((in_flight or {}).items()) if n > 0
        ],
        in_flight_reported=in_flight is not None,
        endpoints_version=endpoints_version,
        closing=closing,
    )


def version_stats_of(version: int, stats: versions.Stats) -> res.VersionStats:
    """One version's outcomes as sent in a report."""
    return res.VersionStats(
        version=version,
        requests=stats.requests,
        server_errors=stats.server_errors,
        transport_errors=stats.transport_errors,
        latency_buckets=stats.latency_buckets,
        latency_sum=pbtime.duration(min(stats.latency_sum_s, pbtime.MAX_DURATION_S)),
    )


def replicas_of(msg: api.WatchEndpointsResponse) -> list[policies.Replica]:
    """The endpoint set as policy replicas."""
    return [
        policies.Replica(replica_id=e.replica_id, url=e.url, version=e.version, accelerator=e.accelerator or "unknown")
        for e in msg.endpoints
    ]


class ControllerLink:
    """Follows the service's endpoints and reports its load."""

    def __init__(
        self,
        stub: api_grpc.ControllerServiceStub,
        balancer: bal.Balancer,
        *,
        url: str,
        report_interval_s: float,
        heartbeat_s: float,
        reconnect_max_s: float = 2.0,
        call_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.stub = stub
        self.balancer = balancer
        self.url = url
        self.report_interval_s = report_interval_s
        self.heartbeat_s = heartbeat_s
        self.reconnect_max_s = reconnect_max_s
        self.call_timeout_s = call_timeout_s
        self.connected = False
        self.last_qps = 0.0
        self.balancer_id = uuid.uuid4().hex  # new at every start, so sequences restart at 1
        self._clock = clock  # the balancer's clock: its arrival times are read from it
        self._sequence = 0
        self._unanswered: Report | None = None
        self._attempts = 0  # of the unanswered report
        self._refusing = False
        self.dropped_requests = 0
        """Requests in reports the controller refused as malformed."""
        self._report_now = asyncio.Event()
        self._news = True  # endpoints or in-flight changed since the last report: report now
        self._closing = False
        self._spec_version = 0
        self._tasks: list[asyncio.Task[None]] = []
        balancer.on_held = self._report_now.set
        balancer.on_drained = self._tell

    def _tell(self) -> None:
        """Something the controller waits for changed (a new endpoint set, a replica outside it
        with nothing in flight any more): report it now, not at the next heartbeat."""
        self._news = True
        self._report_now.set()

    def start(self) -> None:
        """Start both loops; the first report (which shows this balancer's URL) goes at once."""
        self._report_now.set()
        self._tasks = [
            asyncio.create_task(self._watch_loop(), name="endpoint watch"),
            asyncio.create_task(self._report_loop(), name="load reports"),
        ]

    async def stop(self) -> None:
        """Stop both loops, sending what is still unreported first (best effort)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._closing = True  # the controller stops showing this balancer's URL at once
        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
            await self.report_once(timeout=1.0)
            if self.unreported or self.balancer.has_stats:  # that was an unanswered report; newer ones go too
                await self.report_once(timeout=1.0)

    @property
    def unreported(self) -> int:
        """Requests not yet reported: an unanswered report's and those since."""
        return (self._unanswered.requests if self._unanswered else 0) + self.balancer.unreported

    # ---- endpoints ----------------------------------------------------------------------------

    async def _refresh_config(self) -> None:
        svc = (
            await self.stub.GetService(api.GetServiceRequest(service_name=self.balancer.service_name), timeout=5.0)
        ).service
        self.balancer.configure(config_of(svc))
        self._spec_version = svc.latest_version

    async def _watch_loop(self) -> None:
        delay = 0.1
        name = self.balancer.service_name
        last_code: grpc.StatusCode | None = None
        while True:
            try:
                await self._refresh_config()
                call = self.stub.WatchEndpoints(
                    api.WatchEndpointsRequest(service_name=name, after_version=self.balancer.endpoints_version)
                )
                async for msg in call:
                    if not self.connected:
                        log.info("following the endpoints of service %s", name)
                    self.connected = True
                    delay = 0.1
                    if msg.deleted:
                        log.info("service %s was deleted; waiting for it to be created again", name)
                        self.balancer.set_endpoints([], 0)
                        self._tell()
                        break
                    replicas = replicas_of(msg)
                    if any(r.version > self._spec_version for r in replicas):
                        await self._refresh_config()  # a new version may change the policy settings
                    weights = {w.version: w.weight for w in msg.version_weights}
                    self.balancer.set_endpoints(replicas, msg.version, weights)
                    self._tell()  # a replica that left the set may be draining: say what is in flight
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    if self.balancer.policy.replicas:
                        log.info("service %s does not exist (any more); no endpoints", name)
                    self.balancer.set_endpoints([], 0)
                elif self.connected or exc.code() != last_code:
                    # Keep routing to the last known set while the controller is away.
                    log.warning("endpoint watch of %s failed (%s); retrying", name, exc.code().name)
                last_code = exc.code()
            except Exception:
                log.exception("endpoint watch of %s failed; reconnecting", name)
            self.connected = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.reconnect_max_s)

    # ---- load -----------------------------------------------------------------------------------

    async def report_once(self, *, timeout: float) -> None:
        """Send the unanswered report again, or else the arrivals since the last report.

        A report that gets no answer (an error, a timeout: it may have been applied) stays and goes
        again, unchanged and with the same sequence, so the controller counts it once; arrivals
        meanwhile wait for the next report. A report the controller refuses as malformed
        (INVALID_ARGUMENT) is dropped: sending it again could only be refused again.

        Raises:
            grpc.aio.AioRpcError: the controller did not take the report.
        """
        if self._unanswered is None:
            times, count = self.balancer.take_report()
            self._sequence += 1
            self._unanswered = Report(self._sequence, times, count, self.balancer.take_stats())
            self._attempts = 0
        report = self._unanswered
        self._attempts += 1
        try:
            response = await self.stub.ReportLoad(self._request(report), timeout=timeout)
            if response.already_applied and self._attempts == 1:
                # Never sent before, yet applied: another sender used this id. Take a new one.
                log.warning(
                    "the controller already had load report %d from balancer id %s, which this balancer never "
                    "sent; reporting under a new id",
                    report.sequence,
                    self.balancer_id,
                )
                self.balancer_id, self._sequence = uuid.uuid4().hex, 1
                report = self._unanswered = dataclasses.replace(report, sequence=1)
                response = await self.stub.ReportLoad(self._request(report), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                self._unanswered = None
                self.dropped_requests += report.requests
                log.log(
                    logging.DEBUG if self._refusing else logging.ERROR,  # once while every report is refused
                    "the controller refused load report %d; its %d request(s) are dropped: %s",
                    report.sequence,
                    report.requests,
                    exc.details(),
                )
                self._refusing = True
            raise
        self._unanswered = None
        self._refusing = False
        self.last_qps = response.qps

    def _request(self, report: Report) -> api.ReportLoadRequest:
        return request_of(
            report,
            service=self.balancer.service_name,
            balancer_id=self.balancer_id,
            url=self.url,
            now=self._clock(),
            in_flight=self.balancer.in_flight.counts,
            endpoints_version=self.balancer.endpoints_version,
            closing=self._closing,
        )

    async def _report_loop(self) -> None:
        last_sent = 0.0
        failing = False
        hurry = False
        while True:
            if not hurry:
                await waits.wait_event(self._report_now, self.report_interval_s)
            self._report_now.clear()
            now = time.monotonic()
            if (
                not self._news
                and not self.unreported
                and not self.balancer.has_stats
                and now - last_sent < self.heartbeat_s
            ):
                hurry = False
                continue  # nothing new; an empty report only every heartbeat, to keep the URL shown
            resending = self._unanswered is not None
            self._news = False
            try:
                await self.report_once(timeout=self.call_timeout_s)
                last_sent = now
                if failing:
                    log.info("load reports to the controller go through again")
                failing = False
                # Newer arrivals or outcomes: send them now.
                hurry = resending and (self.balancer.unreported > 0 or self.balancer.has_stats)
            except grpc.aio.AioRpcError as exc:
                hurry = False
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    continue  # logged, and dropped; the next report is a new one
                self._news = True  # what the controller waits for still has to reach it
                if not failing:
                    log.warning(
                        "could not report the load of %s (%s); %d request(s) kept for the next report",
                        self.balancer.service_name,
                        exc.code().name,
                        self.unreported,
                    )
                failing = True

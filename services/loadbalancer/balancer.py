"""The balancer's state: the ready set, the policy, the split between versions, held requests,
and load and per-version outcomes not yet reported.

Plain asyncio; the proxy and the controller link drive it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping

import prometheus_client

from services.common import waits
from services.loadbalancer import metrics, policies, versions

MAX_PENDING_TIMES = 100_000
"""Arrival times kept for the next report; beyond this, arrivals are only counted."""


class NoReplicaError(Exception):
    """No ready replica for a request (after holding it, if the service scales from zero).

    Attributes:
        reason: none_ready, hold_timeout (held in vain) or hold_full (too many held already).
    """

    def __init__(self, message: str, *, reason: str = "none_ready") -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Config:
    """What the balancer takes from the service's spec."""

    policy: str = policies.DEFAULT
    target_qps: Mapping[str, float] = dataclasses.field(default_factory=dict)
    scales_from_zero: bool = False
    stream_timeout_s: float = 120.0


class Balancer:
    """Routes requests of one service over its ready replicas."""

    def __init__(
        self,
        service_name: str,
        *,
        hold_timeout_s: float,
        hold_max: int,
        startup_wait_s: float = 0.0,
        policy_override: str = "",
        clock: Callable[[], float] = time.time,
        stats: metrics.BalancerMetrics | None = None,
    ) -> None:
        self.service_name = service_name
        self.stats = stats or metrics.BalancerMetrics(prometheus_client.CollectorRegistry(), service_name)
        self.hold_timeout_s = hold_timeout_s
        self.hold_max = hold_max
        self.startup_wait_s = startup_wait_s
        self.policy_override = policy_override
        self.in_flight = policies.InFlight()
        self.config = Config()
        self.policy = policies.make(policy_override, self.in_flight)
        self.endpoints_version = 0
        self.held = 0
        self.pending_times: list[float] = []
        self.pending_count = 0
        self.on_held: Callable[[], None] = lambda: None
        self.on_drained: Callable[[], None] = lambda: None
        """Called when the last request to a replica outside the ready set ends (the controller
        may end that replica's drain on the next report)."""
        self.split: versions.Split | None = None
        """The controller's weights per version; None while every replica shares the traffic."""
        self._groups: dict[int, policies.Policy] = {}  # a policy per weighted version
        self.pending_stats: dict[int, versions.Stats] = {}
        self.version_totals: dict[int, versions.Stats] = {}
        self._clock = clock
        self._ready = asyncio.Event()
        self._synced = asyncio.Event()  # set by the first endpoint set from the controller

    # ---- configuration and endpoints -------------------------------------------------------

    def configure(self, config: Config) -> None:
        """Apply the spec's settings; a new policy starts from the current ready set."""
        self.config = config
        name = self.policy_override or config.policy
        if name != self.policy.name or (
            isinstance(self.policy, policies.InstanceAware) and self.policy.target_qps != dict(config.target_qps)
        ):
            replicas = list(self.policy.replicas.values())
            self.policy = policies.make(name, self.in_flight, target_qps=config.target_qps)
            self.policy.set_replicas(replicas)
            self._groups = {}
            self._regroup()

    def set_endpoints(
        self, replicas: Iterable[policies.Replica], version: int, weights: Mapping[int, int] | None = None
    ) -> None:
        """Replace the ready set, and the weights per version, with the controller's latest ones.

        With no positive weight every ready replica shares the traffic; with some, each request
        gets a version by weight first (see versions.py). A new split starts only when the weights
        change, so a replica joining or leaving does not reset the proportions.
        """
        self.policy.set_replicas(replicas)
        self.in_flight.retain(self.policy.replicas)
        split = versions.Split(weights or {})
        if not split.weights:
            self.split = None
        elif self.split is None or self.split.weights != split.weights:
            self.split = split
        self._regroup()
        known = {r.version for r in self.policy.replicas.values()} | set(self.split.weights if self.split else ())
        for gone in [v for v in self.version_totals if v not in known]:
            del self.version_totals[gone]
        self.endpoints_version = version
        self._synced.set()
        if self._routable():
            self._ready.set()
        else:
            self._ready.clear()

    def _regroup(self) -> None:
        """One policy per weighted version, over that version's ready replicas."""
        if self.split is None:
            self._groups = {}
            return
        name = self.policy.name
        groups = {}
        for v in self.split.weights:
            group = self._groups.get(v) or policies.make(name, self.in_flight, target_qps=self.config.target_qps)
            group.set_replicas(r for r in self.policy.replicas.values() if r.version == v)
            groups[v] = group
        self._groups = groups

    def _routable(self) -> bool:
        if self.split is None:
            return bool(self.policy.replicas)
        return any(g.replicas for g in self._groups.values())

    def _select(self, exclude: frozenset[int]) -> policies.Replica | None:
        """The policy's choice, inside the version the split chooses when traffic is split."""
        if self.split is None:
            return self.policy.select(exclude)
        ready = {v for v, g in self._groups.items() if g.replicas}
        # A retry goes to a version that still has a replica not tried, when one does.
        untried = {v for v in ready if any(rid not in exclude for rid in self._groups[v].replicas)}
        version = self.split.choose(untried or ready)
        return None if version is None else self._groups[version].select(exclude)

    def replicas(self) -> dict[int, tuple[policies.Replica | None, bool]]:
        """Replica id -> (replica, ready) for ready replicas and gone ones still serving requests."""
        out: dict[int, tuple[policies.Replica | None, bool]] = {
            rid: (r, True) for rid, r in self.policy.replicas.items()
        }
        for rid in self.in_flight.counts:
            out.setdefault(rid, (None, False))
        return out

    # ---- requests ---------------------------------------------------------------------------

    def record_arrival(self) -> None:
        """Count a request for the next load report (once per request, before any retry)."""
        if len(self.pending_times) < MAX_PENDING_TIMES:
            self.pending_times.append(self._clock())
        else:
            self.pending_count += 1

    async def pick(self, exclude: frozenset[int] = frozenset()) -> policies.Replica:
        """The replica for a request attempt, holding the request while none is ready if the
        service scales from zero. The caller must `release` the replica when the attempt ends.

        Raises:
            NoReplicaError: none is ready (and none became ready while held).
        """
        replica = self._select(exclude)
        if replica is None and not self._synced.is_set() and self.startup_wait_s > 0:
            # Just started: the first endpoint set is on its way; a 503 now would be spurious.
            await waits.wait_event(self._synced, self.startup_wait_s)
            replica = self._select(exclude)
        if replica is None and self.config.scales_from_zero and self.hold_timeout_s > 0:
            replica = await self._hold(exclude)
        if replica is None:
            raise NoReplicaError(
                f"no ready replica for service {self.service_name!r}; "
                "check its replicas with `ListReplicas` or `WatchService` on the controller"
            )
        self.in_flight.acquire(replica.replica_id)
        return replica

    def release(self, replica: policies.Replica) -> None:
        """An attempt on `replica` ended (success, error, timeout or disconnect)."""
        rid = replica.replica_id
        self.in_flight.release(rid)
        if not self.in_flight.get(rid) and rid not in self.policy.replicas:
            self.on_drained()

    async def _hold(self, exclude: frozenset[int]) -> policies.Replica | None:
        if self.held >= self.hold_max:
            raise NoReplicaError(
                f"no ready replica for service {self.service_name!r} and {self.held} requests are already "
                "waiting for one to start; try again shortly",
                reason="hold_full",
            )
        self.held += 1
        self.on_held()  # report the arrival at once: the autoscaler scales from zero on it
        start = time.monotonic()
        outcome = "cancelled"
        try:
            deadline = start + self.hold_timeout_s
            while (replica := self._select(exclude)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    outcome = "timed_out"
                    raise NoReplicaError(
                        f"no replica of service {self.service_name!r} became ready within "
                        f"{self.hold_timeout_s:g} s (it scales from zero; the first replica may still be starting)",
                        reason="hold_timeout",
                    )
                if not await waits.wait_event(self._ready, left):
                    continue
            outcome = "released"
            return replica
        finally:
            self.held -= 1
            self.stats.hold_ended(outcome, time.monotonic() - start)

    # ---- per-version outcomes -------------------------------------------------------------------

    def _stats(self, version: int) -> tuple[versions.Stats, versions.Stats]:
        pending = self.pending_stats.setdefault(version, versions.Stats())
        totals = self.version_totals.setdefault(version, versions.Stats())
        return pending, totals

    def record_answer(self, replica: policies.Replica, status: int, latency_s: float) -> None:
        """An attempt on `replica` was answered with `status`, its headers `latency_s` after it was sent."""
        pending, totals = self._stats(replica.version)
        pending.answered(status, latency_s)
        totals.requests += 1
        totals.server_errors += 1 if 500 <= status <= 599 else 0

    def record_transport_error(self, replica: policies.Replica) -> None:
        """An attempt on `replica` got no complete answer."""
        for stats in self._stats(replica.version):
            stats.transport_error()

    @property
    def has_stats(self) -> bool:
        """Whether outcomes wait for the next report."""
        return bool(self.pending_stats)

    def take_stats(self) -> dict[int, versions.Stats]:
        """The outcomes per version since the last report, removed from the balancer: at most
        `versions.MAX_REPORTED` versions (the lowest), the rest wait for the next report."""
        taken = sorted(self.pending_stats)[: versions.MAX_REPORTED]
        return {v: self.pending_stats.pop(v) for v in taken}

    def versions_view(self) -> list[versions.View]:
        """Each version with a ready replica or a weight: weight, current share and totals."""
        ready: dict[int, int] = {}
        for r in self.policy.replicas.values():
            ready[r.version] = ready.get(r.version, 0) + 1
        weights = self.split.weights if self.split else {}
        if self.split:
            shares = self.split.shares({v for v, g in self._groups.items() if g.replicas})
        else:
            total = sum(ready.values())
            shares = {v: n / total for v, n in ready.items()} if total else {}
        return [
            versions.View(
                version=v,
                weight=weights.get(v, 0),
                share_per_mille=round(shares.get(v, 0.0) * 1000),
                ready_replicas=ready.get(v, 0),
                totals=self.version_totals.get(v, versions.Stats()),
            )
            for v in sorted(set(ready) | set(weights))
        ]

    # ---- load reports ------------------------------------------------------------------------

    def take_report(self) -> tuple[list[float], int]:
        """The arrivals since the last report, removed from the balancer."""
        times, count = self.pending_times, self.pending_count
        self.pending_times, self.pending_count = [], 0
        return times, count

    def restore_report(self, times: list[float], count: int) -> None:
        """Put back a report that could not be sent, ahead of newer arrivals."""
        merged = times + self.pending_times
        extra = max(0, len(merged) - MAX_PENDING_TIMES)
        self.pending_times = merged[extra:]
        self.pending_count += count + extra

    @property
    def unreported(self) -> int:
        """Requests not yet reported."""
        return len(self.pending_times) + self.pending_count

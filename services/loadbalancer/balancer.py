"""The balancer's state: the ready set, the policy, held requests and load not yet reported.

Plain asyncio; the proxy and the controller link drive it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping

from services.loadbalancer import policies

MAX_PENDING_TIMES = 100_000
"""Arrival times kept for the next report; beyond this, arrivals are only counted."""


class NoReplicaError(Exception):
    """No ready replica for a request (after holding it, if the service scales from zero)."""


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
    ) -> None:
        self.service_name = service_name
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

    def set_endpoints(self, replicas: Iterable[policies.Replica], version: int) -> None:
        """Replace the ready set with the controller's latest one."""
        self.policy.set_replicas(replicas)
        self.in_flight.retain(self.policy.replicas)
        self.endpoints_version = version
        self._synced.set()
        if self.policy.replicas:
            self._ready.set()
        else:
            self._ready.clear()

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
        replica = self.policy.select(exclude)
        if replica is None and not self._synced.is_set() and self.startup_wait_s > 0:
            # Just started: the first endpoint set is on its way; a 503 now would be spurious.
            try:
                await asyncio.wait_for(self._synced.wait(), self.startup_wait_s)
            except TimeoutError:
                pass
            replica = self.policy.select(exclude)
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
        self.in_flight.release(replica.replica_id)

    async def _hold(self, exclude: frozenset[int]) -> policies.Replica | None:
        if self.held >= self.hold_max:
            raise NoReplicaError(
                f"no ready replica for service {self.service_name!r} and {self.held} requests are already "
                "waiting for one to start; try again shortly"
            )
        self.held += 1
        self.on_held()  # report the arrival at once: the autoscaler scales from zero on it
        try:
            deadline = time.monotonic() + self.hold_timeout_s
            while (replica := self.policy.select(exclude)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoReplicaError(
                        f"no replica of service {self.service_name!r} became ready within "
                        f"{self.hold_timeout_s:g} s (it scales from zero; the first replica may still be starting)"
                    )
                try:
                    await asyncio.wait_for(self._ready.wait(), left)
                except TimeoutError:
                    continue
            return replica
        finally:
            self.held -= 1

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

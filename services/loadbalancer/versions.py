"""Traffic split between service versions by weight, and per-version request statistics.

While the controller splits traffic (a canary rollout), each request first gets a version by
weight, whatever the number of replicas of each, then a replica of that version from the
service's policy. The version is chosen by smooth weighted round robin (as nginx does): it is
deterministic, and after any number of requests each version's count is within about one request
of its exact share (a simulation of random weights over 2 to 5 versions never saw more), so 10/90
gives 100 and 900 of 1,000 whatever the order of arrivals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from services.common import latency

MAX_WEIGHT = 1000
MAX_REPORTED = 64
"""Versions in one load report (the controller refuses more)."""


class Split:
    """Chooses a version per request among the versions with a positive weight."""

    def __init__(self, weights: Mapping[int, int]) -> None:
        self.weights = {v: min(w, MAX_WEIGHT) for v, w in sorted(weights.items()) if w > 0}
        self._current = dict.fromkeys(self.weights, 0)

    def choose(self, eligible: Collection[int]) -> int | None:
        """The version for the next request, among `eligible` ones; None if no weighted version is.

        A version that is not eligible (no ready replica) is skipped and keeps its place, so its
        share goes to the others in proportion to their weights.
        """
        candidates = [v for v in self.weights if v in eligible]
        if not candidates:
            return None
        total = 0
        for v in candidates:
            self._current[v] += self.weights[v]
            total += self.weights[v]
        best = max(candidates, key=lambda v: self._current[v])  # ties: the lowest version
        self._current[best] -= total
        return best

    def shares(self, eligible: Collection[int]) -> dict[int, float]:
        """Each weighted version's share of new requests (0 to 1) when `eligible` have replicas."""
        total = sum(w for v, w in self.weights.items() if v in eligible)
        return {v: (w / total if total and v in eligible else 0.0) for v, w in self.weights.items()}


@dataclasses.dataclass
class Stats:
    """Outcomes of request attempts to one version: what `VersionStats` reports."""

    requests: int = 0
    server_errors: int = 0
    transport_errors: int = 0
    latency_buckets: dict[int, int] = dataclasses.field(default_factory=dict)
    latency_sum_s: float = 0.0

    def answered(self, status: int, latency_s: float) -> None:
        """An attempt got an answer with `status`, its headers `latency_s` after it was sent."""
        self.requests += 1
        if 500 <= status <= 599:
            self.server_errors += 1
        key = latency.key_of(latency_s)
        self.latency_buckets[key] = self.latency_buckets.get(key, 0) + 1
        self.latency_sum_s += max(latency_s, 0.0)

    def transport_error(self) -> None:
        """An attempt got no complete answer (refused, reset, broken, timed out)."""
        self.requests += 1
        self.transport_errors += 1

    def add(self, other: Stats) -> None:
        """Add another interval's counts to these."""
        self.requests += other.requests
        self.server_errors += other.server_errors
        self.transport_errors += other.transport_errors
        self.latency_buckets = latency.merged([self.latency_buckets, other.latency_buckets])
        self.latency_sum_s += other.latency_sum_s


@dataclasses.dataclass(frozen=True)
class View:
    """One version as the balancer routes to it, for the admin API."""

    version: int
    weight: int
    share_per_mille: int
    ready_replicas: int
    totals: Stats

"""Load-balancing policies and exact in-flight accounting, keyed by replica id (plain Python).

A policy picks one ready replica per request attempt. Every pick is paired with exactly one
release (the proxy releases in a `finally`), so in-flight counts are exact on every path: success,
upstream error, timeout, client disconnect, and replicas that leave the ready set while requests
to them are still running (their counts drain to 0 and are then forgotten).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Mapping

ROUND_ROBIN = "round_robin"
LEAST_LOAD = "least_load"
INSTANCE_AWARE = "instance_aware_least_load"
NAMES = (ROUND_ROBIN, LEAST_LOAD, INSTANCE_AWARE)
DEFAULT = LEAST_LOAD


@dataclasses.dataclass(frozen=True)
class Replica:
    """A ready replica as the controller announced it."""

    replica_id: int
    url: str
    version: int = 0
    accelerator: str = "unknown"


class InFlight:
    """Requests in flight per replica id; never negative. Totals are kept for ready replicas and for
    gone ones until their last request ends, so replica churn leaves no trace."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.totals: dict[int, int] = {}
        self._ready: set[int] | None = None  # None: no ready set given yet, keep every total

    def retain(self, ready: Iterable[int]) -> None:
        """The ready set changed: forget the totals of replicas outside it with nothing in flight."""
        self._ready = set(ready)
        for replica_id in [r for r in self.totals if r not in self._ready and r not in self.counts]:
            del self.totals[replica_id]

    def get(self, replica_id: int) -> int:
        """In-flight requests of a replica."""
        return self.counts.get(replica_id, 0)

    def acquire(self, replica_id: int) -> None:
        """A request was sent to the replica."""
        self.counts[replica_id] = self.counts.get(replica_id, 0) + 1
        self.totals[replica_id] = self.totals.get(replica_id, 0) + 1

    def release(self, replica_id: int) -> None:
        """A request to the replica finished, however it finished."""
        left = self.counts.get(replica_id, 0) - 1
        if left > 0:
            self.counts[replica_id] = left
        else:
            self.counts.pop(replica_id, None)  # 0 is not stored: gone replicas leave no trace
            if self._ready is not None and replica_id not in self._ready:
                self.totals.pop(replica_id, None)


class Policy:
    """Base: holds the ready set; subclasses choose."""

    name = ""

    def __init__(self, in_flight: InFlight) -> None:
        self.in_flight = in_flight
        self.replicas: dict[int, Replica] = {}

    def set_replicas(self, replicas: Iterable[Replica]) -> None:
        """Replace the ready set."""
        self.replicas = {r.replica_id: r for r in replicas}

    def select(self, exclude: frozenset[int] = frozenset()) -> Replica | None:
        """The replica for the next attempt, avoiding `exclude` when another is ready; None if none is ready."""
        raise NotImplementedError


class RoundRobin(Policy):
    """A strict cycle over the ready set, reshuffled whenever the set changes."""

    name = ROUND_ROBIN

    def __init__(self, in_flight: InFlight, *, shuffle: Callable[[list[Replica]], None] = random.shuffle) -> None:
        super().__init__(in_flight)
        self._order: list[Replica] = []
        self._next = 0
        self._shuffle = shuffle

    def set_replicas(self, replicas: Iterable[Replica]) -> None:
        """Replace the ready set; a different set of ids (or URLs) starts a new shuffled cycle."""
        before = self.replicas
        super().set_replicas(replicas)
        if before == self.replicas:
            return
        self._order = list(self.replicas.values())
        self._shuffle(self._order)
        self._next = 0

    def select(self, exclude: frozenset[int] = frozenset()) -> Replica | None:
        """The next replica of the cycle (skipping excluded ones, unless all are)."""
        n = len(self._order)
        if not n:
            return None
        for step in range(n):
            r = self._order[(self._next + step) % n]
            if r.replica_id not in exclude:
                self._next = (self._next + step + 1) % n
                return r
        r = self._order[self._next % n]
        self._next = (self._next + 1) % n
        return r


class LeastLoad(Policy):
    """Fewest in-flight requests; ties rotate so an idle fleet still shares sequential requests."""

    name = LEAST_LOAD

    def __init__(self, in_flight: InFlight) -> None:
        super().__init__(in_flight)
        self._tie = 0

    def score(self, r: Replica) -> float:
        """Lower is better."""
        return float(self.in_flight.get(r.replica_id))

    def select(self, exclude: frozenset[int] = frozenset()) -> Replica | None:
        """The least loaded replica not excluded (any, if all are excluded)."""
        ids = sorted(self.replicas)
        if not ids:
            return None
        candidates = [i for i in ids if i not in exclude] or ids
        self._tie += 1
        start = self._tie % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min((self.replicas[i] for i in rotated), key=self.score)


class InstanceAware(LeastLoad):
    """Least in-flight load relative to each accelerator's target QPS."""

    name = INSTANCE_AWARE

    def __init__(self, in_flight: InFlight, target_qps: Mapping[str, float] | None = None) -> None:
        super().__init__(in_flight)
        self.target_qps = dict(target_qps or {})

    def capacity(self, accelerator: str) -> float:
        """Target QPS of an accelerator: exact key, then the same base name ("A100" for "A100:1"),
        else 1.0; non-positive values count as 1.0."""
        qps = self.target_qps.get(accelerator)
        if qps is None:
            base = accelerator.split(":")[0]
            qps = next((v for k, v in self.target_qps.items() if k.split(":")[0] == base), None)
        return qps if qps is not None and qps > 0 else 1.0

    def score(self, r: Replica) -> float:
        """In-flight requests over the accelerator's target QPS."""
        return self.in_flight.get(r.replica_id) / self.capacity(r.accelerator)


def make(name: str, in_flight: InFlight, *, target_qps: Mapping[str, float] | None = None) -> Policy:
    """The policy called `name` ("" means the default, least_load).

    Raises:
        ValueError: unknown name.
    """
    name = name or DEFAULT
    if name == ROUND_ROBIN:
        return RoundRobin(in_flight)
    if name == LEAST_LOAD:
        return LeastLoad(in_flight)
    if name == INSTANCE_AWARE:
        return InstanceAware(in_flight, target_qps)
    raise ValueError(f"unknown load balancing policy {name!r}; expected one of {', '.join(NAMES)}")

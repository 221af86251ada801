"""The balancers of one service, as their load reports show them: URLs that expire, and in-flight
requests per replica that let a drain end early.

A balancer is alive while it reports: its URL is shown on the service until `ttl_s` passes without
a report from it (or it says it is closing). A replica drained after a scale-down or a manual
termination may go as soon as every live balancer reported nothing in flight to it, with an
endpoint set that no longer routes to it; a balancer that does not report in-flight counts (a
third party) keeps the full drain, and so does a service no balancer reports for.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping


@dataclasses.dataclass(frozen=True)
class Report:
    """What a load report says about its balancer."""

    balancer_id: str
    url: str = ""
    endpoints_version: int = 0
    in_flight: Mapping[int, int] | None = None
    """Replica id -> requests in flight (replicas with none left out); None: not reported."""
    closing: bool = False


@dataclasses.dataclass
class _Seen:
    url: str
    first: float
    last: float
    endpoints_version: int
    in_flight: Mapping[int, int] | None


@dataclasses.dataclass(frozen=True)
class _Drain:
    started: float
    after_version: int | None
    """The replica is out of every endpoint set newer than this; None: it was in none."""


class Table:
    """Live balancers and draining replicas of one service; times are the caller's (monotonic)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._seen: dict[str, _Seen] = {}
        self._drains: dict[int, _Drain] = {}

    def report(self, report: Report, now: float) -> None:
        """Record a report (any report: a resent one still says the balancer is alive)."""
        if report.closing:
            self._seen.pop(report.balancer_id, None)
            return
        old = self._seen.get(report.balancer_id)
        if old is None and not report.url and report.in_flight is None:
            return  # a sender of counts only (a script, a test): not a balancer of the service
        self._seen[report.balancer_id] = _Seen(
            url=report.url or (old.url if old else ""),
            first=old.first if old else now,
            last=now,
            endpoints_version=report.endpoints_version,
            in_flight=dict(report.in_flight) if report.in_flight is not None else None,
        )

    def expire(self, now: float) -> None:
        """Forget balancers silent for `ttl_s`."""
        # A timer may fire a hair early (the loop's clock resolution): a millisecond's grace.
        for bid in [b for b, s in self._seen.items() if now - s.last >= self.ttl_s - 1e-3]:
            del self._seen[bid]

    def url(self) -> str:
        """The URL shown for the service: the live balancer with a URL that reported first, so the
        URL stays put while another balancer comes and goes."""
        live = sorted((s.first, s.url) for s in self._seen.values() if s.url)
        return live[0][1] if live else ""

    def next_expiry(self) -> float | None:
        """When the next live balancer expires unless it reports again."""
        return min((s.last + self.ttl_s for s in self._seen.values()), default=None)

    def draining(self, replica_id: int, now: float, *, after_version: int | None) -> None:
        """A replica started draining; it left the endpoint sets after `after_version` (None: it
        was in none)."""
        self._drains[replica_id] = _Drain(started=now, after_version=after_version)

    def forget(self, replica_id: int) -> None:
        """The replica's drain is over (or it is gone)."""
        self._drains.pop(replica_id, None)

    def drained(self) -> list[int]:
        """Draining replicas every live balancer confirmed idle, removed from the table."""
        live = list(self._seen.values())
        if not live or any(s.in_flight is None for s in live):
            return []
        done = [rid for rid, d in self._drains.items() if all(_confirms(s, rid, d) for s in live)]
        for rid in done:
            del self._drains[rid]
        return sorted(done)


def _confirms(seen: _Seen, replica_id: int, drain: _Drain) -> bool:
    if seen.last <= drain.started or seen.in_flight is None or seen.in_flight.get(replica_id, 0) > 0:
        return False
    return drain.after_version is None or seen.endpoints_version > drain.after_version


class ServiceBalancers:
    """A Table with a timer: `on_change` runs when the shown URL changes, by a report or by expiry."""

    def __init__(self, ttl_s: float, *, on_change: Callable[[], None]) -> None:
        self.table = Table(ttl_s)
        self._on_change = on_change
        self._timer: asyncio.TimerHandle | None = None

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    @property
    def url(self) -> str:
        """The service's URL: empty while no balancer is alive."""
        return self.table.url()

    def report(self, report: Report) -> list[int]:
        """Record a report; return the draining replicas that may go now."""
        before = self.table.url()
        now = self._now()
        self.table.report(report, now)
        self.table.expire(now)
        if self.table.url() != before:
            self._on_change()
        self._arm()
        return self.table.drained()

    def draining(self, replica_id: int, *, after_version: int | None) -> None:
        """See Table.draining."""
        self.table.draining(replica_id, self._now(), after_version=after_version)

    def forget(self, replica_id: int) -> None:
        """See Table.forget."""
        self.table.forget(replica_id)

    def close(self) -> None:
        """Stop the timer (the service is gone or the controller stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        self.close()
        when = self.table.next_expiry()
        if when is not None:
            self._timer = asyncio.get_running_loop().call_at(when, self._expired)

    def _expired(self) -> None:
        self._timer = None
        before = self.table.url()
        self.table.expire(self._now())
        if self.table.url() != before:
            self._on_change()
        self._arm()

"""Rollout analysis: is the new version worse than the stable one, from the balancers' statistics?

Balancers report, with each load report, the outcomes of the request attempts per version since
their last report (`VersionStats`). The controller adds each applied report to a per-version
`Series`, in one-second slots by its own clock at arrival, so no balancer clock is trusted (as
with load reports). Reports are deduplicated before they get here: a report counts once.

`analyze` compares the new version's error rate (5xx answers and transport errors over attempts)
and, optionally, its latency p99 with the stable version's over the last `window_s` seconds:

- fewer than `min_requests` attempts to the new version: not enough data (no verdict yet);
- its error rate above the stable one's plus `max_error_rate_increase_pct` points: fail;
- its p99 above `max_latency_p99_ratio` times the stable one's: fail;
- else pass.

When the stable version had fewer than `min_requests` attempts in the window (it had no traffic,
as after a blue-green switch), the baseline is 0 %: the new version may then have at most the
allowed increase in errors. Latency is only compared when both versions have enough answers.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping

from services.common import latency

MAX_WINDOW_S = 3600.0
"""The longest analysis window; a series keeps no more than this."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """Outcomes of request attempts to one version: one report's, or a window's sum."""

    requests: int = 0
    server_errors: int = 0
    transport_errors: int = 0
    latency_buckets: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """Answered attempts by latency bucket (services.common.latency)."""
    latency_sum_s: float = 0.0

    @property
    def errors(self) -> int:
        """Attempts that failed: 5xx answers and transport errors."""
        return self.server_errors + self.transport_errors

    @property
    def error_rate_pct(self) -> float:
        """Failed attempts over attempts, in percent (0 without attempts)."""
        return 100.0 * self.errors / self.requests if self.requests else 0.0

    @property
    def answered(self) -> int:
        """Attempts with a latency."""
        return sum(self.latency_buckets.values())

    def plus(self, other: Sample) -> Sample:
        """The sum of two samples."""
        return Sample(
            requests=self.requests + other.requests,
            server_errors=self.server_errors + other.server_errors,
            transport_errors=self.transport_errors + other.transport_errors,
            latency_buckets=latency.merged([self.latency_buckets, other.latency_buckets]),
            latency_sum_s=self.latency_sum_s + other.latency_sum_s,
        )


class Series:
    """One version's reported samples over the recent past, in one-second slots by arrival time."""

    def __init__(self, horizon_s: float = MAX_WINDOW_S) -> None:
        self.horizon_s = horizon_s
        self.slots: dict[int, Sample] = {}

    def add(self, sample: Sample, now: float) -> None:
        """Count a report's sample as arrived at `now` (the controller's clock, seconds)."""
        slot = math.floor(now)
        self.slots[slot] = self.slots.get(slot, Sample()).plus(sample)
        for old in [s for s in self.slots if s + 1 <= now - self.horizon_s]:
            del self.slots[old]

    def total(self, now: float, window_s: float) -> Sample:
        """The sum of the samples that arrived in the last `window_s` seconds (to the second)."""
        out = Sample()
        for slot, sample in self.slots.items():
            if slot + 1 > now - window_s and slot <= now:
                out = out.plus(sample)
        return out


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """When a new version fails (the `service.rollout.analysis` section)."""

    max_error_rate_increase_pct: float = 5.0
    """Points the new version's error rate may exceed the stable version's by."""
    window_s: float = 30.0
    """The window rates are taken over."""
    min_requests: int = 20
    """Fewest attempts to the new version in the window before it is judged."""
    max_latency_p99_ratio: float | None = None
    """The new version's p99 may be at most this times the stable version's; None: not checked."""


class Outcome(enum.Enum):
    """What the analysis concluded."""

    PASS = "pass"
    FAIL = "fail"
    NOT_ENOUGH_DATA = "not enough data"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The analysis's conclusion, the reason in one line, and the numbers it is based on."""

    outcome: Outcome
    reason: str
    canary: Sample
    stable: Sample


def analyze(stable: Series | None, canary: Series | None, thresholds: Thresholds, now: float) -> Verdict:
    """Judge the new version (`canary`) against the `stable` one over the last window.

    Args:
        stable: The stable version's series; None if it has none (no report named it).
        canary: The new version's series; None if it has none.
        thresholds: When to fail.
        now: The controller's clock, seconds (the same clock the series were filled with).

    Returns:
        PASS, FAIL (the reason names the numbers) or NOT_ENOUGH_DATA.
    """
    t = thresholds
    window = f"over the last {t.window_s:g} s"
    c = canary.total(now, t.window_s) if canary else Sample()
    s = stable.total(now, t.window_s) if stable else Sample()
    if c.requests < t.min_requests:
        return Verdict(
            Outcome.NOT_ENOUGH_DATA,
            f"{_requests(c.requests)} {window}; at least {t.min_requests} are needed to judge",
            c,
            s,
        )
    compared = s.requests >= t.min_requests
    baseline = s.error_rate_pct if compared else 0.0
    stable_text = (
        f"the stable version's {baseline:.1f} %"
        if compared
        else f"0 % (the stable version had {_requests(s.requests)}, too few to compare)"
    )
    errors = f"error rate {c.error_rate_pct:.1f} % {window} ({_requests(c.requests)})"
    if c.error_rate_pct - baseline > t.max_error_rate_increase_pct:
        return Verdict(
            Outcome.FAIL, f"{errors} is above {stable_text} + {t.max_error_rate_increase_pct:g} points", c, s
        )
    reason = f"{errors} is within {stable_text} + {t.max_error_rate_increase_pct:g} points"
    if t.max_latency_p99_ratio is not None:
        c_p99, s_p99 = latency.quantile(c.latency_buckets, 0.99), latency.quantile(s.latency_buckets, 0.99)
        if c_p99 is None or s_p99 is None or min(c.answered, s.answered) < t.min_requests:
            reason += "; latency not compared (too few answers)"
        else:
            p99 = f"latency p99 {_ms(c_p99)} {window} ({c.answered} answers)"
            limit = f"{t.max_latency_p99_ratio:g} x the stable version's {_ms(s_p99)}"
            if c_p99 > t.max_latency_p99_ratio * s_p99:
                return Verdict(Outcome.FAIL, f"{p99} is above {limit}", c, s)
            reason += f"; {p99} is within {limit}"
    return Verdict(Outcome.PASS, reason, c, s)


def _requests(n: int) -> str:
    return f"{n} request" if n == 1 else f"{n} requests"


def _ms(seconds: float) -> str:
    ms = seconds * 1000.0
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.2g} ms"

"""The rollout analysis rule: a new version's error rate and latency against the stable version's
over a sliding window of the balancers' per-version reports (pure, table-driven)."""

from __future__ import annotations

import dataclasses

import pytest

from services.common import latency
from services.controller.domain import analysis as an

NOW = 10_000.0
T = an.Thresholds()  # the defaults: + 5 points over 30 s, at least 20 requests, no latency check


def sample(requests: int, server_errors: int = 0, transport_errors: int = 0, p_ms: float = 10.0) -> an.Sample:
    """`requests` attempts; the answered ones all took about `p_ms`."""
    answered = requests - transport_errors
    buckets = {latency.key_of(p_ms / 1000): answered} if answered else {}
    return an.Sample(requests, server_errors, transport_errors, buckets, answered * p_ms / 1000)


def series(*entries: tuple[float, an.Sample]) -> an.Series:
    """Samples that arrived `age` seconds before NOW."""
    s = an.Series()
    for age, smp in sorted(entries, key=lambda e: -e[0]):
        s.add(smp, NOW - age)
    return s


def latencies(requests: int, slow_ms: float, slow: int, fast_ms: float = 10.0) -> an.Sample:
    buckets = {latency.key_of(fast_ms / 1000): requests - slow}
    buckets[latency.key_of(slow_ms / 1000)] = buckets.get(latency.key_of(slow_ms / 1000), 0) + slow
    return an.Sample(requests, 0, 0, buckets, 0.0)


CASES = [
    # (name, stable, canary, thresholds, outcome, reason)
    (
        "too few canary requests",
        series((1, sample(500, 1))),
        series((1, sample(12, 12))),
        T,
        an.Outcome.NOT_ENOUGH_DATA,
        "12 requests over the last 30 s; at least 20 are needed to judge",
    ),
    (
        "no report named the canary yet",
        series((1, sample(500))),
        None,
        T,
        an.Outcome.NOT_ENOUGH_DATA,
        "0 requests over the last 30 s; at least 20 are needed to judge",
    ),
    (
        "half the canary's requests fail",
        series((5, sample(100, 1)), (20, sample(100))),
        series((2, sample(62, 29)), (12, sample(63, 31))),
        T,
        an.Outcome.FAIL,
        "error rate 48.0 % over the last 30 s (125 requests) is above the stable version's 0.5 % + 5 points",
    ),
    (
        "an increase of exactly the allowed points passes",
        series((1, sample(100, 1))),
        series((1, sample(100, 6))),
        T,
        an.Outcome.PASS,
        "error rate 6.0 % over the last 30 s (100 requests) is within the stable version's 1.0 % + 5 points",
    ),
    (
        "one more failure fails",
        series((1, sample(100, 1))),
        series((1, sample(100, 7))),
        T,
        an.Outcome.FAIL,
        "error rate 7.0 % over the last 30 s (100 requests) is above the stable version's 1.0 % + 5 points",
    ),
    (
        "transport errors count as errors",
        series((1, sample(100))),
        series((1, sample(40, 0, 10))),
        T,
        an.Outcome.FAIL,
        "error rate 25.0 % over the last 30 s (40 requests) is above the stable version's 0.0 % + 5 points",
    ),
    (
        "a stable version that errs as much is no reason to fail",
        series((1, sample(200, 40))),
        series((1, sample(100, 22))),
        T,
        an.Outcome.PASS,
        "error rate 22.0 % over the last 30 s (100 requests) is within the stable version's 20.0 % + 5 points",
    ),
    (
        "a stable version without traffic: the baseline is 0 %",
        series((1, sample(3, 1))),
        series((1, sample(100, 6))),
        T,
        an.Outcome.FAIL,
        "error rate 6.0 % over the last 30 s (100 requests) is above 0 % (the stable version had 3 requests, "
        "too few to compare) + 5 points",
    ),
    (
        "no stable series at all",
        None,
        series((1, sample(100, 4))),
        T,
        an.Outcome.PASS,
        "error rate 4.0 % over the last 30 s (100 requests) is within 0 % (the stable version had 0 requests, "
        "too few to compare) + 5 points",
    ),
    (
        "failures older than the window are forgotten",
        series((1, sample(100))),
        series((45, sample(100, 100)), (31, sample(50, 50)), (3, sample(30))),
        T,
        an.Outcome.PASS,
        "error rate 0.0 % over the last 30 s (30 requests) is within the stable version's 0.0 % + 5 points",
    ),
    (
        "only old reports: not enough data now",
        series((1, sample(100))),
        series((40, sample(100, 100))),
        T,
        an.Outcome.NOT_ENOUGH_DATA,
        "0 requests over the last 30 s; at least 20 are needed to judge",
    ),
    (
        "a longer window and a stricter rule",
        series((50, sample(100, 0))),
        series((50, sample(10, 1)), (1, sample(10, 0))),
        an.Thresholds(max_error_rate_increase_pct=2, window_s=60, min_requests=20),
        an.Outcome.FAIL,
        "error rate 5.0 % over the last 60 s (20 requests) is above the stable version's 0.0 % + 2 points",
    ),
    (
        "latency p99 three times the stable one's fails a ratio of 2",
        series((1, latencies(200, 100, 10))),
        series((1, latencies(100, 300, 5))),
        an.Thresholds(max_latency_p99_ratio=2),
        an.Outcome.FAIL,
        "latency p99 {c} over the last 30 s (100 answers) is above 2 x the stable version's {s}",
    ),
    (
        "latency within the ratio passes",
        series((1, latencies(200, 100, 10))),
        series((1, latencies(100, 150, 5))),
        an.Thresholds(max_latency_p99_ratio=2),
        an.Outcome.PASS,
        "error rate 0.0 % over the last 30 s (100 requests) is within the stable version's 0.0 % + 5 points; "
        "latency p99 {c} over the last 30 s (100 answers) is within 2 x the stable version's {s}",
    ),
    (
        "latency is not compared without enough stable answers",
        series((1, latencies(5, 100, 1))),
        series((1, latencies(100, 3000, 50))),
        an.Thresholds(max_latency_p99_ratio=2),
        an.Outcome.PASS,
        "error rate 0.0 % over the last 30 s (100 requests) is within 0 % (the stable version had 5 requests, "
        "too few to compare) + 5 points; latency not compared (too few answers)",
    ),
    (
        "errors are judged before latency",
        series((1, latencies(200, 100, 10))),
        series((1, dataclasses.replace(latencies(100, 900, 50), server_errors=50))),
        an.Thresholds(max_latency_p99_ratio=2),
        an.Outcome.FAIL,
        "error rate 50.0 % over the last 30 s (100 requests) is above the stable version's 0.0 % + 5 points",
    ),
]


@pytest.mark.parametrize(
    ("stable", "canary", "thresholds", "outcome", "reason"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_analysis(
    stable: an.Series | None, canary: an.Series | None, thresholds: an.Thresholds, outcome: an.Outcome, reason: str
) -> None:
    verdict = an.analyze(stable, canary, thresholds, NOW)
    if "{c}" in reason:  # p99s are read from histogram buckets: the text shows the estimates
        c_p99 = latency.quantile(verdict.canary.latency_buckets, 0.99)
        s_p99 = latency.quantile(verdict.stable.latency_buckets, 0.99)
        assert c_p99 is not None and s_p99 is not None
        reason = reason.format(c=an._ms(c_p99), s=an._ms(s_p99))
    assert (verdict.outcome, verdict.reason) == (outcome, reason)


def test_p99_estimates_are_within_a_bucket_of_the_truth() -> None:
    s = latencies(1000, 250, 20)  # 2 % at 250 ms: the p99 is 250 ms
    p99 = latency.quantile(s.latency_buckets, 0.99)
    assert p99 is not None and 250 / 1.19 / 1000 <= p99 <= 250 * 1.19 / 1000
    assert latency.quantile({}, 0.99) is None


def test_a_series_adds_reports_of_one_second_and_forgets_past_its_horizon() -> None:
    s = an.Series(horizon_s=60)
    s.add(sample(10, 1), NOW - 0.6)
    s.add(sample(10, 2), NOW - 0.4)  # same second: one slot
    s.add(sample(10, 3), NOW - 0.1)
    assert len(s.slots) <= 2
    assert (s.total(NOW, 30).requests, s.total(NOW, 30).server_errors) == (30, 6)
    s.add(sample(5), NOW + 61)  # a minute later, everything before is past the horizon
    assert list(s.slots) == [int(NOW + 61)]
    assert s.total(NOW + 61, 30).requests == 5


def test_totals_keep_every_count_and_latency() -> None:
    a = sample(10, 1, 2, p_ms=5)
    b = sample(20, 3, 0, p_ms=50)
    total = series((1, a), (2, b)).total(NOW, 30)
    assert (total.requests, total.server_errors, total.transport_errors, total.errors) == (30, 4, 2, 6)
    assert total.answered == 28
    assert total.latency_sum_s == pytest.approx(a.latency_sum_s + b.latency_sum_s)
    assert total.error_rate_pct == pytest.approx(20.0)
    assert an.Sample().error_rate_pct == 0.0


@pytest.mark.parametrize(
    ("seconds", "key"),
    [(0.0, latency.MIN_KEY), (-1.0, latency.MIN_KEY), (0.001, 0), (0.002, 4), (0.0015, 3), (1e9, latency.MAX_KEY)],
)
def test_latency_buckets(seconds: float, key: int) -> None:
    assert latency.key_of(seconds) == key
    if latency.MIN_KEY < key < latency.MAX_KEY:
        assert latency.lower_s(key) < seconds <= latency.upper_s(key)

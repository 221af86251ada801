"""Latency histograms that add up across reports and balancers: four buckets per doubling.

Key `i` counts latencies in (2^((i-1)/4), 2^(i/4)] milliseconds, so each bucket is about 19 %
wide and a quantile read from it is off by at most that. Latencies at or below 2^-10 ms count
in `MIN_KEY`, those above 2^24 ms (about 4.7 h) in `MAX_KEY`. The balancer fills these
(`VersionStats.latency_buckets`), the controller adds them up and reads quantiles off the sum;
both sides use this module, so the bucket bounds always agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

PER_DOUBLING = 4
MIN_KEY = -40
MAX_KEY = 96


def key_of(seconds: float) -> int:
    """The bucket of a latency given in seconds (negative or NaN counts as the smallest)."""
    ms = seconds * 1000.0
    if not ms > 2.0 ** (MIN_KEY / PER_DOUBLING):  # also NaN
        return MIN_KEY
    if math.isinf(ms):
        return MAX_KEY
    return max(MIN_KEY, min(MAX_KEY, math.ceil(PER_DOUBLING * math.log2(ms))))


def upper_s(key: int) -> float:
    """The upper bound of a bucket, in seconds."""
    return float(2.0 ** (key / PER_DOUBLING) / 1000.0)


def lower_s(key: int) -> float:
    """The lower bound of a bucket, in seconds (0 for the smallest)."""
    return 0.0 if key <= MIN_KEY else upper_s(key - 1)


def merged(histograms: Iterable[Mapping[int, int]]) -> dict[int, int]:
    """The sum of several histograms, key by key."""
    out: dict[int, int] = {}
    for histogram in histograms:
        for key, count in histogram.items():
            out[key] = out.get(key, 0) + count
    return out


def quantile(histogram: Mapping[int, int], q: float) -> float | None:
    """The q-quantile (0 < q <= 1) in seconds, interpolated inside its bucket on a log scale;
    None for an empty histogram."""
    total = sum(c for c in histogram.values() if c > 0)
    if total <= 0:
        return None
    rank = max(1.0, math.ceil(q * total))
    seen = 0
    for key in sorted(histogram):
        count = histogram[key]
        if count <= 0:
            continue
        if seen + count >= rank:
            low, high = lower_s(key), upper_s(key)
            fraction = (rank - seen) / count
            if low <= 0.0:
                return high * fraction
            return float(low * (high / low) ** fraction)
        seen += count
    return upper_s(max(histogram))  # not reached: the ranks add up to `total`

"""Conversions between protobuf Timestamp/Duration and float seconds, used by every service."""

from __future__ import annotations

from google.protobuf import duration_pb2, timestamp_pb2


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    """A Timestamp of POSIX `seconds`."""
    out = timestamp_pb2.Timestamp()
    out.FromNanoseconds(round(seconds * 1e9))
    return out


def from_timestamp(t: timestamp_pb2.Timestamp) -> float:
    """POSIX seconds of a Timestamp."""
    return t.seconds + t.nanos / 1e9


def duration(seconds: float) -> duration_pb2.Duration:
    """A Duration of `seconds`."""
    out = duration_pb2.Duration()
    out.FromNanoseconds(round(seconds * 1e9))
    return out


def seconds(d: duration_pb2.Duration) -> float:
    """A Duration in seconds."""
    return d.seconds + d.nanos / 1e9


MIN_TIMESTAMP_S = -62_135_596_800
"""0001-01-01T00:00:00Z, the earliest valid Timestamp."""
MAX_TIMESTAMP_S = 253_402_300_799
"""9999-12-31T23:59:59Z, the latest valid Timestamp."""
MAX_DURATION_S = 315_576_000_000
"""About 10,000 years, the longest valid Duration."""
_MAX_NANOS = 999_999_999


def timestamp_problem(t: timestamp_pb2.Timestamp) -> str:
    """Why `t` is not a valid Timestamp (protobuf's documented range), or "" if it is."""
    if not MIN_TIMESTAMP_S <= t.seconds <= MAX_TIMESTAMP_S:
        return f"seconds must be {MIN_TIMESTAMP_S}..{MAX_TIMESTAMP_S} (years 1 to 9999), got {t.seconds}"
    if not 0 <= t.nanos <= _MAX_NANOS:
        return f"nanos must be 0..{_MAX_NANOS}, got {t.nanos}"
    return ""


def duration_problem(d: duration_pb2.Duration, *, negative: bool = True) -> str:
    """Why `d` is not a valid Duration (or is negative when `negative` is False), or "" if fine."""
    if not -MAX_DURATION_S <= d.seconds <= MAX_DURATION_S:
        return f"seconds must be -{MAX_DURATION_S}..{MAX_DURATION_S}, got {d.seconds}"
    if not -_MAX_NANOS <= d.nanos <= _MAX_NANOS or (d.seconds > 0 > d.nanos) or (d.seconds < 0 < d.nanos):
        return f"nanos must be -{_MAX_NANOS}..{_MAX_NANOS} with the sign of seconds, got {d.nanos}"
    if not negative and (d.seconds < 0 or d.nanos < 0):
        return "must not be negative"
    return ""

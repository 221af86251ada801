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

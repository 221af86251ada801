"""Range checks of protobuf Timestamps and Durations received from clients."""

from __future__ import annotations

import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from services.common import pbtime


@pytest.mark.parametrize(
    ("seconds", "nanos", "problem"),
    [
        (0, 0, ""),
        (1_700_000_000, 999_999_999, ""),
        (pbtime.MIN_TIMESTAMP_S, 0, ""),
        (pbtime.MAX_TIMESTAMP_S, 999_999_999, ""),
        (-(2**62), 0, "seconds must be"),
        (2**62, 0, "seconds must be"),
        (pbtime.MIN_TIMESTAMP_S - 1, 0, "seconds must be"),
        (pbtime.MAX_TIMESTAMP_S + 1, 0, "seconds must be"),
        (1_700_000_000, -1, "nanos must be 0..999999999, got -1"),
        (1_700_000_000, 1_000_000_000, "nanos must be"),
    ],
)
def test_timestamp_problem(seconds: int, nanos: int, problem: str) -> None:
    found = pbtime.timestamp_problem(timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos))
    assert found.startswith(problem) if problem else found == ""


@pytest.mark.parametrize(
    ("seconds", "nanos", "negative", "problem"),
    [
        (0, 0, False, ""),
        (5, 500_000_000, False, ""),
        (pbtime.MAX_DURATION_S, 999_999_999, False, ""),
        (-5, -500_000_000, True, ""),
        (-5, 0, False, "must not be negative"),
        (0, -1, False, "must not be negative"),
        (pbtime.MAX_DURATION_S + 1, 0, False, "seconds must be"),
        (-(2**62), 0, True, "seconds must be"),
        (1, 1_000_000_000, False, "nanos must be"),
        (1, -1, True, "nanos must be"),  # signs differ
        (-1, 1, True, "nanos must be"),
    ],
)
def test_duration_problem(seconds: int, nanos: int, negative: bool, problem: str) -> None:
    found = pbtime.duration_problem(duration_pb2.Duration(seconds=seconds, nanos=nanos), negative=negative)
    assert found.startswith(problem) if problem else found == ""

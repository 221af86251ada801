"""Fuzzed specs and requests against a real controller server: every answer is a clean gRPC
status (field violations with INVALID_ARGUMENT), nothing crashes, and a failed call changes
nothing. `bench/fuzz.py` runs many more cases and prints the counts."""

from __future__ import annotations

import pytest

from tests.helpers import fuzzing

pytestmark = pytest.mark.slow


def test_fuzzed_specs_get_clean_statuses_and_change_nothing_on_error(tmp_path) -> None:
    outcome = fuzzing.run_session(str(tmp_path), fuzzing.spec_requests, 50, raise_on_crash=True)
    assert outcome.crashes == []
    assert outcome.codes.get("INVALID_ARGUMENT", 0) > 0


def test_fuzzed_requests_of_every_method_get_clean_statuses(tmp_path) -> None:
    outcome = fuzzing.run_session(str(tmp_path), fuzzing.requests, 100, raise_on_crash=True)
    assert outcome.crashes == []

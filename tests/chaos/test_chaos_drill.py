"""A small seeded chaos run in CI: kills of every component during every scenario kind."""

from __future__ import annotations

import pytest

from tests.chaos import driver

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def test_seeded_chaos_keeps_every_invariant(tmp_path) -> None:
    report = await driver.Chaos(str(tmp_path), seed=27).run(rounds=6)
    assert report.rounds == 6
    assert set(report.scenarios) == set(driver.SCENARIOS)
    assert set(report.kills) == set(driver.TARGETS)
    assert report.violations == []

"""A small seeded chaos run in CI: kills of every component during every scenario kind, some
of them racing the API write. `python -m tests.chaos --seeds 11,12,13 --rounds 50` runs more."""

from __future__ import annotations

import pytest

from tests.chaos import driver

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.drill]


async def test_seeded_chaos_keeps_every_invariant(tmp_path) -> None:
    # Seed 88's six rounds cover every scenario and every kill target; five race the write.
    report = await driver.Chaos(str(tmp_path), seed=88).run(rounds=6)
    assert report.violations == []
    assert report.rounds == 6
    assert set(report.scenarios) == set(driver.SCENARIOS)
    assert set(report.kills) == set(driver.TARGETS)
    assert report.racing > 0

"""The prober fleet outage drill, short: the whole fleet gone for a few seconds, with a failure
window of one second. `python -m tests.chaos --prober-outage 60` runs the full minute."""

from __future__ import annotations

import os

import pytest

from tests.chaos import outage

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.drill]

OUTAGE_S = float(os.environ.get("REPLICAPLANE_DRILL_OUTAGE_S", "4"))


async def test_losing_every_prober_tears_nothing_down_and_probing_resumes(tmp_path) -> None:
    report = await outage.prober_outage(str(tmp_path), OUTAGE_S)
    assert report.violations == []
    assert report.torn_down == 0
    assert 0 <= report.stale_after_s < OUTAGE_S
    assert report.resumed_after_s >= 0

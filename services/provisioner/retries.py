"""Backoff for launch and teardown retries, as a tenacity wait strategy.

SkyPilot's backoff: the first gap is `initial`, each next one `multiplier` times longer, capped
at `maximum`, and each gap jittered by +-40 %. The jittered gap never exceeds `maximum`.
"""

from __future__ import annotations

import random

import tenacity
from tenacity import wait as tenacity_wait

DEFAULT_JITTER = 0.4


class wait_jittered_exponential(tenacity_wait.wait_base):
    """Exponential backoff with multiplicative jitter, for tenacity's `wait=` (named as tenacity's)."""

    def __init__(
        self,
        initial: float,
        multiplier: float,
        maximum: float,
        jitter: float = DEFAULT_JITTER,
        rng: random.Random | None = None,
    ) -> None:
        self.initial = max(0.0, initial)
        self.multiplier = max(1.0, multiplier)
        self.maximum = max(self.initial, maximum)
        self.jitter = min(max(0.0, jitter), 1.0)
        self._rng = rng or random.Random()

    def base(self, attempt_number: int) -> float:
        """The un-jittered gap after attempt `attempt_number` (from 1)."""
        exponent = max(0, attempt_number - 1)
        try:
            gap = self.initial * self.multiplier**exponent
        except OverflowError:
            gap = self.maximum
        return min(gap, self.maximum)

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        """The gap before the next attempt."""
        gap = self.base(retry_state.attempt_number)
        gap *= 1 + self._rng.uniform(-self.jitter, self.jitter)
        return max(0.0, min(gap, self.maximum))

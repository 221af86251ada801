"""Which launch failures are tried again, and the backoff between tries (a tenacity wait).

SkyPilot's backoff: the first gap is `initial`, each next one `multiplier` times longer, capped
at `maximum`, and each gap jittered by +-40 %. The jittered gap never exceeds `maximum`.
"""

from __future__ import annotations

import random

import tenacity
from tenacity import wait as tenacity_wait

from services.provisioner import backend

DEFAULT_JITTER = 0.4


def launch_retryable(exc: BaseException, *, zone: str) -> bool:
    """Whether another attempt of a launch into `zone` ("" when the backend chooses) may help.

    Not for a permanent failure (the spec cannot work), and not for a lack of capacity in a
    zone the launch asked for: that goes back to the controller at once, whose spot placer
    chooses another zone (capacity is the infrastructure's fault, so it is never permanent).
    """
    if not isinstance(exc, backend.LaunchError) or exc.permanent:
        return False
    return not (exc.capacity_unavailable and zone)


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

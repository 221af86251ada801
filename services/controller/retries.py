"""One retry policy per kind of call, defined here and nowhere else (tenacity: exponential waits
with jitter and a cap).

- `STREAM`: re-opening a provisioner stream that broke (launch, teardown, the replica watch).
- `LOGS`: deleting a failed replica's logs (a few tries, then given up: logs are not state).
- `WRITE`: a pass whose writes the store did not take; they stay pending and go again.
- `PASS`: a pass or an autoscaler decision that raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import types
from collections.abc import Awaitable, Callable
from typing import TypeVar

import tenacity

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Policy:
    """Waits of one kind of retry: `initial_s` doubling up to `max_s`, plus up to `jitter_s`."""

    initial_s: float
    max_s: float
    jitter_s: float
    attempts: int = 0  # 0: retry for ever

    def with_times(self, initial_s: float, max_s: float) -> Policy:
        """The same policy with other times (tests shorten them)."""
        return dataclasses.replace(self, initial_s=initial_s, max_s=max_s, jitter_s=min(self.jitter_s, initial_s))

    def wait(self) -> tenacity.wait.wait_base:
        """The tenacity wait strategy."""
        return tenacity.wait_exponential_jitter(multiplier=self.initial_s, max=self.max_s, jitter=self.jitter_s)

    def stop(self) -> tenacity.stop.stop_base:
        """The tenacity stop strategy."""
        return tenacity.stop_after_attempt(self.attempts) if self.attempts else tenacity.stop_never

    def delay(self, attempt: int) -> float:
        """Seconds to wait before try `attempt + 1` (attempt >= 1), for timers outside tenacity."""
        state = types.SimpleNamespace(attempt_number=max(attempt, 1))
        return float(self.wait()(state))  # type: ignore[arg-type]

    def retrying(self, *retry_on: type[BaseException]) -> tenacity.AsyncRetrying:
        """An AsyncRetrying that retries these exceptions with this policy and re-raises the last."""
        return tenacity.AsyncRetrying(
            wait=self.wait(), stop=self.stop(), retry=tenacity.retry_if_exception_type(retry_on), reraise=True
        )

    async def run(
        self,
        attempt: Callable[[int], Awaitable[T]],
        *retry_on: type[Exception],
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> T:
        """Await `attempt(n)` (n counts from 1) until it returns, waiting `delay` after each of the
        exceptions `retry_on`. A plain loop rather than `retrying`: tenacity's machinery around a
        first attempt that nearly always succeeds costs too much when thousands start at once.

        Args:
            attempt: one try; its argument is the try's number.
            retry_on: the exceptions that mean "try again"; any other passes through at once.
            sleep: waits between tries (tests pass their own).

        Returns:
            What the first successful try returned.

        Raises:
            Exception: the last `retry_on` exception once `attempts` tries failed.
        """
        tries = 0
        while True:
            tries += 1
            try:
                return await attempt(tries)
            except retry_on:
                if self.attempts and tries >= self.attempts:
                    raise
            await sleep(self.delay(tries))


STREAM = Policy(initial_s=0.1, max_s=2.0, jitter_s=0.1)
LOGS = Policy(initial_s=0.1, max_s=2.0, jitter_s=0.1, attempts=8)
WRITE = Policy(initial_s=0.05, max_s=2.0, jitter_s=0.05)
PASS = Policy(initial_s=0.5, max_s=2.0, jitter_s=0.2)

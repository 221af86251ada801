"""A weighted FIFO limiter for launches and teardowns in flight.

Capacity is counted in half slots so a teardown (weight 1/2) and a launch (weight 1) are
exact integers. Work that does not fit waits in arrival order; a freed slot goes to the head
of the queue at once (no tick). A waiter never overtakes an earlier one, even a heavier one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

LAUNCH = 2
"""Weight of a launch, in half slots."""
TEARDOWN = 1
"""Weight of a teardown, in half slots."""


class Slots:
    """At most `max_in_flight` launches in flight, teardowns counting 1/2."""

    def __init__(self, max_in_flight: float) -> None:
        if max_in_flight < 0.5:
            raise ValueError("max_in_flight must be at least 0.5")
        self._capacity = round(max_in_flight * 2)
        self._used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def in_use(self) -> float:
        """Slots in use (teardowns count 1/2)."""
        return self._used / 2

    @property
    def waiting(self) -> int:
        """How many are queued."""
        return len(self._waiters)

    def would_wait(self, weight: int) -> bool:
        """Whether acquire(weight) would queue now."""
        return bool(self._waiters) or self._used + weight > self._capacity

    async def acquire(self, weight: int) -> None:
        """Take `weight` half slots, waiting in FIFO order if they are not free."""
        weight = min(weight, self._capacity)
        if not self.would_wait(weight):
            self._used += weight
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (weight, future)
        self._waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                # Granted just as we were cancelled: hand the slot on.
                self.release(weight)
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._grant()
            raise

    def release(self, weight: int) -> None:
        """Return `weight` half slots and wake the waiters that now fit, in order."""
        weight = min(weight, self._capacity)
        self._used = max(0, self._used - weight)
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            weight, future = self._waiters[0]
            if future.done():
                self._waiters.popleft()
                continue
            if self._used + weight > self._capacity:
                return
            self._waiters.popleft()
            self._used += weight
            future.set_result(None)

    @contextlib.asynccontextmanager
    async def hold(self, weight: int) -> AsyncIterator[None]:
        """Hold `weight` half slots for the body of an `async with`."""
        await self.acquire(weight)
        try:
            yield
        finally:
            self.release(weight)

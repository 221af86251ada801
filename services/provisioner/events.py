"""Event logs that streams replay and follow: per-replica operation logs and the watch hub."""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Generic, Protocol, TypeVar

from services.provisioner import model


class _Event(Protocol):
    @property
    def sequence(self) -> int: ...

    @property
    def terminal(self) -> bool: ...


E = TypeVar("E", bound=_Event)


class _Signal:
    """Wakes every waiter on each fire(); one future per generation, created on demand."""

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None

    def fire(self) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(None)
        self._future = None

    async def wait(self) -> None:
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._future)


class EventLog(Generic[E]):
    """The ordered events of one replica's launch (or teardown) operations.

    Followers replay the events after a sequence number, then follow live ones while an
    operation is active, and stop after a terminal event.
    """

    def __init__(self, events: Iterable[E] = ()) -> None:
        self._events: list[E] = list(events)
        self._signal = _Signal()
        self._active = False
        self._closed = False

    @property
    def events(self) -> list[E]:
        """Every event so far (do not modify)."""
        return self._events

    @property
    def last_sequence(self) -> int:
        """Sequence of the last event; 0 when there is none."""
        return self._events[-1].sequence if self._events else 0

    @property
    def last(self) -> E | None:
        """The last event, if any."""
        return self._events[-1] if self._events else None

    @property
    def active(self) -> bool:
        """Whether an operation is appending events."""
        return self._active

    def set_active(self, active: bool) -> None:
        """Mark an operation as running (followers wait) or finished (followers stop)."""
        self._active = active
        self._signal.fire()

    def append(self, event: E) -> None:
        """Add the next event and wake followers."""
        if event.sequence <= self.last_sequence:
            raise ValueError("event sequence must increase")
        self._events.append(event)
        self._signal.fire()

    def close(self) -> None:
        """Stop every follower (server shutdown)."""
        self._closed = True
        self._signal.fire()

    def _after(self, sequence: int) -> list[E]:
        keys = [e.sequence for e in self._events]
        return self._events[bisect.bisect_right(keys, sequence) :]

    async def follow(self, after: int = 0) -> AsyncIterator[E]:
        """Yield events with sequence > `after`, then live ones, until a terminal event.

        Ends without a terminal event when no operation is active and every event was sent
        (for example `after` already covers the terminal event).
        """
        position = after
        while True:
            batch = self._after(position)
            if batch:
                for event in batch:
                    yield event
                    position = event.sequence
                    if event.terminal:
                        return
                continue  # more may have arrived while the caller consumed the batch
            if self._closed or not self._active:
                return
            await self._signal.wait()


class WatchHub:
    """The provisioner-wide stream of replica changes, with a bounded replay history.

    Sequence numbers start at the wall clock in microseconds, so they keep increasing across
    provisioner restarts without being persisted; a resume point that is not in the retained
    history (too old, or from another incarnation) gets a fresh snapshot.
    """

    def __init__(
        self,
        snapshot: Callable[[], list[model.Replica]],
        *,
        history: int = 10_000,
        clock: Callable[[], float] = time.time,
        first_sequence: int | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._clock = clock
        self._ring: collections.deque[model.ReplicaEvent] = collections.deque(maxlen=max(1, history))
        start = first_sequence if first_sequence is not None else int(clock() * 1_000_000)
        self._last = start
        self._signal = _Signal()
        self._closed = False

    @property
    def last_sequence(self) -> int:
        """Sequence of the last event published (or the start point)."""
        return self._last

    def publish(
        self,
        type_: model.ReplicaEventType,
        replica: model.Replica,
        message: str = "",
        cause: model.FailureCause = model.FailureCause.UNSPECIFIED,
    ) -> model.ReplicaEvent:
        """Record a change of `replica` (copied), and whose fault it was, and wake watchers."""
        self._last += 1
        event = model.ReplicaEvent(self._last, self._clock(), type_, replica.copy(), message, cause)
        self._ring.append(event)
        self._signal.fire()
        return event

    def close(self) -> None:
        """End every watch (server shutdown)."""
        self._closed = True
        self._signal.fire()

    def _covers(self, after: int) -> bool:
        oldest = self._ring[0].sequence if self._ring else self._last + 1
        return oldest - 1 <= after <= self._last

    def _after(self, after: int) -> list[model.ReplicaEvent]:
        count = self._last - after
        newest_first = list(itertools.islice(reversed(self._ring), count))
        newest_first.reverse()
        return newest_first

    async def follow(self, after: int = 0) -> AsyncIterator[model.ReplicaEvent]:
        """Yield events after `after`; a snapshot first when `after` is 0 or not retained.

        A snapshot is one SNAPSHOT event per managed replica then SNAPSHOT_END, all carrying
        the sequence they reflect, so a client that resumes from SNAPSHOT_END misses nothing.
        A watcher that falls behind the retained history gets a new snapshot the same way.
        """
        position = after
        need_snapshot = after <= 0 or not self._covers(after)
        while not self._closed:
            if need_snapshot:
                sequence, now = self._last, self._clock()
                replicas = self._snapshot()
                for replica in replicas:
                    yield model.ReplicaEvent(sequence, now, model.ReplicaEventType.SNAPSHOT, replica)
                yield model.ReplicaEvent(sequence, now, model.ReplicaEventType.SNAPSHOT_END, None)
                position, need_snapshot = sequence, False
                continue
            if not self._covers(position):
                need_snapshot = True
                continue
            batch = self._after(position)
            if not batch:
                await self._signal.wait()
                continue
            for event in batch:
                yield event
                position = event.sequence

"""The single writer: every write of the controller goes through one thread with its own SQLite
connection, so the event loop never waits for the store's lock or an fsync.

A unit of work is a function of the store run inside one transaction; its result (or error)
comes back to the loop as a future. Units run one at a time in the order submitted; units queued
together share one transaction (group commit: one fsync for all), each in a savepoint of its own,
and their futures resolve once that transaction committed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from services.common import errors
from services.controller import store

log = logging.getLogger(__name__)

T = TypeVar("T")

GROUP_MAX = 256
"""Units of work committed together at most (their writes share one transaction and one fsync)."""

_Item = tuple[Callable[[store.Store], Any], "asyncio.Future[Any]", asyncio.AbstractEventLoop, bool]


class Writer:
    """A thread that owns a store connection and runs units of work in order."""

    def __init__(
        self, path: str, *, synchronous: str = "FULL", busy_timeout_s: float = 5.0, db: store.Store | None = None
    ) -> None:
        # `db`: a connection made by the caller (store.reopen(): it checks the leader's lease
        # epoch like the store it came from); else one is opened on `path`.
        self.db = db if db is not None else store.Store(path, synchronous=synchronous, busy_timeout_s=busy_timeout_s)
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="store writer", daemon=True)
        self._thread.start()
        self.depth = 0  # units submitted and not finished (read on the loop)

    def submit(self, fn: Callable[[store.Store], T], *, transaction: bool = True) -> asyncio.Future[T]:
        """Run `fn(store)` on the writer thread (inside one transaction unless told otherwise).

        Returns:
            A future of the loop that resolves to fn's result, or to the exception it raised
            (errors.UnavailableError when the store did not take the write).
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self.depth += 1
        fut.add_done_callback(self._done)
        self._queue.put((fn, fut, loop, transaction))
        return fut

    def _done(self, _: asyncio.Future[Any]) -> None:
        self.depth -= 1

    def on_writable_change(self, callback: Callable[[bool], None]) -> None:
        """Call `callback(writable)` on the loop whenever writes start failing or work again."""
        loop = asyncio.get_running_loop()

        def changed(ok: bool) -> None:
            loop.call_soon_threadsafe(callback, ok)

        self.db.on_writable_change(changed)

    def _run(self) -> None:
        held: list[_Item | None] = []  # taken from the queue but not in the last group: next
        while True:
            item = held.pop() if held else self._queue.get()
            if item is None:
                return
            if not item[3]:
                self._alone(item)
                continue
            group = [item]
            # Group commit: units queued meanwhile join this transaction (one fsync for all), each
            # in a savepoint of its own, so one unit's error undoes only that unit. Order is kept.
            while len(group) < GROUP_MAX:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None or not item[3]:
                    held.append(item)
                    break
                group.append(item)
            self._together(group)

    def _alone(self, item: _Item, *, transaction: bool = False) -> None:
        fn, fut, loop, _ = item
        try:
            if transaction:
                with self.db.transaction():
                    result = fn(self.db)
            else:
                result = fn(self.db)
        except BaseException as exc:
            _deliver(loop, fut, None, exc)
        else:
            _deliver(loop, fut, result, None)

    def _together(self, group: list[_Item]) -> None:
        if len(group) == 1:
            self._alone(group[0], transaction=True)
            return
        outcomes: list[tuple[Any, BaseException | None]] = []
        try:
            with self.db.transaction():
                for fn, _, _, _ in group:
                    try:
                        with self.db.transaction():  # a savepoint
                            outcomes.append((fn(self.db), None))
                    except errors.UnavailableError:
                        raise
                    except errors.ReplicaplaneError as exc:  # the unit's answer (NOT_FOUND...): its own
                        outcomes.append((None, exc))
        except errors.UnavailableError as exc:
            for _, fut, loop, _ in group:  # the store failed: nothing of the group was stored
                _deliver(loop, fut, None, exc)
            return
        except Exception:
            # A unit failed in a way that is not an answer: the group is undone, and each unit
            # runs again on its own, so only the failing one fails.
            for item in group:
                self._alone(item, transaction=True)
            return
        for (_, fut, loop, _), (result, error) in zip(group, outcomes, strict=True):
            _deliver(loop, fut, result, error)

    async def close(self) -> None:
        """Finish the units already submitted, then stop the thread and close the connection."""
        self._queue.put(None)
        await asyncio.to_thread(self._thread.join)
        self.db.close()


def _deliver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    def settle() -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the loop is closed: nobody waits any more

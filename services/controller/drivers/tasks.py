"""Background tasks keyed by replica id, so a driver knows what is in motion."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


class Tasks:
    """Named tasks by key; a finished task leaves the map by itself."""

    def __init__(self) -> None:
        self._tasks: dict[int, asyncio.Task[None]] = {}

    def __contains__(self, key: int) -> bool:
        return key in self._tasks

    def __len__(self) -> int:
        return len(self._tasks)

    def keys(self) -> list[int]:
        return list(self._tasks)

    def start(
        self, key: int, coro: Coroutine[Any, Any, None], name: str, on_done: Callable[[], None] | None = None
    ) -> None:
        """Run `coro` as the task of `key`; `on_done` runs once it has left the map, however it
        ended (a pass it kicks must not still see it in motion)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks[key] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._tasks.get(key) is t:
                del self._tasks[key]
            if on_done is not None:
                on_done()

        task.add_done_callback(done)

    def cancel(self, key: int) -> None:
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

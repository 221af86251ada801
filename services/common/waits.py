"""Waiting for an asyncio.Event with a time limit, without losing a cancel.

Python 3.11's `asyncio.wait_for` returns the inner result when it is cancelled in the same turn
that result came (CPython gh-86296, fixed in 3.12): a loop that waits for news that way and is
cancelled to stop just as news arrive swallows the cancel and runs on, and whoever awaits it
hangs. `asyncio.timeout` counts cancels (`Task.uncancel`) and lets a real one through.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, within_s: float | None) -> bool:
    """Wait until `event` is set, at most `within_s` seconds (None: no limit).

    Returns:
        True when it was set, False when the time ran out.
    """
    try:
        async with asyncio.timeout(within_s):
            await event.wait()
    except TimeoutError:
        return False
    return True

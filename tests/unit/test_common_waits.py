"""`waits.wait_event`: an Event with a time limit that never swallows a cancel."""

from __future__ import annotations

import asyncio

import pytest

from services.common import waits


async def test_it_says_whether_the_event_came_in_time() -> None:
    event = asyncio.Event()
    assert await waits.wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await waits.wait_event(event, 5) is True
    assert await waits.wait_event(event, None) is True  # set already, no limit


async def test_a_cancel_in_the_turn_the_event_is_set_ends_a_waiting_loop() -> None:
    # asyncio.wait_for (3.11) returns the event's result then, and the loop would run for ever.
    event = asyncio.Event()
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            await waits.wait_event(event, 60)
            event.clear()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)
    event.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(5):
            await task
    assert rounds == 1

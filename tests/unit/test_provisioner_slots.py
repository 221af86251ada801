"""The weighted FIFO limiter of launches and teardowns."""

from __future__ import annotations

import asyncio

import pytest

from services.provisioner import slots


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_launches_beyond_the_cap_wait_and_get_a_freed_slot_at_once() -> None:
    limiter = slots.Slots(2)
    await limiter.acquire(slots.LAUNCH)
    await limiter.acquire(slots.LAUNCH)
    assert limiter.would_wait(slots.LAUNCH)
    third = asyncio.create_task(limiter.acquire(slots.LAUNCH))
    await _settle()
    assert not third.done() and limiter.waiting == 1
    limiter.release(slots.LAUNCH)
    await _settle()
    assert third.done() and limiter.in_use == 2


async def test_teardowns_weigh_half() -> None:
    limiter = slots.Slots(1)
    await limiter.acquire(slots.TEARDOWN)
    await limiter.acquire(slots.TEARDOWN)
    assert limiter.in_use == 1
    assert limiter.would_wait(slots.TEARDOWN)


async def test_waiters_are_served_in_arrival_order_without_overtaking() -> None:
    limiter = slots.Slots(1)
    await limiter.acquire(slots.LAUNCH)
    order: list[str] = []

    async def take(label: str, weight: int) -> None:
        await limiter.acquire(weight)
        order.append(label)

    heavy = asyncio.create_task(take("launch", slots.LAUNCH))
    await _settle()
    light = asyncio.create_task(take("teardown", slots.TEARDOWN))
    await _settle()
    limiter.release(slots.TEARDOWN)  # half a slot frees: the teardown fits but must not overtake
    await _settle()
    assert order == []
    limiter.release(slots.TEARDOWN)
    await _settle()
    assert order == ["launch"]
    limiter.release(slots.LAUNCH)
    await _settle()
    assert order == ["launch", "teardown"]
    await asyncio.gather(heavy, light)


async def test_a_cancelled_waiter_leaves_the_queue_and_wakes_the_next() -> None:
    limiter = slots.Slots(1)
    await limiter.acquire(slots.LAUNCH)
    first = asyncio.create_task(limiter.acquire(slots.LAUNCH))
    await _settle()
    second = asyncio.create_task(limiter.acquire(slots.TEARDOWN))
    await _settle()
    first.cancel()
    await _settle()
    assert first.cancelled()
    assert limiter.waiting == 1
    limiter.release(slots.LAUNCH)
    await _settle()
    assert second.done() and limiter.in_use == 0.5


async def test_hold_releases_on_error() -> None:
    limiter = slots.Slots(1)
    with pytest.raises(RuntimeError):
        async with limiter.hold(slots.LAUNCH):
            raise RuntimeError("boom")
    assert limiter.in_use == 0


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        slots.Slots(0)

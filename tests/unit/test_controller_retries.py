"""`retries.Policy.run`: the plain retry loop of the launch and teardown drivers."""

from __future__ import annotations

import asyncio

import pytest

from services.controller import retries


class Broke(Exception):
    """Stands for the drivers' "follow it again"."""


class Sleeps:
    """Records the waits instead of waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def failing(times: int, exc: Exception, tries: list[int]):
    async def attempt(n: int) -> str:
        tries.append(n)
        if len(tries) <= times:
            raise exc
        return f"done on {n}"

    return attempt


NO_JITTER = retries.Policy(initial_s=1.0, max_s=4.0, jitter_s=0.0)


async def test_a_first_try_that_succeeds_neither_waits_nor_retries() -> None:
    sleeps, tries = Sleeps(), []
    assert await NO_JITTER.run(failing(0, Broke(), tries), Broke, sleep=sleeps) == "done on 1"
    assert (tries, sleeps.delays) == ([1], [])


async def test_retried_exceptions_are_tried_again_after_the_policy_delays() -> None:
    sleeps, tries = Sleeps(), []
    assert await NO_JITTER.run(failing(4, Broke(), tries), Broke, sleep=sleeps) == "done on 5"
    assert tries == [1, 2, 3, 4, 5]
    assert sleeps.delays == [NO_JITTER.delay(n) for n in range(1, 5)] == [1.0, 2.0, 4.0, 4.0]


async def test_the_waits_carry_the_policy_jitter() -> None:
    policy = retries.Policy(initial_s=1.0, max_s=2.0, jitter_s=0.5)
    sleeps = Sleeps()
    await policy.run(failing(6, Broke(), []), Broke, sleep=sleeps)
    assert all(1.0 <= d <= 1.5 for d in sleeps.delays[:1]) and all(2.0 <= d <= 2.5 for d in sleeps.delays[1:])


async def test_after_its_attempts_the_last_exception_is_raised() -> None:
    policy = retries.Policy(initial_s=1.0, max_s=4.0, jitter_s=0.0, attempts=3)
    sleeps, tries = Sleeps(), []
    last = Broke("third")
    calls = iter([Broke("first"), Broke("second"), last])

    async def attempt(n: int) -> None:
        tries.append(n)
        raise next(calls)

    with pytest.raises(Broke) as raised:
        await policy.run(attempt, Broke, sleep=sleeps)
    assert raised.value is last
    assert (tries, sleeps.delays) == ([1, 2, 3], [1.0, 2.0])


async def test_a_policy_without_attempts_never_gives_up() -> None:
    sleeps = Sleeps()
    assert await NO_JITTER.run(failing(50, Broke(), []), Broke, sleep=sleeps) == "done on 51"
    assert len(sleeps.delays) == 50


async def test_other_exceptions_pass_through_at_once() -> None:
    sleeps, tries = Sleeps(), []
    with pytest.raises(KeyError):
        await NO_JITTER.run(failing(1, KeyError("x"), tries), Broke, ValueError, sleep=sleeps)
    assert (tries, sleeps.delays) == ([1], [])


async def test_every_listed_exception_is_retried() -> None:
    calls = iter([ValueError(), Broke()])

    async def attempt(n: int) -> int:
        for exc in calls:
            raise exc
        return n

    assert await NO_JITTER.run(attempt, Broke, ValueError, sleep=Sleeps()) == 3


async def test_cancelling_during_a_wait_ends_the_loop() -> None:
    tries: list[int] = []
    policy = retries.Policy(initial_s=60.0, max_s=60.0, jitter_s=0.0)
    task = asyncio.create_task(policy.run(failing(10, Broke(), tries), Broke))
    while not tries:
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert tries == [1]


async def test_cancelling_a_try_is_not_retried() -> None:
    started = asyncio.Event()
    tries: list[int] = []

    async def attempt(n: int) -> None:
        tries.append(n)
        started.set()
        await asyncio.sleep(60)

    task = asyncio.create_task(NO_JITTER.run(attempt, Broke, Exception, sleep=Sleeps()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert tries == [1]

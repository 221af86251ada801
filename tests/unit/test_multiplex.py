"""The multiplexed launch stream's server side (`multiplex.serve_batches`): what is ready at a
write goes in one message, never more than BATCH_MAX, each inner stream in order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.common import multiplex


async def _requests(keys: list[str]) -> AsyncIterator[tuple[str, int | None]]:
    for key in keys:
        yield key, 2


async def _items(count: int | None) -> AsyncIterator[int]:
    for i in range(count or 0):
        yield i


def _wrap(key: str, item: int | multiplex.Ended) -> tuple[str, int | str]:
    return key, ("end" if isinstance(item, multiplex.Ended) else item)


async def _collect(keys: list[str]) -> list[list[tuple[str, int | str]]]:
    batches = multiplex.serve_batches(_requests(keys), _items, _wrap, domain="test")
    async with asyncio.timeout(10):
        return [batch async for batch in batches]


async def test_responses_ready_together_share_one_message_and_keep_each_streams_order() -> None:
    batches = await _collect(["a", "b", "c"])
    flat = [response for batch in batches for response in batch]
    assert len(batches) < len(flat)  # not one message per response
    for key in "abc":
        assert [item for k, item in flat if k == key] == [0, 1, "end"]


async def test_a_batch_never_holds_more_than_the_most_one_message_may() -> None:
    keys = [f"k{i}" for i in range(multiplex.BATCH_MAX)]  # 3 responses each
    batches = await _collect(keys)
    assert sum(len(b) for b in batches) == 3 * multiplex.BATCH_MAX
    assert max(len(b) for b in batches) == multiplex.BATCH_MAX


async def test_one_response_per_message_through_serve() -> None:
    responses = multiplex.serve(_requests(["a", "b"]), _items, _wrap, domain="test")
    async with asyncio.timeout(10):
        flat = [r async for r in responses]
    assert sorted(flat, key=str) == sorted(
        [("a", 0), ("a", 1), ("a", "end"), ("b", 0), ("b", 1), ("b", "end")], key=str
    )

"""Unit tests of probe streams: schedules, fast startup, changes, removal, batching."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from services.common import errors
from services.prober import probing, streams

DEFAULTS = probing.Defaults(timeout_s=1, interval_s=10, fast_interval_s=0.02, min_interval_s=0.001)


class FakeProber:
    """Answers probes from a per-target script of outcomes; records when each probe ran."""

    def __init__(self) -> None:
        self.ready: dict[str, bool] = {}
        self.delay: dict[str, float] = {}
        self.calls: list[tuple[str, float, probing.Target]] = []

    async def probe(self, target: probing.Target) -> probing.Result:
        self.calls.append((target.target_id, time.monotonic(), target))
        delay = self.delay.get(target.target_id, 0.0)
        if delay:
            await asyncio.sleep(delay)
        if self.ready.get(target.target_id, True):
            return probing.Result(target.target_id, probing.Outcome.READY, 200, delay, "", time.time())
        return probing.Result(target.target_id, probing.Outcome.REPLICA_FAILURE, 503, delay, "HTTP 503", time.time())

    def count(self, target_id: str) -> int:
        return sum(1 for c in self.calls if c[0] == target_id)


@pytest.fixture
async def fake() -> FakeProber:
    return FakeProber()


@pytest.fixture
async def stream(fake: FakeProber) -> AsyncIterator[streams.ProbeStream]:
    s = streams.ProbeStream(fake, DEFAULTS, streams.StreamSettings(batch_max=50, flush_interval_s=0.001))  # type: ignore[arg-type]
    yield s
    s.close()


def spec(target_id: str = "t", **kwargs: object) -> probing.TargetSpec:
    return probing.TargetSpec(target_id=target_id, url="http://127.0.0.1:1", **kwargs)  # type: ignore[arg-type]


async def collect(stream: streams.ProbeStream, seconds: float) -> list[probing.Result]:
    out: list[probing.Result] = []
    deadline = asyncio.get_running_loop().time() + seconds
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        try:
            batch = await asyncio.wait_for(stream.next_batch(), left)
        except TimeoutError:
            break
        if batch is None:
            break
        out += batch
    return out


async def test_first_probe_is_made_at_once(stream: streams.ProbeStream, fake: FakeProber) -> None:
    started = time.monotonic()
    stream.upsert(spec(interval_s=10))
    batch = await asyncio.wait_for(stream.next_batch(), 1)
    assert batch is not None
    assert [r.target_id for r in batch] == ["t"]
    assert fake.calls[0][1] - started < 0.05


async def test_starting_target_is_probed_fast_until_first_success(
    stream: streams.ProbeStream, fake: FakeProber
) -> None:
    fake.ready["t"] = False
    stream.upsert(spec(starting=True, interval_s=10, fast_interval_s=0.02))
    await collect(stream, 0.15)
    fast_count = fake.count("t")
    assert fast_count >= 4  # about every 20 ms
    fake.ready["t"] = True
    await collect(stream, 0.1)
    after_ready = fake.count("t")
    await collect(stream, 0.2)
    assert fake.count("t") == after_ready  # back to the 10 s interval


async def test_not_starting_target_uses_the_interval(stream: streams.ProbeStream, fake: FakeProber) -> None:
    fake.ready["t"] = False
    stream.upsert(spec(starting=False, interval_s=10, fast_interval_s=0.01))
    await collect(stream, 0.15)
    assert fake.count("t") == 1


async def test_unchanged_upsert_keeps_the_schedule(stream: streams.ProbeStream, fake: FakeProber) -> None:
    stream.upsert(spec(interval_s=10))
    await collect(stream, 0.05)
    stream.upsert(spec(interval_s=10))
    await collect(stream, 0.05)
    assert fake.count("t") == 1


async def test_changed_target_takes_effect_at_once(stream: streams.ProbeStream, fake: FakeProber) -> None:
    stream.upsert(spec(path="/old", interval_s=10))
    await collect(stream, 0.05)
    stream.upsert(spec(path="/new", interval_s=10))
    await collect(stream, 0.05)
    assert [str(c[2].url.path) for c in fake.calls] == ["/old", "/new"]


async def test_removed_target_stops_and_its_buffered_results_are_dropped(
    stream: streams.ProbeStream, fake: FakeProber
) -> None:
    stream.upsert(spec("a", interval_s=0.01))
    stream.upsert(spec("b", interval_s=10))
    await asyncio.sleep(0.05)
    stream.remove("a")
    count = fake.count("a")
    results = await collect(stream, 0.1)
    assert {r.target_id for r in results} == {"b"}
    assert fake.count("a") == count
    assert stream.target_count == 1


async def test_invalid_target_gives_a_result_and_is_not_probed(stream: streams.ProbeStream, fake: FakeProber) -> None:
    stream.upsert(probing.TargetSpec(target_id="bad", url="ftp://x", headers={"Authorization": "Bearer hush"}))
    (result,) = await collect(stream, 0.05)
    assert result.outcome is probing.Outcome.INVALID_TARGET
    assert "url" in result.error
    assert "hush" not in result.error
    assert fake.calls == []


async def test_a_target_changed_to_invalid_stops_being_probed(stream: streams.ProbeStream, fake: FakeProber) -> None:
    stream.upsert(spec(interval_s=0.01))
    await asyncio.sleep(0.03)
    stream.upsert(probing.TargetSpec(target_id="t", url="gopher://x"))
    await asyncio.sleep(0.01)
    count = fake.count("t")
    await asyncio.sleep(0.05)
    assert fake.count("t") == count
    assert stream.target_count == 0


async def test_slow_target_does_not_delay_others(stream: streams.ProbeStream, fake: FakeProber) -> None:
    fake.delay["slow"] = 5.0
    stream.upsert(spec("slow", interval_s=0.01))
    stream.upsert(spec("fast", interval_s=0.01))
    # Wait on the condition, not a fixed time: a loaded machine may take longer than 0.2 s.
    async with asyncio.timeout(4):
        while fake.count("fast") < 8:
            await collect(stream, 0.05)
    assert fake.count("slow") == 1  # still in its first, 5 s probe


async def test_results_come_in_batches_of_at_most_batch_max(fake: FakeProber) -> None:
    s = streams.ProbeStream(fake, DEFAULTS, streams.StreamSettings(batch_max=10, flush_interval_s=0.01))  # type: ignore[arg-type]
    try:
        for i in range(35):
            s.upsert(spec(f"t{i}", interval_s=10))
        sizes = []
        while sum(sizes) < 35:
            batch = await asyncio.wait_for(s.next_batch(), 1)
            assert batch is not None
            sizes.append(len(batch))
        assert max(sizes) == 10
        assert len(sizes) == 4
    finally:
        s.close()


async def test_a_stream_holds_at_most_max_targets(fake: FakeProber) -> None:
    s = streams.ProbeStream(fake, DEFAULTS, streams.StreamSettings(max_targets=2, flush_interval_s=0))  # type: ignore[arg-type]
    try:
        for i in range(3):
            s.upsert(spec(f"t{i}", interval_s=10))
        results = await collect(s, 0.05)
        refused = [r for r in results if r.outcome is probing.Outcome.INVALID_TARGET]
        assert [r.target_id for r in refused] == ["t2"]
        assert s.target_count == 2
    finally:
        s.close()


async def test_slow_reader_keeps_only_the_newest_results(fake: FakeProber) -> None:
    s = streams.ProbeStream(fake, DEFAULTS, streams.StreamSettings(max_buffered=5, flush_interval_s=0))  # type: ignore[arg-type]
    try:
        s.upsert(spec(interval_s=0.001))
        async with asyncio.timeout(10):
            while fake.count("t") < 8:  # more results than the buffer holds (no fixed sleep)
                await asyncio.sleep(0.005)
        batch = await s.next_batch()
        assert batch is not None
        assert len(batch) == 5
    finally:
        s.close()


async def test_closed_stream_returns_buffered_results_then_none(stream: streams.ProbeStream, fake: FakeProber) -> None:
    stream.upsert(spec())
    await asyncio.sleep(0.02)
    stream.close()
    assert await stream.next_batch() is not None
    assert await stream.next_batch() is None
    stream.upsert(spec("late"))
    assert stream.target_count == 0


async def test_engine_refuses_streams_while_draining(fake: FakeProber) -> None:
    engine = streams.Engine(fake, DEFAULTS, streams.StreamSettings())  # type: ignore[arg-type]
    stream = engine.open_stream()
    assert engine.stream_count == 1
    engine.drain()
    assert await stream.next_batch() is None
    with pytest.raises(errors.UnavailableError):
        engine.open_stream()
    engine.close_stream(stream)
    assert engine.stream_count == 0

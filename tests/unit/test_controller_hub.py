"""The controller's watch hub: snapshots, resumes, and watchers that stop reading."""

from __future__ import annotations

import asyncio

import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors
from services.controller import hub


def _snapshot() -> api.WatchServiceResponse:
    return api.WatchServiceResponse(service=res.Service(name="svc"))


def _change(h: hub.ServiceHub, replica_id: int = 1) -> None:
    h.publish(res.Service(name="svc"), [res.Replica(replica_id=replica_id)], [])


async def test_a_watcher_that_stops_reading_is_dropped_with_its_resume_point() -> None:
    h = hub.ServiceHub()
    stream = h.watch(0, _snapshot)
    first = await anext(stream)
    assert first.snapshot
    for i in range(hub.QUEUE_LIMIT + 5_000):  # a burst while the watcher reads nothing
        _change(h, i)
    assert h.queued() == 0  # nothing kept for it: the queue went with the watcher
    with pytest.raises(errors.ResourceExhaustedError) as err:
        await anext(stream)
    assert err.value.reason == "WATCH_FELL_BEHIND"
    assert err.value.metadata["after_sequence"] == str(first.sequence)
    assert f"after_sequence={first.sequence}" in err.value.message

    # Resuming from that point works: the gap is longer than the history, so a snapshot comes.
    resumed = h.watch(first.sequence, _snapshot)
    again = await anext(resumed)
    assert again.snapshot
    assert again.sequence == h.sequence
    await resumed.aclose()


async def test_a_watcher_dropped_mid_stream_resumes_from_the_last_change_it_read() -> None:
    h = hub.ServiceHub()
    stream = h.watch(0, _snapshot)
    await anext(stream)
    _change(h, 1)
    read = await anext(stream)
    for i in range(hub.QUEUE_LIMIT + 1):
        _change(h, i)
    with pytest.raises(errors.ResourceExhaustedError) as err:
        await anext(stream)
    assert err.value.metadata["after_sequence"] == str(read.sequence)


async def test_a_watcher_that_keeps_up_is_never_dropped() -> None:
    h = hub.ServiceHub()
    stream = h.watch(0, _snapshot)
    last = (await anext(stream)).sequence
    for _ in range(3):
        for i in range(hub.QUEUE_LIMIT - 1):
            _change(h, i)
        for _ in range(hub.QUEUE_LIMIT - 1):
            msg = await anext(stream)
            assert msg.sequence == last + 1
            last = msg.sequence
    assert h.queued() == 0
    await stream.aclose()


async def test_a_slow_watcher_does_not_hold_back_the_others() -> None:
    h = hub.ServiceHub()
    stalled = h.watch(0, _snapshot)
    reading = h.watch(0, _snapshot)
    await anext(stalled)
    await anext(reading)
    got = 0
    for i in range(hub.QUEUE_LIMIT + 10):
        _change(h, i)
        await anext(reading)
        got += 1
    assert got == hub.QUEUE_LIMIT + 10
    with pytest.raises(errors.ResourceExhaustedError):
        await anext(stalled)
    await reading.aclose()


async def test_a_deleted_service_ends_the_stream_after_what_was_queued() -> None:
    h = hub.ServiceHub()
    stream = h.watch(0, _snapshot)
    await anext(stream)
    _change(h, 1)
    h.publish(res.Service(name="svc"), [], [], deleted=True)
    rest = [msg async for msg in stream]
    assert [m.deleted for m in rest] == [False, True]
    assert h.queued() == 0


async def test_an_endpoint_watcher_that_stops_reading_is_dropped_with_its_version() -> None:
    h = hub.ServiceHub()
    stream = h.watch_endpoints(0)
    first = await anext(stream)
    for i in range(hub.QUEUE_LIMIT + 5):
        h.set_endpoints([res.Endpoint(replica_id=i, url=f"http://127.0.0.1:{i}")])
    assert h.queued() == 0
    with pytest.raises(errors.ResourceExhaustedError) as err:
        await anext(stream)
    assert err.value.metadata["after_version"] == str(first.version)
    assert f"after_version={first.version}" in err.value.message


async def test_an_endpoint_watcher_waits_for_changes_and_ends_with_the_service() -> None:
    h = hub.ServiceHub()
    stream = h.watch_endpoints(0)
    await anext(stream)
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    assert not pending.done()
    h.set_endpoints([res.Endpoint(replica_id=1, url="http://127.0.0.1:1")])
    assert [e.replica_id for e in (await asyncio.wait_for(pending, 5)).endpoints] == [1]
    h.close()
    assert [m.deleted for m in [m async for m in stream]] == [True]


async def test_the_change_history_is_bounded_by_what_its_changes_hold_not_only_by_their_count() -> None:
    # Each change carries the whole service: 1,024 changes of a 10,000-endpoint service held 10
    # million endpoints (issue 24). Changes past the bound go; resuming before them is a snapshot.
    h = hub.ServiceHub()
    big = res.Service(name="svc", endpoints=[res.Endpoint(replica_id=i) for i in range(hub.HISTORY_ITEMS // 4)])
    sequences = []
    for i in range(10):
        h.publish(big, [res.Replica(replica_id=i)], [])
        sequences.append(h.sequence)
    assert h._history_items <= hub.HISTORY_ITEMS
    kept = len(h._history)
    assert 1 <= kept < 10

    old = h.watch(sequences[0], _snapshot)
    assert (await anext(old)).snapshot
    await old.aclose()
    recent = h.watch(sequences[-2], _snapshot)
    resumed = await anext(recent)
    assert not resumed.snapshot and resumed.sequence == sequences[-1]
    await recent.aclose()

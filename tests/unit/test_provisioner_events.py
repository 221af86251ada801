"""Operation event logs and the watch hub: replay, follow, snapshot, gaps."""

from __future__ import annotations

import asyncio

from services.provisioner import events, model

T = model.LaunchEventType
R = model.ReplicaEventType


def _replica(name: str = "svc-1") -> model.Replica:
    return model.Replica(name=name, service="svc", replica_id=1, version=1)


def _launch(seq: int, type_: model.LaunchEventType) -> model.LaunchEvent:
    return model.LaunchEvent(sequence=seq, time=float(seq), type=type_, replica=_replica())


async def _collect(stream, limit: int = 100) -> list:
    out = []
    async for item in stream:
        out.append(item)
        if len(out) >= limit:
            break
    return out


async def test_log_replays_after_a_sequence_and_stops_at_terminal() -> None:
    log = events.EventLog([_launch(1, T.QUEUED), _launch(2, T.PROVISIONING), _launch(3, T.RUNNING)])
    assert [e.sequence for e in await _collect(log.follow(0))] == [1, 2, 3]
    assert [e.sequence for e in await _collect(log.follow(1))] == [2, 3]
    assert await _collect(log.follow(3)) == []


async def test_log_follows_live_events_while_active() -> None:
    log: events.EventLog[model.LaunchEvent] = events.EventLog()
    log.set_active(True)
    log.append(_launch(1, T.QUEUED))
    follower = asyncio.create_task(_collect(log.follow(0)))
    await asyncio.sleep(0)
    log.append(_launch(2, T.PROVISIONING))
    log.append(_launch(3, T.FAILED))
    log.set_active(False)
    got = await asyncio.wait_for(follower, 5)
    assert [e.type for e in got] == [T.QUEUED, T.PROVISIONING, T.FAILED]


async def test_log_follower_ends_when_the_operation_stops_without_terminal() -> None:
    log: events.EventLog[model.LaunchEvent] = events.EventLog([_launch(1, T.QUEUED)])
    log.set_active(True)
    follower = asyncio.create_task(_collect(log.follow(0)))
    await asyncio.sleep(0)
    log.close()
    assert len(await asyncio.wait_for(follower, 5)) == 1


async def test_hub_snapshot_then_live_events() -> None:
    replicas = [_replica("svc-1"), _replica("svc-2")]
    hub = events.WatchHub(lambda: [r.copy() for r in replicas], first_sequence=100)
    stream = hub.follow(0)
    snap = [await anext(stream) for _ in range(3)]
    assert [e.type for e in snap] == [R.SNAPSHOT, R.SNAPSHOT, R.SNAPSHOT_END]
    assert all(e.sequence == 100 for e in snap)
    hub.publish(R.APP_EXITED, replicas[0], "exit 1")
    live = await asyncio.wait_for(anext(stream), 5)
    assert (live.type, live.sequence, live.replica.name) == (R.APP_EXITED, 101, "svc-1")
    await stream.aclose()


async def test_hub_resume_replays_only_missed_events() -> None:
    hub = events.WatchHub(list, first_sequence=0)
    for _ in range(5):
        hub.publish(R.APP_RUNNING, _replica())
    stream = hub.follow(3)
    got = [await anext(stream) for _ in range(2)]
    assert [e.sequence for e in got] == [4, 5]
    await stream.aclose()


async def test_hub_resume_point_outside_history_gets_a_new_snapshot() -> None:
    hub = events.WatchHub(lambda: [_replica()], history=3, first_sequence=0)
    for _ in range(10):
        hub.publish(R.APP_RUNNING, _replica())
    for stale in (2, 10_000):  # too old, and from another incarnation
        stream = hub.follow(stale)
        first, end = await anext(stream), await anext(stream)
        assert (first.type, end.type, end.sequence) == (R.SNAPSHOT, R.SNAPSHOT_END, 10)
        await stream.aclose()


async def test_hub_sequence_starts_at_wall_clock_microseconds() -> None:
    hub = events.WatchHub(list, clock=lambda: 1_700_000_000.0)
    assert hub.last_sequence == 1_700_000_000_000_000
    event = hub.publish(R.TERMINATED, _replica())
    assert event.sequence == hub.last_sequence == 1_700_000_000_000_001


async def test_hub_event_carries_a_copy_of_the_replica() -> None:
    hub = events.WatchHub(list, first_sequence=0)
    replica = _replica()
    event = hub.publish(R.APP_RUNNING, replica)
    replica.exit_code = 9
    assert event.replica is not None and event.replica.exit_code == 0

"""The lease row and epoch fencing, on both store backends: who leads, and what a deposed
leader's writes do (nothing)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from replicaplane.common.v1 import spec_pb2
from services.common import errors
from services.controller import event_log, writer
from services.controller import store as store_mod
from services.controller.domain import events as ev


@pytest.fixture
def store(store_url: str, tmp_path):
    s = store_mod.Store(store_url or os.path.join(str(tmp_path), "state.db"))
    yield s
    s.close()


def spec() -> spec_pb2.ServiceSpec:
    return spec_pb2.ServiceSpec(run="serve", yaml="run: serve\n")


def test_the_first_to_ask_leads_at_epoch_1_and_others_see_it(store: store_mod.Store) -> None:
    assert store.read_lease() is None
    lease = store.acquire_lease("a", "10.0.0.1:50051", 3.0)
    assert (lease.holder, lease.epoch, lease.address, lease.lapsed) == ("a", 1, "10.0.0.1:50051", False)
    other = store.acquire_lease("b", "10.0.0.2:50051", 3.0)
    assert (other.holder, other.epoch, other.address) == ("a", 1, "10.0.0.1:50051")  # b stands by
    again = store.acquire_lease("a", "10.0.0.1:50051", 3.0)
    assert again.epoch == 1 and again.expires >= lease.expires  # asking again renews, same epoch


def test_a_lapsed_lease_goes_to_the_next_one_with_a_new_epoch(store: store_mod.Store) -> None:
    store.acquire_lease("a", "addr-a", 0.2)
    time.sleep(0.3)
    assert store.read_lease().lapsed  # type: ignore[union-attr]
    lease = store.acquire_lease("b", "addr-b", 3.0)
    assert (lease.holder, lease.epoch, lease.address) == ("b", 2, "addr-b")
    assert not store.renew_lease("a", 1, 3.0)  # the old leader learns it was deposed
    assert store.renew_lease("b", 2, 3.0)


def test_a_released_lease_is_taken_at_once(store: store_mod.Store) -> None:
    store.acquire_lease("a", "addr-a", 30.0)
    store.release_lease("a", 1)
    assert store.acquire_lease("b", "addr-b", 30.0).holder == "b"
    store.release_lease("a", 1)  # no longer a's: nothing happens
    assert not store.read_lease().lapsed  # type: ignore[union-attr]


def test_writes_of_a_deposed_leader_change_nothing(store: store_mod.Store) -> None:
    store.acquire_lease("a", "addr-a", 0.2)
    lost: list[bool] = []
    store.fence("a", 1, on_lost=lambda: lost.append(True))
    store.create_service("svc", spec(), now=1.0)  # leading: writes go through
    copy = store.reopen()  # a writer thread's own connection checks the same epoch
    copy.update_service("svc", status_message="from the copy")
    time.sleep(0.3)
    taker = store.reopen(fenced=False)
    assert taker.acquire_lease("b", "addr-b", 30.0).epoch == 2

    with pytest.raises(store_mod.FencedError) as info:
        store.update_service("svc", status_message="from the deposed leader")
    assert info.value.reason == "NOT_LEADER" and isinstance(info.value, errors.UnavailableError)
    assert lost == [True] and store.fenced_out and copy.fenced_out
    with pytest.raises(store_mod.FencedError):  # the copy too, without asking the database
        copy.add_version("svc", spec())
    with pytest.raises(store_mod.FencedError):
        store.put_autoscaler_state("svc", b"x")
    assert not store.check_writable()
    assert lost == [True]  # told once
    row = taker.get_service("svc")
    assert row is not None and row.status_message == "from the copy" and row.latest_version == 1
    assert taker.get_autoscaler_state("svc") is None
    copy.close()
    taker.close()


def test_a_store_fenced_before_anyone_leads_writes_nothing(store: store_mod.Store) -> None:
    store.fence("a", 1)
    with pytest.raises(store_mod.FencedError):
        store.create_service("svc", spec(), now=1.0)
    assert store.get_service("svc") is None


async def _record_and_close(store: store_mod.Store, reason: str) -> None:
    """Record one event through an event log writing by the controller's writer, then stop both
    the way the controller does (the log first, then the writer)."""
    db_writer = writer.Writer(store.path, db=store.reopen())
    events = event_log.Events(db=store, db_writer=db_writer)
    events.open("svc", {})
    events.record("svc", ev.Draft(ev.EventType.NORMAL, reason, "recorded just before the stop"))
    events.close()  # hands what is pending to the writer, which finishes it before it closes
    await db_writer.close()


def test_the_event_log_of_a_deposed_leader_keeps_nothing(store: store_mod.Store) -> None:
    # The event log writes through the writer's connection: it is fenced like every other write.
    store.acquire_lease("a", "addr-a", 0.2)
    store.fence("a", 1)
    store.create_service("svc", spec(), now=1.0)
    asyncio.run(_record_and_close(store, "Leading"))
    assert [e.reason for e in store.list_events("svc")] == ["Leading"]
    time.sleep(0.3)
    taker = store.reopen(fenced=False)
    assert taker.acquire_lease("b", "addr-b", 30.0).epoch == 2

    asyncio.run(_record_and_close(store, "Stale"))
    assert [e.reason for e in taker.list_events("svc")] == ["Leading"]
    taker.close()


def test_closing_the_event_log_writes_what_is_pending_without_waiting_out_its_batch_window(
    store: store_mod.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Events are gathered for a while before they are written; a stop must not wait that out.
    monkeypatch.setattr(event_log, "_BATCH_S", 60.0)
    store.create_service("svc", spec(), now=1.0)
    started = time.monotonic()
    asyncio.run(_record_and_close(store, "Pending"))
    assert time.monotonic() - started < 30.0
    assert [e.reason for e in store.list_events("svc")] == ["Pending"]


def test_the_event_log_opens_no_store_connection_of_its_own(
    store: store_mod.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A second connection writing the same SQLite file made the writer wait for SQLite's lock,
    # which sleeps in steps of up to 100 ms: creates stalled for up to a second at 10,000
    # replicas. Every write goes through the writer's connection now.
    store.create_service("svc", spec(), now=1.0)

    async def run() -> None:
        db_writer = writer.Writer(store.path, db=store.reopen())
        opened: list[bool] = []
        monkeypatch.setattr(store_mod.Store, "reopen", lambda self, **kw: opened.append(True) or self)
        events = event_log.Events(db=store, db_writer=db_writer)
        events.open("svc", {})
        for i in range(3):
            events.record("svc", ev.Draft(ev.EventType.NORMAL, f"R{i}", "m"))
        events.close()
        await db_writer.close()
        assert opened == []

    asyncio.run(run())
    assert [e.reason for e in store.list_events("svc")] == ["R0", "R1", "R2"]

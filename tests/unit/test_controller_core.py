"""The controller core's parts that need no server: the writer and the store it opens, the book
of pending rows, the pass's plan and the retry policies (issue 19)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest

from services.common import errors
from services.controller import book, planner, retries, writer
from services.controller import store as store_mod
from services.controller.domain import autoscaler, failures
from services.controller.domain import status as st
from tests.unit.test_store import NOW, make_replica, make_spec

S = st.ReplicaStatus

_TRY_LOCK = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], timeout=0.1, isolation_level=None)
try:
    db.execute("BEGIN IMMEDIATE")
except sqlite3.OperationalError:
    print("busy")
else:
    print("got it")
    db.execute("ROLLBACK")
"""


def _other_process_can_write(path: str) -> bool:
    out = subprocess.run([sys.executable, "-c", _TRY_LOCK, path], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "got it"


def test_opening_a_second_store_keeps_the_first_ones_lock(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Closing any descriptor of an open SQLite file drops every POSIX lock the process holds on
    # it (SQLite's documented pitfall): a second Store on the same file (the writer's) must not
    # open and close the file itself, and the first one's lock and commits stay.
    path = str(tmp_path / "state.db")
    first = store_mod.Store(path)
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (opened.append(str(p)), real_open(p, *a, **k))[1])
    with first.transaction():
        first.create_service("svc", make_spec(), now=NOW)
        second = store_mod.Store(path, busy_timeout_s=0.05)
        assert path not in opened, "the second store opened (and closed) the database file"
        assert not _other_process_can_write(path)
    assert second.get_service("svc") is not None  # the first one's commit is there
    second.close()
    first.close()


async def test_the_writer_runs_units_in_order_off_the_loop_and_reports_errors(tmp_path) -> None:
    path = str(tmp_path / "state.db")
    reader = store_mod.Store(path)
    w = writer.Writer(path)
    try:
        await w.submit(lambda db: db.create_service("svc", make_spec(), now=NOW))
        futures = [w.submit(lambda db, i=i: db.put_replica(make_replica("svc", i))) for i in range(1, 21)]
        assert w.depth == 20
        await asyncio.gather(*futures)
        assert w.depth == 0
        assert [r.replica_id for r in reader.list_replicas("svc")] == list(range(1, 21))  # another connection sees them
        with pytest.raises(errors.NotFoundError):
            await w.submit(lambda db: db.put_replica(make_replica("nope", 1)))

        def half_then_fail(db: store_mod.Store) -> None:
            db.put_replica(make_replica("svc", 30))
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            await w.submit(half_then_fail)
        assert reader.get_replica("svc", 30) is None  # a unit is one transaction: all or nothing
    finally:
        await w.close()
        reader.close()


async def test_units_queued_together_share_one_commit_and_fail_alone(tmp_path) -> None:
    # Group commit: units queued while the writer is busy are written in one transaction (one
    # fsync); a unit answering NOT_FOUND fails alone, a unit that breaks is undone alone.
    path = str(tmp_path / "state.db")
    reader = store_mod.Store(path)
    w = writer.Writer(path)
    commits: list[bool] = []
    w.db.on_write(lambda _seconds, ok: commits.append(ok))

    async def queued(*units: Callable[[store_mod.Store], object]) -> list[object]:
        gate = threading.Event()
        held = w.submit(lambda _db: gate.wait(10), transaction=False)  # the writer is busy: units queue
        futures = [w.submit(unit) for unit in units]
        gate.set()
        await held
        return list(await asyncio.gather(*futures, return_exceptions=True))

    def broken(db: store_mod.Store) -> None:
        db.put_replica(make_replica("svc", 500))
        raise RuntimeError("boom")

    try:
        await w.submit(lambda db: db.create_service("svc", make_spec(), now=NOW))
        commits.clear()
        puts = [lambda db, i=i: db.put_replica(make_replica("svc", i)) for i in range(1, 101)]
        got = await queued(*puts[:50], lambda db: db.put_replica(make_replica("nope", 1)), *puts[50:])
        assert isinstance(got[50], errors.NotFoundError)
        assert [r.replica_id for r in reader.list_replicas("svc")] == list(range(1, 101))
        assert commits == [True], commits  # 101 units, one transaction
        got = await queued(lambda db: db.put_replica(make_replica("svc", 101)), broken)
        assert got[0] is None and isinstance(got[1], RuntimeError)
        assert [r.replica_id for r in reader.list_replicas("svc")][-1] == 101
        assert reader.get_replica("svc", 500) is None
    finally:
        await w.close()
        reader.close()


async def test_a_batch_of_a_deleted_service_is_dropped(tmp_path) -> None:
    w = writer.Writer(str(tmp_path / "state.db"))
    try:
        batch = book.Batch("gone", puts=[make_replica("gone", 1)], state=b"{}")
        assert await w.submit(batch.apply) == []
    finally:
        await w.close()


def test_the_book_takes_everything_pending_and_a_failed_batch_goes_back_newer_changes_first() -> None:
    b = book.Book("svc")
    replicas = {i: make_replica("svc", i) for i in (1, 2, 3)}
    assert b.empty()
    b.put(1)
    b.put(2)
    b.delete(3, logs="svc-3")
    b.state(b"one")
    b.row(status=3)
    batch = b.take(replicas)
    assert b.empty()
    assert ([r.replica_id for r in batch.puts], batch.deletes, batch.state, batch.row, batch.logs) == (
        [1, 2],
        [3],
        b"one",
        {"status": 3},
        ["svc-3"],
    )
    replicas[1].endpoint = "changed after the take"
    assert batch.puts[0].endpoint != replicas[1].endpoint  # the batch holds copies
    # Meanwhile: 2 is deleted, a newer state and status are set. Then the batch fails.
    b.delete(2)
    b.state(b"two")
    b.row(status=4)
    b.restore(batch)
    again = b.take(replicas)
    assert [r.replica_id for r in again.puts] == [1]  # with its newest content
    assert again.puts[0].endpoint == "changed after the take"
    assert sorted(again.deletes) == [2, 3]
    assert (again.state, again.row, again.logs) == (b"two", {"status": 4}, ["svc-3"])


def _views(*rows: tuple[int, int, S]) -> list[st.ReplicaView]:
    return [st.ReplicaView(replica_id=i, version=v, status=s) for i, v, s in rows]


@pytest.mark.parametrize(
    ("name", "views", "target", "stopped", "paused", "want"),
    [
        ("nothing yet: launch the target", [], 3, False, False, (3, (), True, None)),
        ("at target: nothing", _views((1, 1, S.READY), (2, 1, S.READY)), 2, False, False, (0, (), False, None)),
        (
            "over target: the worst goes",
            _views((1, 1, S.READY), (2, 1, S.STARTING)),
            1,
            False,
            False,
            (0, (2,), False, None),
        ),
        ("stopped version: no launch", [], 2, True, False, (0, (), False, None)),
        ("paused: no launch, ask again later", [], 2, False, True, (0, (), True, "later")),
        ("a big scale-up: 50 now, the rest next", [], 120, False, False, (50, (), True, 0.0)),
    ],
)
def test_the_plan_of_a_pass(name, views, target, stopped, paused, want) -> None:  # type: ignore[no-untyped-def]
    backoff = failures.Backoff().failed(100.0, "HTTP 503") if paused else failures.Backoff()
    p = planner.plan(
        views,
        policy=autoscaler.Policy(min_replicas=target, max_replicas=target),
        adopted_target=target,
        latest_version=1,
        stopped=stopped,
        blue_green=False,
        backoff=backoff,
        now=100.5,
        torn_down={},
    )
    launch, teardown, wanted, again = want
    assert (p.launch, p.teardown, p.launch_wanted) == (launch, teardown, wanted), name
    if again == "later":
        assert p.again_in_s is not None and 0 < p.again_in_s <= 1.0, name
    else:
        assert p.again_in_s == again, name


def test_a_pass_of_a_large_service_launches_a_share_of_it_not_50() -> None:
    views = _views(*((i, 1, S.READY) for i in range(1, 4_001)))
    p = planner.plan(
        views,
        policy=autoscaler.Policy(min_replicas=10_000, max_replicas=10_000),
        adopted_target=10_000,
        latest_version=1,
        stopped=False,
        blue_green=False,
        backoff=failures.Backoff(),
        now=0.0,
        torn_down={},
    )
    assert (p.launch, p.again_in_s) == (200, 0.0)  # 4,000 records / 20; the rest next pass


def test_blue_green_switch_removes_the_old_versions_kept_failures() -> None:
    views = _views((1, 1, S.FAILED), (2, 2, S.READY))
    p = planner.plan(
        views,
        policy=autoscaler.Policy(min_replicas=1, max_replicas=1),
        adopted_target=1,
        latest_version=2,
        stopped=False,
        blue_green=True,
        backoff=failures.Backoff(),
        now=0.0,
        torn_down={1: 1},
    )
    assert p.remove == (1,)


@pytest.mark.parametrize("policy", [retries.STREAM, retries.WRITE, retries.PASS, retries.LOGS])
def test_each_retry_policy_grows_with_jitter_up_to_its_cap(policy: retries.Policy) -> None:
    delays = [policy.delay(n) for n in range(1, 12)]
    assert all(0 <= d <= policy.max_s + policy.jitter_s for d in delays)
    assert delays[0] <= policy.initial_s + policy.jitter_s
    assert max(delays[-3:]) >= policy.max_s * 0.99


def test_the_stream_policy_follows_the_settings() -> None:
    p = retries.STREAM.with_times(0.01, 0.05)
    assert all(p.delay(n) <= 0.05 + 0.01 for n in range(1, 10))

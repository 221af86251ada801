"""Unit tests of the controller's store, on SQLite and on PostgreSQL (the `store_url` fixture).

Tests that take `db_path` are about the SQLite file itself; the others run on both backends."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
import threading

import pytest
from google.protobuf import duration_pb2

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2
from services.common import errors
from services.controller import store as store_mod
from services.controller.store import schema

NOW = 1_700_000_000.0


def make_spec(run: str = "python3 -m http.server 8080", *, header: str = "") -> spec_pb2.ServiceSpec:
    spec = spec_pb2.ServiceSpec(run=run, yaml=f"run: {run}\n")
    spec.service.readiness_probe.path = "/health"
    spec.service.readiness_probe.initial_delay.CopyFrom(duration_pb2.Duration(seconds=1200))
    if header:
        spec.service.readiness_probe.headers["Authorization"] = header
    return spec


def make_replica(
    service: str, replica_id: int, *, version: int = 1, status: int = resources_pb2.REPLICA_STATUS_PENDING
) -> resources_pb2.Replica:
    replica = resources_pb2.Replica(
        service=service,
        replica_id=replica_id,
        replica_name=f"{service}-{replica_id}",
        version=version,
        status=status,  # type: ignore[arg-type]
        endpoint=f"http://127.0.0.1:{40000 + replica_id}",
    )
    replica.facts.launch_phase = resources_pb2.LAUNCH_PHASE_SCHEDULED
    replica.create_time.FromSeconds(int(NOW))
    return replica


@pytest.fixture
def db_path(tmp_path: object) -> str:
    return os.path.join(str(tmp_path), "state", "state.db")


@pytest.fixture
def store(store_url: str, db_path: str):
    s = store_mod.Store(store_url or db_path)
    yield s
    s.close()


@pytest.fixture
def svc(store: store_mod.Store) -> str:
    store.create_service("svc", make_spec(), now=NOW, request_id="req-1")
    return "svc"


# ---- opening ----------------------------------------------------------------------------------


def test_open_creates_private_wal_database(db_path: str) -> None:
    with store_mod.Store(db_path) as s:
        assert s.schema_version() == store_mod.SCHEMA_VERSION
        s.create_service("svc", make_spec(header="Bearer s3cret"), now=NOW)
        for suffix in ("-wal", "-shm"):  # the spec holds secrets: WAL files are private too
            assert stat.S_IMODE(os.stat(db_path + suffix).st_mode) == 0o600
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
    assert stat.S_IMODE(os.stat(db_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(db_path)).st_mode) == 0o700


def test_in_state_dir_expands_home(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    with store_mod.Store.in_state_dir("~/.replicaplane/controller") as s:
        assert s.path == os.path.join(str(tmp_path), ".replicaplane", "controller", "state.db")
    assert os.path.exists(os.path.join(str(tmp_path), ".replicaplane", "controller", "state.db"))


def test_synchronous_must_be_normal_or_full(db_path: str) -> None:
    with pytest.raises(ValueError):
        store_mod.Store(db_path, synchronous="OFF")
    with store_mod.Store(db_path, synchronous="full") as s:
        assert s._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


# ---- services ---------------------------------------------------------------------------------


def test_create_service_stores_version_one(store: store_mod.Store) -> None:
    spec = make_spec(header="Bearer s3cret")
    row = store.create_service("svc", spec, now=NOW, request_id="req-1")
    assert row == store_mod.ServiceRow(
        name="svc",
        create_time=NOW,
        status=resources_pb2.SERVICE_STATUS_CONTROLLER_INIT,
        status_message="",
        uptime_start=None,
        update_mode=resources_pb2.UPDATE_MODE_UNSPECIFIED,
        latest_version=1,
        next_replica_id=1,
        deleting=False,
        request_id="req-1",
        uid=row.uid,
    )
    assert len(row.uid) == 8
    assert store.get_service("svc") == row
    assert store.list_versions("svc") == [1]
    assert store.get_version("svc", 1) == spec
    assert store._db.execute("SELECT yaml FROM versions").fetchone()[0] == spec.yaml


def test_create_existing_service_is_already_exists(store: store_mod.Store, svc: str) -> None:
    with pytest.raises(errors.AlreadyExistsError) as info:
        store.create_service(svc, make_spec("other"), now=NOW + 1)
    assert info.value.metadata == {"service": "svc"}
    assert store.get_version(svc, 1) == make_spec()  # untouched
    assert store.list_versions(svc) == [1]


def test_get_missing_service_is_none(store: store_mod.Store) -> None:
    assert store.get_service("nope") is None


def test_list_services_in_name_order(store: store_mod.Store) -> None:
    for name in ("b", "c", "a"):
        store.create_service(name, make_spec(), now=NOW)
    assert [r.name for r in store.list_services()] == ["a", "b", "c"]


def test_update_service_sets_fields(store: store_mod.Store, svc: str) -> None:
    row = store.update_service(
        svc,
        status=resources_pb2.SERVICE_STATUS_READY,
        status_message="1/1 ready",
        uptime_start=NOW + 5,
        update_mode=resources_pb2.UPDATE_MODE_BLUE_GREEN,
        deleting=True,
    )
    assert row.status == resources_pb2.SERVICE_STATUS_READY
    assert row.status_message == "1/1 ready"
    assert row.uptime_start == NOW + 5
    assert row.update_mode == resources_pb2.UPDATE_MODE_BLUE_GREEN
    assert row.deleting is True
    assert store.get_service(svc) == row
    assert store.update_service(svc, uptime_start=None).uptime_start is None
    assert store.update_service(svc) == store.get_service(svc)


def test_update_service_refuses_counters_and_unknown_fields(store: store_mod.Store, svc: str) -> None:
    for field in ("next_replica_id", "latest_version", "name", "bogus"):
        with pytest.raises(ValueError, match=field):
            store.update_service(svc, **{field: 1})


def test_update_missing_service_is_not_found(store: store_mod.Store) -> None:
    with pytest.raises(errors.NotFoundError):
        store.update_service("nope", status_message="x")
    with pytest.raises(errors.NotFoundError):
        store.update_service("nope")


def test_delete_service_removes_everything(store: store_mod.Store, svc: str) -> None:
    store.create_service("other", make_spec(), now=NOW)
    store.add_version(svc, make_spec("v2"))
    store.put_replica(make_replica(svc, store.allocate_replica_id(svc)))
    store.put_replica(make_replica("other", store.allocate_replica_id("other")))
    store.put_autoscaler_state(svc, b"{}")
    store.delete_service(svc)
    assert store.get_service(svc) is None
    assert store.list_versions(svc) == []
    assert store.list_replicas(svc) == []
    assert store.get_autoscaler_state(svc) is None
    assert [r.replica_id for r in store.list_replicas("other")] == [1]
    store.delete_service(svc)  # a no-op the second time


def test_recreated_service_starts_fresh(store: store_mod.Store, svc: str) -> None:
    store.allocate_replica_id(svc)
    old_uid = store.get_service(svc).uid
    store.delete_service(svc)
    row = store.create_service(svc, make_spec(), now=NOW)
    assert (row.latest_version, row.next_replica_id) == (1, 1)
    assert row.uid != old_uid and len(row.uid) == 8  # a new incarnation: replica names never repeat


# ---- versions ---------------------------------------------------------------------------------


def test_add_version_bumps_latest(store: store_mod.Store, svc: str) -> None:
    v2 = make_spec("v2")
    assert store.add_version(svc, v2) == 2
    assert store.add_version(svc, make_spec("v3")) == 3
    assert store.get_service(svc).latest_version == 3  # type: ignore[union-attr]
    assert store.list_versions(svc) == [1, 2, 3]
    assert store.get_version(svc, 2) == v2
    assert store.get_version(svc, 9) is None


def test_add_version_to_missing_service_is_not_found(store: store_mod.Store) -> None:
    with pytest.raises(errors.NotFoundError):
        store.add_version("nope", make_spec())


def test_add_version_is_atomic_across_connections(store: store_mod.Store, svc: str) -> None:
    # Two stores (as two processes would) adding versions at once never get the same number.
    other = store_mod.Store(store.path)
    results: list[int] = []
    lock = threading.Lock()

    def add(s: store_mod.Store) -> None:
        for _ in range(25):
            v = s.add_version(svc, make_spec())
            with lock:
                results.append(v)

    threads = [threading.Thread(target=add, args=(s,)) for s in (store.reopen(), other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == list(range(2, 52))
    assert other.list_versions(svc) == list(range(1, 52))
    other.close()


def test_add_version_rolled_back_with_transaction(store: store_mod.Store, svc: str) -> None:
    with pytest.raises(RuntimeError), store.transaction():
        assert store.add_version(svc, make_spec("v2")) == 2
        raise RuntimeError("boom")
    assert store.list_versions(svc) == [1]
    assert store.get_service(svc).latest_version == 1  # type: ignore[union-attr]
    assert store.add_version(svc, make_spec("v2")) == 2


def test_delete_unreferenced_versions_keeps_newest_and_referenced(store: store_mod.Store, svc: str) -> None:
    for i in range(2, 6):
        store.add_version(svc, make_spec(f"v{i}"))
    store.put_replica(make_replica(svc, store.allocate_replica_id(svc), version=2))
    store.put_replica(make_replica(svc, store.allocate_replica_id(svc), version=4))
    assert store.delete_unreferenced_versions(svc) == [1, 3]
    assert store.list_versions(svc) == [2, 4, 5]
    assert store.delete_unreferenced_versions(svc) == []
    store.delete_replica(svc, 1)
    store.delete_replica(svc, 2)
    assert store.delete_unreferenced_versions(svc) == [2, 4]
    assert store.list_versions(svc) == [5]
    # Numbers keep going up after deletions.
    assert store.add_version(svc, make_spec()) == 6


def test_delete_unreferenced_versions_of_missing_service(store: store_mod.Store) -> None:
    assert store.delete_unreferenced_versions("nope") == []


# ---- replica ids ------------------------------------------------------------------------------


def test_replica_ids_start_at_one_and_count_per_service(store: store_mod.Store, svc: str) -> None:
    store.create_service("other", make_spec(), now=NOW)
    assert [store.allocate_replica_id(svc) for _ in range(3)] == [1, 2, 3]
    assert store.allocate_replica_id("other") == 1
    assert store.get_service(svc).next_replica_id == 4  # type: ignore[union-attr]


def test_allocate_replica_id_of_missing_service_is_not_found(store: store_mod.Store) -> None:
    with pytest.raises(errors.NotFoundError):
        store.allocate_replica_id("nope")


def test_replica_ids_never_reused_after_delete_and_reopen(store_url: str, db_path: str) -> None:
    with store_mod.Store(store_url or db_path) as s:
        s.create_service("svc", make_spec(), now=NOW)
        for _ in range(3):
            s.put_replica(make_replica("svc", s.allocate_replica_id("svc")))
        for rid in (1, 2, 3):
            s.delete_replica("svc", rid)
        assert s.allocate_replica_id("svc") == 4
    with store_mod.Store(store_url or db_path) as s:
        assert s.list_replicas("svc") == []
        assert s.allocate_replica_id("svc") == 5


def test_putting_an_unallocated_id_moves_the_counter(store: store_mod.Store, svc: str) -> None:
    store.put_replica(make_replica(svc, 7))
    assert store.allocate_replica_id(svc) == 8
    store.put_replica(make_replica(svc, 2))  # below the counter: counter unchanged
    assert store.allocate_replica_id(svc) == 9


def test_allocated_id_rolled_back_with_transaction_is_not_acknowledged(store: store_mod.Store, svc: str) -> None:
    with pytest.raises(RuntimeError), store.transaction():
        assert store.allocate_replica_id(svc) == 1
        raise RuntimeError("boom")
    # Nobody ever saw id 1 committed, so handing it out again is not a reuse.
    assert store.allocate_replica_id(svc) == 1


# ---- replicas ---------------------------------------------------------------------------------


def test_put_get_replica_round_trips(store: store_mod.Store, svc: str) -> None:
    replica = make_replica(svc, store.allocate_replica_id(svc))
    replica.facts.first_ready_time.FromSeconds(int(NOW) + 3)
    replica.facts.drain.FromSeconds(120)
    store.put_replica(replica)
    assert store.get_replica(svc, 1) == replica
    assert store.get_replica(svc, 2) is None
    assert store.get_replica("nope", 1) is None


def test_put_replica_upserts(store: store_mod.Store, svc: str) -> None:
    replica = make_replica(svc, store.allocate_replica_id(svc))
    store.put_replica(replica)
    replica.status = resources_pb2.REPLICA_STATUS_READY
    replica.facts.ready_now = True
    store.put_replica(replica)
    assert store.list_replicas(svc) == [replica]
    row = store._db.execute("SELECT status, version FROM replicas").fetchone()
    assert tuple(row) == (resources_pb2.REPLICA_STATUS_READY, 1)


def test_put_replica_checks_service_and_id(store: store_mod.Store, svc: str) -> None:
    with pytest.raises(errors.NotFoundError):
        store.put_replica(make_replica("nope", 1))
    with pytest.raises(ValueError):
        store.put_replica(make_replica(svc, 0))


def test_put_replicas_is_one_transaction(store: store_mod.Store, svc: str) -> None:
    good = [make_replica(svc, store.allocate_replica_id(svc)) for _ in range(3)]
    with pytest.raises(errors.NotFoundError):
        store.put_replicas([*good, make_replica("nope", 1)])
    assert store.list_replicas(svc) == []
    store.put_replicas(iter(good))
    assert store.list_replicas(svc) == good


def test_put_replicas_of_many_services_past_one_statement_keeps_the_last_of_each(
    store: store_mod.Store, svc: str
) -> None:
    # Rows go in multi-row statements of at most 100: a batch past that, over two services, with
    # one record given twice (the last one counts) and ids never allocated (the counter moves).
    store.create_service("other", make_spec(), now=NOW)
    batch = [make_replica(svc, i) for i in range(1, 251)] + [make_replica("other", i) for i in (5, 7)]
    batch.append(make_replica(svc, 3, status=resources_pb2.REPLICA_STATUS_READY))
    store.put_replicas(batch)
    stored = store.list_replicas(svc)
    assert [r.replica_id for r in stored] == list(range(1, 251))
    assert stored[2].status == resources_pb2.REPLICA_STATUS_READY
    assert [r.replica_id for r in store.list_replicas("other")] == [5, 7]
    assert (store.allocate_replica_id(svc), store.allocate_replica_id("other")) == (251, 8)


def test_list_replicas_in_id_order_and_by_status(store: store_mod.Store, svc: str) -> None:
    ids = [store.allocate_replica_id(svc) for _ in range(5)]
    statuses = [
        resources_pb2.REPLICA_STATUS_READY,
        resources_pb2.REPLICA_STATUS_PENDING,
        resources_pb2.REPLICA_STATUS_READY,
        resources_pb2.REPLICA_STATUS_FAILED,
        resources_pb2.REPLICA_STATUS_STARTING,
    ]
    for rid, status in reversed(list(zip(ids, statuses, strict=True))):
        store.put_replica(make_replica(svc, rid, status=status))
    assert [r.replica_id for r in store.list_replicas(svc)] == [1, 2, 3, 4, 5]
    ready = store.list_replicas(svc, statuses=[resources_pb2.REPLICA_STATUS_READY])
    assert [r.replica_id for r in ready] == [1, 3]
    assert store.list_replicas(svc, statuses=[]) == []


def test_delete_replica(store: store_mod.Store, svc: str) -> None:
    for _ in range(2):
        store.put_replica(make_replica(svc, store.allocate_replica_id(svc)))
    store.delete_replica(svc, 1)
    store.delete_replica(svc, 1)  # a no-op the second time
    assert [r.replica_id for r in store.list_replicas(svc)] == [2]


# ---- autoscaler state -------------------------------------------------------------------------


def test_autoscaler_state_round_trips(store: store_mod.Store, svc: str) -> None:
    assert store.get_autoscaler_state(svc) is None
    store.put_autoscaler_state(svc, b'{"target": 2}')
    store.put_autoscaler_state(svc, b'{"target": 3}')
    assert store.get_autoscaler_state(svc) == b'{"target": 3}'


def test_autoscaler_state_of_missing_service_is_not_found(store: store_mod.Store) -> None:
    with pytest.raises(errors.NotFoundError):
        store.put_autoscaler_state("nope", b"{}")


# ---- transactions -----------------------------------------------------------------------------


def test_transaction_commits_all_or_nothing(store: store_mod.Store, svc: str) -> None:
    with store.transaction() as tx:
        assert tx is store
        rid = store.allocate_replica_id(svc)
        store.put_replica(make_replica(svc, rid))
        store.put_autoscaler_state(svc, b"1")
    with pytest.raises(RuntimeError), store.transaction():
        store.put_replica(make_replica(svc, store.allocate_replica_id(svc)))
        store.put_autoscaler_state(svc, b"2")
        store.update_service(svc, status_message="half")
        raise RuntimeError("boom")
    assert [r.replica_id for r in store.list_replicas(svc)] == [1]
    assert store.get_autoscaler_state(svc) == b"1"
    assert store.get_service(svc).status_message == ""  # type: ignore[union-attr]


def test_nested_block_that_fails_rolls_back_only_itself(store: store_mod.Store, svc: str) -> None:
    with store.transaction():
        store.update_service(svc, status_message="outer")
        with pytest.raises(errors.NotFoundError):
            # put_replicas fails half way: its first write must not survive.
            store.put_replicas([make_replica(svc, 1), make_replica("nope", 2)])
        with pytest.raises(KeyError), store.transaction(), store.transaction():
            store.put_autoscaler_state(svc, b"inner")
            raise KeyError("x")
        store.put_autoscaler_state(svc, b"kept")
    assert store.get_service(svc).status_message == "outer"  # type: ignore[union-attr]
    assert store.list_replicas(svc) == []
    assert store.get_autoscaler_state(svc) == b"kept"


def test_reads_inside_transaction_see_its_writes(store: store_mod.Store, svc: str) -> None:
    with store.transaction():
        store.put_replica(make_replica(svc, store.allocate_replica_id(svc)))
        assert len(store.list_replicas(svc)) == 1


def test_read_modify_write_is_atomic_across_threads(store: store_mod.Store, svc: str) -> None:
    # Each thread has its own store (connection); counters incremented inside a transaction
    # never lose an update.
    def bump(s: store_mod.Store) -> None:
        for _ in range(30):
            with s.transaction():
                n = int(s.get_autoscaler_state(svc) or b"0")
                s.put_autoscaler_state(svc, str(n + 1).encode())

    stores = [store.reopen() for _ in range(3)]
    threads = [threading.Thread(target=bump, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert stores[0].get_autoscaler_state(svc) == b"90"
    for s in stores:
        s.close()


def test_shared_store_serialises_threads(store: store_mod.Store, svc: str) -> None:
    # One store used from several threads: the lock keeps their transactions apart.
    def bump() -> None:
        for _ in range(30):
            with store.transaction():
                n = int(store.get_autoscaler_state(svc) or b"0")
                store.put_autoscaler_state(svc, str(n + 1).encode())

    threads = [threading.Thread(target=bump) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert store.get_autoscaler_state(svc) == b"90"


def test_writer_waits_for_another_process_lock(store: store_mod.Store, svc: str) -> None:
    other = store_mod.Store(store.path, busy_timeout_s=10)
    holding = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with other.transaction():
            other.update_service(svc, status_message="held")
            holding.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert holding.wait(10)
    waiter = store_mod.Store(store.path, busy_timeout_s=10)
    timer = threading.Timer(0.2, release.set)
    timer.start()
    waiter.put_autoscaler_state(svc, b"after")  # blocks until the holder commits, then succeeds
    t.join(10)
    assert waiter.get_service(svc).status_message == "held"  # type: ignore[union-attr]
    assert waiter.get_autoscaler_state(svc) == b"after"
    waiter.close()
    other.close()


def test_busy_past_timeout_is_unavailable(store: store_mod.Store, svc: str) -> None:
    other = store_mod.Store(store.path, busy_timeout_s=0.05)
    changes: list[bool] = []
    other.on_writable_change(changes.append)
    with store.transaction():
        store.update_service(svc, status_message="held")
        with pytest.raises(errors.UnavailableError) as info:
            other.put_autoscaler_state(svc, b"x")
        assert info.value.reason == "STORE_UNAVAILABLE"
        assert not other.writable and not other.check_writable()
        assert other.get_autoscaler_state(svc) is None  # reads go on
    assert changes == [False]
    other.put_autoscaler_state(svc, b"x")
    assert other.writable and changes == [False, True]
    assert other.check_writable()
    other.close()


def test_a_damaged_file_is_unavailable_in_the_users_words_with_the_detail_logged(
    db_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    with store_mod.Store(db_path) as s:
        s.create_service("svc", make_spec(), now=NOW)
        s.put_replicas([make_replica("svc", i) for i in range(1, 50)])
        page = s._db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'replicas'").fetchone()[0]
        size = s._db.execute("PRAGMA page_size").fetchone()[0]
    # Closing checkpointed the WAL into the file; damage the replicas table's root page.
    with open(db_path, "r+b") as fh:
        fh.seek((page - 1) * size)
        fh.write(b"\xff" * size)
    with store_mod.Store(db_path) as s:
        with pytest.raises(errors.UnavailableError) as info:
            s.list_replicas("svc")
        assert info.value.reason == "STORE_UNAVAILABLE"
        assert info.value.message == (
            "the controller could not read its state: its state store is damaged; try again later"
        )
        assert info.value.metadata == {"cause": "damaged", "operation": "read"}
        with pytest.raises(errors.UnavailableError) as info:
            s.put_replica(make_replica("svc", 60))
        assert info.value.message.startswith("the controller could not save the change: its state store is damaged")
        assert "malformed" not in info.value.message and "DatabaseError" not in info.value.message
    assert "database disk image is malformed" in caplog.text


async def test_transaction_held_across_await_is_refused(store: store_mod.Store, svc: str) -> None:
    entered = asyncio.Event()
    done = asyncio.Event()

    async def holder() -> None:
        with store.transaction():
            store.update_service(svc, status_message="holder")
            entered.set()
            await done.wait()

    task = asyncio.create_task(holder())
    await entered.wait()
    with pytest.raises(RuntimeError, match="await"):
        store.get_service(svc)
    with pytest.raises(RuntimeError, match="await"):
        store.update_service(svc, status_message="intruder")
    done.set()
    await task
    assert store.get_service(svc).status_message == "holder"  # type: ignore[union-attr]


# ---- migrations -------------------------------------------------------------------------------


def _old_database(path: str, version: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert store_mod.migrate(conn, target=version) == version
        conn.execute(
            "INSERT INTO services (name, create_time, status, latest_version, next_replica_id) "
            "VALUES ('old', ?, 3, 1, 3)",
            (NOW,),
        )
        conn.execute(
            "INSERT INTO versions (service, version, spec, yaml) VALUES ('old', 1, ?, ?)",
            (make_spec().SerializeToString(), make_spec().yaml),
        )
        conn.execute(
            "INSERT INTO replicas (service, replica_id, status, version, data) VALUES ('old', 2, 1, 1, ?)",
            (make_replica("old", 2).SerializeToString(),),
        )
    finally:
        conn.close()


def test_opening_a_version_1_database_migrates_it(db_path: str) -> None:
    _old_database(db_path, 1)
    with store_mod.Store(db_path) as s:
        assert s.schema_version() == store_mod.SCHEMA_VERSION
        row = s.get_service("old")
        assert row is not None
        assert (row.request_id, row.status, row.next_replica_id) == ("", 3, 3)
        assert len(row.uid) == 8  # an existing service gets its incarnation uid too
        assert s.get_version("old", 1) == make_spec()
        assert s.list_replicas("old", statuses=[1]) == [make_replica("old", 2)]
        indexes = {r[0] for r in s._db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert {"replicas_by_version", "replicas_by_status"} <= indexes
        assert s.allocate_replica_id("old") == 3
    with store_mod.Store(db_path) as s:  # reopening is a no-op
        assert s.schema_version() == store_mod.SCHEMA_VERSION
        assert s.get_service("old").uid == row.uid


def test_migrations_are_ordered_and_each_bumps_the_version(tmp_path: object) -> None:
    conn = sqlite3.connect(os.path.join(str(tmp_path), "m.db"), isolation_level=None)
    try:
        for target in range(len(store_mod.MIGRATIONS) + 1):
            assert store_mod.migrate(conn, target=target) == target
            assert conn.execute("PRAGMA user_version").fetchone()[0] == target
    finally:
        conn.close()


def test_failed_migration_leaves_old_schema(db_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _old_database(db_path, 1)

    def broken(db: sqlite3.Connection) -> None:
        db.execute("ALTER TABLE services ADD COLUMN request_id TEXT NOT NULL DEFAULT ''")
        raise sqlite3.OperationalError("disk on fire")

    monkeypatch.setattr(schema, "SQLITE", (schema.SQLITE[0], broken, *schema.SQLITE[2:]))
    with pytest.raises(sqlite3.OperationalError):
        store_mod.Store(db_path)
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
        columns = {r[1] for r in conn.execute("PRAGMA table_info(services)")}
        assert "request_id" not in columns
    finally:
        conn.close()


def test_newer_schema_is_refused(db_path: str) -> None:
    with store_mod.Store(db_path):
        pass
    conn = sqlite3.connect(db_path)
    conn.execute(f"PRAGMA user_version = {store_mod.SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(store_mod.SchemaError):
        store_mod.Store(db_path)


def test_controller_id_is_created_once_and_kept(tmp_path) -> None:
    with store_mod.Store.in_state_dir(str(tmp_path / "a")) as s:
        first = s.controller_id()
        assert first and s.controller_id() == first
    with store_mod.Store.in_state_dir(str(tmp_path / "a")) as s:
        assert s.controller_id() == first
    with store_mod.Store.in_state_dir(str(tmp_path / "b")) as s:
        assert s.controller_id() != first


def test_an_error_that_ended_the_whole_transaction_is_reported_as_itself(tmp_path) -> None:
    # Some I/O errors make SQLite roll the whole transaction back, savepoints included; the
    # nested block must then report that error, not fail on its own "no such savepoint".
    original = sqlite3.OperationalError("disk I/O error")
    with store_mod.Store(str(tmp_path / "state.db")) as db:
        with pytest.raises(errors.UnavailableError) as info, db.transaction(), db.transaction():
            db._db.execute("ROLLBACK")  # what SQLite does on such an error
            raise original
        assert info.value.__cause__ is original
        assert db.check_writable()  # and the store works on

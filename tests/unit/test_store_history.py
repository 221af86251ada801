"""The store's version history, event log and rollout state (schema migration 6)."""

from __future__ import annotations

import os
import sqlite3

import pytest

from replicaplane.controller.v1 import resources_pb2 as res
from services.controller import store as store_mod
from services.controller import store_history
from tests.unit.test_store import NOW, make_spec

ACTIVE, SUPERSEDED, ROLLED_BACK = (
    res.VERSION_OUTCOME_ACTIVE,
    res.VERSION_OUTCOME_SUPERSEDED,
    res.VERSION_OUTCOME_ROLLED_BACK,
)


@pytest.fixture
def store(tmp_path, store_url: str):
    # On both backends (tests/conftest.py).
    with store_mod.Store(store_url or os.path.join(str(tmp_path), "state.db")) as s:
        s.create_service("svc", make_spec(), now=NOW)
        yield s


def outcomes(store: store_mod.Store) -> list[tuple[int, int, str]]:
    return [(h.version, h.outcome, h.reason) for h in store.list_history("svc")]


def test_each_version_is_kept_with_its_spec_and_the_one_before_is_superseded(store: store_mod.Store) -> None:
    assert outcomes(store) == [(1, ACTIVE, "")]
    v2 = store.add_version("svc", make_spec("serve --v2"), now=NOW + 10, mode=res.UPDATE_MODE_CANARY)
    store.set_version_outcome("svc", v2, ROLLED_BACK, "error rate 50 %", now=NOW + 20)
    v3 = store.add_version("svc", make_spec(), now=NOW + 30, rollback_of=1)
    assert outcomes(store) == [(1, SUPERSEDED, ""), (2, ROLLED_BACK, "error rate 50 %"), (3, ACTIVE, "")]
    rows = store.list_history("svc")
    assert rows[0].end_time == NOW + 10 and rows[1].end_time == NOW + 20 and rows[2].end_time is None
    assert (rows[1].update_mode, rows[2].rollback_of) == (res.UPDATE_MODE_CANARY, 1)
    assert rows[1].spec == make_spec("serve --v2")
    assert rows[0].digest == rows[2].digest != rows[1].digest
    store.delete_unreferenced_versions("svc")  # the versions table forgets; the history does not
    assert store.get_history("svc", 1).spec == make_spec()  # type: ignore[union-attr]
    assert v3 == 3


def test_the_digest_ignores_the_yaml_text_and_secret_values() -> None:
    a, b = make_spec(header="Bearer one"), make_spec(header="Bearer two")
    b.yaml = a.yaml + "\n# a comment\n"
    assert store_history.spec_digest(a) == store_history.spec_digest(b)
    assert store_history.spec_digest(a) != store_history.spec_digest(make_spec("other"))
    assert len(store_history.spec_digest(a)) == 12


def test_the_history_keeps_the_last_versions(store: store_mod.Store) -> None:
    for i in range(store_history.HISTORY_KEPT + 5):
        store.add_version("svc", make_spec(f"serve {i}"), now=NOW + i)
    versions = [h.version for h in store.list_history("svc")]
    assert len(versions) == store_history.HISTORY_KEPT
    assert versions[-1] == store_history.HISTORY_KEPT + 6


def event(seq: int, message: str = "m") -> res.Event:
    return res.Event(sequence=seq, service_name="svc", reason="R", message=message, count=1)


def test_events_are_kept_in_order_replaced_entries_go_and_the_log_is_bounded(
    store: store_mod.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put_events("svc", [event(1), event(2)])
    store.put_events("svc", [event(3, "again")], replaced=[1])
    assert [e.sequence for e in store.list_events("svc")] == [2, 3]
    store.put_events("svc", [event(4), event(5, "4 again")], replaced=[4])  # both in one batch
    assert [e.sequence for e in store.list_events("svc")] == [2, 3, 5]
    monkeypatch.setattr(store_history, "EVENTS_KEPT", 3)
    store.put_events("svc", [event(i) for i in range(6, 9)])
    assert [e.sequence for e in store.list_events("svc")] == [6, 7, 8]
    store.put_events("gone", [event(1)])  # a service deleted meanwhile: dropped
    assert store.list_events("gone") == []


def test_deleting_a_service_removes_its_history_events_and_rollout_state(store: store_mod.Store) -> None:
    store.put_events("svc", [event(1)])
    store.put_rollout_state("svc", b"state")
    assert store.get_rollout_state("svc") == b"state"
    store.delete_service("svc")
    assert (store.list_history("svc"), store.list_events("svc"), store.get_rollout_state("svc")) == ([], [], None)
    store.create_service("svc", make_spec(), now=NOW)
    assert outcomes(store) == [(1, ACTIVE, "")]


def test_migration_6_keeps_the_versions_stored_before_as_history(tmp_path) -> None:
    path = os.path.join(str(tmp_path), "state.db")
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        store_mod.migrate(conn, target=4)
        conn.execute("INSERT INTO services (name, create_time, latest_version) VALUES ('old', ?, 2)", (NOW,))
        for version, run in ((1, "a"), (2, "b")):
            conn.execute(
                "INSERT INTO versions (service, version, spec) VALUES ('old', ?, ?)",
                (version, make_spec(run).SerializeToString()),
            )
    finally:
        conn.close()
    with store_mod.Store(path) as s:
        rows = s.list_history("old")
        assert [(h.version, h.outcome, h.create_time) for h in rows] == [(1, SUPERSEDED, NOW), (2, ACTIVE, NOW)]
        assert rows[1].spec == make_spec("b")
        s.put_rollout_state("old", None)
        assert s.get_rollout_state("old") is None

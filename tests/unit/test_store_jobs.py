"""The store's jobs table: ids per pool, replaced rows, order, and jobs going with their pool."""

from __future__ import annotations

import os
import sqlite3

import pytest

from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors
from services.controller import store as store_mod
from tests.unit.test_store import NOW, make_spec


@pytest.fixture
def store(tmp_path: object, store_url: str):
    # On both backends (tests/conftest.py).
    s = store_mod.Store(store_url or os.path.join(str(tmp_path), "state", "state.db"))
    s.create_service("batch", make_spec(), now=NOW)
    s.create_service("other", make_spec(), now=NOW)
    yield s
    s.close()


def _job(pool: str = "batch", run: str = "echo hi") -> res.Job:
    return res.Job(pool=pool, run=run, state=res.JOB_STATE_PENDING)


def test_job_ids_start_at_1_per_pool_and_grow(store: store_mod.Store) -> None:
    assert [store.add_job(_job()).job_id for _ in range(3)] == [1, 2, 3]
    assert store.add_job(_job("other")).job_id == 1
    assert [j.job_id for j in store.list_jobs("batch")] == [1, 2, 3]


def test_a_job_row_is_replaced_whole(store: store_mod.Store) -> None:
    job = store.add_job(_job())
    job.state = res.JOB_STATE_SUCCEEDED
    job.exit_code = 0
    job.envs["SEED"] = "7"
    store.put_jobs([job])
    assert store.list_jobs("batch") == [job]


def test_a_job_of_an_unknown_pool_is_refused_and_nothing_is_written(store: store_mod.Store) -> None:
    with pytest.raises(errors.NotFoundError):
        store.add_job(_job("nope"))
    good = store.add_job(_job())
    with pytest.raises(errors.NotFoundError):
        store.put_jobs([good, res.Job(pool="nope", job_id=1)])
    assert store.list_jobs("nope") == []


def test_jobs_go_with_their_pool(store: store_mod.Store) -> None:
    store.add_job(_job())
    store.add_job(_job("other"))
    store.delete_service("batch")
    assert store.list_jobs("batch") == []
    assert len(store.list_jobs("other")) == 1
    store.create_service("batch", make_spec(), now=NOW)
    assert store.add_job(_job()).job_id == 1  # a new pool of the same name starts again


def test_the_jobs_migration_builds_the_table_on_an_old_database(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "old.db")
    conn = sqlite3.connect(path, isolation_level=None)
    store_mod.migrate(conn, target=store_mod.SCHEMA_VERSION - 1)
    conn.close()
    with store_mod.Store(path) as s:
        assert s.schema_version() == store_mod.SCHEMA_VERSION
        s.create_service("batch", make_spec(), now=NOW)
        assert s.add_job(_job()).job_id == 1
        indexes = {r[0] for r in s._db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert "jobs_by_state" in indexes

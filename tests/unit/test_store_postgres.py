"""What only the PostgreSQL backend has: a URL that may hold a password, a server that ends a
session, a session stuck in a transaction, and the migrations kept in step with SQLite's."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from replicaplane.common.v1 import spec_pb2
from services.common import errors
from services.controller import store as store_mod
from services.controller.server import Settings, check
from services.controller.store import postgres, schema
from tests.helpers import postgres as pg_helper


@pytest.fixture
def url(postgres_server: pg_helper.Server):
    made = postgres_server.database()
    yield made
    postgres_server.drop(made)


def spec() -> spec_pb2.ServiceSpec:
    return spec_pb2.ServiceSpec(run="serve", yaml="run: serve\n")


def test_both_backends_have_every_migration() -> None:
    assert len(schema.SQLITE) == len(schema.POSTGRES) == store_mod.SCHEMA_VERSION


def test_a_postgresql_url_opens_the_postgresql_store(url: str) -> None:
    with store_mod.Store(url) as s:
        assert isinstance(s, postgres.PostgresStore)
        assert s.schema_version() == store_mod.SCHEMA_VERSION
    with store_mod.open_store(url, state_dir="/nonexistent") as s:  # the state dir is not used
        assert isinstance(s, postgres.PostgresStore)


def test_the_password_is_never_logged_nor_in_errors(url: str, caplog: pytest.LogCaptureFixture) -> None:
    secret_url = url.replace("replicaplane@", "replicaplane:s3cret-pw@")  # trust auth ignores it
    with store_mod.Store(secret_url) as s:
        assert "s3cret" not in s.location and s.location.endswith(url.rsplit("/", 1)[1])
        assert "s3cret" not in repr(Settings(store_url=secret_url))
        s.create_service("svc", spec(), now=1.0)
        _end_sessions(url)
        with pytest.raises(errors.UnavailableError) as info:
            s.add_version("svc", spec())
    assert "s3cret" not in str(info.value) and "s3cret" not in caplog.text
    assert "s3cret" not in str(info.value.metadata)


def test_a_bad_store_url_is_refused_by_field_without_quoting_it() -> None:
    with pytest.raises(errors.ValidationError) as info:
        check(Settings(store_url="mysql://root:hunter2@db/x"))
    assert [v.field for v in info.value.violations] == ["controller.store_url"]
    assert "hunter2" not in str(info.value)


def test_a_session_the_server_ended_is_replaced_on_the_next_call(url: str) -> None:
    with store_mod.Store(url) as s:
        s.create_service("svc", spec(), now=1.0)
        _end_sessions(url)
        with pytest.raises(errors.UnavailableError) as info:  # the call that found it broken
            s.add_version("svc", spec())
        assert info.value.metadata["cause"] == "unreachable"
        assert not s.writable
        assert s.add_version("svc", spec()) == 2  # a new session; nothing of the failed call stuck
        assert s.writable


def test_a_session_stuck_in_a_transaction_loses_the_writer_lock(url: str) -> None:
    # A controller stopped mid-transaction (SIGSTOP) must not hold every other writer off: the
    # server ends its session after idle_timeout_s, and its transaction never commits.
    stuck = postgres.PostgresStore(url, idle_timeout_s=0.5)
    stuck.create_service("svc", spec(), now=1.0)
    other = store_mod.Store(url, busy_timeout_s=10)
    holding, failed = threading.Event(), []

    def hold() -> None:
        try:
            with stuck.transaction():
                stuck.update_service("svc", status_message="from the stuck one")
                holding.set()
                time.sleep(2)  # no statement: the session idles in its transaction
        except errors.UnavailableError as exc:
            failed.append(exc)

    thread = threading.Thread(target=hold)
    thread.start()
    assert holding.wait(10)
    start = time.monotonic()
    other.update_service("svc", status_message="from the other")
    assert time.monotonic() - start < 1.9  # it did not wait for the stuck one to wake up
    thread.join(10)
    assert failed, "the stuck transaction committed"
    assert other.get_service("svc").status_message == "from the other"  # type: ignore[union-attr]
    other.close()
    stuck.close()


def test_an_unreachable_server_is_one_line_naming_it_without_the_password(postgres_server: pg_helper.Server) -> None:
    port = pg_helper._free_port()
    with pytest.raises(errors.StartupError) as info:
        store_mod.Store(f"postgresql://nobody:pw-s3cret@127.0.0.1:{port}/x", busy_timeout_s=1)
    assert str(info.value).startswith(f"cannot reach the PostgreSQL store at postgresql://nobody@127.0.0.1:{port}/x: ")
    assert "s3cret" not in str(info.value)


def _end_sessions(url: str) -> None:
    """What a server restart or a network cut does to every open session of one database."""
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as db:
        db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))

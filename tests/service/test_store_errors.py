"""A store that fails for real (another process holds its lock): the API says what failed in the
user's terms, and the SQLite detail goes to the log only."""

from __future__ import annotations

import logging
import os
import sqlite3

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from services.common import grpc_errors
from tests.service.test_controller import spec, started

SQLITE_WORDS = ("sqlite", "OperationalError", "DatabaseError", "database is locked", "disk I/O")


async def unavailable(call) -> grpc_errors.RpcError:  # type: ignore[no-untyped-def]
    """The call's error, checked for UNAVAILABLE and no SQLite text anywhere in the status."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    err = grpc_errors.RpcError(info.value)
    assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE"), err
    assert_no_sqlite_internals(f"{info.value.details()} {info.value.trailing_metadata()}")
    return err


def assert_no_sqlite_internals(text: str) -> None:
    for word in SQLITE_WORDS:
        assert word.lower() not in text.lower(), (word, text)


async def test_a_busy_store_says_the_change_was_not_saved_and_logs_the_detail(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services.controller.store")
    async with started(tmp_path, store_busy_timeout_s=0.05) as env:
        await env.stub.CreateService(api.CreateServiceRequest(yaml=spec(name="first")))
        lock = sqlite3.connect(os.path.join(env.state_dir, "state.db"), isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")
        try:
            calls = [
                env.stub.CreateService(api.CreateServiceRequest(yaml=spec(name="second"))),
                env.stub.UpdateService(api.UpdateServiceRequest(service_name="first", yaml=spec("first", 2))),
                env.stub.DeleteService(api.DeleteServiceRequest(service_name="first")),
            ]
            for call in calls:
                err = await unavailable(call)
                assert err.message.startswith("the controller could not save the change"), err.message
                assert "busy" in err.message and "try again" in err.message
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        got = (await env.stub.GetService(api.GetServiceRequest(service_name="first"))).service
        assert got.latest_version == 1  # nothing was changed
        await env.stub.CreateService(api.CreateServiceRequest(yaml=spec(name="second")))
    assert "database is locked" in caplog.text  # the detail is for the operator

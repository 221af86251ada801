"""Fixtures every suite shares: the store backends, and short event batches for in-process controllers.

`store_url` runs a test once per store backend: "" (the default SQLite file in the state
directory) and a fresh database on a throwaway PostgreSQL server (tests/helpers/postgres.py),
started once per session. Without PostgreSQL the PostgreSQL runs are skipped, saying why; in CI
(CI=true) they fail instead, so a CI machine that lost its PostgreSQL cannot pass unnoticed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from services.controller import event_log
from tests.helpers import postgres


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[postgres.Server]:
    """A PostgreSQL server for the whole session."""
    reason = postgres.unavailable()
    if reason:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"PostgreSQL is required in CI: {reason}")
        pytest.skip(f"no PostgreSQL here: {reason}")
    with postgres.running() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The controller's store_url setting, once per backend ("" is SQLite in state_dir)."""
    if request.param == "sqlite":
        yield ""
        return
    server: postgres.Server = request.getfixturevalue("postgres_server")
    url = server.database()
    yield url
    server.drop(url)


@pytest.fixture(autouse=True)
def _short_event_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process controllers gather events for 0.01 s, not 0.2 s, before writing them.

    Tests that restart a controller read the events it stored. No test checks the window;
    `raising=False` keeps the suite working if the name changes.
    """
    monkeypatch.setattr(event_log, "_BATCH_S", 0.01, raising=False)

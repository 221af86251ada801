"""Fixtures for end-to-end tests: the three real services and real replica processes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.helpers import cluster as cl


@pytest.fixture
async def cluster(tmp_path) -> AsyncIterator[cl.Cluster]:
    c = cl.Cluster(str(tmp_path))
    try:
        yield c
    finally:
        await c.close()

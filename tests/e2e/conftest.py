"""Fixtures for end-to-end tests: the three real services and real replica processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.helpers import cluster as cl


@pytest.fixture(scope="module")
def cluster_settings() -> dict[str, Any]:
    """Keyword arguments of the module's shared cluster (cl.Cluster's); a module overrides it."""
    return {}


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory, cluster_settings: dict[str, Any]) -> Iterator[cl.Shared]:
    """One cluster for the module's tests, started by the first that asks for it."""
    shared = cl.Shared(lambda: cl.Cluster(str(tmp_path_factory.mktemp("cluster")), connect=False, **cluster_settings))
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture
async def cluster(shared_cluster: cl.Shared) -> AsyncIterator[cl.Cluster]:
    """The module's cluster, with no service in it, a tag of this test's own and a channel.

    A test that needs a cluster nobody used before (other settings, a count of every process of
    the cluster) starts its own `cl.Cluster`."""
    async with shared_cluster.lend() as c:
        yield c

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


@pytest.fixture(scope="session")
def default_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cl.Shared]:
    """The cluster with default settings, shared by every module that keeps them."""
    shared = cl.Shared(lambda: cl.Cluster(str(tmp_path_factory.mktemp("cluster")), connect=False))
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture(scope="module")
def shared_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, cluster_settings: dict[str, Any]
) -> Iterator[cl.Shared]:
    """The cluster the module's tests share: the session's default one, or with the module's
    own settings one of its own, started by the first test that asks for it."""
    if not cluster_settings:
        yield request.getfixturevalue("default_cluster")
        return
    shared = cl.Shared(lambda: cl.Cluster(str(tmp_path_factory.mktemp("cluster")), connect=False, **cluster_settings))
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture
async def cluster(shared_cluster: cl.Shared) -> AsyncIterator[cl.Cluster]:
    """A shared cluster, with no service in it, a tag of this test's own and a channel.

    A test that needs a cluster nobody used before (other settings, a count of every process of
    the cluster) starts its own `cl.Cluster`."""
    async with shared_cluster.lend() as c:
        yield c

"""End to end: a pool on the kubernetes backend (the API emulator and its fake kubelet): workers
are Pods, READY when setup is done, jobs exec'd into them; the pool grows with its queue and
shrinks back to zero, as on the local backend."""

from __future__ import annotations

import pytest

from tests.e2e import test_pools as local_scenarios
from tests.e2e.test_kubernetes import emulator, kube_cluster, kube_shared, nodes
from tests.helpers import cluster as cl
from tests.helpers import kube_emulator

pytestmark = pytest.mark.e2e

__all__ = ["emulator", "kube_cluster", "kube_shared", "nodes"]  # the fixtures


async def test_a_pool_of_pods_grows_with_its_queue_runs_every_job_and_shrinks_to_zero(
    kube_cluster: cl.Cluster, emulator: kube_emulator.Emulator
) -> None:
    await local_scenarios.test_a_pool_grows_with_its_queue_runs_every_job_and_shrinks_to_zero(kube_cluster)
    assert await emulator.names("pod") == []

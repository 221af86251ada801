"""End to end with `--backend kubernetes`: the local backend's scenarios, replicas as Pods.

The provisioner process runs the kubernetes backend against the in-memory API emulator (a
kubeconfig on loopback), whose fake kubelet runs each Pod's command as a local process; the
controller and prober are the same as with the local backend.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.e2e import test_controller as local_scenarios
from tests.helpers import cluster as cl
from tests.helpers import kube_emulator

pytestmark = pytest.mark.e2e

READY = res.REPLICA_STATUS_READY


@pytest.fixture(scope="module")
def nodes(request: pytest.FixtureRequest) -> list[kube_emulator.Node] | None:
    """The emulator's nodes: its default node unless a test's parameter (indirect) says."""
    return getattr(request, "param", None)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory, nodes) -> Iterator[kube_emulator.Emulator]:
    emu = kube_emulator.Emulator(str(tmp_path_factory.mktemp("emu")), nodes=nodes).start()
    try:
        yield emu
    finally:
        emu.stop()


@pytest.fixture(scope="module")
def kube_shared(tmp_path_factory: pytest.TempPathFactory, emulator: kube_emulator.Emulator) -> Iterator[cl.Shared]:
    """One cluster on one emulator for the module's tests (per `nodes`); after each test its
    Pods are gone too."""
    tmp = tmp_path_factory.mktemp("kube")
    env = {
        "REPLICAPLANE_PROVISIONER_BACKEND": "kubernetes",
        "REPLICAPLANE_PROVISIONER_KUBERNETES_KUBECONFIG": emulator.kubeconfig(str(tmp / "kubeconfig")),
        "REPLICAPLANE_PROVISIONER_KUBERNETES_NAMESPACE": emulator.namespace,
        "REPLICAPLANE_PROVISIONER_KUBERNETES_INSTANCE": f"e2e-{uuid.uuid4().hex[:8]}",
        "REPLICAPLANE_PROVISIONER_KUBERNETES_PORT_ANNOTATION": kube_emulator.PORT_ANNOTATION,
        "REPLICAPLANE_PROVISIONER_KUBERNETES_WATCH_IDLE_S": "5",
        "REPLICAPLANE_PROVISIONER_KUBERNETES_ALTERNATIVE_TIMEOUT_S": "0.5",
    }

    async def no_pod() -> bool:
        return not await emulator.names("pod")

    shared = cl.Shared(lambda: cl.Cluster(str(tmp), provisioner_env=env, connect=False), settled=no_pod)
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture
async def kube_cluster(kube_shared: cl.Shared) -> AsyncIterator[cl.Cluster]:
    async with kube_shared.lend() as c:
        yield c


def _without_uid(names: list[str]) -> list[str]:
    """Pod names are replica names, `{service}-{id}-{uid}`: the service incarnation's uid cut."""
    return [name.rsplit("-", 1)[0] for name in names]


async def test_two_replicas_become_ready_and_answer(kube_cluster: cl.Cluster, emulator) -> None:
    await local_scenarios.test_two_replicas_become_ready_and_answer(kube_cluster)
    assert _without_uid(await emulator.names("pod")) == ["web-1", "web-2"]


async def test_app_exit_fails_without_relaunch_loop(kube_cluster: cl.Cluster) -> None:
    await local_scenarios.test_app_exit_fails_without_relaunch_loop(kube_cluster)


async def test_manual_terminate_of_ready_replica_is_replaced(kube_cluster: cl.Cluster, emulator) -> None:
    await local_scenarios.test_manual_terminate_of_ready_replica_is_replaced(kube_cluster)
    assert _without_uid(await emulator.names("pod")) == ["term-2"]


async def test_delete_removes_every_replica_process_and_pod(kube_cluster: cl.Cluster, emulator) -> None:
    await local_scenarios.test_delete_removes_every_replica_process(kube_cluster)
    assert await emulator.names("pod") == []


async def test_spot_pod_deleted_by_someone_else_is_preempted_and_replaced(kube_cluster: cl.Cluster, emulator) -> None:
    yaml_text = cl.app_yaml("spot", kube_cluster.tag).replace("  ports: 8080\n", "  ports: 8080\n  use_spot: true\n")
    await kube_cluster.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text))
    w = cl.Watch(kube_cluster.stub, "spot")
    await w.until(lambda w: w.count(READY) == 2)
    await emulator.call(emulator.kubelet.delete_pod(w.replicas[1].replica_name))
    await w.until(lambda w: 1 not in w.replicas and w.count(READY) == 2)
    assert res.REPLICA_STATUS_PREEMPTED in w.seen_statuses[1]
    assert sorted(w.replicas) == [2, 3]
    w.cancel()


@pytest.mark.parametrize("nodes", [[kube_emulator.gpu_node("h100-node", "H100", 1)]], indirect=True)
async def test_any_of_runs_on_the_alternative_that_fits_and_endpoints_name_its_accelerator(
    kube_cluster: cl.Cluster, emulator
) -> None:
    # No node has an A100: the replica runs on the H100, and its endpoint (what instance-aware
    # balancing weighs) says so.
    extra = "  any_of:\n    - accelerators: A100:1\n    - accelerators: H100:1\n"
    yaml_text = cl.app_yaml("anyof", kube_cluster.tag, replicas=1).replace("  ports: 8080\n", "  ports: 8080\n" + extra)
    await kube_cluster.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text))
    w = cl.Watch(kube_cluster.stub, "anyof")
    await w.until(lambda w: w.count(READY) == 1)
    assert w.replicas[1].accelerator == "H100"
    endpoints = kube_cluster.stub.WatchEndpoints(api.WatchEndpointsRequest(service_name="anyof"))
    first = await anext(aiter(endpoints))
    endpoints.cancel()
    assert [(e.replica_id, e.accelerator) for e in first.endpoints] == [(1, "H100")]
    w.cancel()
    pod = await emulator.pod(w.replicas[1].replica_name)
    assert pod is not None and pod["spec"]["nodeName"] == "h100-node"

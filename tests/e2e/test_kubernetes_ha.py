"""The base's two controllers (deploy/kubernetes/base: leader election on a PostgreSQL store) with
the Kubernetes backend against the emulator: the settings of the manifests, a service created
through the standby, the leader killed (-9, as a Pod lost with its node), the standby leading,
the same Pods serving, a delete through the new leader removing them.

Marked `drill` (a failover): `make drill` runs it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import clients
from tests.e2e.test_kubernetes_deploy import manifest_env
from tests.helpers import cluster as cl
from tests.helpers import ha, kube_emulator
from tests.helpers import postgres as pg_helper

pytestmark = pytest.mark.drill

READY = res.REPLICA_STATUS_READY


@pytest.fixture
def emulator(tmp_path) -> Iterator[kube_emulator.Emulator]:
    emu = kube_emulator.Emulator(str(tmp_path / "emu")).start()
    try:
        yield emu
    finally:
        emu.stop()


@pytest.fixture
def url(postgres_server: pg_helper.Server):
    made = postgres_server.database()
    yield made
    postgres_server.drop(made)


async def test_the_base_controllers_fail_over_on_kubernetes(emulator, url: str, tmp_path) -> None:
    controller_env = manifest_env("controller")
    assert controller_env["REPLICAPLANE_CONTROLLER_LEADER_ELECTION"] == "true"
    controller_env["REPLICAPLANE_CONTROLLER_STORE_URL"] = url  # the Secret's value, in the base
    c = cl.Cluster(
        str(tmp_path),
        provisioner_env={
            **manifest_env("provisioner"),
            "REPLICAPLANE_PROVISIONER_KUBERNETES_KUBECONFIG": emulator.kubeconfig(str(tmp_path / "kubeconfig")),
            "REPLICAPLANE_PROVISIONER_KUBERNETES_NAMESPACE": emulator.namespace,
            "REPLICAPLANE_PROVISIONER_KUBERNETES_PORT_ANNOTATION": kube_emulator.PORT_ANNOTATION,
            "REPLICAPLANE_PROVISIONER_KUBERNETES_INSTANCE": f"e2e-{uuid.uuid4().hex[:8]}",
        },
        controller_env=controller_env,
        prober_env=manifest_env("prober"),
    )
    standby = c.start_other_controller("ctl2")
    try:
        first = c.controller
        assert await ha.answers(first.addr) and not await ha.answers(standby.addr)
        target = clients.controller_target(f"{first.addr},{standby.addr}")
        async with grpc.aio.insecure_channel(standby.addr) as via_standby, grpc.aio.insecure_channel(target) as both:
            await api_grpc.ControllerServiceStub(via_standby).CreateService(
                api.CreateServiceRequest(yaml=cl.app_yaml("web", c.tag)), timeout=30
            )
            stub = api_grpc.ControllerServiceStub(both)
            w = cl.Watch(stub, "web")
            await w.until(lambda w: w.count(READY) == 2, timeout=60)
            w.cancel()
            pods = sorted(await emulator.names("pod"))
            assert len(pods) == 2

            killed = time.monotonic()
            first.kill()
            deadline = killed + 30
            while not await ha.answers(standby.addr):
                assert time.monotonic() < deadline, "the standby never led"
                await asyncio.sleep(0.1)
            lease_s = float(controller_env["REPLICAPLANE_CONTROLLER_LEASE_DURATION_S"])
            assert time.monotonic() - killed <= lease_s * 4 / 3 + 2

            w = cl.Watch(stub, "web")
            await w.until(lambda w: w.count(READY) == 2, timeout=60)
            w.cancel()
            assert sorted(await emulator.names("pod")) == pods  # the same Pods: nothing launched again

            await stub.DeleteService(api.DeleteServiceRequest(service_name="web"), timeout=30)
            async with asyncio.timeout(60):
                while await emulator.names("pod"):
                    await asyncio.sleep(0.1)
    finally:
        standby.stop()
        await c.close()

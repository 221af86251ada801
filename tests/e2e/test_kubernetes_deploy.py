"""The control plane as deploy/kubernetes runs it, end to end against the Kubernetes emulator.

The controller, the provisioner (kubernetes backend), a prober and the load balancer run as
processes with the settings of the manifests' ConfigMaps (read from deploy/kubernetes, so the
two cannot drift). Only what says where things are is replaced: listen addresses, peers'
addresses, state directories, and the cluster (the emulator's kubeconfig and namespace instead
of the in-cluster service account). Then a user's round trip: create a service, READY, a
request through the URL the balancer fleet gives it, `replicactl logs`, delete.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.helpers import balancer as lb
from tests.helpers import cluster as cl
from tests.helpers import kube_emulator, kube_manifests

pytestmark = pytest.mark.e2e

READY = res.REPLICA_STATUS_READY
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Where things are: the only settings of the manifests a run on one machine replaces.
LOCATION = {
    "controller": {"LISTEN_ADDR", "STATE_DIR", "PROVISIONER_ADDR", "PROBER_ADDRS"},
    "provisioner": {"LISTEN_ADDR", "STATE_DIR", "KUBERNETES_IN_CLUSTER", "KUBERNETES_NAMESPACE"},
    "prober": {"LISTEN_ADDR"},
    # The fleet's first port and its range go together: port 0 here, so the range follows it.
    "loadbalancer": {
        "LISTEN_ADDR",
        "HTTP_ADDR",
        "FLEET_PORT_MAX",
        "FLEET_PORTS_FILE",
        "CONTROLLER_ADDR",
        "ADVERTISE_HOST",
    },
}


def manifest_env(component: str) -> dict[str, str]:
    """The manifests' settings of `component` less the location ones, which must exist there."""
    env = kube_manifests.service_env(component)
    prefix = f"REPLICAPLANE_{component.upper()}_"
    for key in LOCATION[component]:
        assert prefix + key in env, f"the manifests no longer set {prefix + key}"
        del env[prefix + key]
    return env


@pytest.fixture
def emulator(tmp_path) -> Iterator[kube_emulator.Emulator]:
    emu = kube_emulator.Emulator(str(tmp_path / "emu")).start()
    try:
        yield emu
    finally:
        emu.stop()


@pytest.fixture
async def deployed(tmp_path, emulator: kube_emulator.Emulator) -> AsyncIterator[tuple[cl.Cluster, lb.Balancer]]:
    provisioner_env = {
        **manifest_env("provisioner"),
        "REPLICAPLANE_PROVISIONER_KUBERNETES_KUBECONFIG": emulator.kubeconfig(str(tmp_path / "kubeconfig")),
        "REPLICAPLANE_PROVISIONER_KUBERNETES_NAMESPACE": emulator.namespace,
        # The emulator's Pods share this machine's loopback: it publishes each serving port.
        "REPLICAPLANE_PROVISIONER_KUBERNETES_PORT_ANNOTATION": kube_emulator.PORT_ANNOTATION,
        "REPLICAPLANE_PROVISIONER_KUBERNETES_INSTANCE": f"e2e-{uuid.uuid4().hex[:8]}",
    }
    assert provisioner_env["REPLICAPLANE_PROVISIONER_BACKEND"] == "kubernetes"
    c = cl.Cluster(
        str(tmp_path),
        provisioner_env=provisioner_env,
        controller_env=manifest_env("controller"),
        prober_env=manifest_env("prober"),
    )
    balancer = None
    try:
        lb_env = manifest_env("loadbalancer")
        assert lb_env["REPLICAPLANE_LOADBALANCER_FLEET"] == "true"  # every service gets a URL
        extra = {
            k.removeprefix("REPLICAPLANE_LOADBALANCER_").lower(): v
            for k, v in lb_env.items()
            if k.startswith("REPLICAPLANE_LOADBALANCER_")
        }
        extra["fleet_ports_file"] = str(tmp_path / "lb" / "ports.json")
        balancer = await lb.start(c.controller.addr, "", str(tmp_path / "lb"), **extra)
        yield c, balancer
    finally:
        if balancer is not None:
            await balancer.close()
        await c.close()


async def test_the_deployed_settings_run_a_service_from_create_to_delete(deployed, emulator, tmp_path) -> None:
    c, balancer = deployed
    service = "hello"
    run = f'echo "{service} app starting"; exec {sys.executable} {cl.APP} --port 8080 --tag {c.tag}'
    await c.stub.CreateService(api.CreateServiceRequest(yaml=cl.app_yaml(service, c.tag, run=run)))
    w = cl.Watch(c.stub, service)
    await w.until(lambda w: w.count(READY) == 2, timeout=60)
    w.cancel()
    assert len(await emulator.names("pod")) == 2

    # A request through the balancer fleet the manifests configure, at the URL the controller shows.
    await balancer.until(lambda s: s.service_name == service and sum(r.ready for r in s.replicas) == 2)
    w = cl.Watch(c.stub, service)
    await w.until(lambda w: bool(w.service.load_balancer_url), timeout=30)
    w.cancel()
    url = w.service.load_balancer_url
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url + "/health", timeout=5).read())
    assert body.startswith(b"hello from replica ")

    # The replica's app log, from its Pod's log, through replicactl.
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "services.cli", "--controller", c.controller.addr, "logs", service, "1", "--no-follow"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "gen", "python")])},
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert f"{service} app starting" in out.stdout

    await c.stub.DeleteService(api.DeleteServiceRequest(service_name=service))
    async with asyncio.timeout(30):
        while await emulator.names("pod"):
            await asyncio.sleep(0.1)

"""The provisioner over gRPC with the kubernetes backend: what only this backend does.

Launch, events, teardown, app exit, preemption and adoption are the backend contract
(test_backend_contract.py); the API server's protocol and failures are in
test_provisioner_kubernetes_api.py. Here: the objects a replica is made of, spot and eviction
semantics, scheduling and image failures, Pods stuck terminating, other instances' Pods, and
settings. The fake kubelet (tests/helpers/kube_emulator.py) runs each Pod's command as a local
process, so replicas really serve; its chaos hooks play whoever else deletes or evicts Pods.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc
from services.provisioner import kube_objects, server
from tests.helpers import kube_emulator
from tests.helpers import kube_provisioner as kp
from tests.helpers import provisioner_client as client

L, T, R = client.L, client.T, client.R


@pytest.fixture
def emulator(tmp_path) -> Iterator[kube_emulator.Emulator]:
    emu = kube_emulator.Emulator(str(tmp_path / "emu")).start()
    try:
        yield emu
    finally:
        emu.stop()


@pytest.fixture
def instance() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def prov(tmp_path, emulator, instance) -> AsyncIterator[kp.Running]:
    running = await kp.start(kp.settings(str(tmp_path), emulator, instance, kubernetes_service_type="ClusterIP"))
    try:
        yield running
    finally:
        await running.stop()


async def _launch(stub: pb_grpc.ProvisionerServiceStub, request: pb.LaunchRequest) -> list:
    return await client.collect(stub.Launch(request))


async def _watch(stub: pb_grpc.ProvisionerServiceStub) -> grpc.aio.UnaryStreamCall:
    call = stub.WatchReplicas(pb.WatchReplicasRequest())
    await client.next_event(call, R.REPLICA_EVENT_TYPE_SNAPSHOT_END)
    return call


async def _until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


async def test_replica_runs_as_a_pod_with_service_and_secret_and_teardown_removes_them(prov, emulator) -> None:
    spec = client.spec(setup="echo preparing", envs={"MODE": "test"})
    spec.secrets["API_TOKEN"] = "s3cret-value"
    spec.resources.cpus = "0.5+"
    request = client.launch_request(1, spec_=spec)
    request.version = 3
    events = await _launch(prov.stub, request)
    assert client.types(events) == ["QUEUED", "PROVISIONING", "RUNNING"]
    running = events[-1]
    assert running.replica.backend == "kubernetes"
    body = json.loads(await client.wait_http(running.endpoint + "/health"))
    assert body["replica_id"] == "1"

    pod = await emulator.pod("svc-1")
    assert pod is not None
    labels = pod["metadata"]["labels"]
    assert labels[kube_objects.LABEL_SERVICE] == "svc"
    assert labels[kube_objects.LABEL_VERSION] == "3"
    assert labels[kube_objects.LABEL_REPLICA_ID] == "1"
    assert pod["metadata"]["annotations"][kube_objects.ANNOTATION_REPLICA] == "svc-1"
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["PORT"], env["REPLICA_ID"], env["SKYPILOT_SERVE_REPLICA_ID"], env["MODE"]) == ("8080", "1", "1", "test")
    assert container["resources"] == {"requests": {"cpu": "0.5"}}
    assert "s3cret-value" not in json.dumps(pod)  # the value lives in the Secret only
    assert await emulator.names("service") == ["svc-1"]
    assert await emulator.names("secret") == ["svc-1"]
    assert "svc-1" in emulator.kubelet.alive()
    # The backend never creates namespaces it was not told to.
    assert not [path for path, _ in emulator.logged("POST") if path.rstrip("/").endswith("/namespaces")]

    teardown = await client.collect(prov.stub.Terminate(pb.TerminateRequest(name="svc-1")))
    assert client.types(teardown) == ["TERMINATING", "TERMINATED"]
    for kind in ("pod", "service", "secret"):
        assert await emulator.names(kind) == []
    deletes = [q for path, q in emulator.logged("DELETE") if path.endswith("/pods/svc-1")]
    assert deletes and deletes[0].get("gracePeriodSeconds") == "1"  # kill_grace_s
    await _until(lambda: not emulator.kubelet.alive())


async def test_a_spot_pod_deleted_by_others_is_preempted(prov, emulator) -> None:
    # A non-spot replica's Pod deleted by others VANISHES: the backend contract.
    await _launch(prov.stub, client.launch_request(1, use_spot=True))
    watch = await _watch(prov.stub)
    await emulator.call(emulator.kubelet.delete_pod("svc-1"))
    preempted = await client.next_event(watch, R.REPLICA_EVENT_TYPE_PREEMPTED)
    watch.cancel()
    assert preempted.replica.name == "svc-1" and preempted.replica.is_spot
    assert "deleted by someone else" in preempted.message
    teardown = await client.collect(prov.stub.Terminate(pb.TerminateRequest(name="svc-1")))
    assert client.types(teardown)[-1] == "TERMINATED"


async def test_eviction_is_preemption_of_a_spot_replica(prov, emulator) -> None:
    await _launch(prov.stub, client.launch_request(1, use_spot=True))
    watch = await _watch(prov.stub)
    await emulator.call(emulator.kubelet.evict("svc-1"))
    event = await client.next_event(watch, R.REPLICA_EVENT_TYPE_PREEMPTED)
    assert event.replica.name == "svc-1"
    assert "evicted" in event.message
    watch.cancel()
    assert "svc-1" not in emulator.kubelet.alive()


async def test_unschedulable_and_image_pull_failures_are_launch_failure_reasons(prov) -> None:
    gpu = client.spec()
    gpu.resources.accelerators = "A100:1"
    events = await _launch(prov.stub, client.launch_request(1, spec_=gpu))
    failed = [e for e in events if e.type == L.LAUNCH_EVENT_TYPE_ATTEMPT_FAILED]
    assert len(failed) == 3  # retried per the launch policy
    assert "could not be scheduled within 0.3 s" in events[-1].message
    assert "didn't match Pod's node affinity/selector" in events[-1].message  # no node has that accelerator
    assert events[-1].capacity_unavailable

    pulled = client.spec()
    pulled.resources.image_id = f"docker:{kube_emulator.BAD_IMAGE_PREFIX}nope:1"
    events = await _launch(prov.stub, client.launch_request(2, spec_=pulled))
    assert client.types(events)[-1] == "FAILED"
    assert f"image {kube_emulator.BAD_IMAGE_PREFIX}nope:1 could not be pulled" in events[-1].message

    fractional = client.spec()
    fractional.resources.accelerators = "A100:0.5"
    events = await _launch(prov.stub, client.launch_request(3, spec_=fractional))
    assert client.types(events) == ["QUEUED", "PROVISIONING", "ATTEMPT_FAILED", "FAILED"]
    assert events[-1].permanent


async def test_pod_stuck_terminating_fails_teardown_and_is_reported(prov, emulator) -> None:
    await _launch(prov.stub, client.launch_request(1))
    await emulator.call(emulator.kubelet.hold("svc-1"))
    teardown = await client.collect(prov.stub.Terminate(pb.TerminateRequest(name="svc-1")))
    assert client.types(teardown) == ["TERMINATING", "RETRYING", "RETRYING", "FAILED"]
    assert "stuck terminating" in teardown[-1].message
    assert kube_emulator.HOLD_FINALIZER in teardown[-1].message
    replica = (await prov.stub.GetReplica(pb.GetReplicaRequest(name="svc-1"))).replica
    assert "stuck terminating" in replica.failure_reason  # not forgotten
    await emulator.call(emulator.kubelet.release("svc-1"))
    teardown = await client.collect(prov.stub.Terminate(pb.TerminateRequest(name="svc-1")))
    assert client.types(teardown)[-1] == "TERMINATED"


async def test_pods_of_another_instance_are_never_adopted_or_touched(tmp_path, emulator, instance) -> None:
    # Adoption after a restart is the backend contract; here: another provisioner's Pods in the
    # same namespace (another instance label). One of the same name as ours is in the API tests.
    (tmp_path / "other").mkdir()
    other = await kp.start(kp.settings(str(tmp_path / "other"), emulator, "someone-else"))
    try:
        await _launch(other.stub, client.launch_request(1, service="theirs"))
        await _launch(other.stub, client.launch_request(2))
    finally:
        await other.stop()
    ours = await kp.start(kp.settings(str(tmp_path), emulator, instance))
    try:
        assert not (await ours.stub.ListReplicas(pb.ListReplicasRequest())).replicas
        assert await emulator.names("pod") == ["svc-2", "theirs-1"]
        events = await _launch(ours.stub, client.launch_request(1))
        assert client.types(events)[-1] == "RUNNING"
        await client.collect(ours.stub.Terminate(pb.TerminateRequest(name="svc-1")))
        assert await emulator.names("pod") == ["svc-2", "theirs-1"]  # never touched
        assert sorted(emulator.kubelet.alive()) == ["svc-2", "theirs-1"]
    finally:
        await ours.stop()


async def test_bad_kubernetes_settings_are_reported_by_field(tmp_path, emulator, instance) -> None:
    settings = kp.settings(
        str(tmp_path),
        emulator,
        instance,
        kubernetes_namespace="Not_A_Namespace",
        kubernetes_spot_tolerations="gpu=yes:Sometimes",
        kubernetes_service_type="Headless",
    )
    with pytest.raises(Exception) as caught:
        await server.build_server(settings)
    fields = {v.field for v in caught.value.violations}  # type: ignore[attr-defined]
    assert fields == {
        "provisioner.kubernetes_namespace",
        "provisioner.kubernetes_spot_tolerations",
        "provisioner.kubernetes_service_type",
    }


async def test_node_port_endpoints_are_the_node_and_its_node_port(tmp_path, emulator, instance) -> None:
    values = kp.settings(
        str(tmp_path), emulator, instance, kubernetes_service_type="NodePort", kubernetes_endpoint="node_port"
    )
    running = await kp.start(values)
    try:
        events = await _launch(running.stub, client.launch_request(1))
        assert client.types(events)[-1] == "RUNNING"
        service = await asyncio.to_thread(emulator.run, emulator.api.get, "services", emulator.namespace, "svc-1")
        (port,) = service["spec"]["ports"]
        assert 30000 <= port["nodePort"] <= 32767
        pod = await emulator.pod("svc-1")
        assert events[-1].endpoint == f"http://{pod['status']['hostIP']}:{port['nodePort']}"
    finally:
        await running.stop()
    # A fixed node address (a DNS name for the nodes, an external load balancer in front of them).
    values = dataclasses.replace(values, kubernetes_node_address="nodes.example.test")
    running = await kp.start(values)
    try:
        events = await _launch(running.stub, client.launch_request(2))
        service = await asyncio.to_thread(emulator.run, emulator.api.get, "services", emulator.namespace, "svc-2")
        assert events[-1].endpoint == f"http://nodes.example.test:{service['spec']['ports'][0]['nodePort']}"
        for name in ("svc-1", "svc-2"):
            await client.collect(running.stub.Terminate(pb.TerminateRequest(name=name)))
    finally:
        await running.stop()


async def test_load_balancer_endpoints_wait_for_the_ingress_address(tmp_path, emulator, instance) -> None:
    emulator.run(setattr, emulator.api, "load_balancer_delay_s", 0.5)  # a cloud takes a while
    values = kp.settings(
        str(tmp_path), emulator, instance, kubernetes_service_type="LoadBalancer", kubernetes_endpoint="load_balancer"
    )
    running = await kp.start(values)
    try:
        events = await _launch(running.stub, client.launch_request(1))
        assert client.types(events)[-1] == "RUNNING"
        service = await asyncio.to_thread(emulator.run, emulator.api.get, "services", emulator.namespace, "svc-1")
        (ingress,) = service["status"]["loadBalancer"]["ingress"]
        assert events[-1].endpoint == f"http://{ingress['ip']}:8080"
        await running.stop()
        running = await kp.start(values)
        replica = (await running.stub.GetReplica(pb.GetReplicaRequest(name="svc-1"))).replica
        assert replica.endpoint == events[-1].endpoint  # re-found after a restart
        await client.collect(running.stub.Terminate(pb.TerminateRequest(name="svc-1")))
    finally:
        await running.stop()


async def test_external_endpoints_need_a_service_type_that_has_them(tmp_path, emulator, instance) -> None:
    for endpoint, service_type in [("node_port", "ClusterIP"), ("load_balancer", "NodePort"), ("node_port", "")]:
        settings = kp.settings(
            str(tmp_path), emulator, instance, kubernetes_service_type=service_type, kubernetes_endpoint=endpoint
        )
        with pytest.raises(Exception) as caught:
            await server.build_server(settings)
        assert {v.field for v in caught.value.violations} == {"provisioner.kubernetes_endpoint"}  # type: ignore[attr-defined]

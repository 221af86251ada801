"""The provisioner over gRPC with the kubernetes backend, against the in-memory API emulator.

The fake kubelet (tests/helpers/kube_emulator.py) runs each Pod's command as a local process,
so replicas really serve; the chaos hooks play whoever else deletes or evicts Pods.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc
from replicaplane.provisioner.v1 import resources_pb2
from services.provisioner import kube_objects, server
from tests.helpers import kube_emulator
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


def _settings(tmp_path, emulator: kube_emulator.Emulator, instance: str, **overrides: object) -> server.Settings:
    values: dict[str, object] = {
        "listen_addr": "127.0.0.1:0",
        "state_dir": str(tmp_path / "state"),
        "backend": "kubernetes",
        "kubernetes_kubeconfig": emulator.kubeconfig(str(tmp_path / "kubeconfig")),
        "kubernetes_namespace": emulator.namespace,
        "kubernetes_instance": instance,
        "kubernetes_port_annotation": kube_emulator.PORT_ANNOTATION,
        "kubernetes_schedule_timeout_s": 0.3,
        "kubernetes_delete_timeout_s": 0.5,
        "kubernetes_watch_timeout_s": 1,
        "kubernetes_watch_idle_s": 1,
        "launch_backoff_initial_s": 0.05,
        "launch_backoff_max_s": 0.1,
        "teardown_backoff_initial_s": 0.05,
        "teardown_backoff_max_s": 0.1,
        "kill_grace_s": 1.0,
    }
    values.update(overrides)
    return server.Settings(**values)  # type: ignore[arg-type]


class _Running:
    """A started provisioner server and a stub to it."""

    def __init__(self, srv: server.Server, channel: grpc.aio.Channel) -> None:
        self.server = srv
        self.channel = channel
        self.stub = pb_grpc.ProvisionerServiceStub(channel)

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(None)


async def _start(settings: server.Settings) -> _Running:
    srv = await server.build_server(settings)
    await srv.start()
    return _Running(srv, grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}"))


@pytest.fixture
async def prov(tmp_path, emulator, instance) -> AsyncIterator[_Running]:
    running = await _start(_settings(tmp_path, emulator, instance, kubernetes_service_type="ClusterIP"))
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


async def test_failing_setup_is_retried_then_fails_with_its_exit_code(prov) -> None:
    request = client.launch_request(1, spec_=client.spec("true", setup="echo preparing; exit 7"))
    events = await _launch(prov.stub, request)
    assert client.types(events) == [
        "QUEUED",
        "PROVISIONING",
        "ATTEMPT_FAILED",
        "RETRYING",
        "PROVISIONING",
        "ATTEMPT_FAILED",
        "RETRYING",
        "PROVISIONING",
        "ATTEMPT_FAILED",
        "FAILED",
    ]
    assert events[-1].message == "setup exited with code 7"
    assert not events[-1].permanent


async def test_app_exit_is_reported_with_its_code(prov) -> None:
    watch = await _watch(prov.stub)
    events = await _launch(prov.stub, client.launch_request(1, spec_=client.spec("sleep 0.3; exit 3")))
    assert client.types(events)[-1] == "RUNNING"
    exited = await client.next_event(watch, R.REPLICA_EVENT_TYPE_APP_EXITED)
    assert (exited.replica.name, exited.replica.exit_code) == ("svc-1", 3)
    assert exited.message == "app exited with code 3"
    watch.cancel()


async def test_deletion_by_others_is_preemption_for_spot_and_vanishing_otherwise(prov, emulator) -> None:
    await _launch(prov.stub, client.launch_request(1, use_spot=True))
    await _launch(prov.stub, client.launch_request(2))
    watch = await _watch(prov.stub)
    await emulator.call(emulator.kubelet.delete_pod("svc-1"))
    preempted = await client.next_event(watch, R.REPLICA_EVENT_TYPE_PREEMPTED)
    assert preempted.replica.name == "svc-1" and preempted.replica.is_spot
    assert "deleted by someone else" in preempted.message
    await emulator.call(emulator.kubelet.delete_pod("svc-2"))
    vanished = await client.next_event(watch, R.REPLICA_EVENT_TYPE_VANISHED)
    assert vanished.replica.name == "svc-2"
    watch.cancel()
    # A replica whose Pod is gone still tears down cleanly.
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


async def test_watch_survives_idle_timeouts(prov, emulator) -> None:
    await _launch(prov.stub, client.launch_request(1, use_spot=True))
    watch = await _watch(prov.stub)
    before = len([q for _, q in emulator.logged("GET") if q.get("watch") == "true"])
    await asyncio.sleep(2.5)  # more than two idle periods of 1 s: the watch is re-opened
    after = len([q for _, q in emulator.logged("GET") if q.get("watch") == "true"])
    assert after >= before + 2
    await emulator.call(emulator.kubelet.delete_pod("svc-1"))
    event = await client.next_event(watch, R.REPLICA_EVENT_TYPE_PREEMPTED)
    assert event.replica.name == "svc-1"
    watch.cancel()


async def test_restart_readopts_pods_reports_what_ended_and_leaves_foreign_pods(tmp_path, emulator, instance) -> None:
    settings = _settings(tmp_path, emulator, instance)
    first = await _start(settings)
    try:
        await _launch(first.stub, client.launch_request(1))
        events = await _launch(first.stub, client.launch_request(2))
        endpoint_2 = events[-1].endpoint
        await _launch(first.stub, client.launch_request(3, spec_=client.spec("sleep 1; exit 4")))
    finally:
        await first.stop()
    # Another provisioner's Pod in the same namespace; while we are down, one of our Pods is
    # deleted and another one's app exits.
    (tmp_path / "other").mkdir()
    other = await _start(_settings(tmp_path / "other", emulator, "someone-else"))
    try:
        await _launch(other.stub, client.launch_request(1, service="theirs"))
    finally:
        await other.stop()
    await emulator.call(emulator.kubelet.delete_pod("svc-1"))
    pod_3 = await emulator.pod("svc-3")
    async with asyncio.timeout(10):
        while (pod_3 or {}).get("status", {}).get("phase") != "Failed":
            await asyncio.sleep(0.05)
            pod_3 = await emulator.pod("svc-3")

    second = await _start(settings)
    try:

        async def app_state(name: str) -> int:
            return (await second.stub.GetReplica(pb.GetReplicaRequest(name=name))).replica.app_state

        async with asyncio.timeout(10):
            while await app_state("svc-3") != resources_pb2.APP_STATE_EXITED:
                await asyncio.sleep(0.05)
        assert (await second.stub.GetReplica(pb.GetReplicaRequest(name="svc-3"))).replica.exit_code == 4
        assert await app_state("svc-1") == resources_pb2.APP_STATE_VANISHED
        replica = (await second.stub.GetReplica(pb.GetReplicaRequest(name="svc-2"))).replica
        assert replica.state == resources_pb2.REPLICA_STATE_RUNNING
        assert replica.app_state == resources_pb2.APP_STATE_RUNNING
        assert replica.endpoint == endpoint_2
        assert json.loads(await client.wait_http(endpoint_2 + "/health"))["replica_id"] == "2"
        assert await emulator.names("pod") == ["svc-2", "svc-3", "theirs-1"]
        for name in ("svc-1", "svc-2", "svc-3"):
            await client.collect(second.stub.Terminate(pb.TerminateRequest(name=name)))
        assert await emulator.names("pod") == ["theirs-1"]  # never touched
    finally:
        await second.stop()


async def test_bad_kubernetes_settings_are_reported_by_field(tmp_path, emulator, instance) -> None:
    settings = _settings(
        tmp_path,
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

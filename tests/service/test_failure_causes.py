"""Failure causes over gRPC, local and kubernetes backends: the user's fault vs the infrastructure's."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc
from replicaplane.provisioner.v1 import resources_pb2
from services.provisioner import procs, server
from tests.helpers import kube_emulator, provisioner_procs
from tests.helpers import kube_provisioner as kp
from tests.helpers import provisioner_client as client

L, R = client.L, client.R
USER = resources_pb2.FAILURE_CAUSE_USER
INFRA = resources_pb2.FAILURE_CAUSE_INFRASTRUCTURE
UNSPECIFIED = resources_pb2.FAILURE_CAUSE_UNSPECIFIED


def _settings(state_dir: str) -> server.Settings:
    return server.Settings(
        listen_addr="127.0.0.1:0",
        state_dir=state_dir,
        launch_backoff_initial_s=0.05,
        launch_backoff_max_s=0.1,
        teardown_backoff_initial_s=0.05,
        teardown_backoff_max_s=0.1,
        kill_grace_s=1.0,
    )


class Provisioner:
    """A provisioner server on the local backend that a test can restart."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.srv: server.Server | None = None
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.ProvisionerServiceStub

    async def start(self) -> None:
        self.srv = await server.build_server(_settings(self.state_dir))
        await self.srv.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.srv.port}")
        self.stub = pb_grpc.ProvisionerServiceStub(self.channel)

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.srv is not None:
            await self.srv.stop(None)
        self.srv = self.channel = None


@pytest.fixture
async def prov(tmp_path) -> AsyncIterator[Provisioner]:
    p = Provisioner(str(tmp_path / "state"))
    await p.start()
    try:
        yield p
    finally:
        await p.stop()
        provisioner_procs.kill_replicas(p.state_dir)


def _failures(events: list) -> list:
    return [e for e in events if e.type in (L.LAUNCH_EVENT_TYPE_ATTEMPT_FAILED, L.LAUNCH_EVENT_TYPE_FAILED)]


async def test_a_setup_that_exits_1_fails_the_launch_by_the_users_fault(prov: Provisioner) -> None:
    request = client.launch_request(1, spec_=client.spec("true", setup="exit 1"))
    events = await client.collect(prov.stub.Launch(request))
    assert events[-1].type == L.LAUNCH_EVENT_TYPE_FAILED
    assert events[-1].message == "setup exited with code 1"
    assert [e.cause for e in _failures(events)] == [USER] * 4  # three attempts, then the end
    assert {e.cause for e in events if e not in _failures(events)} == {UNSPECIFIED}


async def test_a_bad_command_and_a_missing_workdir_are_the_users(prov: Provisioner, tmp_path) -> None:
    bad = client.launch_request(1, spec_=client.spec("true", setup="no-such-command-here"))
    events = await client.collect(prov.stub.Launch(bad))
    assert events[-1].cause == USER and events[-1].message == "setup exited with code 127"
    missing = client.launch_request(2, spec_=client.spec("true", workdir=str(tmp_path / "nowhere")))
    events = await client.collect(prov.stub.Launch(missing))
    assert events[-1].type == L.LAUNCH_EVENT_TYPE_FAILED
    assert events[-1].cause == USER and events[-1].permanent


async def test_a_zone_without_capacity_fails_the_launch_by_the_infrastructures_fault(prov: Provisioner) -> None:
    await prov.stub.SetZoneAvailability(pb.SetZoneAvailabilityRequest(zone="zone-a", refuse_for=client.duration(60)))
    events = await client.collect(prov.stub.Launch(client.launch_request(1, zone="zone-a", use_spot=True)))
    assert client.types(events) == ["QUEUED", "PROVISIONING", "ATTEMPT_FAILED", "FAILED"]
    assert [e.cause for e in _failures(events)] == [INFRA, INFRA]
    assert events[-1].capacity_unavailable and not events[-1].permanent


async def test_a_provisioner_restart_mid_launch_is_an_infrastructure_failure_then_the_launch_goes_on(
    prov: Provisioner,
) -> None:
    request = client.launch_request(1, spec_=client.spec("sleep 30", setup="sleep 2"))
    call = prov.stub.Launch(request)
    seen = []
    async for message in call:
        seen.append(message.event)
        if message.event.type == L.LAUNCH_EVENT_TYPE_PROVISIONING:
            break
    call.cancel()
    await prov.stop()  # the setup of attempt 1 is lost with the provisioner
    await prov.start()
    events = await client.collect(prov.stub.Launch(pb.LaunchRequest(name="svc-1", attach_only=True)))
    interrupted = [e for e in events if e.type == L.LAUNCH_EVENT_TYPE_ATTEMPT_FAILED]
    assert [(e.attempt, e.cause) for e in interrupted] == [(1, INFRA)]
    assert interrupted[0].message == "attempt 1 was interrupted by a provisioner restart"
    assert events[-1].type == L.LAUNCH_EVENT_TYPE_RUNNING


async def test_app_ends_on_the_watch_say_whose_fault_they_were(prov: Provisioner) -> None:
    watch = prov.stub.WatchReplicas(pb.WatchReplicasRequest())
    await client.next_event(watch, R.REPLICA_EVENT_TYPE_SNAPSHOT_END)
    await client.collect(prov.stub.Launch(client.launch_request(1, spec_=client.spec("sleep 0.2; exit 3"))))
    exited = await client.next_event(watch, R.REPLICA_EVENT_TYPE_APP_EXITED)
    assert (exited.replica.exit_code, exited.cause) == (3, USER)

    await client.collect(prov.stub.Launch(client.launch_request(2, spec_=client.spec("sleep 30"))))
    pgids = {procs.read_stat(p).pgid for p in provisioner_procs.replica_pids(prov.state_dir)}
    os.killpg(pgids.pop(), signal.SIGKILL)  # from outside: an OOM killer, a stray `kill`
    vanished = await client.next_event(watch, R.REPLICA_EVENT_TYPE_VANISHED)
    assert (vanished.replica.name, vanished.cause) == ("svc-2", INFRA)

    await client.collect(prov.stub.Launch(client.launch_request(3, spec_=client.spec("sleep 30"))))
    await prov.stub.PreemptReplica(pb.PreemptReplicaRequest(name="svc-3"))
    preempted = await client.next_event(watch, R.REPLICA_EVENT_TYPE_PREEMPTED)
    assert (preempted.replica.name, preempted.cause) == ("svc-3", INFRA)
    watch.cancel()


# ---- the kubernetes backend, against the test API server ------------------------------------


@pytest.fixture
def emulator(tmp_path) -> Iterator[kube_emulator.Emulator]:
    emu = kube_emulator.Emulator(str(tmp_path / "emu")).start()
    try:
        yield emu
    finally:
        emu.stop()


@pytest.fixture
async def kube(tmp_path, emulator) -> AsyncIterator[kp.Running]:
    running = await kp.start(kp.settings(str(tmp_path), emulator, f"t-{uuid.uuid4().hex[:8]}"))
    try:
        yield running
    finally:
        await running.stop()


async def test_a_503_from_the_api_server_is_the_infrastructures_fault_never_permanent(kube, emulator) -> None:
    emulator.run(emulator.api.fail, "create", "pods", 503, times=10_000, message="etcdserver: request timed out")
    events = await client.collect(kube.stub.Launch(client.launch_request(1)))
    assert events[-1].type == L.LAUNCH_EVENT_TYPE_FAILED and not events[-1].permanent
    assert [e.cause for e in _failures(events)] == [INFRA] * 4  # three attempts, then the end
    assert "503 ServiceUnavailable" in events[-1].message


async def test_kubernetes_user_failures_are_the_users(kube, emulator) -> None:
    broken = client.spec(setup="exit 1")
    events = await client.collect(kube.stub.Launch(client.launch_request(1, spec_=broken)))
    assert (events[-1].message, events[-1].cause) == ("setup exited with code 1", USER)

    missing = client.spec()
    missing.resources.image_id = f"docker:{kube_emulator.BAD_IMAGE_PREFIX}nope:1"
    events = await client.collect(kube.stub.Launch(client.launch_request(2, spec_=missing)))
    assert "could not be pulled" in events[-1].message and events[-1].cause == USER

    emulator.run(emulator.api.fail, "create", "pods", 422, times=1, message='Pod "svc-3" is invalid')
    events = await client.collect(kube.stub.Launch(client.launch_request(3)))
    assert client.types(events) == ["QUEUED", "PROVISIONING", "ATTEMPT_FAILED", "FAILED"]
    assert events[-1].cause == USER and events[-1].permanent


async def test_kubernetes_app_ends_say_whose_fault_they_were(kube, emulator) -> None:
    watch = kube.stub.WatchReplicas(pb.WatchReplicasRequest())
    await client.next_event(watch, R.REPLICA_EVENT_TYPE_SNAPSHOT_END)
    await client.collect(kube.stub.Launch(client.launch_request(1, spec_=client.spec("sleep 0.3; exit 3"))))
    exited = await client.next_event(watch, R.REPLICA_EVENT_TYPE_APP_EXITED)
    assert (exited.replica.exit_code, exited.cause) == (3, USER)
    await client.collect(kube.stub.Launch(client.launch_request(2)))
    await emulator.call(emulator.kubelet.delete_pod("svc-2"))
    vanished = await client.next_event(watch, R.REPLICA_EVENT_TYPE_VANISHED)
    assert (vanished.replica.name, vanished.cause) == ("svc-2", INFRA)
    await client.collect(kube.stub.Launch(client.launch_request(3, use_spot=True)))
    await emulator.call(emulator.kubelet.evict("svc-3"))
    preempted = await client.next_event(watch, R.REPLICA_EVENT_TYPE_PREEMPTED)
    assert (preempted.replica.name, preempted.cause) == ("svc-3", INFRA)
    watch.cancel()

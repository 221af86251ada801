"""A restarted provisioner process re-finds its replicas and never leaves one orphaned."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import grpc

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc
from replicaplane.provisioner.v1 import resources_pb2
from services.provisioner import local, procs
from tests.helpers import procs as service_procs
from tests.helpers import provisioner_client as client
from tests.helpers import provisioner_procs

R = client.R


def _env(state_dir: str) -> dict[str, str]:
    return {
        "REPLICAPLANE_PROVISIONER_STATE_DIR": state_dir,
        "REPLICAPLANE_PROVISIONER_LAUNCH_BACKOFF_INITIAL_S": "0.05",
        "REPLICAPLANE_PROVISIONER_LAUNCH_BACKOFF_MAX_S": "0.1",
        "REPLICAPLANE_PROVISIONER_KILL_GRACE_S": "1",
        "REPLICAPLANE_LOG_LEVEL": "WARNING",
    }


def _handle(state_dir: str, name: str) -> dict:
    """What the local backend persisted about replica `name` ({} until it exists)."""
    try:
        with open(os.path.join(state_dir, "local", name, "handle.json"), encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return {}


def _spawn_stray(state_dir: str) -> subprocess.Popen[bytes]:
    """A process with this provisioner's owner marker and a token no record knows."""
    return subprocess.Popen(
        ["sleep", "30"],
        env={**os.environ, local.OWNER_ENV: provisioner_procs.owner(state_dir), local.TOKEN_ENV: "unknown"},
        start_new_session=True,
    )


async def _until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


async def _snapshot(stub: pb_grpc.ProvisionerServiceStub, after: int) -> dict[str, resources_pb2.ProvisionedReplica]:
    call = stub.WatchReplicas(pb.WatchReplicasRequest(after_sequence=after))
    replicas = {}
    async with asyncio.timeout(10):
        while True:
            message = await call.read()
            event = message.event
            if event.type == R.REPLICA_EVENT_TYPE_SNAPSHOT_END:
                break
            assert event.type == R.REPLICA_EVENT_TYPE_SNAPSHOT
            replicas[event.replica.name] = event.replica
    call.cancel()
    return replicas


async def test_restart_refinds_running_replicas_reports_the_gone_and_leaks_nothing(tmp_path) -> None:
    state_dir = str(tmp_path / "state")
    svc = service_procs.start_service("provisioner", env=_env(state_dir), workdir=str(tmp_path))
    stray: subprocess.Popen[bytes] | None = None
    try:
        async with grpc.aio.insecure_channel(svc.addr) as channel:
            stub = pb_grpc.ProvisionerServiceStub(channel)
            launches = [
                client.launch_request(1),
                client.launch_request(2, spec_=client.spec("sleep 30")),
                client.launch_request(3, spec_=client.spec("sleep 0.3; exit 4")),
            ]
            results = await asyncio.gather(*(client.collect(stub.Launch(r)) for r in launches))
            assert all(client.types(events)[-1] == "RUNNING" for events in results)
            endpoint = results[0][-1].endpoint
            await client.wait_http(endpoint)
            before = await _snapshot(stub, 0)
            assert set(before) == {"svc-1", "svc-2", "svc-3"}
            # A launch in flight when the provisioner dies hard.
            stub.Launch(client.launch_request(4, spec_=client.spec(setup="sleep 30")))
            await _until(lambda: _handle(state_dir, "svc-4").get("setup_pgid"))
            old_setup = _handle(state_dir, "svc-4")["setup_pgid"]
            assert procs.group_alive(old_setup)

        svc.kill()  # SIGKILL: no graceful anything
        old_pids = set(provisioner_procs.replica_pids(state_dir))
        assert old_pids, "replicas must outlive the provisioner"
        await client.wait_http(endpoint)  # still serving with no provisioner at all
        os.killpg(_handle(state_dir, "svc-2")["pgid"], signal.SIGKILL)  # dies while nobody watches
        await asyncio.sleep(0.5)  # svc-3 exits with code 4 meanwhile
        # A process claiming to be ours that no record knows must not survive the restart.
        stray = _spawn_stray(state_dir)

        svc = service_procs.start_service("provisioner", env=_env(state_dir), workdir=str(tmp_path))
        async with grpc.aio.insecure_channel(svc.addr) as channel:
            stub = pb_grpc.ProvisionerServiceStub(channel)
            after = await _snapshot(stub, 12345)  # a resume point from the old incarnation: snapshot
            assert after["svc-1"].app_state == resources_pb2.APP_STATE_RUNNING
            assert after["svc-1"].endpoint == endpoint
            assert after["svc-2"].app_state == resources_pb2.APP_STATE_VANISHED
            assert after["svc-3"].app_state == resources_pb2.APP_STATE_EXITED
            assert after["svc-3"].exit_code == 4
            await client.wait_http(endpoint)
            replay = await client.collect(stub.Launch(client.launch_request(1, attach_only=True)))
            assert client.types(replay)[-1] == "RUNNING" and replay[-1].endpoint == endpoint
            stray.wait(timeout=5)  # killed by the restarted provisioner

            # The interrupted launch starts again: its old setup was killed, a new one runs.
            await _until(lambda: not procs.group_alive(old_setup))
            await _until(lambda: _handle(state_dir, "svc-4").get("setup_pgid", old_setup) != old_setup)
            assert (await stub.GetReplica(pb.GetReplicaRequest(name="svc-4"))).replica.state == (
                resources_pb2.REPLICA_STATE_PROVISIONING
            )

            # Exits of re-found replicas (not children any more) are still pushed.
            watch = stub.WatchReplicas(pb.WatchReplicasRequest())
            await client.next_event(watch, R.REPLICA_EVENT_TYPE_SNAPSHOT_END)
            wrapper = _handle(state_dir, "svc-1")["pgid"]
            (app,) = [
                p
                for p in provisioner_procs.replica_pids(state_dir)
                if p != wrapper and procs.read_stat(p).pgid == wrapper
            ]
            os.kill(app, signal.SIGKILL)  # the app only; its wrapper records 137
            exited = await client.next_event(watch, R.REPLICA_EVENT_TYPE_APP_EXITED)
            assert (exited.replica.name, exited.replica.exit_code) == ("svc-1", 137)
            watch.cancel()

            for name in ("svc-1", "svc-2", "svc-3", "svc-4"):
                events = await client.collect(stub.Terminate(pb.TerminateRequest(name=name)))
                assert client.types(events)[-1] == "TERMINATED"
            assert provisioner_procs.wait_no_replicas(state_dir) == []
            assert not (await stub.ListReplicas(pb.ListReplicasRequest())).replicas
    finally:
        svc.stop()
        if stray is not None and stray.poll() is None:
            stray.kill()
            stray.wait()
        provisioner_procs.kill_replicas(state_dir)


async def test_sigterm_ends_streams_cleanly_and_keeps_replicas_running(tmp_path) -> None:
    state_dir = str(tmp_path / "state")
    svc = service_procs.start_service("provisioner", env=_env(state_dir), workdir=str(tmp_path))
    try:
        async with grpc.aio.insecure_channel(svc.addr) as channel:
            stub = pb_grpc.ProvisionerServiceStub(channel)
            events = await client.collect(stub.Launch(client.launch_request(1)))
            endpoint = events[-1].endpoint
            watch = stub.WatchReplicas(pb.WatchReplicasRequest())
            await client.next_event(watch, R.REPLICA_EVENT_TYPE_SNAPSHOT_END)
            assert await asyncio.to_thread(svc.stop) == 0
            # The open watch ends like any cut stream: the client re-attaches elsewhere or later.
            assert await watch.read() is grpc.aio.EOF
        assert provisioner_procs.replica_pids(state_dir)
        await client.wait_http(endpoint)
    finally:
        svc.stop()
        provisioner_procs.kill_replicas(state_dir)


async def test_replica_owner_is_reported_and_survives_a_restart(tmp_path) -> None:
    state_dir = str(tmp_path / "state")
    svc = service_procs.start_service("provisioner", env=_env(state_dir), workdir=str(tmp_path))
    try:
        async with grpc.aio.insecure_channel(svc.addr) as channel:
            stub = pb_grpc.ProvisionerServiceStub(channel)
            with_owner = client.launch_request(1, spec_=client.spec("sleep 30"), owner="controller-a")
            events = await client.collect(stub.Launch(with_owner))
            assert client.types(events)[-1] == "RUNNING" and events[-1].replica.owner == "controller-a"
            events = await client.collect(stub.Launch(client.launch_request(2, spec_=client.spec("sleep 30"))))
            assert events[-1].replica.owner == ""  # an unowned launch (older controllers)
            # Attaching with another owner neither changes nor hijacks the replica.
            again = await client.collect(stub.Launch(client.launch_request(1, owner="controller-b")))
            assert again[-1].replica.owner == "controller-a"
            try:
                await stub.Launch(client.launch_request(3, owner="x" * 129)).read()
                raise AssertionError("an over-long owner was accepted")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "owner" in (exc.details() or "")
            assert set(await _snapshot(stub, 0)) == {"svc-1", "svc-2"}

        svc.kill()
        svc = service_procs.start_service("provisioner", env=_env(state_dir), workdir=str(tmp_path))
        async with grpc.aio.insecure_channel(svc.addr) as channel:
            stub = pb_grpc.ProvisionerServiceStub(channel)
            after = await _snapshot(stub, 0)
            assert {name: r.owner for name, r in after.items()} == {"svc-1": "controller-a", "svc-2": ""}
            got = (await stub.GetReplica(pb.GetReplicaRequest(name="svc-1"))).replica
            assert got.owner == "controller-a"
            for name in ("svc-1", "svc-2"):
                events = await client.collect(stub.Terminate(pb.TerminateRequest(name=name)))
                assert client.types(events)[-1] == "TERMINATED"
    finally:
        svc.stop()
        provisioner_procs.kill_replicas(state_dir)

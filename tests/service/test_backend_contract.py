"""One contract for every provisioner backend: the same scenarios against `local` and `kubernetes`.

Each scenario drives a provisioner server over gRPC; the `backend` fixture runs it on one
backend (the kubernetes one against the test API server and its fake kubelet, which runs each
Pod's command as a local process) and supplies what only a backend can do: make a replica
disappear from outside, and say what still runs. Behaviour only one backend has (loopback
addresses and ports, process groups; Pods, Services, Secrets, API failures) is tested in
test_provisioner.py and test_provisioner_kubernetes*.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable

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
RUNNING, EXITED = resources_pb2.APP_STATE_RUNNING, resources_pb2.APP_STATE_EXITED
VANISHED, PREEMPTED = resources_pb2.APP_STATE_VANISHED, resources_pb2.APP_STATE_PREEMPTED


class Backend:
    """A provisioner server on one backend, restartable, and what only that backend can do."""

    name = ""

    def __init__(self, settings: server.Settings) -> None:
        self.settings = settings
        self.server: server.Server | None = None
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.ProvisionerServiceStub

    async def start(self) -> None:
        """Start the server (re-finding whatever replicas run)."""
        self.server = await server.build_server(self.settings)
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = pb_grpc.ProvisionerServiceStub(self.channel)

    async def stop(self) -> None:
        """Stop the server; replicas keep running."""
        if self.channel is not None:
            await self.channel.close()
            self.channel = None
        if self.server is not None:
            await self.server.stop(None)
            self.server = None

    async def restart(self) -> None:
        """Stop the server and start a new one with the same settings."""
        await self.stop()
        await self.start()

    async def vanish(self, name: str) -> None:
        """Make replica `name` disappear without the provisioner (a crash, someone else)."""
        raise NotImplementedError

    def running(self) -> list[str]:
        """What of this backend's replicas still runs (processes, Pods)."""
        raise NotImplementedError

    async def left_running(self, timeout: float = 10.0) -> list[str]:
        """Wait (bounded) until nothing runs; return what is left."""
        deadline = asyncio.get_running_loop().time() + timeout
        while (left := await asyncio.to_thread(self.running)) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return left

    async def close(self) -> None:
        """Stop the server and whatever a failed test left running."""
        await self.stop()


class LocalBackend(Backend):
    """Replicas as process groups on this machine."""

    name = "local"

    def __init__(self, tmp: str) -> None:
        self.state_dir = os.path.join(tmp, "state")
        super().__init__(
            server.Settings(
                listen_addr="127.0.0.1:0",
                state_dir=self.state_dir,
                launch_backoff_initial_s=0.05,
                launch_backoff_max_s=0.1,
                teardown_backoff_initial_s=0.05,
                teardown_backoff_max_s=0.1,
                kill_grace_s=1.0,
            )
        )

    async def vanish(self, name: str) -> None:
        """SIGKILL the replica's process group."""
        os.killpg(self._pgid(name), signal.SIGKILL)

    def _pgid(self, name: str) -> int:
        with open(os.path.join(self.state_dir, "local", name, "handle.json"), encoding="utf-8") as fh:
            return int(json.load(fh)["pgid"])

    def running(self) -> list[str]:
        """Live replica processes."""
        return [str(pid) for pid in provisioner_procs.replica_pids(self.state_dir)]

    async def close(self) -> None:
        """Stop the server and kill leftover processes."""
        await super().close()
        provisioner_procs.kill_replicas(self.state_dir)


class KubernetesBackend(Backend):
    """Replicas as Pods, against the test API server and its fake kubelet."""

    name = "kubernetes"

    def __init__(self, tmp: str) -> None:
        self.emulator = kube_emulator.Emulator(os.path.join(tmp, "emu")).start()
        super().__init__(kp.settings(tmp, self.emulator, f"c-{uuid.uuid4().hex[:8]}"))

    async def vanish(self, name: str) -> None:
        """Someone else deletes the Pod at once."""
        await self.emulator.call(self.emulator.kubelet.delete_pod(name))

    def running(self) -> list[str]:
        """Pods, and processes the fake kubelet runs for them."""
        names = self.emulator.run(self.emulator.api.names, "pods", self.emulator.namespace)
        return [f"pod {n}" for n in names] + [f"process of {n}" for n in self.emulator.kubelet.alive()]

    async def close(self) -> None:
        """Stop the server, then the API server and kubelet (which kill every process)."""
        await super().close()
        self.emulator.stop()


@pytest.fixture(params=[LocalBackend, KubernetesBackend], ids=lambda cls: cls.name)
async def backend(request, tmp_path) -> AsyncIterator[Backend]:
    b = request.param(str(tmp_path))
    try:
        await b.start()
        yield b
    finally:
        await b.close()


async def _launch(b: Backend, request: pb.LaunchRequest) -> list:
    return await client.collect(b.stub.Launch(request))


async def _watch(b: Backend) -> grpc.aio.UnaryStreamCall:
    """A watch call already past its snapshot."""
    call = b.stub.WatchReplicas(pb.WatchReplicasRequest())
    await client.next_event(call, R.REPLICA_EVENT_TYPE_SNAPSHOT_END)
    return call


async def _replica(b: Backend, name: str) -> resources_pb2.ProvisionedReplica:
    return (await b.stub.GetReplica(pb.GetReplicaRequest(name=name))).replica


async def _until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait (bounded) until `check()`, run off the event loop (it may scan /proc)."""
    try:
        async with asyncio.timeout(timeout):
            while not await asyncio.to_thread(check):
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


async def _until_app_state(b: Backend, name: str, state: int, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while (await _replica(b, name)).app_state != state:
            await asyncio.sleep(0.05)


async def test_launches_report_each_step_and_the_replicas_serve(backend: Backend) -> None:
    results = await asyncio.gather(*(_launch(backend, client.launch_request(i)) for i in (1, 2)))
    endpoints = set()
    for i, events in zip((1, 2), results, strict=True):
        assert client.types(events) == ["QUEUED", "PROVISIONING", "RUNNING"]
        running = events[-1]
        assert running.replica.backend == backend.name
        assert running.replica.state == resources_pb2.REPLICA_STATE_RUNNING
        assert running.replica.app_state == RUNNING
        assert running.endpoint == running.replica.endpoint
        assert json.loads(await client.wait_http(running.endpoint + "/health"))["replica_id"] == str(i)
        endpoints.add(running.endpoint)
    assert len(endpoints) == 2
    listed = await backend.stub.ListReplicas(pb.ListReplicasRequest(service="svc"))
    assert [r.name for r in listed.replicas] == ["svc-1", "svc-2"]
    assert (await _replica(backend, "svc-2")).endpoint in endpoints


async def test_failing_setup_is_retried_then_fails_with_its_exit_code(backend: Backend) -> None:
    events = await _launch(backend, client.launch_request(1, spec_=client.spec("true", setup="echo prep; exit 7")))
    assert client.types(events) == [
        *("QUEUED", "PROVISIONING", "ATTEMPT_FAILED", "RETRYING"),
        *("PROVISIONING", "ATTEMPT_FAILED", "RETRYING", "PROVISIONING", "ATTEMPT_FAILED", "FAILED"),
    ]
    assert events[-1].message == "setup exited with code 7"
    assert not events[-1].permanent
    assert events[-1].replica.state == resources_pb2.REPLICA_STATE_FAILED
    assert await backend.left_running() == []


async def test_app_exit_is_pushed_on_the_watch_with_its_code(backend: Backend) -> None:
    watch = await _watch(backend)
    events = await _launch(backend, client.launch_request(1, spec_=client.spec("sleep 0.3; exit 3")))
    assert client.types(events)[-1] == "RUNNING"  # RUNNING means started; the exit comes on the watch
    exited = await client.next_event(watch, R.REPLICA_EVENT_TYPE_APP_EXITED)
    watch.cancel()
    assert (exited.replica.name, exited.replica.exit_code, exited.replica.app_state) == ("svc-1", 3, EXITED)
    assert exited.message == "app exited with code 3"


async def test_a_replica_gone_from_outside_is_reported_vanished_and_still_tears_down(backend: Backend) -> None:
    await _launch(backend, client.launch_request(1, spec_=client.spec("sleep 30")))
    watch = await _watch(backend)
    await backend.vanish("svc-1")
    vanished = await client.next_event(watch, R.REPLICA_EVENT_TYPE_VANISHED)
    watch.cancel()
    assert (vanished.replica.name, vanished.replica.app_state) == ("svc-1", VANISHED)
    teardown = await client.collect(backend.stub.Terminate(pb.TerminateRequest(name="svc-1")))
    assert client.types(teardown) == ["TERMINATING", "TERMINATED"]
    assert await backend.left_running() == []


async def test_preempt_reports_preempted_and_stops_the_replica(backend: Backend) -> None:
    await _launch(backend, client.launch_request(1, use_spot=True))
    watch = await _watch(backend)
    response = await backend.stub.PreemptReplica(pb.PreemptReplicaRequest(name="svc-1"))
    assert response.replica.app_state == PREEMPTED
    event = await client.next_event(watch, R.REPLICA_EVENT_TYPE_PREEMPTED)
    watch.cancel()
    assert event.replica.name == "svc-1" and event.replica.is_spot
    # A preempted replica tears down at once (no drain), and nothing of it is left.
    teardown = await client.collect(
        backend.stub.Terminate(pb.TerminateRequest(name="svc-1", drain=client.duration(30)))
    )
    assert client.types(teardown) == ["TERMINATING", "TERMINATED"]
    assert await backend.left_running() == []


async def test_teardown_drains_stops_the_replica_and_forgets_it(backend: Backend) -> None:
    events = await _launch(backend, client.launch_request(1))
    await client.wait_http(events[-1].endpoint)
    watch = await _watch(backend)
    teardown = await client.collect(
        backend.stub.Terminate(pb.TerminateRequest(name="svc-1", drain=client.duration(0.2)))
    )
    assert client.types(teardown) == ["DRAINING", "TERMINATING", "TERMINATED"]
    assert (await client.next_event(watch, R.REPLICA_EVENT_TYPE_TERMINATED)).replica.name == "svc-1"
    watch.cancel()
    assert await backend.left_running() == []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _replica(backend, "svc-1")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    again = await client.collect(backend.stub.Terminate(pb.TerminateRequest(name="svc-1")))
    assert client.types(again) == ["TERMINATED"]  # gone already: one event


async def test_cancel_mid_launch_leaves_nothing_running(backend: Backend) -> None:
    launch = asyncio.create_task(_launch(backend, client.launch_request(1, spec_=client.spec(setup="sleep 30"))))
    async with asyncio.timeout(10):
        while not await asyncio.to_thread(backend.running):  # setup is running
            await asyncio.sleep(0.02)
    assert (await backend.stub.CancelLaunch(pb.CancelLaunchRequest(name="svc-1"))).cancelled
    assert client.types(await launch)[-1] == "CANCELLED"
    assert await backend.left_running() == []


async def test_a_restarted_provisioner_adopts_its_replicas_and_reports_what_ended_meanwhile(
    backend: Backend,
) -> None:
    first = await _launch(backend, client.launch_request(1))
    endpoint = first[-1].endpoint
    await _launch(backend, client.launch_request(2, spec_=client.spec("sleep 30")))
    await _launch(backend, client.launch_request(3, spec_=client.spec("sleep 0.5; exit 4")))
    await backend.stop()
    await backend.vanish("svc-2")  # while no provisioner runs; svc-3's app exits meanwhile too
    await backend.start()

    adopted = await _replica(backend, "svc-1")
    assert (adopted.state, adopted.app_state, adopted.endpoint) == (
        resources_pb2.REPLICA_STATE_RUNNING,
        RUNNING,
        endpoint,
    )
    assert json.loads(await client.wait_http(endpoint + "/health"))["replica_id"] == "1"
    await _until_app_state(backend, "svc-2", VANISHED)
    await _until_app_state(backend, "svc-3", EXITED)
    assert (await _replica(backend, "svc-3")).exit_code == 4
    replay = await _launch(backend, client.launch_request(1, attach_only=True))
    assert client.types(replay)[-1] == "RUNNING" and replay[-1].endpoint == endpoint

    for name in ("svc-1", "svc-2", "svc-3"):
        assert client.types(await client.collect(backend.stub.Terminate(pb.TerminateRequest(name=name))))[-1] == (
            "TERMINATED"
        )
    assert await backend.left_running() == []
    assert not (await backend.stub.ListReplicas(pb.ListReplicasRequest())).replicas


async def test_app_log_follows_the_app_and_is_kept_after_it_failed(backend: Backend) -> None:
    run = 'echo "app says hello"; echo "to stderr" >&2; sleep 0.5; echo "last words"; exit 3'
    request = client.launch_request(1, spec_=client.spec(run, setup="echo preparing the app"))
    assert client.types(await _launch(backend, request))[-1] == "RUNNING"
    # Followed while the app runs; the stream ends once its exit is known, with every line.
    chunks = await client.collect(backend.stub.StreamLogs(pb.StreamLogsRequest(name="svc-1", follow=True)), timeout=15)
    followed = b"".join(c.data for c in chunks).decode()
    assert [line for line in followed.splitlines() if line] == ["app says hello", "to stderr", "last words"]
    await _until_app_state(backend, "svc-1", EXITED)
    await client.collect(backend.stub.Terminate(pb.TerminateRequest(name="svc-1", keep_logs=True)))
    assert await backend.left_running() == []
    # Kept after the teardown, once each; setup's output is in the launch log, not the app's.
    chunks = await client.collect(backend.stub.StreamLogs(pb.StreamLogsRequest(name="svc-1")))
    assert b"".join(c.data for c in chunks).decode() == followed
    kind = resources_pb2.LOG_KIND_LAUNCH
    chunks = await client.collect(backend.stub.StreamLogs(pb.StreamLogsRequest(name="svc-1", kind=kind)))
    assert "preparing the app" in b"".join(c.data for c in chunks).decode()


async def test_app_log_of_a_replica_adopted_after_a_restart_goes_on_without_repeats(backend: Backend) -> None:
    run = 'echo "before the restart"; sleep 1.5; echo "after the restart"; sleep 30'
    await _launch(backend, client.launch_request(1, spec_=client.spec(run)))
    await _until_log(backend, "svc-1", "before the restart")
    await backend.restart()
    await _until_log(backend, "svc-1", "after the restart")
    chunks = await client.collect(backend.stub.StreamLogs(pb.StreamLogsRequest(name="svc-1")))
    assert b"".join(c.data for c in chunks).decode().splitlines() == ["before the restart", "after the restart"]
    await client.collect(backend.stub.Terminate(pb.TerminateRequest(name="svc-1")))


async def _until_log(b: Backend, name: str, text: str, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while True:
            chunks = await client.collect(b.stub.StreamLogs(pb.StreamLogsRequest(name=name)))
            if text in b"".join(c.data for c in chunks).decode():
                return
            await asyncio.sleep(0.05)


# ---- pool workers and their jobs ------------------------------------------------------------

USER = resources_pb2.FAILURE_CAUSE_USER
INFRA = resources_pb2.FAILURE_CAUSE_INFRASTRUCTURE
J = resources_pb2.JobEventType


async def _worker(b: Backend, setup: str = "", **spec_fields: object) -> list:
    spec = client.worker_spec(setup, **spec_fields)  # type: ignore[arg-type]
    return await _launch(b, client.launch_request(1, "pool", spec_=spec))


async def _job_log(b: Backend, job_id: str) -> str:
    kind = resources_pb2.LOG_KIND_JOB
    chunks = await client.collect(b.stub.StreamLogs(pb.StreamLogsRequest(kind=kind, job_id=job_id)))
    return b"".join(c.data for c in chunks).decode()


async def _started(call: grpc.aio.UnaryStreamCall, timeout: float = 10.0) -> resources_pb2.JobEvent:
    """Read a RunJob stream up to its STARTED event."""
    async with asyncio.timeout(timeout):
        message = await call.read()
    assert message is not grpc.aio.EOF, "the job stream ended before STARTED"
    assert message.event.type == J.JOB_EVENT_TYPE_STARTED, message.event
    return message.event


async def _rest(call: grpc.aio.UnaryStreamCall, timeout: float = 15.0) -> list:
    """The events left on a stream read with read() (iterating it is not allowed then)."""
    out = []
    async with asyncio.timeout(timeout):
        while (message := await call.read()) is not grpc.aio.EOF:
            out.append(message.event)
    return out


async def test_a_worker_is_ready_when_its_setup_exits_zero_and_stays_up(backend: Backend) -> None:
    events = await _worker(backend, "echo preparing the worker")
    assert client.types(events) == ["QUEUED", "PROVISIONING", "SETUP_DONE"]
    done = events[-1]
    assert (done.endpoint, done.replica.endpoint) == ("", "")
    assert done.replica.worker and done.replica.state == resources_pb2.REPLICA_STATE_RUNNING
    await asyncio.sleep(0.3)  # nothing ends a worker but a teardown
    assert (await _replica(backend, "pool-1")).app_state == RUNNING
    kind = resources_pb2.LOG_KIND_LAUNCH
    chunks = await client.collect(backend.stub.StreamLogs(pb.StreamLogsRequest(name="pool-1", kind=kind)))
    assert "preparing the worker" in b"".join(c.data for c in chunks).decode()
    teardown = await client.collect(backend.stub.Terminate(pb.TerminateRequest(name="pool-1")))
    assert client.types(teardown)[-1] == "TERMINATED"
    assert await backend.left_running() == []


async def test_a_worker_whose_setup_fails_is_failed_by_the_user_with_its_setup_log_kept(backend: Backend) -> None:
    events = await _worker(backend, "echo missing dependency; exit 5")
    assert client.types(events)[-1] == "FAILED"
    assert (events[-1].cause, events[-1].message) == (USER, "setup exited with code 5")
    await client.collect(backend.stub.Terminate(pb.TerminateRequest(name="pool-1", keep_logs=True)))
    assert await backend.left_running() == []
    kind = resources_pb2.LOG_KIND_LAUNCH
    chunks = await client.collect(backend.stub.StreamLogs(pb.StreamLogsRequest(name="pool-1", kind=kind)))
    assert "missing dependency" in b"".join(c.data for c in chunks).decode()


async def test_a_job_runs_in_the_workers_directory_and_environment_and_reports_its_exit_code(
    backend: Backend,
) -> None:
    await _worker(backend, "echo made-by-setup > marker", envs={"POOL_ENV": "from-the-pool"})
    run = 'cat marker; echo "$POOL_ENV $JOB_ENV $SKYPILOT_TASK_ID $SKYPILOT_JOB_ID $REPLICAPLANE_JOB_ID"; exit 3'
    request = client.job_request("j-1", "pool-1", run, envs={"JOB_ENV": "from-the-job"})
    events = await client.collect(backend.stub.RunJob(request))
    assert client.types(events) == ["STARTED", "EXITED"]
    assert (events[-1].exit_code, events[-1].job.state, events[-1].job.exit_code) == (
        3,
        resources_pb2.JOB_STATE_EXITED,
        3,
    )
    assert events[0].job.start_time.seconds > 0 and events[0].job.replica == "pool-1"
    assert await _job_log(backend, "j-1") == "made-by-setup\nfrom-the-pool from-the-job j-1 j-1 j-1\n"
    got = (await backend.stub.GetJob(pb.GetJobRequest(job_id="j-1"))).job
    assert (got.state, got.exit_code, got.service) == (resources_pb2.JOB_STATE_EXITED, 3, "pool")
    assert (await _replica(backend, "pool-1")).job_id == ""  # free again
    assert client.types(await client.collect(backend.stub.RunJob(client.job_request("j-2", "pool-1", "true")))) == [
        "STARTED",
        "EXITED",
    ]
    await client.collect(backend.stub.Terminate(pb.TerminateRequest(name="pool-1")))
    assert await backend.left_running() == []


async def test_one_job_at_a_time_and_cancel_stops_it_and_frees_the_worker(backend: Backend) -> None:
    await _worker(backend)
    mark = uuid.uuid4().hex  # in the environment of every process of the job
    run = "echo working; sleep 30 & sh -c 'sleep 30'"  # a child in the background, one in the foreground
    first = backend.stub.RunJob(client.job_request("j-1", "pool-1", run, envs={"JOB_MARK": mark}))
    await _started(first)
    await _until(lambda: len(procs.pids_with_env("JOB_MARK", mark)) >= 2, "the job's processes")
    assert (await _replica(backend, "pool-1")).job_id == "j-1"
    with pytest.raises(grpc.aio.AioRpcError) as busy:
        await client.collect(backend.stub.RunJob(client.job_request("j-2", "pool-1", "true")))
    assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already runs job j-1" in (busy.value.details() or "")
    cancelled = await backend.stub.CancelJob(pb.CancelJobRequest(job_id="j-1", grace=client.duration(0.5)))
    assert cancelled.cancelled and cancelled.job.state == resources_pb2.JOB_STATE_CANCELLED
    await _until(lambda: not procs.pids_with_env("JOB_MARK", mark), "the job's processes to be gone")
    assert client.types(await _rest(first)) == ["CANCELLED"]
    got = (await backend.stub.GetJob(pb.GetJobRequest(job_id="j-1"))).job
    assert got.state == resources_pb2.JOB_STATE_CANCELLED and got.end_time.seconds > 0
    again = await backend.stub.CancelJob(pb.CancelJobRequest(job_id="j-1"))
    assert not again.cancelled  # ended already
    events = await client.collect(backend.stub.RunJob(client.job_request("j-2", "pool-1", "echo second")))
    assert client.types(events) == ["STARTED", "EXITED"] and events[-1].exit_code == 0
    await client.collect(backend.stub.Terminate(pb.TerminateRequest(name="pool-1")))
    assert await backend.left_running() == []


async def test_a_job_attached_to_again_even_across_a_restart_never_runs_twice(backend: Backend) -> None:
    await _worker(backend)
    request = client.job_request("j-1", "pool-1", "echo run >> runs.txt; sleep 2; echo finished")
    first, second = backend.stub.RunJob(request), backend.stub.RunJob(request)
    assert (await _started(first)).sequence == (await _started(second)).sequence == 1
    await backend.restart()  # both streams are cut; the job goes on
    attach = client.job_request("j-1", "", "", after_sequence=1, attach_only=True)
    events = await client.collect(backend.stub.RunJob(attach))
    assert client.types(events) == ["EXITED"] and events[-1].exit_code == 0
    replay = await client.collect(backend.stub.RunJob(request))  # the same request again
    assert client.types(replay) == ["STARTED", "EXITED"]
    await client.collect(backend.stub.RunJob(client.job_request("j-2", "pool-1", "cat runs.txt")))
    assert await _job_log(backend, "j-2") == "run\n"
    assert (await _job_log(backend, "j-1")).splitlines()[-1] == "finished"
    await client.collect(backend.stub.Terminate(pb.TerminateRequest(name="pool-1")))
    assert await backend.left_running() == []


async def test_a_worker_dying_mid_job_ends_the_job_failed_by_the_infrastructure(backend: Backend) -> None:
    await _worker(backend)
    call = backend.stub.RunJob(client.job_request("j-1", "pool-1", "sleep 30"))
    await _started(call)
    await backend.vanish("pool-1")
    rest = await _rest(call)
    assert client.types(rest) == ["FAILED"]
    assert rest[-1].cause == INFRA and "worker died" in rest[-1].message
    assert rest[-1].job.state == resources_pb2.JOB_STATE_FAILED
    await client.collect(backend.stub.Terminate(pb.TerminateRequest(name="pool-1")))
    assert await backend.left_running() == []  # the job's processes went with the worker


async def test_what_a_job_leaves_running_gets_sigterm_then_sigkill_before_its_end_is_reported(
    backend: Backend,
) -> None:
    await _worker(backend)
    mark = uuid.uuid4().hex  # in the environment of every process of the job
    stubborn = "trap 'echo termed >> termed' TERM; : > ready; while :; do sleep 0.1; done"
    # One that asks for SIGKILL, one in the background, and one that left the job's group.
    run = f'sh -c "{stubborn}" & sleep 30 & setsid sleep 30 & while [ ! -f ready ]; do sleep 0.05; done; exit 2'
    events = await client.collect(
        backend.stub.RunJob(client.job_request("j-1", "pool-1", run, envs={"JOB_MARK": mark}))
    )
    assert client.types(events) == ["STARTED", "EXITED"] and events[-1].exit_code == 2
    assert await asyncio.to_thread(procs.pids_with_env, "JOB_MARK", mark) == []  # gone before the end
    await client.collect(backend.stub.RunJob(client.job_request("j-2", "pool-1", "cat termed")))
    assert (await _job_log(backend, "j-2")).startswith("termed\n")  # asked first, killed after the grace
    await client.collect(backend.stub.Terminate(pb.TerminateRequest(name="pool-1")))
    assert await backend.left_running() == []


async def test_what_a_job_leaves_running_is_stopped_when_it_ends_after_a_restart(backend: Backend) -> None:
    await _worker(backend)
    mark = uuid.uuid4().hex
    request = client.job_request("j-1", "pool-1", "sleep 30 & setsid sleep 30 & sleep 1", envs={"JOB_MARK": mark})
    call = backend.stub.RunJob(request)
    await _started(call)
    await backend.restart()  # the job ends while no provisioner, or a new one, watches it
    attach = client.job_request("j-1", "", "", after_sequence=1, attach_only=True)
    events = await client.collect(backend.stub.RunJob(attach))
    assert client.types(events) == ["EXITED"] and events[-1].exit_code == 0
    assert await asyncio.to_thread(procs.pids_with_env, "JOB_MARK", mark) == []
    await client.collect(backend.stub.Terminate(pb.TerminateRequest(name="pool-1")))
    assert await backend.left_running() == []

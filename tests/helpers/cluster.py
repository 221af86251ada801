"""The three real services as processes, plus helpers to drive and observe the controller."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import security
from services.provisioner import procs as proc_env
from tests.helpers import ports, procs, provisioner_procs

APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "apps", "httpapp.py")

# Small timings so failure paths finish in seconds.
PROVISIONER_ENV = {
    "REPLICAPLANE_PROVISIONER_LAUNCH_BACKOFF_INITIAL_S": "0.05",
    "REPLICAPLANE_PROVISIONER_LAUNCH_BACKOFF_MAX_S": "0.2",
    "REPLICAPLANE_PROVISIONER_TEARDOWN_BACKOFF_INITIAL_S": "0.05",
    "REPLICAPLANE_PROVISIONER_TEARDOWN_BACKOFF_MAX_S": "0.2",
    "REPLICAPLANE_PROVISIONER_KILL_GRACE_S": "1",
}
CONTROLLER_ENV = {"REPLICAPLANE_CONTROLLER_DRAIN_S": "0.2"}


def replica_pids(tag: str) -> list[int]:
    """Pids of live processes whose command line carries `--tag <tag>`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z" and b"--tag" in argv and tag.encode() in argv:
            pids.append(int(entry))
    return pids


def replica_processes(tag: str) -> dict[int, tuple[str, int]]:
    """Live replica processes carrying the tag: pid -> (env SERVICE_NAME or "", REPLICA_ID)."""
    out = {}
    for pid in replica_pids(tag):
        rid = proc_env.env_value(pid, "REPLICA_ID")
        if rid is not None:  # None: it exited between the listing and the read
            out[pid] = (proc_env.env_value(pid, "SERVICE_NAME") or "", int(rid))
    return out


def kill_tagged(tag: str) -> None:
    """SIGKILL every process carrying the tag (test cleanup of last resort)."""
    for pid in replica_pids(tag):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def app_yaml(
    name: str, tag: str, *, replicas: int = 2, app_args: str = "", probe: str = "", extra: str = "", run: str = ""
) -> str:
    """A service YAML running tests/helpers/apps/httpapp.py (or `run`, if given)."""
    probe = probe or (
        "    path: /health\n    initial_delay_seconds: 20\n"
        "    consecutive_failure_threshold_timeout: 1\n    endpoint_probe_interval_seconds: 0.2\n"
    )
    return (
        f"name: {name}\n"
        "service:\n"
        "  readiness_probe:\n"
        f"{probe}"
        f"  replicas: {replicas}\n"
        "resources:\n"
        "  ports: 8080\n"
        f"run: {run or f'{sys.executable} {APP} --port 8080 --tag {tag} {app_args}'}\n"
        f"{extra}"
    )


class Cluster:
    """Provisioner, probers and controller as real processes in one temp directory."""

    def __init__(
        self,
        tmp: str,
        *,
        probers: int = 1,
        provisioner_env: dict[str, str] | None = None,
        controller_env: dict[str, str] | None = None,
        prober_env: dict[str, str] | None = None,
        api_token: str = "",
        connect: bool = True,
    ) -> None:
        """Start the services. `connect=False` opens no channel yet: `connect()` does, on the
        event loop that will use it (a cluster shared by tests opens one per test)."""
        self.tmp = tmp
        self.api_token = api_token
        self.prober_env = prober_env or {}
        self.provisioner_state_dir = os.path.join(tmp, "prov")
        self.controller_env = {**CONTROLLER_ENV, **(controller_env or {})}
        if "REPLICAPLANE_CONTROLLER_TLS_CERT_FILE" not in self.controller_env:
            # A token on the API with plaintext TCP to the provisioner and probers is refused
            # unless allowed: test clusters run on a machine no one else uses.
            self.controller_env.setdefault("REPLICAPLANE_CONTROLLER_ALLOW_OPEN_INTERNAL", "true")
        self.tag = uuid.uuid4().hex[:12]
        self.tags = [self.tag]
        # Services are restarted on the address they had: on a loopback address of this test
        # process, the port a kill frees is not taken by the connections tests open meanwhile.
        self.host = ports.private_host()
        self.provisioner_env = {
            **PROVISIONER_ENV,
            "REPLICAPLANE_PROVISIONER_STATE_DIR": self.provisioner_state_dir,
            **(provisioner_env or {}),
        }
        # The provisioner and the probers start side by side; the controller needs their ports.
        starting = [self._spawn_provisioner(), *(self._spawn_prober(i) for i in range(probers))]
        try:
            started = [s.wait() for s in starting]
        except BaseException:
            for s in starting:
                s.proc.kill()
                s.proc.wait()
            raise
        self.provisioner, self.probers = started[0], started[1:]
        self.controller = self._start_controller()
        if connect:
            self.connect()

    def connect(self) -> None:
        """Open the channel to the controller (`stub`), on the running event loop."""
        self.channel = grpc.aio.insecure_channel(
            self.controller.addr, interceptors=security.token_interceptors(self.api_token)
        )
        self.stub = api_grpc.ControllerServiceStub(self.channel)

    def new_tag(self) -> None:
        """A new `tag` for the next test's replicas, so it sees only its own processes."""
        self.tag = uuid.uuid4().hex[:12]
        self.tags.append(self.tag)

    def alive(self) -> bool:
        """True while every service process of the cluster runs."""
        return all(svc.proc.poll() is None for svc in [self.controller, *self.probers, self.provisioner])

    def _dir(self, name: str) -> str:
        path = os.path.join(self.tmp, name)
        os.makedirs(path, exist_ok=True)
        return path

    def _spawn_provisioner(self, port: int = 0) -> procs.Starting:
        return procs.spawn_service(
            "provisioner", env=self.provisioner_env, workdir=self._dir("provisioner"), host=self.host, port=port
        )

    def _spawn_prober(self, i: int, port: int = 0) -> procs.Starting:
        return procs.spawn_service(
            "prober", env=self.prober_env, workdir=self._dir(f"prober{i}"), host=self.host, port=port
        )

    def _start_provisioner(self, port: int = 0) -> procs.ServiceProcess:
        return self._spawn_provisioner(port).wait()

    def _start_prober(self, i: int, port: int = 0) -> procs.ServiceProcess:
        return self._spawn_prober(i, port).wait()

    def restart_provisioner(self, *, kill: bool = True) -> None:
        """Kill -9 (or SIGTERM) the provisioner and start it again on the same port."""
        port = self.provisioner.port
        if kill:
            self.provisioner.kill()
        else:
            self.provisioner.stop()
        self.provisioner = self._start_provisioner(port)

    def stop_prober(self, i: int) -> None:
        """SIGKILL prober i."""
        self.probers[i].kill()

    def start_prober(self, i: int) -> None:
        """Start prober i again on its old port."""
        self.probers[i] = self._start_prober(i, self.probers[i].port)

    def _start_controller(self, port: int = 0, *, state: str = "ctl") -> procs.ServiceProcess:
        return procs.start_service(
            "controller",
            env={
                **self.controller_env,
                "REPLICAPLANE_CONTROLLER_STATE_DIR": os.path.join(self.tmp, state),
                "REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR": self.provisioner.addr,
                "REPLICAPLANE_CONTROLLER_PROBER_ADDRS": ",".join(p.addr for p in self.probers),
            },
            workdir=self._dir("controller" if state == "ctl" else f"controller-{state}"),
            host=self.host,
            port=port,
        )

    def start_other_controller(self, state: str, port: int = 0) -> procs.ServiceProcess:
        """Another controller with its own state directory `<tmp>/<state>`, sharing this
        cluster's provisioner and probers; the caller stops it."""
        return self._start_controller(port, state=state)

    async def restart_controller(self, *, kill: bool = True) -> None:
        """Kill -9 (or SIGTERM) the controller and start it again on the same port."""
        port = self.controller.port
        if kill:
            self.controller.kill()
        else:
            self.controller.stop()
        self.controller = self._start_controller(port)

    def replica_pgid(self, name: str) -> int:
        """The process group of the local backend's replica `name` (led by its wrapper)."""
        path = os.path.join(self.provisioner_state_dir, "local", name, "handle.json")
        with open(path, encoding="utf-8") as fh:
            return int(json.load(fh)["pgid"])

    async def delete_services(self, timeout: float = 10.0) -> bool:
        """Delete every service and wait until none is left and no replica process of the
        current tag runs. Returns whether that happened within `timeout`."""
        deadline = asyncio.get_running_loop().time() + timeout
        with contextlib.suppress(grpc.aio.AioRpcError):
            services = (await self.stub.ListServices(api.ListServicesRequest(), timeout=5)).services
            for svc in services:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self.stub.DeleteService(api.DeleteServiceRequest(service_name=svc.name), timeout=5)
            while asyncio.get_running_loop().time() < deadline:
                left = (await self.stub.ListServices(api.ListServicesRequest(), timeout=5)).services
                if not left and not replica_pids(self.tag):
                    return True
                await asyncio.sleep(0.1)
        return False

    def stop(self) -> None:
        """Stop the services and kill every replica process left (no channel is used)."""
        for svc in [self.controller, *self.probers, self.provisioner]:
            svc.stop()
        for tag in self.tags:
            kill_tagged(tag)
        provisioner_procs.kill_replicas(self.provisioner_state_dir)

    async def close(self) -> None:
        """Delete every service (so no replica leaks), stop the services, kill stragglers."""
        await self.delete_services()
        await self.channel.close()
        self.stop()


class Shared:
    """One cluster lent to one test after another (a module's or a session's), which saves starting
    four processes per test. Each test gets a new tag, a channel on its own event loop, and a
    cluster with no service left by the test before: after each test every service is deleted
    and waited for. A cluster found with a dead process, or that did not clean up, is stopped
    and the next test gets a new one."""

    def __init__(self, make: Callable[[], Cluster], *, settled: Callable[[], Awaitable[bool]] | None = None) -> None:
        """`make` starts a cluster with `connect=False`; `settled`, if given, says whether what
        else a test leaves behind (a backend's objects) is gone too, after its services."""
        self._make = make
        self._settled = settled
        self._cluster: Cluster | None = None

    @contextlib.asynccontextmanager
    async def lend(self) -> AsyncIterator[Cluster]:
        """The cluster for one test."""
        c = self._cluster
        if c is not None and not c.alive():
            self.stop()
            c = None
        if c is None:
            c = self._cluster = self._make()
        c.new_tag()
        c.connect()
        clean = False
        try:
            yield c
        finally:
            try:
                clean = c.alive() and await c.delete_services(timeout=30) and await self._until_settled(30)
            finally:
                await c.channel.close()
                if not clean:
                    self.stop()

    async def _until_settled(self, timeout: float) -> bool:
        if self._settled is None:
            return True
        deadline = asyncio.get_running_loop().time() + timeout
        while not await self._settled():
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def stop(self) -> None:
        """Stop the cluster, if one runs."""
        if self._cluster is not None:
            self._cluster.stop()
            self._cluster = None


class Watch:
    """Follows WatchService and keeps the latest service and replicas."""

    def __init__(self, stub: api_grpc.ControllerServiceStub, name: str) -> None:
        self.stub = stub
        self.name = name
        self.service: res.Service | None = None
        self.replicas: dict[int, res.Replica] = {}
        self.deleted = False
        self.first_sequence = 0
        self.seen_statuses: dict[int, list[int]] = {}
        self._call = stub.WatchService(api.WatchServiceRequest(service_name=name))

    def _apply(self, msg: api.WatchServiceResponse) -> None:
        if msg.snapshot:
            self.replicas = {}
        self.first_sequence = self.first_sequence or msg.sequence
        self.service = msg.service
        for r in msg.replicas:
            self.replicas[r.replica_id] = r
            seen = self.seen_statuses.setdefault(r.replica_id, [])
            if not seen or seen[-1] != r.status:
                seen.append(r.status)
        for rid in msg.removed_replica_ids:
            self.replicas.pop(rid, None)
        self.deleted = self.deleted or msg.deleted

    async def until(self, pred: Callable[[Watch], bool], timeout: float = 30.0) -> Watch:
        """Read changes until pred(self) holds; fail with the last state after `timeout`."""
        if self.service is not None and pred(self):
            return self

        async def run() -> None:
            async for msg in self._call:
                self._apply(msg)
                if pred(self):
                    return
            raise AssertionError("watch ended")

        try:
            await asyncio.wait_for(run(), timeout)
        except TimeoutError:
            raise AssertionError(f"timed out; last state: {self.describe()}") from None
        return self

    def statuses(self) -> dict[int, str]:
        """Replica id -> status name."""
        return {i: res.ReplicaStatus.Name(r.status) for i, r in sorted(self.replicas.items())}

    def count(self, status: int) -> int:
        """Replicas in `status`."""
        return sum(1 for r in self.replicas.values() if r.status == status)

    def describe(self) -> str:
        """A one-line summary for failure messages."""
        svc = self.service
        head = (
            f"{res.ServiceStatus.Name(svc.status)} {svc.ready_replicas}/{svc.total_replicas} {svc.status_message!r}"
            if svc
            else "no service"
        )
        reasons = {i: r.failure_reason for i, r in self.replicas.items() if r.failure_reason}
        return f"{head} replicas={self.statuses()} reasons={reasons}"

    def cancel(self) -> None:
        """Stop watching."""
        self._call.cancel()

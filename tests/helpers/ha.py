"""Several controller processes on one PostgreSQL store, for the failover drill and its bench.

The provisioner (the scripted one: it counts every launch per replica name) and a prober run in
the caller's event loop; the controllers are real processes, so they can be killed (-9) and
stopped (SIGSTOP) for real. `Churn` keeps creating, updating and deleting services through a
channel to every controller (clients.controller_target) and records each acknowledged write.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import psycopg

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from services.common import clients
from services.prober import server as prober_server
from tests.helpers import fake_provisioner, procs

LEASE_S = 3.0
AUDITED = ("services", "versions", "replicas", "autoscaler_state", "meta")

YAML = """
name: {name}
service:
  readiness_probe:
    path: /health
    initial_delay_seconds: 5
    endpoint_probe_interval_seconds: 0.2
  replicas: {replicas}
resources:
  ports: 8080
run: serve
"""


def spec(name: str, replicas: int = 1) -> str:
    return YAML.format(name=name, replicas=replicas)


@dataclasses.dataclass
class Plane:
    """The controllers, and what they share."""

    url: str
    fake: fake_provisioner.FakeProvisioner
    env: dict[str, str]
    workdir: str
    controllers: list[procs.ServiceProcess] = dataclasses.field(default_factory=list)

    def start_controller(self) -> procs.ServiceProcess:
        n = len(self.controllers)
        env = {**self.env, "REPLICAPLANE_CONTROLLER_STATE_DIR": os.path.join(self.workdir, f"ctl-{n}")}
        run = os.path.join(self.workdir, f"run-{n}")
        os.makedirs(run, exist_ok=True)
        proc = procs.start_service("controller", env=env, workdir=run)
        self.controllers.append(proc)
        return proc

    @property
    def target(self) -> str:
        """Every controller, for one channel."""
        return clients.controller_target(",".join(c.addr for c in self.controllers))

    def lease(self) -> tuple[str, int, str] | None:
        """(holder, epoch, address) of the lease, or None."""
        with psycopg.connect(self.url) as db:
            row = db.execute("SELECT holder, epoch, address FROM leases WHERE name = 'controller'").fetchone()
        return None if row is None else (str(row[0]), int(row[1]), str(row[2]))

    def leader(self) -> procs.ServiceProcess | None:
        lease = self.lease()
        for c in self.controllers:
            if lease is not None and c.addr == lease[2] and c.proc.poll() is None:
                return c
        return None

    async def wait_leader(self, *, other_than: procs.ServiceProcess | None = None, timeout: float = 30.0):  # type: ignore[no-untyped-def]
        """The controller that leads and answers API calls itself (not forwarding)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = await asyncio.to_thread(self.leader)
            if leader is not None and leader is not other_than and await answers(leader.addr):
                return leader
            await asyncio.sleep(0.05)
        raise AssertionError(f"no controller leads after {timeout} s")

    def install_audit(self) -> None:
        """Record which process (application_name carries its pid) wrote each row, and when."""
        with psycopg.connect(self.url, autocommit=True) as db:
            db.execute("CREATE TABLE IF NOT EXISTS write_audit (app TEXT, tbl TEXT, at DOUBLE PRECISION)")
            db.execute(
                """CREATE OR REPLACE FUNCTION audit_write() RETURNS trigger AS $$
                   BEGIN
                     INSERT INTO write_audit VALUES (current_setting('application_name'), TG_TABLE_NAME,
                                                     extract(epoch from clock_timestamp()));
                     RETURN NULL;
                   END $$ LANGUAGE plpgsql"""
            )
            for table in AUDITED:
                db.execute(f"DROP TRIGGER IF EXISTS audit_{table} ON {table}")
                db.execute(
                    f"CREATE TRIGGER audit_{table} AFTER INSERT OR UPDATE OR DELETE ON {table} "
                    "FOR EACH ROW EXECUTE FUNCTION audit_write()"
                )

    def writes_by(self, pid: int, *, since: float = 0.0) -> int:
        """Rows written by the controller with process id `pid` since `since` (time.time())."""
        with psycopg.connect(self.url) as db:
            row = db.execute(
                "SELECT count(*) FROM write_audit WHERE app = %s AND at >= %s", (f"replicaplane:{pid}", since)
            ).fetchone()
        return int(row[0]) if row else 0


async def answers(addr: str) -> bool:
    """True if the controller at `addr` serves the API itself (ListServices, not forwarded)."""
    async with grpc.aio.insecure_channel(addr) as channel:
        try:
            await api_grpc.ControllerServiceStub(channel).ListServices(
                api.ListServicesRequest(), timeout=1.0, metadata=(("x-replicaplane-forwarded", "1"),)
            )
        except grpc.aio.AioRpcError:
            return False
    return True


@contextlib.asynccontextmanager
async def plane(url: str, workdir: str, *, controllers: int = 2, lease_s: float = LEASE_S) -> AsyncIterator[Plane]:
    """A fake provisioner, a prober and `controllers` controllers sharing the store at `url`."""
    async with fake_provisioner.serving() as (fake, provisioner_addr):
        prober = await prober_server.build_server(prober_server.load_settings(listen_addr="127.0.0.1:0"))
        await prober.start()
        env = {
            "REPLICAPLANE_CONTROLLER_STORE_URL": url,
            "REPLICAPLANE_CONTROLLER_LEADER_ELECTION": "true",
            "REPLICAPLANE_CONTROLLER_LEASE_DURATION_S": str(lease_s),
            "REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR": provisioner_addr,
            "REPLICAPLANE_CONTROLLER_PROBER_ADDRS": f"127.0.0.1:{prober.port}",
            "REPLICAPLANE_CONTROLLER_DRAIN_S": "0.1",
            "REPLICAPLANE_CONTROLLER_METRICS_ADDR": "",
        }
        p = Plane(url, fake, env, workdir)
        try:
            for _ in range(controllers):
                await asyncio.to_thread(p.start_controller)
                if len(p.controllers) == 1:
                    await p.wait_leader()
            yield p
        finally:
            for c in p.controllers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.proc.pid, signal.SIGCONT)
                await asyncio.to_thread(c.stop)
            await prober.stop(None)


@dataclasses.dataclass
class Churn:
    """Creates, updates and deletes services through `target` until stopped; each write is
    retried with its request id (or as the same delete) until acknowledged."""

    target: str
    prefix: str = "churn-"
    created: list[str] = dataclasses.field(default_factory=list)
    updated: dict[str, int] = dataclasses.field(default_factory=dict)  # name -> replicas acknowledged
    deleted: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    longest_wait_s: float = 0.0
    _stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    async def _write(self, stub: api_grpc.ControllerServiceStub, call: str, request: object) -> bool:
        start = time.monotonic()
        while time.monotonic() - start < 30:
            try:
                await getattr(stub, call)(request, timeout=5)
                self.longest_wait_s = max(self.longest_wait_s, time.monotonic() - start)
                return True
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND and call == "DeleteService":
                    return True  # a retried delete that the first attempt already did
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.errors.append(f"{call}: {err.code().name}: {err.details()}")
                    return False
            await asyncio.sleep(0.1)
        self.errors.append(f"{call}: not acknowledged in 30 s")
        return False

    async def run(self) -> None:
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = api_grpc.ControllerServiceStub(channel)
            n = 0
            while not self._stop.is_set():
                n += 1
                name = f"{self.prefix}{n}"
                request = api.CreateServiceRequest(yaml=spec(name), request_id=str(uuid.uuid4()))
                if await self._write(stub, "CreateService", request):
                    self.created.append(name)
                if n % 3 == 0 and len(self.created) >= 2:
                    target = self.created[-2]
                    update = api.UpdateServiceRequest(
                        service_name=target, yaml=spec(target, 2), request_id=str(uuid.uuid4())
                    )
                    if await self._write(stub, "UpdateService", update):
                        self.updated[target] = 2
                if n % 4 == 0 and len(self.created) >= 4:
                    victim = self.created[-4]
                    if victim not in self.deleted and victim not in self.updated:
                        delete = api.DeleteServiceRequest(service_name=victim)
                        if await self._write(stub, "DeleteService", delete):
                            self.deleted.append(victim)
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()

"""Seeded chaos: scale up, scale down, rolling updates, replica terminations and deletes while the controller, the
provisioner or a prober is SIGKILLed at a random moment; then the invariants are checked.

A round is: one API write, a random pause (inside drain, launch, startup or teardown), a
SIGKILL of a random component, a random outage, the restart, and then the checks. In some
rounds the kill races the write instead; a write that then fails was not acknowledged, and the
model adopts whichever outcome the service shows. The checks:

- the service converges to its acknowledged target (all READY, all at the latest version);
- no acknowledged write was lost (version and target as acknowledged; a deleted service stays
  deleted);
- every live replica process is known to the controller and to the provisioner, and none is
  running twice;
- no replica id was reused within a service incarnation;
- the kept failure record of a broken service is still there.

With `secure`, the services run with mTLS between them and a token on the API.

Every choice comes from `random.Random(seed)`, so a seed replays the same kill points (the
timing of the system under test still varies with machine load).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import random
import sys
import time
import uuid

import grpc

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from tests.helpers import certs
from tests.helpers import cluster as cl

READY = res.REPLICA_STATUS_READY
FAILED = {
    res.REPLICA_STATUS_FAILED,
    res.REPLICA_STATUS_FAILED_CLEANUP,
    res.REPLICA_STATUS_FAILED_INITIAL_DELAY,
    res.REPLICA_STATUS_FAILED_PROBING,
    res.REPLICA_STATUS_FAILED_PROVISION,
    res.REPLICA_STATUS_UNKNOWN,
}
SCENARIOS = ("scale_up", "scale_down", "rolling_update", "terminate", "delete")
TARGETS = ("controller", "provisioner", "prober")
SERVICE = "chaos"
BROKEN = "broken"


@dataclasses.dataclass
class Report:
    """What one seeded run saw."""

    seed: int
    rounds: int = 0
    kills: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    scenarios: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    violations: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    racing: int = 0
    """Rounds whose kill raced the write."""
    unacknowledged: int = 0
    """Racing writes that failed (the model then adopts whichever outcome landed)."""


def _yaml(tag: str, name: str, replicas: int, generation: int) -> str:
    return cl.app_yaml(
        name, tag, replicas=replicas, extra=f"envs:\n  SERVICE_NAME: {name}\n  GENERATION: '{generation}'\n"
    )


def _broken_yaml(tag: str) -> str:
    return cl.app_yaml(BROKEN, tag, replicas=1, app_args="--exit-code 1", extra=f"envs:\n  SERVICE_NAME: {BROKEN}\n")


class Chaos:
    """One seeded run against a fresh cluster in `tmp`."""

    def __init__(
        self,
        tmp: str,
        seed: int,
        *,
        converge_timeout: float = 90.0,
        max_outage_s: float = 1.5,
        race_share: float = 0.3,
        secure: bool = False,
    ) -> None:
        self.rng = random.Random(seed)
        self.report = Report(seed)
        self.tmp = tmp
        self.converge_timeout = converge_timeout
        self.max_outage_s = max_outage_s
        self.race_share = race_share
        self.secure = secure
        self.controller_id: certs.Identity | None = None
        self.cluster: cl.Cluster | None = None
        self.target = 2
        self.version = 0
        self.generation = 0
        self.uid = ""
        self.ids_seen: set[int] = set()
        self.ids_gone: set[int] = set()
        self.kept_failed: dict[int, int] = {}
        self.intended = (self.target, self.generation)

    @property
    def c(self) -> cl.Cluster:
        assert self.cluster is not None
        return self.cluster

    def violation(self, text: str) -> None:
        self.report.violations.append(f"seed {self.report.seed} round {self.report.rounds}: {text}")

    async def run(self, rounds: int) -> Report:
        """Set up, run `rounds` rounds, tear down; violations are collected, not raised."""
        started = time.monotonic()
        self.cluster = self._new_cluster()
        try:
            await self._setup()
            for _ in range(rounds):
                self.report.rounds += 1
                await self._round()
        except Exception as exc:  # a broken run is a finding, with its reason
            self.violation(f"run aborted: {type(exc).__name__}: {exc}")
        finally:
            await self.c.close()
            self.report.seconds = time.monotonic() - started
        return self.report

    def _new_cluster(self) -> cl.Cluster:
        if not self.secure:
            return cl.Cluster(self.tmp, probers=2)
        ca = certs.Authority(os.path.join(self.tmp, "pki"))
        self.controller_id = ca.issue("controller")
        token = f"chaos-{uuid.uuid4().hex}"
        return cl.Cluster(
            self.tmp,
            probers=2,
            controller_env={**self.controller_id.env("controller"), "REPLICAPLANE_CONTROLLER_AUTH_TOKEN": token},
            provisioner_env=ca.issue("provisioner").env("provisioner"),
            prober_env=ca.issue("prober").env("prober"),
            api_token=token,
        )

    def _provisioner_channel(self) -> grpc.aio.Channel:
        if self.controller_id is None:
            return grpc.aio.insecure_channel(self.c.provisioner.addr)
        cert, key, ca = self.controller_id.read()
        return grpc.aio.secure_channel(self.c.provisioner.addr, grpc.ssl_channel_credentials(ca, key, cert))

    async def _setup(self) -> None:
        await self.c.stub.CreateService(api.CreateServiceRequest(yaml=_broken_yaml(self.c.tag)), timeout=30)
        await self._create()
        w = cl.Watch(self.c.stub, BROKEN)
        failed = res.REPLICA_STATUS_FAILED
        await w.until(lambda w: any(r.status == failed for r in w.replicas.values()), timeout=self.converge_timeout)
        w.cancel()
        self.kept_failed = {i: r.status for i, r in w.replicas.items() if r.status == failed}
        await self._converge()

    async def _create(self) -> None:
        self.generation += 1
        yaml_text = _yaml(self.c.tag, SERVICE, self.target, self.generation)
        svc = (await self.c.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text), timeout=30)).service
        self.version, self.uid = svc.latest_version, svc.uid
        self.ids_seen, self.ids_gone = set(), set()

    async def _write(self, scenario: str, pick: float) -> None:
        """The API write of a round; the model follows it once it is acknowledged.

        `pick` (in [0, 1)) chooses the replica to terminate; it is drawn before the write, so a
        write racing a kill draws nothing from the seeded generator at an unknown moment.
        """
        if scenario == "delete":
            await self.c.stub.DeleteService(api.DeleteServiceRequest(service_name=SERVICE), timeout=30)
            return
        if scenario == "terminate":
            listed = await self.c.stub.ListReplicas(api.ListReplicasRequest(service_name=SERVICE), timeout=30)
            ready = sorted(r.replica_id for r in listed.replicas if r.status == READY)
            if not ready:
                return
            victim = ready[int(pick * len(ready))]
            request = api.TerminateReplicaRequest(service_name=SERVICE, replica_id=victim)
            await self.c.stub.TerminateReplica(request, timeout=30)
            self.ids_gone.add(victim)
            return
        target, generation = self.target, self.generation
        if scenario == "scale_up":
            target = min(target + 1, 4)
        elif scenario == "scale_down":
            target = max(target - 1, 1)
        else:
            generation += 1
        self.intended = (target, generation)
        yaml_text = _yaml(self.c.tag, SERVICE, target, generation)
        reply = await self.c.stub.UpdateService(
            api.UpdateServiceRequest(service_name=SERVICE, yaml=yaml_text), timeout=30
        )
        self.target, self.generation, self.version = target, generation, reply.service.latest_version

    async def _write_during_kill(self, scenario: str, pick: float, target: str) -> bool:
        """The write and the kill at (nearly) the same moment; True when the write failed."""
        write = asyncio.create_task(self._write(scenario, pick))
        await asyncio.sleep(self.rng.uniform(0.0, 0.01))
        await self._kill(target)
        try:
            await write
        except grpc.aio.AioRpcError:
            return True
        return False

    async def _adopt(self, scenario: str) -> bool:
        """After a write that was not acknowledged, take whichever outcome the service shows.

        Returns True when the service is gone or going (an unacknowledged delete that landed).
        """
        deadline = time.monotonic() + self.converge_timeout
        while True:
            try:
                svc = (await self.c.stub.GetService(api.GetServiceRequest(service_name=SERVICE), timeout=10)).service
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return True
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        if svc.status == res.SERVICE_STATUS_SHUTTING_DOWN:
            return scenario == "delete" or self._bad(f"service shutting down after an unacknowledged {scenario}")
        generation = int(svc.spec.envs.get("GENERATION", self.generation))
        if (svc.target_replicas, generation) not in ((self.target, self.generation), self.intended):
            self.violation(
                f"after an unacknowledged {scenario}: target {svc.target_replicas} generation {generation}, "
                f"neither the old {(self.target, self.generation)} nor the new {self.intended}"
            )
        self.target, self.generation = svc.target_replicas, generation
        self.version = max(self.version, svc.latest_version)
        return False

    def _bad(self, text: str) -> bool:
        self.violation(text)
        return False

    async def _kill(self, target: str) -> None:
        outage = self.rng.uniform(0.0, self.max_outage_s)
        prober = self.rng.randrange(len(self.c.probers)) if target == "prober" else 0
        if target == "controller":
            self.c.controller.kill()
            await asyncio.sleep(outage)
            await self.c.restart_controller(kill=True)
        elif target == "provisioner":
            self.c.provisioner.kill()
            await asyncio.sleep(outage)
            self.c.restart_provisioner(kill=True)
        else:
            self.c.stop_prober(prober)
            await asyncio.sleep(outage)
            self.c.start_prober(prober)
        self.report.kills[target] += 1

    async def _round(self) -> None:
        scenario = self.rng.choice(SCENARIOS)
        target = self.rng.choice(TARGETS)
        pause = self.rng.uniform(0.0, 1.0)
        racing = self.rng.random() < self.race_share
        pick = self.rng.random()
        self.report.scenarios[scenario] += 1
        deleted = scenario == "delete"
        if racing:
            self.report.racing += 1
            if await self._write_during_kill(scenario, pick, target):
                self.report.unacknowledged += 1
                deleted = await self._adopt(scenario)
        else:
            await self._write(scenario, pick)
            await asyncio.sleep(pause)
            await self._kill(target)
        if deleted:
            await self._check_deleted()
            await self._create()
        await self._converge()
        await self._check()

    async def _check_deleted(self) -> None:
        deadline = time.monotonic() + self.converge_timeout
        while time.monotonic() < deadline:
            try:
                await self.c.stub.GetService(api.GetServiceRequest(service_name=SERVICE), timeout=10)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    break
            await asyncio.sleep(0.2)
        else:
            self.violation("acknowledged delete did not finish")
            return
        await asyncio.sleep(0.3)
        left = [rid for svc, rid in cl.replica_processes(self.c.tag).values() if svc == SERVICE]
        if left:
            self.violation(f"replicas {sorted(left)} of the deleted service still run")

    async def _converge(self) -> None:
        def done(w: cl.Watch) -> bool:
            reps = w.replicas.values()
            return (
                w.service is not None
                and w.count(READY) == self.target
                and len(w.replicas) == self.target
                and all(r.version == w.service.latest_version for r in reps)
            )

        w = cl.Watch(self.c.stub, SERVICE)
        try:
            await w.until(done, timeout=self.converge_timeout)
        except AssertionError as exc:
            self.violation(f"did not converge to {self.target}: {exc}")
            return
        finally:
            w.cancel()
        assert w.service is not None
        if w.service.uid != self.uid:
            self.violation(f"service incarnation changed from {self.uid} to {w.service.uid}")
        if w.service.latest_version < self.version:
            self.violation(f"acknowledged version {self.version} lost: now {w.service.latest_version}")
        if w.service.target_replicas != self.target:
            self.violation(f"acknowledged target {self.target} lost: now {w.service.target_replicas}")
        current = set(w.replicas)
        reused = current & self.ids_gone
        if reused:
            self.violation(f"replica ids reused: {sorted(reused)}")
        self.ids_gone |= self.ids_seen - current
        self.ids_seen |= current

    async def _check(self) -> None:
        await asyncio.sleep(0.3)  # let a teardown that just ended reap its process
        replicas = (await self.c.stub.ListReplicas(api.ListReplicasRequest(service_name=SERVICE), timeout=30)).replicas
        known = {(SERVICE, r.replica_id) for r in replicas if r.status not in FAILED}
        live = collections.Counter((svc, rid) for svc, rid in cl.replica_processes(self.c.tag).values())
        doubled = sorted(k for k, n in live.items() if n > 1)
        if doubled:
            self.violation(f"replicas running twice: {doubled}")
        unknown = sorted(set(live) - known)
        if unknown:
            self.violation(f"live replicas unknown to the controller: {unknown}")
        missing = sorted(known - set(live))
        if missing:
            self.violation(f"replicas the controller counts have no process: {missing}")
        channel = self._provisioner_channel()
        try:
            stub = prov_grpc.ProvisionerServiceStub(channel)
            records = (await stub.ListReplicas(prov_pb.ListReplicasRequest(), timeout=30)).replicas
        finally:
            await channel.close()
        running = {
            (r.service, r.replica_id)
            for r in records
            if r.state in (prov_res.REPLICA_STATE_RUNNING, prov_res.REPLICA_STATE_PROVISIONING)
        }
        not_at_provisioner = sorted(set(live) - running)
        if not_at_provisioner:
            self.violation(f"live replicas unknown to the provisioner: {not_at_provisioner}")
        broken = (await self.c.stub.ListReplicas(api.ListReplicasRequest(service_name=BROKEN), timeout=30)).replicas
        statuses = {r.replica_id: r.status for r in broken}
        for rid in self.kept_failed:
            if statuses.get(rid) not in FAILED:
                self.violation(f"kept failure record {BROKEN}/{rid} lost: {statuses.get(rid)}")


async def run_seeds(
    seeds: list[int], rounds: int, tmp_root: str, *, secure: bool = False, out: object = sys.stdout
) -> list[Report]:
    """Run each seed on a fresh cluster, one after the other, printing a line per run."""
    reports = []
    for seed in seeds:
        folder = os.path.join(tmp_root, f"seed{seed}")
        os.makedirs(folder, exist_ok=True)
        report = await Chaos(folder, seed, secure=secure).run(rounds)
        reports.append(report)
        print(
            f"seed {seed}: rounds {report.rounds} kills {dict(report.kills)} scenarios {dict(report.scenarios)} "
            f"racing {report.racing} unacknowledged {report.unacknowledged} "
            f"violations {len(report.violations)} seconds {report.seconds:.1f}",
            file=out,  # type: ignore[arg-type]
            flush=True,
        )
        for line in report.violations:
            print(f"  {line}", file=out, flush=True)  # type: ignore[arg-type]
    return reports

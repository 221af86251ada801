"""Controller at scale: thousands of replicas from create to all READY, a kill -9 and restart, and
1,000 services listed.

The provisioner is the scripted one from tests/helpers (replicas are records, not processes, each
answering at its own path of one local server), so the figures are the controller's own cost; the
controller and the prober are real processes. Run from the repo root:
`python bench/controller_scale.py`. Prints `figure:` lines:

- scale_<n>_all_ready_s, ready_10k_s: one service of n replicas, CreateService to all READY.
- scale_exponent: b of time = a * n^b, fitted over the sizes (1.0 is linear); scale_cpu_exponent
  the same over the controller's CPU seconds (the steadier figure on a shared machine).
- controller_cpu_10k_cores, controller_rss_10k_mib: steady CPU (1.0 = one core) and RSS of the
  controller holding the largest size READY, probes at the default 10 s interval.
- restart_10k_s: kill -9 of that controller, then a new process on the same store: from its start
  to every replica READY in a fresh WatchService snapshot. The bench then checks that the
  provisioner saw no Launch and no Terminate since the kill (0 relaunches, 0 teardowns), and waits
  until every replica's own path was requested by the prober after the restart (every replica
  re-probed); reprobed_10k_s is that time.
- services_1000x10_ready_s, create_1000_services_s: 1,000 services of 10 replicas (CreateService
  calls 16 at a time), to all 10,000 READY; list_services_p99_ms, list_replicas_p99_ms: listing
  them page by page (100 a page) while they run.

With BENCH_SMOKE=1 (or --smoke) it runs tiny sizes through every step, and checks that the full
sizes' specs are accepted by the controller as this bench configures it (a dry-run update).
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
sys.path.insert(1, os.path.join(sys.path[0], "gen", "python"))

import grpc  # noqa: E402

from replicaplane.controller.v1 import controller_service_pb2 as api  # noqa: E402
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc  # noqa: E402
from tests.helpers import bench, fake_provisioner, procs  # noqa: E402

SIZES = bench.pick((1000, 3000, 10000), (20, 60, 200))
FULL_LARGEST = 10000
SERVICES, PER_SERVICE = bench.pick((1000, 10), (20, 3))
CREATE_CONCURRENCY = 16
CPU_WINDOW_S = bench.pick(10.0, 0.5)
LIST_ROUNDS = bench.pick(20, 3)
PAGE = 100


def spec_yaml(name: str, size: int) -> str:
    """One service of `size` replicas."""
    return (
        f"name: {name}\nservice:\n  readiness_probe: /health\n  replicas: {size}\nresources:\n  ports: 8080\nrun: x\n"
    )


def controller_env(state_dir: str, provisioner_addr: str, prober_addr: str) -> dict[str, str]:
    """The controller process's settings: its replica caps fit the full run's largest size."""
    return {
        "REPLICAPLANE_CONTROLLER_STATE_DIR": state_dir,
        "REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR": provisioner_addr,
        "REPLICAPLANE_CONTROLLER_PROBER_ADDRS": prober_addr,
        "REPLICAPLANE_CONTROLLER_DRAIN_S": "0",
        "REPLICAPLANE_CONTROLLER_MAX_REPLICAS_PER_SERVICE": str(FULL_LARGEST),
        "REPLICAPLANE_CONTROLLER_MAX_REPLICAS_TOTAL": str(FULL_LARGEST),
        "REPLICAPLANE_CONTROLLER_METRICS_ADDR": "",
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """Resident memory of a process, MiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def exponent(sizes: Sequence[int], seconds: Sequence[float]) -> float:
    """b of seconds = a * size^b, least squares over the logs."""
    xs, ys = [math.log(n) for n in sizes], [math.log(max(s, 1e-6)) for s in seconds]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, math.ceil(len(ordered) * 0.99) - 1)]


class Controller:
    """A controller process on one state dir, started again after a kill."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc: procs.ServiceProcess | None = None
        self.channel: grpc.aio.Channel | None = None
        self.stub: api_grpc.ControllerServiceStub

    async def start(self) -> None:
        # In a thread: the scripted provisioner serves on this loop while the controller starts.
        self.proc = await asyncio.to_thread(procs.start_service, "controller", env=self.env)
        self.channel = grpc.aio.insecure_channel(self.proc.addr)
        self.stub = api_grpc.ControllerServiceStub(self.channel)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.proc.pid

    async def kill(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.proc is not None:
            self.proc.kill()

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.proc is not None:
            await asyncio.to_thread(self.proc.stop)


async def wait_ready(stub: api_grpc.ControllerServiceStub, name: str, count: int) -> None:
    async for msg in stub.WatchService(api.WatchServiceRequest(service_name=name), timeout=600):
        if msg.service.ready_replicas >= count:
            return


async def delete(stub: api_grpc.ControllerServiceStub, name: str) -> float:
    t0 = time.monotonic()
    watch = stub.WatchService(api.WatchServiceRequest(service_name=name), timeout=600)
    await stub.DeleteService(api.DeleteServiceRequest(service_name=name))
    async for msg in watch:
        if msg.deleted:
            break
    return time.monotonic() - t0


async def restart(ctl: Controller, fake: fake_provisioner.FakeProvisioner, size: int) -> tuple[float, float]:
    """kill -9 and a new controller on the same store: seconds to all READY, to all re-probed."""
    await ctl.kill()
    launches, terminations = sum(fake.launches.values()), sum(fake.terminations.values())
    fake.requests.clear()
    t0 = time.monotonic()
    await ctl.start()
    await wait_ready(ctl.stub, "big", size)
    ready_s = time.monotonic() - t0
    while len(fake.requests) < size:  # each replica answers at its own path
        if time.monotonic() - t0 > 120:
            raise RuntimeError(f"only {len(fake.requests)} of {size} replicas re-probed in 120 s")
        await asyncio.sleep(0.05)
    reprobed_s = time.monotonic() - t0
    relaunched = sum(fake.launches.values()) - launches
    torn_down = sum(fake.terminations.values()) - terminations
    if relaunched or torn_down:
        raise RuntimeError(f"restart relaunched {relaunched} and tore down {torn_down} replicas")
    return ready_s, reprobed_s


async def one_service(size: int, largest: bool) -> dict[str, float]:
    """One service of `size` replicas; for the largest size also steady cost and a restart."""
    out: dict[str, float] = {}
    async with fake_provisioner.serving(endpoint_per_replica=True) as (fake, provisioner_addr):
        prober = await asyncio.to_thread(procs.start_service, "prober")
        state_dir = tempfile.mkdtemp(prefix="rp-bench-scale-")
        ctl = Controller(controller_env(state_dir, provisioner_addr, prober.addr))
        await ctl.start()
        try:
            t0, c0 = time.monotonic(), cpu_seconds(ctl.pid)
            await ctl.stub.CreateService(api.CreateServiceRequest(yaml=spec_yaml("big", size)))
            await wait_ready(ctl.stub, "big", size)
            out["ready_s"], out["cpu_s"] = time.monotonic() - t0, cpu_seconds(ctl.pid) - c0
            if largest:
                # The full run's largest spec must pass this controller's checks, or the bench has rotted.
                await ctl.stub.UpdateService(
                    api.UpdateServiceRequest(service_name="big", yaml=spec_yaml("big", FULL_LARGEST), dry_run=True)
                )
                await asyncio.sleep(CPU_WINDOW_S / 2)  # the launch burst's tail
                c1, t1 = cpu_seconds(ctl.pid), time.monotonic()
                await asyncio.sleep(CPU_WINDOW_S)
                out["steady_cpu"] = (cpu_seconds(ctl.pid) - c1) / (time.monotonic() - t1)
                out["rss_mib"] = rss_mib(ctl.pid)
                out["restart_s"], out["reprobed_s"] = await restart(ctl, fake, size)
            out["delete_s"] = await delete(ctl.stub, "big")
        finally:
            await ctl.stop()
            await asyncio.to_thread(prober.stop)
    return out


async def list_all(stub: api_grpc.ControllerServiceStub, samples: list[float]) -> list[api.ListServicesResponse]:
    pages, token = [], ""
    while True:
        t0 = time.perf_counter()
        page = await stub.ListServices(api.ListServicesRequest(page_size=PAGE, page_token=token))
        samples.append((time.perf_counter() - t0) * 1000)
        pages.append(page)
        token = page.next_page_token
        if not token:
            return pages


async def many_services() -> dict[str, float]:
    """SERVICES services of PER_SERVICE replicas: create, all READY, listings."""
    out: dict[str, float] = {}
    names = [f"s{i:04d}" for i in range(SERVICES)]
    async with fake_provisioner.serving(endpoint_per_replica=True) as (_, provisioner_addr):
        prober = await asyncio.to_thread(procs.start_service, "prober")
        ctl = Controller(controller_env(tempfile.mkdtemp(prefix="rp-bench-many-"), provisioner_addr, prober.addr))
        await ctl.start()
        try:
            t0 = time.monotonic()
            queue = list(reversed(names))

            async def creator() -> None:
                while queue:
                    name = queue.pop()
                    await ctl.stub.CreateService(api.CreateServiceRequest(yaml=spec_yaml(name, PER_SERVICE)))

            await asyncio.gather(*(creator() for _ in range(CREATE_CONCURRENCY)))
            out["create_s"] = time.monotonic() - t0
            while True:
                pages = await list_all(ctl.stub, [])
                if sum(s.ready_replicas for p in pages for s in p.services) >= SERVICES * PER_SERVICE:
                    break
                await asyncio.sleep(0.2)
            out["ready_s"] = time.monotonic() - t0
            services_ms: list[float] = []
            replicas_ms: list[float] = []
            for i in range(LIST_ROUNDS):
                await list_all(ctl.stub, services_ms)
                for name in names[i :: max(1, len(names) // 50)]:
                    t1 = time.perf_counter()
                    await ctl.stub.ListReplicas(api.ListReplicasRequest(service_name=name, page_size=PAGE))
                    replicas_ms.append((time.perf_counter() - t1) * 1000)
            out["list_services_p99_ms"], out["list_replicas_p99_ms"] = p99(services_ms), p99(replicas_ms)
            out["list_calls"] = len(services_ms)
        finally:
            await ctl.stop()
            await asyncio.to_thread(prober.stop)
    return out


async def main() -> None:
    bench.announce()
    ready: list[float] = []
    cpu: list[float] = []
    largest: dict[str, float] = {}
    for size in SIZES:
        got = await one_service(size, size == SIZES[-1])
        ready.append(got["ready_s"])
        cpu.append(got["cpu_s"])
        print(f"{size} replicas: all READY in {got['ready_s']:.2f} s ({got['cpu_s']:.2f} s controller CPU)", flush=True)
        print(f"figure: scale_{size}_all_ready_s {got['ready_s']:.2f} s")
        print(f"figure: scale_{size}_delete_s {got['delete_s']:.2f} s", flush=True)
        largest = got
    n = SIZES[-1]
    print(f"{n} replicas held READY: {largest['steady_cpu']:.3f} cores, {largest['rss_mib']:.0f} MiB RSS")
    print(f"kill -9 and restart with {n} replicas: all READY in {largest['restart_s']:.2f} s, every replica")
    print(f"probed again in {largest['reprobed_s']:.2f} s, 0 launches and 0 teardowns since the kill")
    print(f"scale_exponent fitted over {', '.join(map(str, SIZES))} replicas")
    print(f"figure: ready_10k_s {ready[-1]:.2f} s")
    print(f"figure: scale_exponent {exponent(SIZES, ready):.2f} exponent")
    print(f"figure: scale_cpu_exponent {exponent(SIZES, cpu):.2f} exponent")
    print(f"figure: controller_cpu_10k_cores {largest['steady_cpu']:.3f} cores")
    print(f"figure: controller_rss_10k_mib {largest['rss_mib']:.0f} MiB")
    print(f"figure: restart_10k_s {largest['restart_s']:.2f} s")
    print(f"figure: reprobed_10k_s {largest['reprobed_s']:.2f} s", flush=True)
    many = await many_services()
    label = f"{SERVICES}x{PER_SERVICE}"
    print(f"{label}: {many['list_calls']:.0f} ListServices calls of {PAGE} services")
    print(f"figure: create_{SERVICES}_services_s {many['create_s']:.2f} s")
    print(f"figure: services_{label}_ready_s {many['ready_s']:.2f} s")
    print(f"figure: list_services_p99_ms {many['list_services_p99_ms']:.1f} ms")
    print(f"figure: list_replicas_p99_ms {many['list_replicas_p99_ms']:.1f} ms")


if __name__ == "__main__":
    asyncio.run(main())

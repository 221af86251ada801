"""Autoscaler benchmark: how soon a scale-up launches once its delay has elapsed, and what the
controller costs while it holds 1,000 replicas under steady load.

The controller and a prober run as processes; the provisioner is the scripted one from
tests/helpers (replicas are records answering at one local endpoint), so the figures are the
controller's own. Run from the repo root: `python bench/autoscaler.py`. Prints `figure:` lines.

- load_to_launch_ms: a load report raises the wanted replicas by one; from the report plus the
  upscale delay to the provisioner receiving the launch (median of ROUNDS).
- controller_cpu_1k_replicas: the controller's CPU time over a steady WINDOW_S divided by the
  window (1.0 = one core), holding 1,000 READY replicas while a load report of 1,000 request
  times arrives every second and probes run at the default 10 s interval.

With BENCH_SMOKE=1 (or --smoke) it runs 2 rounds and 20 replicas for 1 s, and checks that the
1,000-replica spec is accepted by the controller as this bench configures it (a dry-run update).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
sys.path.insert(1, os.path.join(sys.path[0], "gen", "python"))

import grpc  # noqa: E402

from replicaplane.controller.v1 import controller_service_pb2 as api  # noqa: E402
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc  # noqa: E402
from services.common import pbtime  # noqa: E402
from tests.helpers import bench, fake_provisioner, procs  # noqa: E402

ROUNDS = bench.pick(10, 2)
UPSCALE_DELAY_S = 0.5
FULL_REPLICAS = 1000
REPLICAS = bench.pick(FULL_REPLICAS, 20)
WINDOW_S = bench.pick(10.0, 1.0)
SETTLE_S = bench.pick(3.0, 0.5)

LATENCY_YAML = f"""name: lat
service:
  readiness_probe: /health
  replica_policy:
    min_replicas: 1
    max_replicas: 50
    target_qps_per_replica: 1
    upscale_delay_seconds: {UPSCALE_DELAY_S}
    downscale_delay_seconds: 3600
resources:
  ports: 8080
run: x
"""


def big_yaml(replicas: int) -> str:
    """A service held at `replicas` (min = max, within the controller's default replica cap) under
    load that alone would want half as many; the autoscaler still decides on every report."""
    return f"""name: big
service:
  readiness_probe: /health
  replica_policy:
    min_replicas: {replicas}
    max_replicas: {replicas}
    target_qps_per_replica: 2
resources:
  ports: 8080
run: x
"""


def controller_env(state_dir: str, provisioner_addr: str, prober_addr: str) -> dict[str, str]:
    """The controller process's environment (its settings)."""
    return {
        "REPLICAPLANE_CONTROLLER_STATE_DIR": state_dir,
        "REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR": provisioner_addr,
        "REPLICAPLANE_CONTROLLER_PROBER_ADDRS": prober_addr,
        "REPLICAPLANE_CONTROLLER_DRAIN_S": "0",
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_ready(stub: api_grpc.ControllerServiceStub, name: str, count: int) -> None:
    async for msg in stub.WatchService(api.WatchServiceRequest(service_name=name)):
        if msg.service.ready_replicas >= count:
            return


async def load_to_launch(stub: api_grpc.ControllerServiceStub, fake: fake_provisioner.FakeProvisioner) -> list[float]:
    """Milliseconds from (report + delay) to the launch, one sample per round."""
    await stub.CreateService(api.CreateServiceRequest(yaml=LATENCY_YAML))
    await wait_ready(stub, "lat", 1)
    # Half a replica's worth first, then each 60 more requests in the 60 s window are one more
    # request per second: one more replica, never on a rounding edge.
    await stub.ReportLoad(api.ReportLoadRequest(service_name="lat", request_count=30))
    samples = []
    for _ in range(ROUNDS):
        known = set(fake.launch_times)
        t0 = time.monotonic()
        await stub.ReportLoad(api.ReportLoadRequest(service_name="lat", request_count=60))
        deadline = t0 + 30
        while not set(fake.launch_times) - known:
            if time.monotonic() > deadline:
                raise RuntimeError("no launch within 30 s of a load report")
            await asyncio.sleep(0.001)
        (name,) = set(fake.launch_times) - known
        samples.append((fake.launch_times[name] - (t0 + UPSCALE_DELAY_S)) * 1000)
    return samples


async def steady_cpu(stub: api_grpc.ControllerServiceStub, pid: int) -> float:
    """Fraction of one core the controller uses holding REPLICAS replicas under steady load."""
    await stub.CreateService(api.CreateServiceRequest(yaml=big_yaml(REPLICAS)))
    stop = asyncio.Event()

    async def report() -> None:
        sequence = 0
        while not stop.is_set():
            sequence += 1
            ages = [pbtime.duration(i / REPLICAS) for i in range(REPLICAS)]  # as a balancer sends them
            await stub.ReportLoad(
                api.ReportLoadRequest(service_name="big", balancer_id="bench", sequence=sequence, request_ages=ages)
            )
            await asyncio.sleep(1.0)

    reporter = asyncio.create_task(report())
    try:
        await wait_ready(stub, "big", REPLICAS)
        # The full run's spec must pass this controller's checks, or the bench has rotted.
        await stub.UpdateService(
            api.UpdateServiceRequest(service_name="big", yaml=big_yaml(FULL_REPLICAS), dry_run=True)
        )
        await asyncio.sleep(SETTLE_S)  # let the launch burst settle
        c0, t0 = cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(WINDOW_S)
        return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
    finally:
        stop.set()
        await reporter


async def main() -> None:
    bench.announce()
    async with fake_provisioner.serving() as (fake, provisioner_addr):
        prober = procs.start_service("prober")
        state_dir = tempfile.mkdtemp(prefix="rp-bench-autoscaler-")
        controller = procs.start_service("controller", env=controller_env(state_dir, provisioner_addr, prober.addr))
        channel = grpc.aio.insecure_channel(controller.addr)
        stub = api_grpc.ControllerServiceStub(channel)
        try:
            samples = await load_to_launch(stub, fake)
            cpu = await steady_cpu(stub, controller.proc.pid)
        finally:
            await channel.close()
            controller.stop()
            prober.stop()
    median = statistics.median(samples)
    print(f"load to launch: median {median:.1f} ms, max {max(samples):.1f} ms over {ROUNDS} scale-ups")
    print(f"controller with {REPLICAS} replicas under steady load: {cpu:.3f} of one core")
    print(f"figure: load_to_launch_ms {median:.1f} ms")
    print(f"figure: controller_cpu_1k_replicas {cpu:.3f} cores")


if __name__ == "__main__":
    asyncio.run(main())

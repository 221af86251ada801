"""Controller at scale: one service of thousands of replicas, from create to all READY and back.

The provisioner is the scripted one from tests/helpers (replicas are records, not processes, all
answering at one local endpoint), so the figure is the controller's own cost; the prober is a
real process. Run from the repo root: `python bench/controller_scale.py`. Prints `figure:` lines.
With BENCH_SMOKE=1 (or --smoke) it runs tiny sizes and checks that the full sizes' spec is
accepted by the controller as this bench configures it (a dry-run update).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
sys.path.insert(1, os.path.join(sys.path[0], "gen", "python"))

import grpc  # noqa: E402

from replicaplane.controller.v1 import controller_service_pb2 as api  # noqa: E402
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc  # noqa: E402
from services.controller import server as controller_server  # noqa: E402
from tests.helpers import bench, fake_provisioner, procs  # noqa: E402

SIZES = (1000, 3000)
SMOKE_SIZES = (20, 60)


def spec_yaml(size: int) -> str:
    """One service of `size` replicas."""
    return f"name: big\nservice:\n  readiness_probe: /health\n  replicas: {size}\nresources:\n  ports: 8080\nrun: x\n"


def controller_settings(provisioner_addr: str, prober_addr: str, state_dir: str) -> controller_server.Settings:
    """The in-process controller's settings: its replica cap fits the largest size."""
    return controller_server.Settings(
        listen_addr="127.0.0.1:0",
        state_dir=state_dir,
        provisioner_addr=provisioner_addr,
        prober_addrs=prober_addr,
        drain_s=0,
        max_replicas_per_service=max(SIZES),
    )


async def run(size: int) -> tuple[float, float, float]:
    """Seconds to all READY, controller CPU seconds for it, seconds to delete."""
    async with fake_provisioner.serving() as (_, provisioner_addr):
        return await measure(size, provisioner_addr)


async def measure(size: int, provisioner_addr: str) -> tuple[float, float, float]:
    """run() with the provisioner up."""
    prober = procs.start_service("prober")
    running = await controller_server.start(
        controller_settings(provisioner_addr, prober.addr, tempfile.mkdtemp(prefix="rp-bench-scale-"))
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    stub = api_grpc.ControllerServiceStub(channel)
    yaml_text = spec_yaml(size)
    try:
        t0, c0 = time.monotonic(), time.process_time()
        await stub.CreateService(api.CreateServiceRequest(yaml=yaml_text))
        async for msg in stub.WatchService(api.WatchServiceRequest(service_name="big")):
            if msg.service.ready_replicas == size:
                break
        ready_s, cpu_s = time.monotonic() - t0, time.process_time() - c0
        # The full run's largest spec must pass this controller's checks, or the bench has rotted.
        await stub.UpdateService(api.UpdateServiceRequest(service_name="big", yaml=spec_yaml(max(SIZES)), dry_run=True))
        t1 = time.monotonic()
        watch = stub.WatchService(api.WatchServiceRequest(service_name="big"))
        await stub.DeleteService(api.DeleteServiceRequest(service_name="big"))
        async for msg in watch:
            if msg.deleted:
                break
        return ready_s, cpu_s, time.monotonic() - t1
    finally:
        await channel.close()
        await running.stop(None)
        prober.stop()


async def main() -> None:
    bench.announce()
    for size in bench.pick(SIZES, SMOKE_SIZES):
        ready_s, cpu_s, delete_s = await run(size)
        print(f"{size} replicas: all READY in {ready_s:.2f} s ({cpu_s:.2f} s CPU in this process)")
        print(f"figure: scale_{size}_all_ready_s {ready_s:.2f} s")
        print(f"figure: scale_{size}_delete_s {delete_s:.2f} s")


if __name__ == "__main__":
    asyncio.run(main())

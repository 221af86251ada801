"""Provisioner benchmark: launch dispatch latency and app-exit event latency.

Starts a provisioner (local backend) on loopback, launches 60 replicas at a steady pace (one
every 20 ms, so launches overlap with setups, app starts and exits), and measures:

- launch_first_event: from sending Launch to receiving its first event (QUEUED).
- app_exit_event: from the moment a replica's app exits (it prints $EPOCHREALTIME as its
  last act) to the APP_EXITED event arriving on a WatchReplicas stream. The app's own start
  is excluded.

Run from the repo root: `python bench/provisioner.py`. Ends with `figure:` lines. BENCH_SMOKE=1
(or --smoke) launches 5 replicas whose apps live 0.2 s.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "gen", "python")]

import grpc  # noqa: E402

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb  # noqa: E402
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc  # noqa: E402
from replicaplane.provisioner.v1 import resources_pb2  # noqa: E402
from tests.helpers import bench, provisioner_procs  # noqa: E402
from tests.helpers import procs as service_procs  # noqa: E402
from tests.helpers import provisioner_client as client  # noqa: E402

REPLICAS = bench.pick(60, 5)
PACE_S = 0.02
APP_LIFE_S = bench.pick(1.0, 0.2)
# The app's last act is to print the exit time; bash then exits with code 3 at once.
RUN = f'sleep {APP_LIFE_S}; echo "EXIT_AT $EPOCHREALTIME"; exit 3'


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


async def run(addr: str, state_dir: str) -> dict[str, float]:
    """Launch, measure, tear down; returns the figures."""
    first_event_ms: list[float] = []
    running_ms: list[float] = []
    exit_seen: dict[str, float] = {}
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pb_grpc.ProvisionerServiceStub(channel)
        watch = stub.WatchReplicas(pb.WatchReplicasRequest())
        await client.next_event(watch, client.R.REPLICA_EVENT_TYPE_SNAPSHOT_END)
        all_exited = asyncio.Event()

        async def watcher() -> None:
            while True:
                message = await watch.read()
                if message is grpc.aio.EOF:
                    return
                event = message.event
                if event.type == client.R.REPLICA_EVENT_TYPE_APP_EXITED:
                    exit_seen[event.replica.name] = time.time()
                    if len(exit_seen) == REPLICAS:
                        all_exited.set()

        watching = asyncio.create_task(watcher())

        async def launch(i: int) -> None:
            request = client.launch_request(i, "bench", spec_=client.spec(RUN, ports=(8080,)))
            start = time.perf_counter()
            first = True
            async for message in stub.Launch(request):
                if first:
                    first_event_ms.append((time.perf_counter() - start) * 1000)
                    first = False
                if message.event.type == resources_pb2.LAUNCH_EVENT_TYPE_RUNNING:
                    running_ms.append((time.perf_counter() - start) * 1000)

        launches = []
        for i in range(1, REPLICAS + 1):
            launches.append(asyncio.create_task(launch(i)))
            await asyncio.sleep(PACE_S)
        await asyncio.gather(*launches)
        await asyncio.wait_for(all_exited.wait(), 60)
        watch.cancel()
        watching.cancel()

        exit_ms = []
        for i in range(1, REPLICAS + 1):
            name = f"bench-{i}"
            chunks = [c.data async for c in stub.StreamLogs(pb.StreamLogsRequest(name=name))]
            line = next(x for x in b"".join(chunks).decode().splitlines() if x.startswith("EXIT_AT "))
            exit_ms.append((exit_seen[name] - float(line.split()[1])) * 1000)

        async def terminate(i: int) -> None:
            async for _ in stub.Terminate(pb.TerminateRequest(name=f"bench-{i}")):
                pass

        await asyncio.gather(*(terminate(i) for i in range(1, REPLICAS + 1)))
    left = provisioner_procs.wait_no_replicas(state_dir)
    if left:
        raise RuntimeError(f"replica processes left behind: {left}")
    return {
        "launch_first_event_p50_ms": percentile(first_event_ms, 50),
        "launch_first_event_p99_ms": percentile(first_event_ms, 99),
        "launch_running_p50_ms": percentile(running_ms, 50),
        "app_exit_event_p50_ms": percentile(exit_ms, 50),
        "app_exit_event_p99_ms": percentile(exit_ms, 99),
    }


def main() -> None:
    """Start a provisioner, run the benchmark, print the figures."""
    bench.announce()
    work = tempfile.mkdtemp(prefix="rp-bench-provisioner-")
    state_dir = os.path.join(work, "state")
    env = {
        "REPLICAPLANE_PROVISIONER_STATE_DIR": state_dir,
        "REPLICAPLANE_PROVISIONER_KILL_GRACE_S": "1",
        "REPLICAPLANE_LOG_LEVEL": "WARNING",
    }
    svc = service_procs.start_service("provisioner", env=env, workdir=work)
    try:
        figures = asyncio.run(run(svc.addr, state_dir))
    finally:
        svc.stop()
        provisioner_procs.kill_replicas(state_dir)
    print(f"replicas: {REPLICAS}, launched every {PACE_S * 1000:.0f} ms, each app living {APP_LIFE_S} s")
    for name, value in figures.items():
        print(f"figure: {name} {value:.2f} ms")


if __name__ == "__main__":
    main()

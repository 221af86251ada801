"""Provisioner benchmark: launch dispatch latency, app-exit event latency and job dispatch latency.

Starts a provisioner (local backend) on loopback, launches 60 replicas at a steady pace (one
every 20 ms, so launches overlap with setups, app starts and exits), and measures:

- launch_first_event: from sending Launch to receiving its first event (QUEUED).
- app_exit_event: from the moment a replica's app exits (it prints $EPOCHREALTIME as its
  last act) to the APP_EXITED event arriving on a WatchReplicas stream. The app's own start
  is excluded.

Then it launches 2 pool workers and runs 200 jobs on them, one at a time per worker, and
measures:

- job_start: from sending RunJob to the job's command running (its first act prints
  $EPOCHREALTIME): the provisioner's part of dispatching a job to a free READY worker, bash's
  start included.
- job_started_event: from sending RunJob to receiving its STARTED event.

Run from the repo root: `python bench/provisioner.py`. Ends with `figure:` lines. BENCH_SMOKE=1
(or --smoke) launches 5 replicas whose apps live 0.2 s, and runs 10 jobs.
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
WORKERS = 2
JOBS = bench.pick(200, 10)
JOB_RUN = 'echo "STARTED_AT $EPOCHREALTIME"'


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
        job_figures = await run_jobs(stub)
    left = provisioner_procs.wait_no_replicas(state_dir)
    if left:
        raise RuntimeError(f"replica processes left behind: {left}")
    return {
        "launch_first_event_p50_ms": percentile(first_event_ms, 50),
        "launch_first_event_p99_ms": percentile(first_event_ms, 99),
        "launch_running_p50_ms": percentile(running_ms, 50),
        "app_exit_event_p50_ms": percentile(exit_ms, 50),
        "app_exit_event_p99_ms": percentile(exit_ms, 99),
        **job_figures,
    }


async def run_jobs(stub: pb_grpc.ProvisionerServiceStub) -> dict[str, float]:
    """Launch the workers, run the jobs on them one at a time each, tear the workers down."""
    for w in range(1, WORKERS + 1):
        events = [m.event async for m in stub.Launch(client.worker_request(w, "benchpool", setup="true"))]
        if events[-1].type != resources_pb2.LAUNCH_EVENT_TYPE_SETUP_DONE:
            raise RuntimeError(f"worker {w} did not get ready: {events[-1].message}")
    sent: dict[str, float] = {}
    started_event_ms: list[float] = []

    async def worker_loop(w: int) -> None:
        for n in range(w, JOBS + 1, WORKERS):
            job_id = f"job-{n}"
            sent[job_id] = time.time()
            start = time.perf_counter()
            async for message in stub.RunJob(client.job_request(job_id, f"benchpool-{w}", JOB_RUN)):
                if message.event.type == resources_pb2.JOB_EVENT_TYPE_STARTED:
                    started_event_ms.append((time.perf_counter() - start) * 1000)
                elif message.event.type != resources_pb2.JOB_EVENT_TYPE_EXITED:
                    raise RuntimeError(f"{job_id}: {message.event.message}")

    await asyncio.gather(*(worker_loop(w) for w in range(1, WORKERS + 1)))
    start_ms = []
    for job_id, at in sent.items():
        request = pb.StreamLogsRequest(kind=resources_pb2.LOG_KIND_JOB, job_id=job_id)
        text = b"".join([c.data async for c in stub.StreamLogs(request)]).decode()
        line = next(x for x in text.splitlines() if x.startswith("STARTED_AT "))
        start_ms.append((float(line.split()[1]) - at) * 1000)
    for w in range(1, WORKERS + 1):
        async for _ in stub.Terminate(pb.TerminateRequest(name=f"benchpool-{w}")):
            pass
    return {
        "job_start_p50_ms": percentile(start_ms, 50),
        "job_start_p99_ms": percentile(start_ms, 99),
        "job_started_event_p50_ms": percentile(started_event_ms, 50),
        "job_started_event_p99_ms": percentile(started_event_ms, 99),
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
    print(f"jobs: {JOBS} on {WORKERS} workers, one at a time per worker")
    for name, value in figures.items():
        print(f"figure: {name} {value:.2f} ms")


if __name__ == "__main__":
    main()

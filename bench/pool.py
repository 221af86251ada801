"""Pool benchmark: job dispatch and scale-from-zero, through the controller's API, with the three
real services and real workers (local backend).

- job_dispatch: a job submitted (SubmitJob sent) while a READY worker is free -> its command
  running (its first act prints $EPOCHREALTIME). The controller's queue and dispatch, the
  provisioner's RunJob and bash's start. Jobs one at a time on a pool of 2 workers.
- queue_to_launch: the first job submitted to an empty pool (`min_workers: 0`) -> the worker's
  launch accepted by the provisioner (its create time). The queue-length decision and the
  launch dispatch.

Run from the repo root: `python bench/pool.py`. Prints `figure:` lines. BENCH_SMOKE=1 (or --smoke)
runs 3 dispatch samples and 1 scale-from-zero sample.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import sys
import tempfile
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
sys.path.insert(1, os.path.join(sys.path[0], "gen", "python"))

from replicaplane.controller.v1 import controller_service_pb2 as api  # noqa: E402
from replicaplane.controller.v1 import resources_pb2 as res  # noqa: E402
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb  # noqa: E402
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc  # noqa: E402
from services.common import clients  # noqa: E402
from tests.helpers import bench  # noqa: E402
from tests.helpers import cluster as cl  # noqa: E402

JOBS = bench.pick(100, 3)
ZERO_SAMPLES = bench.pick(5, 1)
ENDED = (res.JOB_STATE_SUCCEEDED, res.JOB_STATE_FAILED, res.JOB_STATE_CANCELLED)


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


async def run_job(c: cl.Cluster, pool: str) -> float:
    """Milliseconds from SubmitJob to the job's command running."""
    t0 = time.time()
    job = (await c.stub.SubmitJob(api.SubmitJobRequest(pool=pool, run='echo "STARTED_AT $EPOCHREALTIME"'))).job
    out = b""
    last = job
    async for msg in c.stub.WatchJob(api.WatchJobRequest(pool=pool, job_id=job.job_id)):
        out += msg.output
        if msg.HasField("job"):
            last = msg.job
    if last.state != res.JOB_STATE_SUCCEEDED:
        raise RuntimeError(f"job {job.job_id} ended {res.JobState.Name(last.state)}: {last.message}")
    started = float(out.decode().split("STARTED_AT ", 1)[1].split()[0])
    return (started - t0) * 1000


async def dispatch_figures(c: cl.Cluster) -> list[float]:
    """job_dispatch samples on a pool of 2 READY workers."""
    await c.stub.CreateService(api.CreateServiceRequest(yaml="name: jobs\npool:\n  workers: 2\nsetup: echo ready\n"))
    w = cl.Watch(c.stub, "jobs")
    await w.until(lambda w: w.count(res.REPLICA_STATUS_READY) == 2, timeout=120)
    w.cancel()
    await run_job(c, "jobs")  # warm up: the first job's channel and processes
    return [await run_job(c, "jobs") for _ in range(JOBS)]


async def queue_to_launch_ms(c: cl.Cluster, prov: prov_grpc.ProvisionerServiceStub, i: int) -> float:
    """Milliseconds from the first job into an empty pool to its worker's launch at the provisioner."""
    name = f"zero{i}"
    yaml_text = f"name: {name}\npool:\n  min_workers: 0\n  max_workers: 1\nsetup: echo ready\n"
    await c.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text))
    w = cl.Watch(c.stub, name)
    await w.until(lambda w: w.service is not None and w.service.status != res.SERVICE_STATUS_CONTROLLER_INIT)
    await asyncio.sleep(0.2)
    t0 = time.time()
    await c.stub.SubmitJob(api.SubmitJobRequest(pool=name, run="true"))
    await w.until(lambda w: bool(w.replicas), timeout=30)
    replica = next(iter(w.replicas.values()))
    w.cancel()
    for _ in range(200):
        try:
            got = await prov.GetReplica(prov_pb.GetReplicaRequest(name=replica.replica_name), timeout=5)
            break
        except Exception:  # not at the provisioner yet
            await asyncio.sleep(0.01)
    created = got.replica.create_time.seconds + got.replica.create_time.nanos / 1e9
    await c.stub.DeleteService(api.DeleteServiceRequest(service_name=name))
    return (created - t0) * 1000


async def main() -> None:
    bench.announce()
    with tempfile.TemporaryDirectory(prefix="bench-pool-") as tmp:
        c = cl.Cluster(tmp)
        try:
            prov = prov_grpc.ProvisionerServiceStub(clients.channel(c.provisioner.addr))
            dispatch = await dispatch_figures(c)
            zero = [await queue_to_launch_ms(c, prov, i) for i in range(ZERO_SAMPLES)]
        finally:
            await c.close()
    print(f"figure: job_dispatch_p50_ms {percentile(dispatch, 50):.2f} ms")
    print(f"figure: job_dispatch_p99_ms {percentile(dispatch, 99):.2f} ms")
    print(f"figure: queue_to_launch_ms {statistics.median(zero):.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())

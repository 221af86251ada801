"""End to end: a pool on the local backend, through the controller's API, with real workers and jobs.

- `min_workers: 0, max_workers: 3`: 6 jobs submitted at once launch 3 workers, every job
  SUCCEEDS, no worker runs two jobs at once, and the pool scales back to 0.
- A worker killed mid-job: its job runs again on another worker and succeeds.
- A killed worker is replaced at once, even with an hour's failure window.
- `kill -9` of the controller with jobs queued and running: after the restart no job is lost,
  none ran twice at once, finished jobs keep their results.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal

import pytest

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.helpers import cluster as cl

pytestmark = pytest.mark.e2e

ENDED = (res.JOB_STATE_SUCCEEDED, res.JOB_STATE_FAILED, res.JOB_STATE_CANCELLED)


def pool_yaml(name: str, pool: str, setup: str = "echo ready") -> str:
    return f"name: {name}\npool:\n{pool}\nsetup: {setup}\n"


async def _jobs(c: cl.Cluster, pool: str) -> list[res.Job]:
    return list((await c.stub.ListJobs(api.ListJobsRequest(pool=pool), timeout=5)).jobs)


async def _until_jobs(c: cl.Cluster, pool: str, check, timeout: float = 60) -> list[res.Job]:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not check(jobs := await _jobs(c, pool)):
            await asyncio.sleep(0.1)
    return jobs


def _no_overlap(jobs: list[res.Job]) -> None:
    """No worker ran two jobs at once (each job's last run, start to end)."""
    by_worker: dict[int, list[tuple[int, int]]] = {}
    for j in jobs:
        by_worker.setdefault(j.replica_id, []).append((j.start_time.ToNanoseconds(), j.end_time.ToNanoseconds()))
    for runs in by_worker.values():
        runs.sort()
        for (_, end), (start, _) in itertools.pairwise(runs):
            assert end <= start, runs


async def test_a_pool_grows_with_its_queue_runs_every_job_and_shrinks_to_zero(cluster: cl.Cluster) -> None:
    spec = "  min_workers: 0\n  max_workers: 3\n  upscale_delay_seconds: 0\n  downscale_delay_seconds: 1\n"
    svc = (await cluster.stub.CreateService(api.CreateServiceRequest(yaml=pool_yaml("batch", spec)))).service
    assert svc.kind == spec_pb2.FLEET_KIND_POOL
    w = cl.Watch(cluster.stub, "batch")
    for i in range(6):
        await cluster.stub.SubmitJob(
            api.SubmitJobRequest(pool="batch", run=f'sleep 1; echo "job {i} $SKYPILOT_JOB_ID"', name=f"j{i}")
        )
    jobs = await _until_jobs(cluster, "batch", lambda js: len(js) == 6 and all(j.state in ENDED for j in js), 120)
    assert {j.state for j in jobs} == {res.JOB_STATE_SUCCEEDED}
    assert all(j.attempts == 1 and j.recoveries == 0 for j in jobs)
    _no_overlap(jobs)
    assert {j.replica_id for j in jobs} <= {1, 2, 3}
    # Back to zero: every worker torn down after the downscale delay, no endpoint or balancer.
    await w.until(lambda w: 3 in w.seen_statuses, timeout=30)
    await w.until(lambda w: not w.replicas, timeout=60)
    assert max(w.seen_statuses) == 3  # three workers were launched, no more
    svc = (await cluster.stub.GetService(api.GetServiceRequest(service_name="batch"))).service
    assert (svc.queued_jobs, svc.running_jobs, svc.load_balancer_url, list(svc.endpoints)) == (0, 0, "", [])
    assert svc.HasField("uptime_start_time")
    out = b""
    async for msg in cluster.stub.WatchJob(api.WatchJobRequest(pool="batch", job_id=1)):
        out += msg.output
    assert out.decode().startswith("job 0 batch-")
    w.cancel()


def _kill_worker(cluster: cl.Cluster, name: str) -> None:
    os.killpg(cluster.replica_pgid(name), signal.SIGKILL)


async def test_a_worker_killed_mid_job_reruns_it_on_another_worker(cluster: cl.Cluster) -> None:
    await cluster.stub.CreateService(api.CreateServiceRequest(yaml=pool_yaml("two", "  workers: 2")))
    w = cl.Watch(cluster.stub, "two")
    await w.until(lambda w: w.count(res.REPLICA_STATUS_READY) == 2, timeout=60)
    job = (await cluster.stub.SubmitJob(api.SubmitJobRequest(pool="two", run="sleep 3; echo done"))).job
    running = await _until_jobs(cluster, "two", lambda js: js[0].HasField("start_time"))
    victim = running[0].replica_id
    _kill_worker(cluster, w.replicas[victim].replica_name)
    done = await _until_jobs(cluster, "two", lambda js: js[0].state in ENDED, 60)
    assert done[0].state == res.JOB_STATE_SUCCEEDED
    assert (done[0].recoveries, done[0].attempts) == (1, 2)
    assert done[0].replica_id != victim
    got = (await cluster.stub.GetJob(api.GetJobRequest(pool="two", job_id=job.job_id))).job
    assert got == done[0]
    # The dead worker is replaced (its record kept as failed, as a service's): two READY workers again.
    failed = (res.REPLICA_STATUS_FAILED, res.REPLICA_STATUS_FAILED_PROBING)
    await w.until(lambda w: w.count(res.REPLICA_STATUS_READY) == 2 and w.replicas[victim].status in failed, 60)
    w.cancel()


async def test_a_killed_worker_is_replaced_at_once_not_after_its_failure_window(cluster: cl.Cluster) -> None:
    """The provisioner's word that the worker's processes are gone replaces it: with an hour's
    failure window, only that word can, and its job runs again on the replacement."""
    spec = "  workers: 1\n  failure_threshold_seconds: 3600"
    await cluster.stub.CreateService(api.CreateServiceRequest(yaml=pool_yaml("lone", spec)))
    w = cl.Watch(cluster.stub, "lone")
    await w.until(lambda w: w.count(res.REPLICA_STATUS_READY) == 1, timeout=60)
    await cluster.stub.SubmitJob(api.SubmitJobRequest(pool="lone", run="sleep 1; echo done"))
    await _until_jobs(cluster, "lone", lambda js: js[0].HasField("start_time"))
    _kill_worker(cluster, w.replicas[1].replica_name)
    done = await _until_jobs(cluster, "lone", lambda js: js[0].state in ENDED, 60)
    assert (done[0].state, done[0].replica_id, done[0].recoveries) == (res.JOB_STATE_SUCCEEDED, 2, 1)
    await w.until(lambda w: w.replicas[1].status == res.REPLICA_STATUS_FAILED_PROBING, timeout=30)
    assert w.replicas[1].failure_reason.startswith("replica vanished: "), w.replicas[1].failure_reason
    assert res.REPLICA_STATUS_NOT_READY not in w.seen_statuses[1]  # no window was waited out
    assert w.replicas[2].status == res.REPLICA_STATUS_READY
    w.cancel()


async def test_kill_9_of_the_controller_loses_no_job_and_runs_none_twice(cluster: cl.Cluster) -> None:
    await cluster.stub.CreateService(api.CreateServiceRequest(yaml=pool_yaml("one", "  workers: 1")))
    w = cl.Watch(cluster.stub, "one")
    await w.until(lambda w: w.count(res.REPLICA_STATUS_READY) == 1, timeout=60)
    w.cancel()
    for i in range(3):
        await cluster.stub.SubmitJob(api.SubmitJobRequest(pool="one", run=f"sleep 1; echo {i}"))
    await cluster.stub.SubmitJob(api.SubmitJobRequest(pool="one", run="exit 4"))
    await _until_jobs(cluster, "one", lambda js: js[0].HasField("start_time"))
    await cluster.restart_controller(kill=True)
    jobs = await _until_jobs(cluster, "one", lambda js: all(j.state in ENDED for j in js), 90)
    assert [j.state for j in jobs] == [res.JOB_STATE_SUCCEEDED] * 3 + [res.JOB_STATE_FAILED]
    assert jobs[3].exit_code == 4
    assert all(j.attempts == 1 for j in jobs)
    _no_overlap(jobs)


async def test_replicactl_runs_a_pool_and_its_jobs(cluster: cl.Cluster) -> None:
    from tests.e2e.test_replicactl import replicactl

    addr = cluster.controller.addr
    up = await asyncio.to_thread(replicactl, addr, "up", "examples/pool/pool.yaml", "--wait", "--timeout", "60")
    assert up.returncode == 0, up.stderr
    assert "batch is up: 0/0 worker(s) READY" in up.stdout
    ran = await asyncio.to_thread(
        replicactl, addr, "jobs", "submit", "batch", "--name", "hi", "--logs", "--", 'echo "hi from $DATA_DIR"'
    )
    assert ran.returncode == 0, ran.stderr
    assert "job 1 submitted to pool batch" in ran.stdout and "hi from /tmp/batch-data" in ran.stdout
    assert "job 1: SUCCEEDED" in ran.stderr
    failed = await asyncio.to_thread(replicactl, addr, "jobs", "submit", "batch", "--logs", "--", "exit 3")
    assert failed.returncode == 1 and "FAILED: exited with code 3" in failed.stderr
    listing = await asyncio.to_thread(replicactl, addr, "jobs", "status", "batch")
    rows = [line.split() for line in listing.stdout.splitlines()[2:]]
    assert [r[:3] for r in rows] == [["1", "hi", "SUCCEEDED"], ["2", "-", "FAILED"]]
    status = await asyncio.to_thread(replicactl, addr, "status", "batch")
    assert status.stdout.splitlines()[2].split()[:2] == ["batch", "POOL"]
    assert "batch: pool, 0 job(s) queued, 0 running" in status.stdout

"""A pool through a real controller (scripted provisioner): it is created and shown as a POOL
with no endpoint, the first job queued in an empty pool launches a worker at once, and a service
never becomes a pool by an update (nor a pool a service)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.service import test_controller as tc

POOL = "name: batch\npool: {min_workers: 0, max_workers: 3, upscale_delay_seconds: 0}\nsetup: echo ready\n"


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[tc.Env]:
    async with tc.started(tmp_path) as e:
        yield e


async def test_a_pool_is_shown_as_a_pool_and_its_first_job_launches_a_worker(env: tc.Env) -> None:
    svc = (await env.stub.CreateService(api.CreateServiceRequest(yaml=POOL))).service
    assert (svc.kind, svc.target_replicas, svc.autoscaler.kind) == (spec_pb2.FLEET_KIND_POOL, 0, "queue_length")
    listed = (await env.stub.ListServices(api.ListServicesRequest())).services
    assert [s.kind for s in listed] == [spec_pb2.FLEET_KIND_POOL]
    await asyncio.sleep(0.3)
    assert sum(env.provisioner.launches.values()) == 0  # nothing queued: no worker
    job = (await env.stub.SubmitJob(api.SubmitJobRequest(pool="batch", run="true"))).job
    assert (job.job_id, job.state) == (1, res.JOB_STATE_PENDING)
    async with asyncio.timeout(10):
        while not env.provisioner.launches:
            await asyncio.sleep(0.01)
    svc = (await env.stub.GetService(api.GetServiceRequest(service_name="batch"))).service
    # The scripted provisioner runs no job: it stays queued (or is given to the worker and back).
    assert (svc.queued_jobs + svc.running_jobs, svc.target_replicas, list(svc.endpoints)) == (1, 1, [])


async def test_a_service_never_becomes_a_pool_nor_a_pool_a_service(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec())
    await env.stub.CreateService(api.CreateServiceRequest(yaml=POOL))
    for name, text, field in (("svc", POOL.replace("batch", "svc"), "pool"), ("batch", tc.spec("batch"), "service")):
        for dry_run in (True, False):
            err = await tc.rpc_error(
                env.stub.UpdateService(api.UpdateServiceRequest(service_name=name, yaml=text, dry_run=dry_run))
            )
            assert err.code == grpc.StatusCode.INVALID_ARGUMENT
            assert [f for f, _ in err.field_violations] == [field]
        svc = (await env.stub.GetService(api.GetServiceRequest(service_name=name))).service
        assert svc.latest_version == 1
    w.cancel()


async def test_a_policy_only_change_keeps_the_workers(env: tc.Env) -> None:
    fixed = "name: fixed\npool: {workers: 2}\nsetup: echo ready\n"
    await env.stub.CreateService(api.CreateServiceRequest(yaml=fixed))
    async with asyncio.timeout(10):
        while sum(env.provisioner.launches.values()) < 2:
            await asyncio.sleep(0.01)
    bigger = "name: fixed\npool: {workers: 3, failure_threshold_seconds: 30}\nsetup: echo ready\n"
    plan = (
        await env.stub.UpdateService(api.UpdateServiceRequest(service_name="fixed", yaml=bigger, dry_run=True))
    ).plan
    assert (plan.in_place, list(plan.kept_replica_ids), plan.launch_count) == (True, [1, 2], 1)
    other_setup = "name: fixed\npool: {workers: 2}\nsetup: echo other\n"
    plan = (
        await env.stub.UpdateService(api.UpdateServiceRequest(service_name="fixed", yaml=other_setup, dry_run=True))
    ).plan
    assert not plan.in_place and list(plan.replaced_replica_ids) == [1, 2]

"""Autoscaling through the controller's API: a real controller and prober, the scripted
provisioner (tests/helpers/fake_provisioner.py), small delays and a short load window."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import timestamp_pb2

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import pbtime
from services.controller import server as controller_server
from services.prober import server as prober_server
from tests.helpers import cluster as cl
from tests.helpers import fake_provisioner
from tests.service import test_controller as tc

READY = res.REPLICA_STATUS_READY
FAST = {"qps_window_s": 1.0, "autoscaler_interval_s": 0.2, "autoscaler_zero_interval_s": 0.2}


def scaling_yaml(
    name: str = "auto", *, lo: int = 1, hi: int = 3, up: float = 0.3, down: float = 0.6, extra: str = ""
) -> str:
    return f"""
name: {name}
service:
  readiness_probe:
    path: /health
    endpoint_probe_interval_seconds: 0.1
  replica_policy:
    min_replicas: {lo}
    max_replicas: {hi}
    target_qps_per_replica: 1
    upscale_delay_seconds: {up}
    downscale_delay_seconds: {down}
{extra}resources:
  ports: 8080
run: serve
"""


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[tc.Env]:
    async with tc.started(tmp_path, **FAST) as e:
        yield e


async def test_report_load_refuses_negative_counts_and_malformed_times(env: tc.Env) -> None:
    await tc.create(env, scaling_yaml())
    bad = timestamp_pb2.Timestamp(seconds=int(time.time()), nanos=-1)
    near = pbtime.timestamp(time.time())
    err = await tc.rpc_error(
        env.stub.ReportLoad(api.ReportLoadRequest(service_name="auto", request_count=-1, request_times=[near, bad]))
    )
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [field for field, _ in err.field_violations] == ["request_count", "request_times[1]"]
    far = pbtime.timestamp(time.time() + 3600)  # the sender's clock runs ahead: counted at arrival
    ok = await env.stub.ReportLoad(api.ReportLoadRequest(service_name="auto", request_times=[near, far]))
    assert ok.qps == pytest.approx(2.0)  # the refused report recorded nothing
    err = await tc.rpc_error(env.stub.ReportLoad(api.ReportLoadRequest(service_name="nope", request_count=1)))
    assert err.code == grpc.StatusCode.NOT_FOUND


async def test_load_scales_up_after_the_delay_and_back_down(env: tc.Env) -> None:
    w = await tc.create(env, scaling_yaml())
    await w.until(lambda w: w.count(READY) == 1)
    t0 = time.monotonic()
    await env.stub.ReportLoad(api.ReportLoadRequest(service_name="auto", request_count=3))
    svc = (await env.stub.GetService(api.GetServiceRequest(service_name="auto"))).service
    assert svc.target_replicas == 1  # held for the upscale delay
    a = svc.autoscaler
    assert (a.kind, a.target_replicas, a.min_replicas, a.max_replicas) == ("request_rate", 1, 1, 3)
    assert a.qps == pytest.approx(3.0)
    assert a.last_decision_reason.startswith("scale up to 3 in ")
    assert a.HasField("last_decision_time")
    await w.until(lambda w: w.service.target_replicas == 3)
    assert time.monotonic() - t0 >= 0.3
    assert w.service.autoscaler.last_decision_reason == "scaled up from 1 to 3 after 0.3 s"
    await w.until(lambda w: w.count(READY) == 3)
    # The window empties after 1 s; the lower target holds for the downscale delay.
    await w.until(lambda w: w.service.target_replicas == 1, timeout=10)
    await w.until(lambda w: len(w.replicas) == 1 and w.count(READY) == 1)
    assert sorted(w.replicas) == [1]  # the newest went first
    assert w.service.autoscaler.last_decision_reason == "scaled down from 3 to 1 after 0.6 s"
    w.cancel()


async def test_short_bursts_do_not_flap(env: tc.Env) -> None:
    w = await tc.create(env, scaling_yaml(up=5))
    await w.until(lambda w: w.count(READY) == 1)
    await env.stub.ReportLoad(api.ReportLoadRequest(service_name="auto", request_count=3))
    await asyncio.sleep(1.5)  # the load leaves the window before the upscale delay
    svc = (await env.stub.GetService(api.GetServiceRequest(service_name="auto"))).service
    assert svc.target_replicas == 1
    assert len(env.provisioner.launches) == 1
    w.cancel()


async def test_scale_from_zero_on_the_first_load_report(env: tc.Env) -> None:
    w = await tc.create(env, scaling_yaml(lo=0, up=30, down=0.3))
    await asyncio.sleep(0.3)
    svc = (await env.stub.GetService(api.GetServiceRequest(service_name="auto"))).service
    assert (svc.target_replicas, len(env.provisioner.launches)) == (0, 0)
    assert svc.status == res.SERVICE_STATUS_NO_REPLICA
    await env.stub.ReportLoad(api.ReportLoadRequest(service_name="auto", request_count=2))
    # Leaving 0 ignores the 30 s upscale delay.
    await w.until(lambda w: w.count(READY) == 2, timeout=10)
    await w.until(lambda w: not w.replicas, timeout=10)  # and back to zero without load
    w.cancel()


async def test_update_changing_the_autoscaler_keeps_the_load(env: tc.Env) -> None:
    fixed = scaling_yaml().replace("    target_qps_per_replica: 1\n", "").replace("max_replicas: 3", "max_replicas: 1")
    w = await tc.create(env, fixed)
    await w.until(lambda w: w.count(READY) == 1)
    await env.stub.ReportLoad(api.ReportLoadRequest(service_name="auto", request_count=2))
    await env.stub.UpdateService(api.UpdateServiceRequest(service_name="auto", yaml=scaling_yaml()))
    await w.until(lambda w: w.service.target_replicas == 2 and w.count(READY) == 2)  # at once, no delay
    w.cancel()


async def test_spot_with_base_fallback_runs_ondemand_beside_spot(env: tc.Env) -> None:
    extra = "    base_ondemand_fallback_replicas: 1\n"
    yaml_text = scaling_yaml(lo=3, hi=3, extra=extra).replace("    target_qps_per_replica: 1\n", "")
    yaml_text = yaml_text.replace("  ports: 8080\n", "  ports: 8080\n  use_spot: true\n")
    w = await tc.create(env, yaml_text)
    await w.until(lambda w: w.count(READY) == 3)
    assert sorted(r.is_spot for r in w.replicas.values()) == [False, True, True]
    assert w.service.autoscaler.kind == "fallback"
    w.cancel()


@contextlib.asynccontextmanager
async def controller(tmp_path, provisioner_addr: str, prober: int) -> AsyncIterator[api_grpc.ControllerServiceStub]:
    running = await controller_server.start(
        controller_server.Settings(
            listen_addr="127.0.0.1:0",
            state_dir=str(tmp_path / "ctl"),
            provisioner_addr=provisioner_addr,
            prober_addrs=f"127.0.0.1:{prober}",
            drain_s=0.05,
            **FAST,  # type: ignore[arg-type]
        )
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield api_grpc.ControllerServiceStub(channel)
    finally:
        await channel.close()
        await running.stop(None)


async def test_restart_resumes_the_autoscaler_without_churn(tmp_path) -> None:
    async with fake_provisioner.serving() as (fake, addr):
        prober = await prober_server.build_server(prober_server.load_settings(listen_addr="127.0.0.1:0"))
        await prober.start()
        try:
            async with controller(tmp_path, addr, prober.port) as stub:
                await stub.CreateService(api.CreateServiceRequest(yaml=scaling_yaml(up=0.5, down=30)))
                w = cl.Watch(stub, "auto")
                await w.until(lambda w: w.count(READY) == 1)
                await stub.ReportLoad(api.ReportLoadRequest(service_name="auto", request_count=3))
                w.cancel()
            # Down while the upscale clock runs: the clock survives the restart.
            async with controller(tmp_path, addr, prober.port) as stub:
                w = cl.Watch(stub, "auto")
                await w.until(lambda w: w.count(READY) == 3, timeout=10)
                # The load has left the window; the 30 s downscale delay holds the target.
                await asyncio.sleep(1.2)
                w.cancel()
            launches = dict(fake.launches)
            async with controller(tmp_path, addr, prober.port) as stub:
                w = cl.Watch(stub, "auto")
                await w.until(lambda w: w.service is not None and w.count(READY) == 3)
                await asyncio.sleep(0.5)
                svc = (await stub.GetService(api.GetServiceRequest(service_name="auto"))).service
                assert svc.target_replicas == 3  # not reset to min_replicas
                assert len(w.replicas) == 3
                w.cancel()
            assert dict(fake.launches) == launches  # no replica launched anew
            assert len(launches) == 3
        finally:
            await prober.stop(None)


async def test_instance_aware_targets_per_accelerator_and_endpoints_name_it(env: tc.Env) -> None:
    yaml_text = scaling_yaml(up=0).replace(
        "    target_qps_per_replica: 1\n", "    target_qps_per_replica: {A100: 2, 'H100:1': 4}\n"
    )
    yaml_text = yaml_text.replace("service:\n", "service:\n  load_balancing_policy: instance_aware_least_load\n")
    yaml_text = yaml_text.replace("  ports: 8080\n", "  ports: 8080\n  accelerators: A100:1\n")
    w = await tc.create(env, yaml_text)
    await w.until(lambda w: w.count(READY) == 1)
    endpoints = env.stub.WatchEndpoints(api.WatchEndpointsRequest(service_name="auto"))
    first = await anext(aiter(endpoints))
    assert [(e.replica_id, e.accelerator) for e in first.endpoints] == [(1, "A100")]
    endpoints.cancel()
    assert w.service.autoscaler.kind == "instance_aware"
    # 3 QPS over the 1 s window; one A100 serves 2: one more replica.
    await env.stub.ReportLoad(api.ReportLoadRequest(service_name="auto", request_count=3))
    await w.until(lambda w: w.service.target_replicas == 2 and w.count(READY) == 2)
    w.cancel()

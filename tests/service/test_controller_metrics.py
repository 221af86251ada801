"""The controller's own metrics on a real controller (a real prober, the scripted provisioner), read
from its `/metrics` endpoint with prometheus_client's parser: each moves when the thing happens."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sqlite3
from collections.abc import AsyncIterator

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import grpc_server
from services.controller import server as controller_server
from services.prober import server as prober_server
from tests.helpers import cluster as cl
from tests.helpers import fake_provisioner, metrics

READY = res.REPLICA_STATUS_READY
YAML = """
name: {name}
service:
  readiness_probe:
    path: /health
    initial_delay_seconds: 5
    endpoint_probe_interval_seconds: 0.1
  replicas: {replicas}
resources:
  ports: 8080
run: serve
"""


@dataclasses.dataclass
class Env:
    stub: api_grpc.ControllerServiceStub
    provisioner: fake_provisioner.FakeProvisioner
    prober: prober_server.Built
    url: str
    state_dir: str
    running: controller_server.Running


@contextlib.asynccontextmanager
async def started(tmp_path, **settings: object) -> AsyncIterator[Env]:
    async with fake_provisioner.serving() as (fake, provisioner_addr):
        prober = await prober_server.build_server(prober_server.load_settings(listen_addr="127.0.0.1:0"))
        await prober.start()
        values: dict[str, object] = {
            "listen_addr": "127.0.0.1:0",
            "metrics_addr": "127.0.0.1:0",
            "state_dir": str(tmp_path / "ctl"),
            "provisioner_addr": provisioner_addr,
            "prober_addrs": f"127.0.0.1:{prober.port}",
            "drain_s": 0.05,
            **settings,
        }
        running = await controller_server.start(controller_server.Settings(**values))  # type: ignore[arg-type]
        endpoint = await grpc_server.serve_metrics(running.built, "127.0.0.1:0")
        assert endpoint is not None
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
        try:
            yield Env(
                api_grpc.ControllerServiceStub(channel), fake, prober, endpoint.url, str(values["state_dir"]), running
            )
        finally:
            await channel.close()
            await endpoint.stop()
            await running.stop(None)
            await prober.stop(None)


def spec(name: str = "web", replicas: int = 2) -> str:
    return YAML.format(name=name, replicas=replicas)


async def test_fleet_launches_ready_time_and_watchers_move_with_the_service(tmp_path) -> None:
    async with started(tmp_path) as env:
        empty = await metrics.ascrape(env.url)
        assert empty.value("replicaplane_controller_watch_subscribers") == 0
        assert not empty.has("replicaplane_controller_replicas")

        await env.stub.CreateService(api.CreateServiceRequest(yaml=spec()))
        w = cl.Watch(env.stub, "web")
        await w.until(lambda w: w.count(READY) == 2)
        s = await metrics.until(
            env.url,
            lambda s: s.value("replicaplane_controller_replicas", service="web", version="1", status="READY") == 2,
            what="two READY replicas",
        )
        assert s.value("replicaplane_controller_launches_total", service="web", outcome="succeeded", cause="none") == 2
        assert s.value("replicaplane_controller_launch_to_ready_seconds_count") == 2
        assert 0 < s.value("replicaplane_controller_launch_to_ready_seconds_sum") < 30
        assert s.value("replicaplane_controller_autoscaler_target_replicas", service="web") == 2
        assert s.value("replicaplane_controller_autoscaler_current_replicas", service="web") == 2
        assert s.value("replicaplane_controller_autoscaler_qps", service="web") == 0
        assert s.value("replicaplane_controller_watch_subscribers") == 1  # the test's watch
        assert s.value("replicaplane_controller_store_write_seconds_count") > 0
        assert s.value("replicaplane_controller_probing_stale") == 0
        assert s.value("replicaplane_controller_pass_duration_seconds_count") > 0
        assert s.value("replicaplane_controller_queue_depth") == 0  # nothing due once all is READY
        for sample in s.samples("replicaplane_controller_replicas"):
            assert set(sample.labels) == {"service", "version", "status"}

        # The app exits: a failed replica (kept), a teardown, a replacement launched.
        env.provisioner.app_exited(w.replicas[1].replica_name, 3)
        await w.until(lambda w: w.replicas[1].status == res.REPLICA_STATUS_FAILED and w.count(READY) == 2)
        s = await metrics.until(
            env.url,
            lambda s: s.value("replicaplane_controller_launches_total", service="web", outcome="succeeded") == 3,
            what="the replacement's launch",
        )
        assert s.value("replicaplane_controller_replicas", service="web", status="FAILED") == 1
        assert s.value("replicaplane_controller_teardowns_total", service="web", outcome="succeeded") == 1

        # Launches refused for capacity: failed, by the infrastructure's fault.
        env.provisioner.capacity_refused = True
        await env.stub.UpdateService(api.UpdateServiceRequest(service_name="web", yaml=spec(replicas=3)))
        s = await metrics.until(
            env.url,
            lambda s: (
                s.value(
                    "replicaplane_controller_launches_total", service="web", outcome="failed", cause="infrastructure"
                )
                >= 1
            ),
            what="a launch failed for capacity",
        )
        assert s.value("replicaplane_controller_autoscaler_target_replicas", service="web") == 3
        env.provisioner.capacity_refused = False

        # A scale-down tears one down; a second watch counts; the service's series go with it.
        await env.stub.UpdateService(api.UpdateServiceRequest(service_name="web", yaml=spec(replicas=1)))
        second = cl.Watch(env.stub, "web")
        await metrics.until(
            env.url,
            lambda s: (
                s.value("replicaplane_controller_teardowns_total", service="web", outcome="succeeded") >= 2
                and s.value("replicaplane_controller_watch_subscribers") == 2
            ),
            what="a scale-down teardown and two watchers",
        )
        await env.stub.DeleteService(api.DeleteServiceRequest(service_name="web", purge=True))
        await w.until(lambda w: w.deleted)
        s = await metrics.until(
            env.url,
            lambda s: (
                not s.has("replicaplane_controller_replicas")
                and s.value("replicaplane_controller_watch_subscribers") == 0
            ),
            what="the service gone",
        )
        assert not s.has("replicaplane_controller_launches_total", service="web")
        assert not s.has("replicaplane_controller_autoscaler_target_replicas", service="web")
        w.cancel()
        second.cancel()


async def test_store_write_errors_and_probing_stale(tmp_path) -> None:
    async with started(tmp_path, store_busy_timeout_s=0.05, sweep_interval_s=0.2, prober_liveness_timeout_s=0.5) as env:
        await metrics.until(env.url, lambda s: s.value("replicaplane_controller_probing_stale") == 0)
        # The sweep's heartbeat is a write.
        s = await metrics.until(env.url, lambda s: s.value("replicaplane_controller_store_write_seconds_count") > 0)
        before = s.value("replicaplane_controller_store_write_seconds_count")

        # Another process holds the write lock: the sweep's heartbeat write fails, and is counted.
        holder = sqlite3.connect(os.path.join(env.state_dir, "state.db"), isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            s = await metrics.until(
                env.url,
                lambda s: s.value("replicaplane_controller_store_write_errors_total") >= 1,
                what="a failed write",
            )
            assert s.value("replicaplane_controller_store_write_seconds_count") > before
        finally:
            holder.execute("ROLLBACK")
            holder.close()

        await env.prober.stop(None)
        await metrics.until(env.url, lambda s: s.value("replicaplane_controller_probing_stale") == 1, what="stale")


async def test_queue_depth_counts_services_with_a_pass_due(tmp_path) -> None:
    async with started(tmp_path) as env:
        for name in ("a", "b"):
            await env.stub.CreateService(api.CreateServiceRequest(yaml=spec(name, replicas=1)))
        await metrics.until(env.url, lambda s: s.value("replicaplane_controller_replicas", status="READY") == 2)
        ctl = env.running.controller
        await asyncio.sleep(0.2)
        assert ctl.queue_depth() == 0
        before = (await metrics.ascrape(env.url)).value("replicaplane_controller_pass_duration_seconds_count")
        ctl._get("a").kick()
        ctl._get("b").kick()
        assert ctl.queue_depth() == 2  # due, not run: the loop has not turned yet
        await metrics.until(
            env.url, lambda s: s.value("replicaplane_controller_pass_duration_seconds_count") >= before + 2
        )
        assert ctl.queue_depth() == 0


async def test_metrics_off_means_no_observers(tmp_path) -> None:
    # metrics_addr empty: no registry, so nothing observes the hub or the store.
    async with fake_provisioner.serving() as (_, provisioner_addr):
        running = await controller_server.start(
            controller_server.Settings(
                listen_addr="127.0.0.1:0",
                metrics_addr="",
                state_dir=str(tmp_path / "ctl"),
                provisioner_addr=provisioner_addr,
                prober_addrs="127.0.0.1:1",
            )
        )
        try:
            assert running.built.metrics is None
            assert running.db._on_write is None
        finally:
            await running.stop(None)
    await asyncio.sleep(0)


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith("REPLICAPLANE_CONTROLLER_"):
            monkeypatch.delenv(name)


async def test_a_launch_failure_counts_under_the_cause_the_core_decided(tmp_path) -> None:
    from replicaplane.provisioner.v1 import resources_pb2 as prov_res

    async with started(tmp_path) as env:
        # An API server's 503: the infrastructure's fault, though no capacity was missing.
        env.provisioner.failing_launches.append(("HTTP 503 from the API server", prov_res.FAILURE_CAUSE_INFRASTRUCTURE))
        env.provisioner.failing_launches.append(("setup exited with 1", prov_res.FAILURE_CAUSE_USER))
        await env.stub.CreateService(api.CreateServiceRequest(yaml=spec(replicas=1)))
        await metrics.until(
            env.url,
            lambda s: (
                s.value("replicaplane_controller_launches_total", outcome="failed", cause="infrastructure") == 1
                and s.value("replicaplane_controller_launches_total", outcome="failed", cause="user") == 1
            ),
            what="one launch failed by each cause",
        )

"""The controller stays responsive while thousands of replicas are created: a real controller
process, the scripted provisioner (replicas are records, so the controller's own cost is what
is measured) and a health check with a 1 s deadline polled throughout."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from tests.helpers import fake_provisioner, procs

pytestmark = [pytest.mark.e2e, pytest.mark.drill]

SIZE = 1000
DEFAULT_TOTAL = 5000  # the controller's default max_replicas_total


def big(name: str) -> str:
    return (
        f"name: {name}\nservice:\n  readiness_probe: /health\n  replicas: {SIZE}\nresources:\n  ports: 8080\nrun: x\n"
    )


class HealthPoller(threading.Thread):
    """Checks health every 20 ms from its own thread (its own gRPC channel, not the test's loop)
    with a 1 s deadline, and records every check that missed it."""

    def __init__(self, addr: str) -> None:
        super().__init__(daemon=True)
        self.addr = addr
        self.stop = threading.Event()
        self.checks = 0
        self.missed: list[str] = []
        self.slowest = 0.0

    def run(self) -> None:
        with grpc.insecure_channel(self.addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connected before measuring
            while not self.stop.is_set():
                start = time.monotonic()
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                except grpc.RpcError as exc:
                    self.missed.append(f"{exc.code().name} after {time.monotonic() - start:.2f} s")  # type: ignore[attr-defined]
                self.slowest = max(self.slowest, time.monotonic() - start)
                self.checks += 1
                time.sleep(0.02)


async def test_health_answers_within_1s_while_services_up_to_the_replica_cap_are_created(tmp_path) -> None:
    async with fake_provisioner.serving() as (fake, provisioner_addr):
        controller = await asyncio.to_thread(
            procs.start_service,
            "controller",
            env={
                "REPLICAPLANE_CONTROLLER_STATE_DIR": str(tmp_path / "ctl"),
                "REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR": provisioner_addr,
                "REPLICAPLANE_CONTROLLER_PROBER_ADDRS": "127.0.0.1:9",  # none: probing is stale
            },
            workdir=str(tmp_path),
        )
        poller = HealthPoller(controller.addr)
        try:
            poller.start()
            async with grpc.aio.insecure_channel(controller.addr) as channel:
                stub = api_grpc.ControllerServiceStub(channel)
                created = []
                for i in range(DEFAULT_TOTAL // SIZE + 1):
                    try:
                        await stub.CreateService(api.CreateServiceRequest(yaml=big(f"big{i}")), timeout=60)
                        created.append(f"big{i}")
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                assert len(created) == DEFAULT_TOTAL // SIZE  # the last one is over the cap
                deadline = time.monotonic() + 120
                while sum(fake.launches.values()) < DEFAULT_TOTAL and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert sum(fake.launches.values()) == DEFAULT_TOTAL
                await asyncio.sleep(1.0)  # the last launch events are applied
        finally:
            poller.stop.set()
            await asyncio.to_thread(poller.join, 10)
            controller.stop()
    assert poller.checks > 10
    assert poller.missed == [], f"{len(poller.missed)} of {poller.checks} checks missed 1 s: {poller.missed[:5]}"

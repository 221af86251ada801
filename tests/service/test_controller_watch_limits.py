"""Watch streams whose clients stop reading: the controller cuts them off with a status that
says where to resume, instead of queueing changes for them without bound."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import client as cli_client
from services.cli import main as cli
from services.cli import status as cli_status
from services.common import grpc_errors
from services.controller import hub
from services.controller import server as controller_server
from tests.helpers import fake_provisioner

SPEC = """
name: svc
service:
  readiness_probe: /health
  replicas: 1
resources:
  ports: 8080
run: serve
"""


@dataclasses.dataclass
class Env:
    stub: api_grpc.ControllerServiceStub
    hub: hub.ServiceHub
    addr: str


@contextlib.asynccontextmanager
async def started(tmp_path) -> AsyncIterator[Env]:
    """A real controller (scripted provisioner, no prober) with service `svc` created."""
    async with fake_provisioner.serving() as (_, provisioner_addr):
        settings = controller_server.Settings(
            listen_addr="127.0.0.1:0",
            state_dir=str(tmp_path / "ctl"),
            provisioner_addr=provisioner_addr,
            prober_addrs="127.0.0.1:1",
        )
        running = await controller_server.start(settings)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
        try:
            stub = api_grpc.ControllerServiceStub(channel)
            await stub.CreateService(api.CreateServiceRequest(yaml=SPEC), timeout=10)
            yield Env(stub, running.controller._get("svc").hub, f"127.0.0.1:{running.port}")
        finally:
            await channel.close()
            await running.stop(None)


def _bulky_change(h: hub.ServiceHub, i: int) -> None:
    h.publish(res.Service(name="svc", status_message=f"{i}:" + "x" * 10_000), [], [])


async def test_a_watch_client_that_stops_reading_is_cut_off_with_where_to_resume(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(hub, "QUEUE_LIMIT", 100)  # a small queue, so the transport fills first
    async with started(tmp_path) as env:
        call = env.stub.WatchService(api.WatchServiceRequest(service_name="svc"))
        first = await call.read()
        assert first.snapshot
        # The client reads nothing more. Changes flow into the transport until it is full,
        # then queue up for the stream until the queue limit cuts it off.
        for i in range(20_000):  # bounded: ~10 MB of transport buffers come first
            _bulky_change(env.hub, i)
            await asyncio.sleep(0)
            if env.hub.watchers == 0:
                break
        assert env.hub.watchers == 0, "the stalled watch was never dropped"
        assert env.hub.queued() == 0

        # When the client reads again it gets every change that was already on its way, in
        # order, then the status naming the last one it got.
        got = [first.sequence]
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            for _ in range(30_000):
                got.append((await call.read()).sequence)
        err = grpc_errors.RpcError(raised.value)
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.reason == "WATCH_FELL_BEHIND"
        assert got == list(range(first.sequence, first.sequence + len(got)))
        assert err.metadata["after_sequence"] == str(got[-1])
        assert f"after_sequence={got[-1]}" in err.message

        resumed = env.stub.WatchService(api.WatchServiceRequest(service_name="svc", after_sequence=got[-1]))
        again = await resumed.read()
        # Nothing is missed: the changes after that point are replayed (or, were the gap longer
        # than the history, a fresh snapshot comes).
        assert (again.snapshot, again.sequence) in {(False, got[-1] + 1), (True, env.hub.sequence)}
        resumed.cancel()


async def test_an_endpoint_watch_that_falls_behind_is_cut_off_with_its_version(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(hub, "QUEUE_LIMIT", 10)
    async with started(tmp_path) as env:
        call = env.stub.WatchEndpoints(api.WatchEndpointsRequest(service_name="svc"))
        first = await call.read()
        while first.version != env.hub.endpoints_version:  # the service's first pass may publish after
            first = await call.read()
        for i in range(11):  # one burst, before the stream's task runs again
            env.hub.set_endpoints([res.Endpoint(replica_id=i + 1, url=f"http://127.0.0.1:{i + 1}")])
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            for _ in range(20):
                await call.read()
        err = grpc_errors.RpcError(raised.value)
        assert (err.code, err.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "WATCH_FELL_BEHIND")
        assert err.metadata["after_version"] == str(first.version)
        assert f"after_version={first.version}" in err.message


async def test_replicactl_watch_resumes_a_dropped_watch_and_misses_nothing(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(hub, "QUEUE_LIMIT", 10)
    async with started(tmp_path) as env:
        client = cli_client.Client(env.addr, 10.0)
        out = io.StringIO()
        args = cli.parser().parse_args(["watch", "svc", "--json"])
        watching = asyncio.ensure_future(asyncio.to_thread(cli_status.cmd_watch, args, client, out))
        try:
            deadline = time.monotonic() + 10
            while not out.getvalue() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            for i in range(25):  # one burst, more than the queue holds
                _bulky_change(env.hub, i)
            await asyncio.sleep(0.2)
            env.hub.publish(res.Service(name="svc", status_message="last"), [], [], deleted=True)
            assert await asyncio.wait_for(watching, 20) == cli.OK
        finally:
            client.close()
        assert "dropped a WatchService stream of svc:" in caplog.text
        changes = [json.loads(line)["change"] for line in out.getvalue().splitlines()]
        sequences = [int(c["sequence"]) for c in changes]
        assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))
        assert changes[-1]["deleted"] is True
        assert changes[-1]["service"]["status_message"] == "last"

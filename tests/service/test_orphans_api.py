"""ListOrphans and ReapOrphans over gRPC: a real controller and a real provisioner (local backend)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc
from services.common import grpc_errors
from services.controller import server as controller_server
from services.provisioner import server as provisioner_server
from tests.helpers import provisioner_client as client
from tests.helpers import provisioner_procs

WEB = """
name: web
service:
  readiness_probe: /health
  replicas: 1
resources:
  ports: 8080
run: sleep 60
"""


@dataclasses.dataclass
class Env:
    stub: api_grpc.ControllerServiceStub
    prov: pb_grpc.ProvisionerServiceStub
    prov_server: provisioner_server.Server


@contextlib.asynccontextmanager
async def started(tmp_path) -> AsyncIterator[Env]:
    """A controller (no prober reachable: readiness does not matter here) and a provisioner."""
    prov_state = str(tmp_path / "prov")
    prov = await provisioner_server.build_server(
        provisioner_server.Settings(listen_addr="127.0.0.1:0", state_dir=prov_state, kill_grace_s=0.5)
    )
    await prov.start()
    running = await controller_server.start(
        controller_server.Settings(
            listen_addr="127.0.0.1:0",
            state_dir=str(tmp_path / "ctl"),
            provisioner_addr=f"127.0.0.1:{prov.port}",
            prober_addrs="127.0.0.1:9",
        )
    )
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ctl_channel,
            grpc.aio.insecure_channel(f"127.0.0.1:{prov.port}") as prov_channel,
        ):
            yield Env(api_grpc.ControllerServiceStub(ctl_channel), pb_grpc.ProvisionerServiceStub(prov_channel), prov)
    finally:
        await running.stop(None)
        await prov.stop(None)
        provisioner_procs.kill_replicas(prov_state)


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[Env]:
    async with started(tmp_path) as e:
        yield e


async def _launch(env: Env, name: str, owner: str) -> None:
    service, rid, _ = name.split("-")
    request = client.launch_request(int(rid), service, spec_=client.spec("sleep 60"), owner=owner)
    request.name = name
    events = await client.collect(env.prov.Launch(request))
    assert events[-1].type == client.L.LAUNCH_EVENT_TYPE_RUNNING


async def _running(env: Env) -> set[str]:
    replicas = (await env.prov.ListReplicas(pb.ListReplicasRequest())).replicas
    return {r.name for r in replicas}


async def _until_gone(env: Env, names: set[str]) -> None:
    async with asyncio.timeout(15):
        while names & await _running(env):
            await asyncio.sleep(0.05)


async def _error(call) -> grpc_errors.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return grpc_errors.RpcError(info.value)


async def test_orphans_are_listed_and_only_this_controllers_own_are_reaped_by_default(env: Env) -> None:
    await env.stub.CreateService(api.CreateServiceRequest(yaml=WEB))
    async with asyncio.timeout(15):
        while not any(n.startswith("web-1-") for n in await _running(env)):
            await asyncio.sleep(0.05)
    listed = await env.stub.ListOrphans(api.ListOrphansRequest())
    me = listed.controller_id
    assert me and list(listed.orphans) == []  # web's replica has its record

    await _launch(env, "lost-1-aaaa", owner=me)  # as if the record was lost with the store
    await _launch(env, "theirs-1-bbbb", owner="ctl-other")  # another controller's
    listed = await env.stub.ListOrphans(api.ListOrphansRequest())
    assert [(o.replica_name, o.owner, o.owned_by_this_controller) for o in listed.orphans] == [
        ("lost-1-aaaa", me, True),
        ("theirs-1-bbbb", "ctl-other", False),
    ]
    lost = listed.orphans[0]
    assert (lost.service_name, lost.replica_id, lost.state, lost.reason) == ("lost", 1, "RUNNING", 'no service "lost"')
    assert lost.create_time.seconds > 0 and lost.endpoint.startswith("http://")

    page = await env.stub.ListOrphans(api.ListOrphansRequest(page_size=1))
    assert [o.replica_name for o in page.orphans] == ["lost-1-aaaa"] and page.next_page_token
    rest = await env.stub.ListOrphans(api.ListOrphansRequest(page_size=1, page_token=page.next_page_token))
    assert [o.replica_name for o in rest.orphans] == ["theirs-1-bbbb"] and not rest.next_page_token
    only = await env.stub.ListOrphans(api.ListOrphansRequest(owner="ctl-other"))
    assert [o.replica_name for o in only.orphans] == ["theirs-1-bbbb"]

    web = next(n for n in await _running(env) if n.startswith("web-"))
    named = await env.stub.ReapOrphans(api.ReapOrphansRequest(replica_names=["theirs-1-bbbb", web, "nope-1-cccc"]))
    assert list(named.reaped) == []
    assert [s.replica_name for s in named.skipped] == ["theirs-1-bbbb", web, "nope-1-cccc"]
    assert "owned by controller ctl-other" in named.skipped[0].reason

    reaped = await env.stub.ReapOrphans(api.ReapOrphansRequest())
    assert [o.replica_name for o in reaped.reaped] == ["lost-1-aaaa"] and reaped.controller_id == me
    await _until_gone(env, {"lost-1-aaaa"})
    assert {"theirs-1-bbbb", web} <= await _running(env)  # another owner's and a recorded one stay

    theirs = await env.stub.ReapOrphans(api.ReapOrphansRequest(owner="ctl-other"))
    assert [o.replica_name for o in theirs.reaped] == ["theirs-1-bbbb"]
    await _until_gone(env, {"theirs-1-bbbb"})
    assert list((await env.stub.ListOrphans(api.ListOrphansRequest())).orphans) == []
    assert web in await _running(env)


async def test_bad_orphan_requests_are_invalid_argument_naming_the_field(env: Env) -> None:
    cases = [
        (env.stub.ReapOrphans(api.ReapOrphansRequest(owner="ctl-other", all_owners=True)), ["all_owners"]),
        (env.stub.ReapOrphans(api.ReapOrphansRequest(owner="x" * 129)), ["owner"]),
        (env.stub.ReapOrphans(api.ReapOrphansRequest(replica_names=["ok-1", ""])), ["replica_names[1]"]),
        (env.stub.ListOrphans(api.ListOrphansRequest(page_size=-1)), ["page_size"]),
        (env.stub.ListOrphans(api.ListOrphansRequest(page_token="not-a-token")), ["page_token"]),
        (env.stub.ListOrphans(api.ListOrphansRequest(owner="a\nb")), ["owner"]),
    ]
    for call, fields in cases:
        err = await _error(call)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, err
        assert [f for f, _ in err.field_violations] == fields


async def test_orphans_are_unavailable_while_the_provisioner_is_down(env: Env) -> None:
    await env.prov_server.stop(None)
    for call in (env.stub.ListOrphans(api.ListOrphansRequest()), env.stub.ReapOrphans(api.ReapOrphansRequest())):
        err = await _error(call)
        assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "PROVISIONER_UNAVAILABLE"), err

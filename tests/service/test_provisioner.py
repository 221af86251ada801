"""The provisioner over gRPC with the local backend and real replica processes."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pathlib
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc
from replicaplane.provisioner.v1 import resources_pb2
from services.common import grpc_errors
from services.provisioner import procs, server
from tests.helpers import provisioner_client as client
from tests.helpers import provisioner_procs

L, T, R = client.L, client.T, client.R


def _settings(state_dir: str, **overrides: object) -> server.Settings:
    values: dict[str, object] = {
        "listen_addr": "127.0.0.1:0",
        "state_dir": state_dir,
        "launch_backoff_initial_s": 0.05,
        "launch_backoff_max_s": 0.1,
        "teardown_backoff_initial_s": 0.05,
        "teardown_backoff_max_s": 0.1,
        "kill_grace_s": 1.0,
        "cancel_timeout_s": 5.0,
    }
    values.update(overrides)
    return server.Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
def state_dir(tmp_path) -> str:
    return str(tmp_path / "state")


@pytest.fixture
async def built(state_dir: str) -> AsyncIterator[server.Server]:
    srv = await server.build_server(_settings(state_dir))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(None)
        provisioner_procs.kill_replicas(state_dir)  # whatever a failing test left running


@pytest.fixture
async def stub(built: server.Server) -> AsyncIterator[pb_grpc.ProvisionerServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{built.port}") as channel:
        yield pb_grpc.ProvisionerServiceStub(channel)


async def _launch(stub: pb_grpc.ProvisionerServiceStub, request: pb.LaunchRequest) -> list:
    return await client.collect(stub.Launch(request))


async def test_each_replica_serves_the_declared_port_on_its_own_loopback_address(stub, state_dir) -> None:
    # Launching, events and serving are the backend contract (test_backend_contract.py); here
    # only the local backend's addressing.
    results = await asyncio.gather(*(_launch(stub, client.launch_request(i)) for i in (1, 2, 3)))
    endpoints = {events[-1].endpoint for events in results}
    assert len(endpoints) == 3
    for endpoint in endpoints:
        body = json.loads(await client.wait_http(endpoint + "/health"))
        # The spec says 8080: each replica serves it on its own loopback address.
        assert endpoint.startswith("http://127.77.") and str(body["port"]) == "8080"


async def test_failed_setup_retries_back_off_and_their_output_outlives_teardown(stub, state_dir) -> None:
    # The events of a failing setup are the backend contract; here the backoff and the launch log.
    request = client.launch_request(1, spec_=client.spec("true", setup="echo preparing; exit 7"))
    events = await _launch(stub, request)
    assert client.types(events)[-1] == "FAILED"
    delays = [e.retry_delay.ToNanoseconds() / 1e9 for e in events if e.type == L.LAUNCH_EVENT_TYPE_RETRYING]
    assert len(delays) == 2 and all(0 < d <= 0.1 for d in delays)
    # A failed replica's logs outlive its teardown when kept.
    await client.collect(stub.Terminate(pb.TerminateRequest(name="svc-1", keep_logs=True)))
    chunks = await client.collect(
        stub.StreamLogs(pb.StreamLogsRequest(name="svc-1", kind=resources_pb2.LOG_KIND_LAUNCH))
    )
    text = b"".join(c.data for c in chunks).decode()
    assert text.count("preparing") == 3
    assert "setup exited with code 7" in text


async def test_teardown_kills_apps_that_ignore_sigterm_and_strays_that_left_the_group(stub, state_dir) -> None:
    # The app ignores SIGTERM (SIGKILL after the 1 s grace); a child escaped into its own session.
    run = "trap '' TERM; setsid sleep 30 & sleep 30"
    await _launch(stub, client.launch_request(1, spec_=client.spec(run)))
    async with asyncio.timeout(10):
        while len({procs.read_stat(p).sid for p in provisioner_procs.replica_pids(state_dir)}) < 2:
            await asyncio.sleep(0.02)
    teardown = await client.collect(stub.Terminate(pb.TerminateRequest(name="svc-1")))
    assert client.types(teardown) == ["TERMINATING", "TERMINATED"]
    assert provisioner_procs.wait_no_replicas(state_dir) == []


async def test_zone_refusal_fails_launches_at_once_as_capacity_unavailable(stub, state_dir) -> None:
    zones = (await stub.ListZones(pb.ListZonesRequest())).zones
    assert [z.name for z in zones] == ["zone-a", "zone-b", "zone-c"]
    refused = await stub.SetZoneAvailability(
        pb.SetZoneAvailabilityRequest(zone="zone-a", refuse_for=client.duration(60))
    )
    assert refused.zone.refusing_launches and refused.zone.refuse_until_time.seconds > 0

    events = await _launch(stub, client.launch_request(1, zone="zone-a", use_spot=True))
    assert client.types(events) == ["QUEUED", "PROVISIONING", "ATTEMPT_FAILED", "FAILED"]
    # Not permanent (capacity is the infrastructure's), yet not retried here: the controller
    # places the replica again.
    assert events[-1].capacity_unavailable and not events[-1].permanent

    events = await _launch(stub, client.launch_request(2, use_spot=True))
    assert events[-1].replica.zone == "zone-b"  # cheapest zone that accepts
    assert events[-1].replica.price_per_hour == pytest.approx(1.2)

    await stub.SetZoneAvailability(pb.SetZoneAvailabilityRequest(zone="zone-a"))
    events = await _launch(stub, client.launch_request(3))
    assert events[-1].replica.zone == "zone-a"


async def test_launch_is_idempotent_by_name_and_replays(stub, state_dir) -> None:
    first = await _launch(stub, client.launch_request(1))
    again = await _launch(stub, client.launch_request(1))
    assert [e.sequence for e in again] == [e.sequence for e in first]
    assert again[-1].endpoint == first[-1].endpoint
    tail = await _launch(stub, client.launch_request(1, after_sequence=2, attach_only=True))
    assert client.types(tail) == ["RUNNING"]
    # One replica: one process group (the wrapper and the app).
    assert len({procs.read_stat(p).pgid for p in provisioner_procs.replica_pids(state_dir)}) == 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _launch(stub, client.launch_request(9, attach_only=True))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_launch_goes_on_when_its_client_goes_away(stub, state_dir) -> None:
    request = client.launch_request(1, spec_=client.spec(setup="sleep 0.3"))
    call = stub.Launch(request)
    first = await call.read()
    assert first.event.type == L.LAUNCH_EVENT_TYPE_QUEUED
    call.cancel()
    rest = await client.collect(stub.Launch(client.launch_request(1, after_sequence=1, attach_only=True)))
    assert client.types(rest) == ["PROVISIONING", "RUNNING"]
    assert [e.sequence for e in rest] == [2, 3]


async def test_bad_requests_are_invalid_argument_with_field_violations(stub, state_dir) -> None:
    request = client.launch_request(1)
    request.name = "wrong"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _launch(stub, request)
    decoded = grpc_errors.RpcError(info.value)
    assert decoded.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in decoded.field_violations] == ["name"]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SetZoneAvailability(pb.SetZoneAvailabilityRequest(zone="nowhere"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.PreemptReplica(pb.PreemptReplicaRequest(name="svc-7"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.collect(stub.StreamLogs(pb.StreamLogsRequest(name="svc-7")))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_list_pages_and_refuses_page_tokens_it_did_not_make(stub, state_dir) -> None:
    for request in (client.launch_request(1), client.launch_request(2), client.launch_request(1, "other")):
        await _launch(stub, request)
    first = await stub.ListReplicas(pb.ListReplicasRequest(service="svc", page_size=1))
    rest = await stub.ListReplicas(pb.ListReplicasRequest(service="svc", page_size=1, page_token=first.next_page_token))
    assert [r.name for r in [*first.replicas, *rest.replicas]] == ["svc-1", "svc-2"] and not rest.next_page_token
    made_up = base64.urlsafe_b64encode(b"svc-1").decode()  # a replica name, as tokens once were
    for service, token in (
        ("svc", "zzz"),
        ("svc", "abc"),
        ("svc", made_up),
        ("other", first.next_page_token),  # another listing's token
        ("", first.next_page_token),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListReplicas(pb.ListReplicasRequest(service=service, page_token=token))
        decoded = grpc_errors.RpcError(info.value)
        assert decoded.code == grpc.StatusCode.INVALID_ARGUMENT, (service, token)
        assert [f for f, _ in decoded.field_violations] == ["page_token"]


async def test_a_short_replica_name_is_not_found_with_the_full_name_in_the_message(stub, state_dir) -> None:
    request = client.launch_request(2, "hello")
    request.name = "hello-2-1a2b3c4d"  # as the controller names it: {service}-{id}-{uid}
    await _launch(stub, request)
    for call in (
        stub.PreemptReplica(pb.PreemptReplicaRequest(name="hello-2")),
        stub.GetReplica(pb.GetReplicaRequest(name="hello-2")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "hello-2-1a2b3c4d" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetReplica(pb.GetReplicaRequest(name="hello-3"))
    assert info.value.details() == "replica hello-3 not found"
    got = await stub.PreemptReplica(pb.PreemptReplicaRequest(name="hello-2-1a2b3c4d"))
    assert got.replica.name == "hello-2-1a2b3c4d"


def _plant_log_outside(state_dir: str) -> None:
    # A log directory outside the state dir, where "../../x" would reach.
    outside = pathlib.Path(state_dir).resolve().parent / "x"
    outside.mkdir(exist_ok=True)
    (outside / "app.log").write_text("not yours\n")


async def test_log_names_are_never_paths_and_refusals_are_bounded(stub, state_dir) -> None:
    _plant_log_outside(state_dir)
    for name in ("../../x", "..", "a/b", "/etc"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.collect(stub.StreamLogs(pb.StreamLogsRequest(name=name)))
        decoded = grpc_errors.RpcError(info.value)
        assert decoded.code == grpc.StatusCode.INVALID_ARGUMENT, name
        assert [f for f, _ in decoded.field_violations] == ["name"]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SetZoneAvailability(
            pb.SetZoneAvailabilityRequest(zone="zone-a", refuse_for=duration_pb2.Duration(seconds=315_576_000_000))
        )
    decoded = grpc_errors.RpcError(info.value)
    assert decoded.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in decoded.field_violations] == ["refuse_for"]
    zones = (await stub.ListZones(pb.ListZonesRequest())).zones
    assert all(not z.HasField("refuse_until_time") for z in zones)


async def test_replica_environment_workdir_and_followed_app_log(stub, state_dir, tmp_path) -> None:
    workdir = tmp_path / "app"
    workdir.mkdir()
    (workdir / "data.txt").write_text("from the workdir\n")
    run = 'cat data.txt; echo "PORT=$PORT ID=$REPLICA_ID SKY=$SKYPILOT_SERVE_REPLICA_ID URL=$URL"; sleep 0.5'
    spec = client.spec(run, envs={"URL": "http://localhost:8080/x"}, workdir=str(workdir))
    events = await _launch(stub, client.launch_request(4, spec_=spec))
    port = events[-1].endpoint.rsplit(":", 1)[1]
    # Follow the app log while the app runs; the stream ends once the app exited.
    chunks = await client.collect(stub.StreamLogs(pb.StreamLogsRequest(name="svc-4", follow=True)), timeout=10)
    text = b"".join(c.data for c in chunks).decode()
    assert "from the workdir" in text
    assert port == "8080"  # the declared port, unchanged, on the replica's own address
    assert "PORT=8080 ID=4 SKY=4 URL=http://localhost:8080/x" in text


async def test_auto_network_is_address_when_advertising_plain_loopback(state_dir) -> None:
    # The local stack sets advertise_host 127.0.0.1; that is still loopback, so each replica
    # gets its own address and keeps its declared port.
    srv = await server.build_server(_settings(state_dir, replica_network="auto", advertise_host="127.0.0.1"))
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = pb_grpc.ProvisionerServiceStub(channel)
            events = await _launch(stub, client.launch_request(6))
            assert events[-1].endpoint.startswith("http://127.77.") and events[-1].endpoint.endswith(":8080")
    finally:
        await srv.stop(None)
        provisioner_procs.kill_replicas(state_dir)


async def test_port_network_maps_each_declared_port_to_a_free_one(state_dir) -> None:
    srv = await server.build_server(_settings(state_dir, replica_network="port"))
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = pb_grpc.ProvisionerServiceStub(channel)
            run = 'echo "PORT=$PORT HOST=$HOST URL=$URL"; sleep 0.5'
            spec = client.spec(run, envs={"URL": "http://localhost:8080/x"})
            events = await _launch(stub, client.launch_request(5, spec_=spec))
            port = events[-1].endpoint.rsplit(":", 1)[1]
            assert events[-1].endpoint == f"http://127.0.0.1:{port}" and port != "8080"
            chunks = await client.collect(stub.StreamLogs(pb.StreamLogsRequest(name="svc-5", follow=True)), timeout=10)
            text = b"".join(c.data for c in chunks).decode()
            assert f"PORT={port} HOST=127.0.0.1 URL=http://localhost:{port}/x" in text
    finally:
        await srv.stop(None)
        provisioner_procs.kill_replicas(state_dir)


async def test_health_check_serves(built) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{built.port}") as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=server.SERVICE_NAME)
        )
    assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_delete_logs_removes_a_gone_replicas_kept_logs_and_only_those(stub, state_dir) -> None:
    request = client.launch_request(4, spec_=client.spec(run="echo hello; sleep 30"))
    request.name = "svc-4-0a1b2c3d"  # the controller's incarnation suffix
    await _launch(stub, request)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.DeleteLogs(pb.DeleteLogsRequest(name=request.name))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # still running
    for _ in range(100):  # RUNNING comes as the process starts: wait until the app wrote its line
        if await client.collect(stub.StreamLogs(pb.StreamLogsRequest(name=request.name))):
            break
        await asyncio.sleep(0.1)
    await client.collect(stub.Terminate(pb.TerminateRequest(name=request.name, keep_logs=True)))
    assert await client.collect(stub.StreamLogs(pb.StreamLogsRequest(name=request.name)))  # kept

    assert (await stub.DeleteLogs(pb.DeleteLogsRequest(name=request.name))).deleted
    assert not (await stub.DeleteLogs(pb.DeleteLogsRequest(name=request.name))).deleted  # idempotent
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.collect(stub.StreamLogs(pb.StreamLogsRequest(name=request.name)))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    for bad in ("../../x", "..", "a/b", ""):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.DeleteLogs(pb.DeleteLogsRequest(name=bad))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
    assert os.listdir(state_dir)  # nothing outside a replica's own logs went


# Two launches and one the provisioner refuses (an owner too long), over one stream.
SHARED = (client.launch_request(1), client.launch_request(2), client.launch_request(3, owner="x" * 129))


async def _follow_shared(
    messages: AsyncIterator[list[pb.LaunchManyResponse]],
) -> tuple[dict[str, list[resources_pb2.LaunchEvent]], dict[str, pb.LaunchManyResponse], int]:
    """Read until the three launches of SHARED ended: the events of each, how each ended, and
    how many messages carried them."""
    events: dict[str, list[resources_pb2.LaunchEvent]] = {"svc-1": [], "svc-2": []}
    ended: dict[str, pb.LaunchManyResponse] = {}
    count = 0
    async with asyncio.timeout(60):
        async for message in messages:
            count += 1
            for response in message:
                if response.done:
                    ended[response.name] = response
                else:
                    events[response.name].append(response.event)
            if len(ended) == 3:
                break
    return events, ended, count


async def _each_ended_as_its_own_launch_would(
    stub, events: dict[str, list[resources_pb2.LaunchEvent]], ended: dict[str, pb.LaunchManyResponse]
) -> None:
    # A refused request ends only its own launch, with the status Launch would have given it.
    assert ended["svc-3"].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "owner" in ended["svc-3"].error_message
    for name in ("svc-1", "svc-2"):
        assert ended[name].error_code == 0
        assert client.types(events[name])[-1] == "RUNNING"
        assert events[name][-1].endpoint
        # The same launch, attached to on a stream of its own, replays the same events.
        again = await _launch(stub, client.launch_request(int(name.removeprefix("svc-"))))
        assert [e.sequence for e in again] == [e.sequence for e in events[name]]


async def test_many_launches_share_one_stream_and_each_ends_as_its_own_launch_would(stub) -> None:
    # LaunchMany (issue 24): one stream for many launches, each response naming its launch.
    outbox: asyncio.Queue[pb.LaunchManyRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.LaunchManyRequest]:
        while (msg := await outbox.get()) is not None:
            yield msg

    for request in SHARED:
        outbox.put_nowait(pb.LaunchManyRequest(launch=request))
    call = stub.LaunchMany(requests())

    async def messages() -> AsyncIterator[list[pb.LaunchManyResponse]]:
        async for response in call:
            yield [response]

    events, ended, _ = await _follow_shared(messages())
    call.cancel()
    await _each_ended_as_its_own_launch_would(stub, events, ended)


async def test_launch_batches_carry_many_launches_per_message_each_ending_as_its_own_launch_would(stub) -> None:
    # LaunchBatches: LaunchMany with many requests and many responses per message.
    outbox: asyncio.Queue[pb.LaunchBatchesRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.LaunchBatchesRequest]:
        while (msg := await outbox.get()) is not None:
            yield msg

    outbox.put_nowait(pb.LaunchBatchesRequest(requests=[pb.LaunchManyRequest(launch=r) for r in SHARED]))
    call = stub.LaunchBatches(requests())

    async def messages() -> AsyncIterator[list[pb.LaunchManyResponse]]:
        async for message in call:
            yield list(message.responses)

    events, ended, count = await _follow_shared(messages())
    call.cancel()
    assert count < sum(map(len, events.values())) + len(ended)  # some messages carried several
    await _each_ended_as_its_own_launch_would(stub, events, ended)


async def test_terminate_batches_tear_many_replicas_down_each_as_its_own_terminate_would(stub, state_dir) -> None:
    # TerminateBatches (issue 24): the teardowns of many replicas on one stream, several per message.
    for rid in (1, 2):
        await _launch(stub, client.launch_request(rid))
    outbox: asyncio.Queue[pb.TerminateBatchesRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.TerminateBatchesRequest]:
        while (msg := await outbox.get()) is not None:
            yield msg

    names = ("svc-1", "svc-2", "svc-9")  # svc-9 never existed: TERMINATED at once, as Terminate says
    outbox.put_nowait(
        pb.TerminateBatchesRequest(
            requests=[pb.TerminateManyRequest(terminate=pb.TerminateRequest(name=n)) for n in names]
        )
    )
    call = stub.TerminateBatches(requests())
    events: dict[str, list[resources_pb2.TerminateEvent]] = {n: [] for n in names}
    ended: dict[str, pb.TerminateManyResponse] = {}
    async with asyncio.timeout(60):
        async for message in call:
            for response in message.responses:
                if response.done:
                    ended[response.name] = response
                else:
                    events[response.name].append(response.event)
            if len(ended) == len(names):
                break
    outbox.put_nowait(None)
    call.cancel()
    assert {n: e.error_code for n, e in ended.items()} == dict.fromkeys(names, 0)
    assert client.types(events["svc-1"]) == client.types(events["svc-2"]) == ["TERMINATING", "TERMINATED"]
    assert client.types(events["svc-9"]) == ["TERMINATED"] and events["svc-9"][0].message == "no such replica"
    assert provisioner_procs.wait_no_replicas(state_dir) == []


async def test_a_launch_no_longer_followed_on_the_shared_stream_goes_on(stub) -> None:
    outbox: asyncio.Queue[pb.LaunchManyRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.LaunchManyRequest]:
        while (msg := await outbox.get()) is not None:
            yield msg

    slow = client.launch_request(1, spec_=client.spec(setup="sleep 3"))
    outbox.put_nowait(pb.LaunchManyRequest(launch=slow))
    call = stub.LaunchMany(requests())
    first = await asyncio.wait_for(call.read(), 30)
    assert first.name == "svc-1" and not first.done
    outbox.put_nowait(pb.LaunchManyRequest(stop="svc-1"))
    outbox.put_nowait(pb.LaunchManyRequest(launch=client.launch_request(2)))
    async with asyncio.timeout(60):
        while True:
            response = await call.read()
            assert not (response.name == "svc-1" and response.done), "a launch no longer followed ended here"
            if response.name == "svc-2" and response.done:
                break
    outbox.put_nowait(None)  # the client is done: the stream ends once its launches have
    async with asyncio.timeout(30):
        while (response := await call.read()) != grpc.aio.EOF:
            assert response.name != "svc-1", "a launch no longer followed sent events"
    # Not followed is not cancelled: the launch of svc-1 went on.
    events = await _launch(stub, client.launch_request(1))
    assert client.types(events)[-1] == "RUNNING"

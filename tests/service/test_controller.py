"""The controller's public API over a real gRPC server, with a real prober and a scripted
provisioner (tests/helpers/fake_provisioner.py) for failures the local backend cannot produce."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sqlite3
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import grpc_errors
from services.controller import server as controller_server
from services.prober import server as prober_server
from tests.helpers import cluster as cl
from tests.helpers import fake_provisioner

READY = res.REPLICA_STATUS_READY
YAML = """
name: {name}
service:
  readiness_probe:
    path: /health
    initial_delay_seconds: 5
    consecutive_failure_threshold_timeout: 1
    endpoint_probe_interval_seconds: 0.1
  replicas: {replicas}
resources:
  ports: 8080
run: {run}
"""


def spec(name: str = "svc", replicas: int = 1, run: str = "serve") -> str:
    return YAML.format(name=name, replicas=replicas, run=run)


@dataclasses.dataclass
class Env:
    stub: api_grpc.ControllerServiceStub
    provisioner: fake_provisioner.FakeProvisioner
    channel: grpc.aio.Channel
    state_dir: str
    addr: str = ""


@contextlib.asynccontextmanager
async def started(tmp_path, *, launch_many: bool = True, **settings: object) -> AsyncIterator[Env]:
    """A real controller and prober with a scripted provisioner (`launch_many`: it has LaunchMany)."""
    async with fake_provisioner.serving(launch_many=launch_many) as (fake, provisioner_addr):
        prober = await prober_server.build_server(prober_server.load_settings(listen_addr="127.0.0.1:0"))
        await prober.start()
        values: dict[str, object] = {
            "listen_addr": "127.0.0.1:0",
            "state_dir": str(tmp_path / "ctl"),
            "provisioner_addr": provisioner_addr,
            "prober_addrs": f"127.0.0.1:{prober.port}",
            "drain_s": 0.05,
            # A token on the API with the provisioner and prober on TCP is refused unless
            # allowed: these run on a machine no one else uses (tests/service/test_private_sockets.py).
            "allow_open_internal": True,
            **settings,
        }
        running = await controller_server.start(controller_server.Settings(**values))  # type: ignore[arg-type]
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
        try:
            yield Env(
                api_grpc.ControllerServiceStub(channel),
                fake,
                channel,
                str(values["state_dir"]),
                addr=f"127.0.0.1:{running.port}",
            )
        finally:
            await channel.close()
            await running.stop(None)
            await prober.stop(None)


@pytest.fixture
async def env(tmp_path, store_url: str) -> AsyncIterator[Env]:
    # Every test on `env` runs on both store backends (tests/conftest.py).
    async with started(tmp_path, store_url=store_url) as e:
        yield e


async def create(env: Env, yaml_text: str) -> cl.Watch:
    svc = (await env.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text))).service
    return cl.Watch(env.stub, svc.name)


async def rpc_error(call) -> grpc_errors.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return grpc_errors.RpcError(err.value)


async def test_failed_scale_down_teardown_is_kept_as_failed_cleanup(env: Env) -> None:
    w = await create(env, spec())
    await w.until(lambda w: w.count(READY) == 1)
    env.provisioner.fail_teardown.add(w.replicas[1].replica_name)
    await env.stub.TerminateReplica(api.TerminateReplicaRequest(service_name="svc", replica_id=1))
    await w.until(lambda w: w.replicas.get(1) and w.replicas[1].status == res.REPLICA_STATUS_FAILED_CLEANUP)
    await w.until(lambda w: w.count(READY) == 1 and 2 in w.replicas)
    assert "teardown failed: cloud said no" in w.replicas[1].failure_reason
    name = w.replicas[1].replica_name

    err = await rpc_error(env.stub.TerminateReplica(api.TerminateReplicaRequest(service_name="svc", replica_id=1)))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.reason == "REPLICA_FAILED"

    await env.stub.TerminateReplica(api.TerminateReplicaRequest(service_name="svc", replica_id=1, purge=True))
    await w.until(lambda w: 1 not in w.replicas)
    assert env.provisioner.terminations[name] == 2  # purge tried the cleanup once more
    w.cancel()


async def test_delete_with_a_failed_teardown_leaves_failed_cleanup_until_purged(env: Env) -> None:
    w = await create(env, spec(replicas=2))
    await w.until(lambda w: w.count(READY) == 2)
    first, second = w.replicas[1].replica_name, w.replicas[2].replica_name
    env.provisioner.fail_teardown.add(second)
    await env.stub.DeleteService(api.DeleteServiceRequest(service_name="svc"))
    await w.until(lambda w: w.service.status == res.SERVICE_STATUS_FAILED_CLEANUP)
    assert list(w.replicas) == [2]
    assert "delete with purge" in w.service.status_message
    assert first not in env.provisioner.running

    await env.stub.DeleteService(api.DeleteServiceRequest(service_name="svc", purge=True))
    await w.until(lambda w: w.deleted)
    err = await rpc_error(env.stub.GetService(api.GetServiceRequest(service_name="svc")))
    assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, "SERVICE_NOT_FOUND")


async def test_a_deleted_service_goes_when_its_last_teardown_ends_not_at_the_next_sweep(tmp_path) -> None:
    # The last teardown's end kicks a pass; that pass must not still see the teardown in motion.
    async with started(tmp_path, sweep_interval_s=600.0) as env:
        w = await create(env, spec(replicas=1))
        await w.until(lambda w: w.count(READY) == 1)
        env.provisioner.teardown_s = 0.1  # as a real one: the last pass ran well before it ends
        await env.stub.DeleteService(api.DeleteServiceRequest(service_name="svc"))
        deadline = asyncio.get_running_loop().time() + 10
        while (await env.stub.ListServices(api.ListServicesRequest())).services:
            assert asyncio.get_running_loop().time() < deadline, "the service waits for the sweep"
            await asyncio.sleep(0.05)
        w.cancel()


async def test_a_deleted_service_with_no_replica_goes_at_once_not_at_the_next_sweep(tmp_path) -> None:
    # No teardown ends to kick a pass: the delete itself must (it waited for the 5 s sweep).
    async with started(tmp_path, sweep_interval_s=600.0) as env:
        await env.stub.CreateService(api.CreateServiceRequest(yaml=spec(replicas=0)))
        await env.stub.DeleteService(api.DeleteServiceRequest(service_name="svc"))
        deadline = asyncio.get_running_loop().time() + 10
        while (await env.stub.ListServices(api.ListServicesRequest())).services:
            assert asyncio.get_running_loop().time() < deadline, "the service waits for the sweep"
            await asyncio.sleep(0.05)


async def test_api_errors_follow_the_aip_model(env: Env) -> None:
    err = await rpc_error(env.stub.GetService(api.GetServiceRequest(service_name="nope")))
    assert err.code == grpc.StatusCode.NOT_FOUND
    await env.stub.CreateService(api.CreateServiceRequest(yaml=spec(), request_id="r1"))
    again = await env.stub.CreateService(api.CreateServiceRequest(yaml=spec(), request_id="r1"))
    assert again.service.name == "svc"  # a retried create with the same request id
    err = await rpc_error(env.stub.CreateService(api.CreateServiceRequest(yaml=spec())))
    assert err.code == grpc.StatusCode.ALREADY_EXISTS
    err = await rpc_error(env.stub.GetReplica(api.GetReplicaRequest(service_name="svc", replica_id=99)))
    assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, "REPLICA_NOT_FOUND")
    err = await rpc_error(env.stub.CreateService(api.CreateServiceRequest(yaml="service: [")))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in err.field_violations] == ["yaml"]
    err = await rpc_error(env.stub.CreateService(api.CreateServiceRequest(yaml=spec().replace("name: svc\n", ""))))
    assert "service_name" in [f for f, _ in err.field_violations]

    w = cl.Watch(env.stub, "svc")
    await w.until(lambda w: w.count(READY) == 1)
    env.provisioner.fail_teardown.add(w.replicas[1].replica_name)
    await env.stub.DeleteService(api.DeleteServiceRequest(service_name="svc"))
    await w.until(lambda w: w.service.status == res.SERVICE_STATUS_FAILED_CLEANUP)
    err = await rpc_error(env.stub.UpdateService(api.UpdateServiceRequest(service_name="svc", yaml=spec(replicas=2))))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    w.cancel()


async def test_app_exit_is_a_user_app_failure(env: Env) -> None:
    w = await create(env, spec())
    await w.until(lambda w: w.count(READY) == 1)
    env.provisioner.app_exited(w.replicas[1].replica_name, 2)
    await w.until(lambda w: w.replicas.get(1) and w.replicas[1].status == res.REPLICA_STATUS_FAILED)
    await w.until(lambda w: w.count(READY) == 1)  # it had been ready: replaced, no stop rule
    assert w.replicas[1].failure_reason == "app exited with code 2"
    assert max(w.replicas) == 2
    w.cancel()


async def test_in_place_update_launches_or_tears_down_exactly_the_difference(env: Env) -> None:
    w = await create(env, spec(replicas=2))
    await w.until(lambda w: w.count(READY) == 2)

    dry = await env.stub.UpdateService(
        api.UpdateServiceRequest(service_name="svc", yaml=spec(replicas=3), dry_run=True)
    )
    assert (list(dry.plan.kept_replica_ids), dry.plan.launch_count, dry.plan.in_place) == ([1, 2], 1, True)
    assert dry.service.latest_version == 1  # nothing applied

    up = await env.stub.UpdateService(api.UpdateServiceRequest(service_name="svc", yaml=spec(replicas=3)))
    assert up.plan.new_version == 2
    await w.until(lambda w: w.count(READY) == 3)
    assert sum(env.provisioner.launches.values()) == 3  # exactly one launch
    assert {r.version for r in w.replicas.values()} == {2}

    down = await env.stub.UpdateService(api.UpdateServiceRequest(service_name="svc", yaml=spec(replicas=2)))
    assert list(down.plan.teardown_replica_ids) == [3]
    await w.until(lambda w: len(w.replicas) == 2 and w.count(READY) == 2)
    assert sum(env.provisioner.terminations.values()) == 1  # exactly one teardown
    w.cancel()


async def test_rolling_update_replaces_replicas_after_new_ones_are_ready(env: Env) -> None:
    w = await create(env, spec(replicas=2))
    await w.until(lambda w: w.count(READY) == 2)
    up = await env.stub.UpdateService(
        api.UpdateServiceRequest(service_name="svc", yaml=spec(replicas=2, run="serve --v2"))
    )
    assert (up.plan.in_place, up.plan.launch_count, list(up.plan.replaced_replica_ids)) == (False, 2, [1, 2])
    await w.until(lambda w: sorted(w.replicas) == [3, 4] and w.count(READY) == 2)
    assert list(w.service.active_versions) == [2]
    w.cancel()


async def test_watch_resumes_after_a_sequence_and_endpoints_are_pushed(env: Env) -> None:
    w = await create(env, spec(replicas=2))
    seen: list[api.WatchServiceResponse] = []
    async for msg in env.stub.WatchService(api.WatchServiceRequest(service_name="svc")):
        seen.append(msg)
        if msg.service.ready_replicas == 2:
            break
    assert seen[0].snapshot and not any(m.snapshot for m in seen[1:])
    assert [m.sequence for m in seen] == sorted({m.sequence for m in seen})
    middle = seen[len(seen) // 2].sequence
    resumed = env.stub.WatchService(api.WatchServiceRequest(service_name="svc", after_sequence=middle))
    first = await resumed.read()
    assert not first.snapshot and first.sequence == middle + 1
    resumed.cancel()
    stale = env.stub.WatchService(api.WatchServiceRequest(service_name="svc", after_sequence=1))
    assert (await stale.read()).snapshot  # too old to replay: a fresh snapshot
    stale.cancel()

    endpoints = env.stub.WatchEndpoints(api.WatchEndpointsRequest(service_name="svc"))
    now = await endpoints.read()
    assert sorted(e.replica_id for e in now.endpoints) == [1, 2]
    await env.stub.TerminateReplica(api.TerminateReplicaRequest(service_name="svc", replica_id=1))
    after = await endpoints.read()
    assert after.version > now.version
    assert [e.replica_id for e in after.endpoints] == [2]  # left the ready set at once
    endpoints.cancel()
    w.cancel()


async def test_paging_purge_and_load(env: Env) -> None:
    w = await create(env, spec(replicas=3))
    await w.until(lambda w: w.count(READY) == 3)
    page = await env.stub.ListReplicas(api.ListReplicasRequest(service_name="svc", page_size=2))
    assert [r.replica_id for r in page.replicas] == [1, 2] and page.next_page_token
    rest = await env.stub.ListReplicas(
        api.ListReplicasRequest(service_name="svc", page_size=2, page_token=page.next_page_token)
    )
    assert [r.replica_id for r in rest.replicas] == [3] and not rest.next_page_token

    env.provisioner.app_exited(w.replicas[2].replica_name, 1)
    await w.until(lambda w: w.replicas.get(2) and w.replicas[2].status == res.REPLICA_STATUS_FAILED)
    purged = await env.stub.PurgeReplicas(api.PurgeReplicasRequest(service_name="svc"))
    assert list(purged.replica_ids) == [2]
    await w.until(lambda w: 2 not in w.replicas)

    load = await env.stub.ReportLoad(api.ReportLoadRequest(service_name="svc", request_count=120))
    assert load.qps == pytest.approx(2.0)
    w.cancel()


async def test_blue_green_switches_traffic_at_once_when_the_new_version_is_ready(env: Env) -> None:
    w = await create(env, spec(replicas=2))
    await w.until(lambda w: w.count(READY) == 2)
    endpoints = env.stub.WatchEndpoints(api.WatchEndpointsRequest(service_name="svc"))
    assert {e.version for e in (await endpoints.read()).endpoints} == {1}
    await env.stub.UpdateService(
        api.UpdateServiceRequest(
            service_name="svc", yaml=spec(replicas=2, run="serve --v2"), mode=res.UPDATE_MODE_BLUE_GREEN
        )
    )
    versions_seen = []
    while True:
        msg = await endpoints.read()
        versions_seen.append(sorted({e.version for e in msg.endpoints}))
        if versions_seen[-1] == [2]:
            break
    assert all(v in ([1], [2]) for v in versions_seen), versions_seen  # never mixed
    await w.until(lambda w: sorted(w.replicas) == [3, 4])
    assert list(w.service.active_versions) == [2]
    endpoints.cancel()
    w.cancel()


async def test_capacity_failures_back_off_instead_of_looping(env: Env) -> None:
    env.provisioner.capacity_refused = True
    w = await create(env, spec(replicas=1))
    await asyncio.sleep(2.0)
    attempts = sum(env.provisioner.launches.values())
    assert 1 <= attempts <= 3, attempts  # 0 s, then 1 s, then 2 s apart
    env.provisioner.capacity_refused = False
    await w.until(lambda w: w.count(READY) == 1, timeout=10)
    assert all(r.replica_id > attempts - 1 for r in w.replicas.values())  # failed ones were removed
    w.cancel()


def status_of(w: cl.Watch, rid: int) -> int:
    r = w.replicas.get(rid)
    return r.status if r is not None else res.REPLICA_STATUS_UNSPECIFIED


async def test_a_new_service_starts_in_replica_init_not_no_replica(env: Env) -> None:
    created = (await env.stub.CreateService(api.CreateServiceRequest(yaml=spec(replicas=2)))).service
    assert created.status in (res.SERVICE_STATUS_CONTROLLER_INIT, res.SERVICE_STATUS_REPLICA_INIT)
    first = await env.stub.WatchService(api.WatchServiceRequest(service_name="svc")).read()
    assert first.service.status in (res.SERVICE_STATUS_CONTROLLER_INIT, res.SERVICE_STATUS_REPLICA_INIT)


async def test_stop_rule_counts_replicas_kept_ready_through_an_in_place_update(env: Env) -> None:
    w = await create(env, spec(replicas=2))
    await w.until(lambda w: w.count(READY) == 2)
    env.provisioner.dead_endpoint = True  # the new replica never answers its probes
    await env.stub.UpdateService(api.UpdateServiceRequest(service_name="svc", yaml=spec(replicas=3)))
    await w.until(lambda w: status_of(w, 3) == res.REPLICA_STATUS_STARTING)
    env.provisioner.dead_endpoint = False
    env.provisioner.app_exited(w.replicas[3].replica_name, 1)
    await w.until(lambda w: status_of(w, 3) == res.REPLICA_STATUS_FAILED)
    # Version 2 has READY replicas (kept in place): a replacement, no stop rule.
    await w.until(lambda w: w.count(READY) == 3)
    assert "scaling stopped" not in w.service.status_message
    w.cancel()


async def test_failed_teardown_of_a_provisioning_replica_is_failed_cleanup_and_purgeable(env: Env) -> None:
    env.provisioner.hold_launches = True
    w = await create(env, spec(replicas=1))
    await w.until(lambda w: status_of(w, 1) == res.REPLICA_STATUS_PROVISIONING)
    name = w.replicas[1].replica_name
    env.provisioner.fail_teardown.add(name)
    env.provisioner.hold_launches = False
    await env.stub.TerminateReplica(api.TerminateReplicaRequest(service_name="svc", replica_id=1))
    await w.until(lambda w: status_of(w, 1) == res.REPLICA_STATUS_FAILED_CLEANUP)
    await w.until(lambda w: w.count(READY) == 1)
    env.provisioner.fail_teardown.discard(name)
    await env.stub.TerminateReplica(api.TerminateReplicaRequest(service_name="svc", replica_id=1, purge=True))
    await w.until(lambda w: 1 not in w.replicas)
    w.cancel()


async def test_watch_changes_carry_the_spec_only_when_the_version_changes(env: Env) -> None:
    big = spec(replicas=2) + "envs:\n  BLOB: " + "x" * 200_000 + "\n"
    w = await create(env, big)
    await w.until(lambda w: w.count(READY) == 2)
    await env.stub.UpdateService(
        api.UpdateServiceRequest(service_name="svc", yaml=big.replace("replicas: 2", "replicas: 3"))
    )
    await w.until(lambda w: w.count(READY) == 3)
    replay = env.stub.WatchService(api.WatchServiceRequest(service_name="svc", after_sequence=w.first_sequence))
    versions_with_spec, changes = [], 0
    while True:
        msg = await asyncio.wait_for(replay.read(), 5)
        assert not msg.snapshot  # a replay of the history
        changes += 1
        if msg.service.HasField("spec"):
            versions_with_spec.append(msg.service.latest_version)
        if msg.service.ready_replicas == 3:
            break
    replay.cancel()
    assert changes > 4
    # The big spec travels once per version (with the change that brings it), not per change.
    assert versions_with_spec[-1:] == [2] and len(versions_with_spec) == len(set(versions_with_spec))
    w.cancel()


async def _health(env: Env) -> int:
    reply = await health_pb2_grpc.HealthStub(env.channel).Check(health_pb2.HealthCheckRequest(service=""))
    return reply.status


async def _until_health(env: Env, status: int) -> None:
    for _ in range(100):
        if await _health(env) == status:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"health never became {status}")


async def test_store_failures_kill_no_task_and_health_says_not_serving(tmp_path) -> None:
    async with started(tmp_path, sweep_interval_s=0.2, store_busy_timeout_s=0.05) as env:
        w = await create(env, spec(replicas=1))
        await w.until(lambda w: w.count(READY) == 1)
        assert await _health(env) == health_pb2.HealthCheckResponse.SERVING

        # Another process holds the store's write lock: every write of the controller fails.
        lock = sqlite3.connect(os.path.join(env.state_dir, "state.db"), isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")
        try:
            env.provisioner.app_exited(w.replicas[1].replica_name, 1)  # an event that must be written
            await _until_health(env, health_pb2.HealthCheckResponse.NOT_SERVING)
            err = await rpc_error(env.stub.CreateService(api.CreateServiceRequest(yaml=spec(name="other"))))
            assert (err.code, err.reason) == (grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")
            err = await rpc_error(
                env.stub.TerminateReplica(api.TerminateReplicaRequest(service_name="svc", replica_id=1))
            )
            assert err.code == grpc.StatusCode.UNAVAILABLE
            replica = (await env.stub.GetReplica(api.GetReplicaRequest(service_name="svc", replica_id=1))).replica
            assert replica.status == READY  # memory never ran ahead of the store
        finally:
            lock.execute("ROLLBACK")
            lock.close()

        await _until_health(env, health_pb2.HealthCheckResponse.SERVING)
        # The app exit was not lost with the failed write: it is applied, and replaced.
        await w.until(lambda w: status_of(w, 1) == res.REPLICA_STATUS_FAILED and w.count(READY) == 1)
        await env.stub.CreateService(api.CreateServiceRequest(yaml=spec(name="other")))
        w.cancel()


async def test_replica_logs_are_streamed_through_the_public_api(env: Env) -> None:
    w = await create(env, spec())
    await w.until(lambda w: w.count(READY) == 1)
    name = w.replicas[1].replica_name

    async def read(**fields: object) -> bytes:
        call = env.stub.StreamReplicaLogs(api.StreamReplicaLogsRequest(**fields))  # type: ignore[arg-type]
        return b"".join([chunk.data async for chunk in call])

    assert await read(service_name="svc", replica_id=1) == f"LOG_KIND_APP of {name}\n".encode()
    launch = await read(service_name="svc", replica_id=1, kind=api.REPLICA_LOG_KIND_LAUNCH, follow=True)
    assert launch == f"LOG_KIND_LAUNCH of {name}\nmore\n".encode()

    err = await rpc_error(read(service_name="", replica_id=0, kind=7))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert sorted(f for f, _ in err.field_violations) == ["kind", "replica_id", "service_name"]
    err = await rpc_error(read(service_name="nope", replica_id=1))
    assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, "SERVICE_NOT_FOUND")
    err = await rpc_error(read(service_name="svc", replica_id=9))
    assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, "REPLICA_NOT_FOUND")
    env.provisioner.running.pop(name)  # the provisioner has no trace of it
    err = await rpc_error(read(service_name="svc", replica_id=1))
    assert (err.code, err.reason) == (grpc.StatusCode.NOT_FOUND, "LOGS_NOT_FOUND")
    w.cancel()


async def test_zones_are_asked_once_not_before_every_create(tmp_path) -> None:
    # The scripted provisioner answers with no zones: an answer all the same (issue 24: 1,000
    # creates made 1,000 ListZones calls). No resync runs meanwhile (it asks while there are none).
    async with started(tmp_path, sweep_interval_s=600.0) as env:
        asked = env.provisioner.zone_lists
        for name in ("z1", "z2", "z3", "z4"):
            await env.stub.CreateService(api.CreateServiceRequest(yaml=spec(name, replicas=1)))
        assert env.provisioner.zone_lists == asked


async def test_every_launch_and_teardown_goes_over_one_shared_provisioner_stream(env: Env) -> None:
    # Issue 24: one LaunchBatches stream for every launch of every service, not a stream each;
    # and one TerminateBatches stream for every teardown (deleting 10,000 replicas took 10 s
    # over a Terminate stream each).
    first, second = await create(env, spec("one", replicas=6)), await create(env, spec("two", replicas=6))
    await first.until(lambda w: w.count(READY) == 6)
    await second.until(lambda w: w.count(READY) == 6)
    assert env.provisioner.streams == {"LaunchBatches": 1}
    assert sum(env.provisioner.launches.values()) == 12
    for name in ("one", "two"):
        await env.stub.DeleteService(api.DeleteServiceRequest(service_name=name))
    await first.until(lambda w: w.deleted)
    await second.until(lambda w: w.deleted)
    assert env.provisioner.teardown_streams == {"TerminateBatches": 1}
    assert sorted(env.provisioner.terminations.values()) == [1] * 12  # each torn down once
    assert env.provisioner.running == {}


async def test_launches_get_streams_of_their_own_from_a_provisioner_without_launch_many(tmp_path) -> None:
    async with started(tmp_path, launch_many=False) as env:
        w = await create(env, spec(replicas=4))
        await w.until(lambda w: w.count(READY) == 4)
        assert env.provisioner.streams["Launch"] >= 4
        assert sum(env.provisioner.launches.values()) == 4  # each launched once
        await env.stub.DeleteService(api.DeleteServiceRequest(service_name="svc"))
        await w.until(lambda w: w.deleted)
        assert env.provisioner.teardown_streams["Terminate"] >= 4  # and torn down on streams of their own
        assert sorted(env.provisioner.terminations.values()) == [1] * 4

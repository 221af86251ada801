"""End to end: controller, provisioner and prober as processes, with real replica processes."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import grpc_errors
from tests.helpers import cluster as cl

pytestmark = pytest.mark.e2e

READY = res.REPLICA_STATUS_READY


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read().decode()


async def _create(c: cl.Cluster, yaml_text: str) -> res.Service:
    resp = await c.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text), timeout=10)
    return resp.service


async def test_two_replicas_become_ready_and_answer(cluster: cl.Cluster) -> None:
    await _create(cluster, cl.app_yaml("web", cluster.tag))
    w = cl.Watch(cluster.stub, "web")
    await w.until(lambda w: w.count(READY) == 2)
    assert w.service.status == res.SERVICE_STATUS_READY
    assert (w.service.ready_replicas, w.service.total_replicas) == (2, 2)
    assert list(w.service.active_versions) == [1]
    assert w.service.HasField("uptime_start_time")
    endpoints = {r.endpoint for r in w.replicas.values()}
    assert len(endpoints) == 2
    for r in w.replicas.values():
        code, body = await asyncio.to_thread(_get, r.endpoint + "/health")
        assert code == 200
        assert f"replica {r.replica_id}" in body
        assert r.replica_name == f"web-{r.replica_id}-{w.service.uid}"
        assert res.REPLICA_STATUS_STARTING in w.seen_statuses[r.replica_id]
    assert len(cl.replica_pids(cluster.tag)) == 2
    w.cancel()


async def test_app_exit_fails_without_relaunch_loop(cluster: cl.Cluster) -> None:
    await _create(cluster, cl.app_yaml("crash", cluster.tag, app_args="--exit-code 3 --exit-after 0.3"))
    w = cl.Watch(cluster.stub, "crash")
    await w.until(lambda w: len(w.replicas) == 2 and w.count(res.REPLICA_STATUS_FAILED) == 2)
    await asyncio.sleep(1.0)  # a relaunch loop would show new replicas by now
    svc = (await cluster.stub.GetService(api.GetServiceRequest(service_name="crash"))).service
    replicas = (await cluster.stub.ListReplicas(api.ListReplicasRequest(service_name="crash"))).replicas
    assert sorted(r.replica_id for r in replicas) == [1, 2]
    assert all(r.failure_reason == "app exited with code 3" for r in replicas)
    assert svc.status == res.SERVICE_STATUS_NO_REPLICA
    assert (svc.ready_replicas, svc.total_replicas) == (0, 0)
    assert "scaling stopped: version 1 failed before ever being ready" in svc.status_message
    w.cancel()


async def test_app_that_never_answers_fails_initial_delay(cluster: cl.Cluster) -> None:
    probe = "    path: /health\n    initial_delay_seconds: 1\n    timeout_seconds: 0.5\n"
    await _create(cluster, cl.app_yaml("mute", cluster.tag, replicas=1, app_args="--never-answer", probe=probe))
    w = cl.Watch(cluster.stub, "mute")
    await w.until(lambda w: w.count(res.REPLICA_STATUS_FAILED_INITIAL_DELAY) == 1)
    r = next(iter(w.replicas.values()))
    assert "initial delay" in r.failure_reason
    assert w.service.status == res.SERVICE_STATUS_NO_REPLICA
    assert cl.replica_pids(cluster.tag) == []
    w.cancel()


async def test_ready_replica_that_stops_answering_is_replaced(cluster: cl.Cluster, tmp_path) -> None:
    stop_file = tmp_path / "stop-1"
    # Only replica 1 reads a stop file that exists later: REPLICA_ID picks the file name.
    args = f"--stop-file {tmp_path}/stop-$REPLICA_ID"
    await _create(cluster, cl.app_yaml("flaky", cluster.tag, replicas=1, app_args=args))
    w = cl.Watch(cluster.stub, "flaky")
    await w.until(lambda w: w.count(READY) == 1)
    stop_file.write_text("stop")
    await w.until(lambda w: res.REPLICA_STATUS_NOT_READY in w.seen_statuses.get(1, []))
    await w.until(lambda w: 1 not in w.replicas or w.replicas[1].status == res.REPLICA_STATUS_FAILED_PROBING)
    await w.until(lambda w: any(rid > 1 and r.status == READY for rid, r in w.replicas.items()))
    assert w.replicas[1].status == res.REPLICA_STATUS_FAILED_PROBING
    assert w.replicas[1].failure_reason.startswith("probe failed")
    assert w.service.status == res.SERVICE_STATUS_READY
    w.cancel()


@pytest.mark.parametrize("victim", ["group", "wrapper"])
async def test_a_replica_killed_from_outside_is_replaced_at_once_not_after_its_probes(
    cluster: cl.Cluster, victim: str
) -> None:
    """SIGKILL to the replica's process group (or to the wrapper that leads it, leaving the app
    alive): the provisioner reports it vanished, and the controller replaces it on that word.
    Probes come once an hour and fail only after an hour, so they cannot be what replaced it."""
    probe = (
        "    path: /health\n    initial_delay_seconds: 20\n"
        "    consecutive_failure_threshold_timeout: 3600\n    endpoint_probe_interval_seconds: 3600\n"
    )
    name = f"killed-{victim}"
    await _create(cluster, cl.app_yaml(name, cluster.tag, replicas=1, probe=probe))
    w = cl.Watch(cluster.stub, name)
    await w.until(lambda w: w.count(READY) == 1)
    pgid = cluster.replica_pgid(w.replicas[1].replica_name)
    if victim == "group":
        os.killpg(pgid, signal.SIGKILL)
    else:
        os.kill(pgid, signal.SIGKILL)
    await w.until(lambda w: w.replicas[1].status == res.REPLICA_STATUS_FAILED_PROBING and w.count(READY) == 1)
    # (A probe may still fail first, NOT_READY: the prober probes a target at once when it
    # changes, as at READY. Its window of an hour is not what ended the replica.)
    assert w.replicas[1].failure_reason.startswith("replica vanished: "), w.replicas[1].failure_reason
    assert [rid for rid, r in w.replicas.items() if r.status == READY] == [2]
    # Its teardown killed what was left of it (the app, when only the wrapper was killed).
    assert sorted(rid for _, rid in cl.replica_processes(cluster.tag).values()) == [2]
    w.cancel()


async def test_manual_terminate_of_ready_replica_is_replaced(cluster: cl.Cluster) -> None:
    await _create(cluster, cl.app_yaml("term", cluster.tag, replicas=1))
    w = cl.Watch(cluster.stub, "term")
    await w.until(lambda w: w.count(READY) == 1)
    await cluster.stub.TerminateReplica(api.TerminateReplicaRequest(service_name="term", replica_id=1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.stub.TerminateReplica(api.TerminateReplicaRequest(service_name="term", replica_id=1))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await w.until(lambda w: 1 not in w.replicas and w.count(READY) == 1)
    assert list(w.replicas) == [2]
    assert res.REPLICA_STATUS_SHUTTING_DOWN in w.seen_statuses[1]
    w.cancel()


async def test_delete_removes_every_replica_process(cluster: cl.Cluster) -> None:
    await _create(cluster, cl.app_yaml("gone", cluster.tag, replicas=2))
    w = cl.Watch(cluster.stub, "gone")
    await w.until(lambda w: w.count(READY) == 2)
    assert len(cl.replica_pids(cluster.tag)) == 2
    resp = await cluster.stub.DeleteService(api.DeleteServiceRequest(service_name="gone"))
    assert resp.service.status == res.SERVICE_STATUS_SHUTTING_DOWN
    await w.until(lambda w: w.deleted)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.stub.GetService(api.GetServiceRequest(service_name="gone"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert cl.replica_pids(cluster.tag) == []


async def test_bad_spec_returns_every_violation_and_stores_nothing(cluster: cl.Cluster) -> None:
    bad = "name: bad\nservice:\n  readiness_probe: health\n  replicas: -1\nresources:\n  ports: 70000\nrun: x\n"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _create(cluster, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    fields = {f for f, _ in grpc_errors.RpcError(err.value).field_violations}
    assert len(fields) >= 3
    services = (await cluster.stub.ListServices(api.ListServicesRequest())).services
    assert list(services) == []


async def _app_log(c: cl.Cluster, name: str) -> bytes | None:
    """A replica's app log at the provisioner, or None if it has none."""
    from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
    from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
    from replicaplane.provisioner.v1 import resources_pb2 as prov_res
    from services.common import clients

    channel = clients.channel(c.provisioner.addr)
    try:
        stub = prov_grpc.ProvisionerServiceStub(channel)
        data = b""
        async for chunk in stub.StreamLogs(
            prov_pb.StreamLogsRequest(name=name, kind=prov_res.LOG_KIND_APP), timeout=10
        ):
            data += chunk.data
        return data
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
        return None
    finally:
        await channel.close()


async def _until_log_gone(c: cl.Cluster, name: str) -> None:
    for _ in range(100):
        if await _app_log(c, name) is None:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"logs of {name} were kept after their record went")


async def test_kept_logs_go_with_their_record_and_names_never_repeat(cluster: cl.Cluster) -> None:
    crashing = cl.app_yaml("crashy", cluster.tag, replicas=1, run="echo boom; exit 3")
    await _create(cluster, crashing)
    w = cl.Watch(cluster.stub, "crashy")
    await w.until(lambda w: 1 in w.replicas and w.replicas[1].status == res.REPLICA_STATUS_FAILED)
    first = w.replicas[1].replica_name
    assert b"boom" in (await _app_log(cluster, first) or b"")  # kept for the user to read

    await cluster.stub.PurgeReplicas(api.PurgeReplicasRequest(service_name="crashy"))
    await w.until(lambda w: 1 not in w.replicas)
    await _until_log_gone(cluster, first)  # purged record: its logs go too
    w.cancel()

    # The same name, created again, never appends to or shows an old incarnation's logs.
    w = await cl.Watch(cluster.stub, "crashy").until(lambda w: w.service is not None)
    await cluster.stub.DeleteService(api.DeleteServiceRequest(service_name="crashy"))
    await w.until(lambda w: w.deleted)
    await _create(cluster, crashing)
    w = cl.Watch(cluster.stub, "crashy")
    await w.until(lambda w: 1 in w.replicas and w.replicas[1].status == res.REPLICA_STATUS_FAILED)
    second = w.replicas[1].replica_name
    assert second != first
    assert (await _app_log(cluster, second) or b"").count(b"boom") == 1

    await cluster.stub.DeleteService(api.DeleteServiceRequest(service_name="crashy"))
    await w.until(lambda w: w.deleted)
    await _until_log_gone(cluster, second)  # deleted service: the kept logs go too


async def test_unchanged_skypilot_yaml_with_a_fixed_port_app_runs_two_replicas(cluster: cl.Cluster) -> None:
    """SkyPilot's http_server example: `run: python3 server.py`, the app binds ('', 8080)."""
    import os

    workdir = os.path.join(os.path.dirname(cl.APP), "fixed_port")
    yaml_text = (
        "name: fixed\n"
        "service:\n"
        "  readiness_probe:\n    path: /health\n    initial_delay_seconds: 20\n"
        "    endpoint_probe_interval_seconds: 0.2\n"
        "  replicas: 2\n"
        "resources:\n  ports: 8080\n  cpus: 2+\n"
        f"workdir: {workdir}\n"
        "run: python3 server.py\n"
    )
    await _create(cluster, yaml_text)
    w = cl.Watch(cluster.stub, "fixed")
    await w.until(lambda w: w.count(READY) == 2)
    endpoints = sorted(r.endpoint for r in w.replicas.values())
    assert len(set(endpoints)) == 2
    assert all(e.endswith(":8080") for e in endpoints), endpoints  # the declared port, unchanged
    answers = sorted(_get(e + "/")[1] for e in endpoints)
    assert answers == ["replica 1\n", "replica 2\n"]


def _field_names(err: grpc.aio.AioRpcError) -> list[str]:
    return [f for f, _ in grpc_errors.RpcError(err).field_violations]


async def test_specs_the_provisioner_cannot_run_are_refused_at_create(tmp_path) -> None:
    c = cl.Cluster(str(tmp_path), provisioner_env={"REPLICAPLANE_PROVISIONER_LOCAL_ACCELERATORS": "H100:1"})
    try:
        marker = tmp_path / "setup-ran"
        base = cl.app_yaml("gpu", c.tag, replicas=1)

        def with_accelerators(value: str, extra: str = "") -> str:
            return base.replace("  ports: 8080\n", f"  ports: 8080\n  accelerators: {value}\n") + extra

        # vllm.yaml asks for an A100 and pip-installs in setup: refused, and setup never runs.
        vllm = with_accelerators("A100:1", f"setup: touch {marker}\n")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.stub.CreateService(api.CreateServiceRequest(yaml=vllm), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _field_names(info.value) == ["resources.accelerators"]
        assert "it offers: H100:1" in grpc_errors.RpcError(info.value).field_violations[0][1]
        missing = base + f"workdir: {tmp_path / 'no-such-dir'}\nfile_mounts:\n  /data: {tmp_path / 'nothing'}\n"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.stub.CreateService(api.CreateServiceRequest(yaml=missing), timeout=10)
        assert sorted(_field_names(info.value)) == ["file_mounts./data", "workdir"]
        assert not (await c.stub.ListServices(api.ListServicesRequest())).services

        # The set form: any one of them will do, and the backend has an H100.
        await _create(c, with_accelerators("{A100:1, H100:1}"))
        w = cl.Watch(c.stub, "gpu")
        await w.until(lambda w: w.count(READY) == 1)
        w.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.stub.UpdateService(api.UpdateServiceRequest(service_name="gpu", yaml=vllm), timeout=10)
        assert _field_names(info.value) == ["resources.accelerators"]
        got = await c.stub.GetService(api.GetServiceRequest(service_name="gpu"))
        assert got.service.latest_version == 1
        assert not marker.exists()
    finally:
        await c.close()


async def test_delete_during_a_drain_tears_down_without_waiting_out_the_drain(tmp_path) -> None:
    # A 10-minute drain: the delete must not wait for it (spec.md section 9: down never drains),
    # or `make down` gives up on the service and leaves its replica running.
    c = cl.Cluster(str(tmp_path), controller_env={"REPLICAPLANE_CONTROLLER_DRAIN_S": "600"})
    try:
        await _create(c, cl.app_yaml("drained", c.tag, replicas=1))
        w = cl.Watch(c.stub, "drained")
        await w.until(lambda w: w.count(READY) == 1)
        await c.stub.TerminateReplica(api.TerminateReplicaRequest(service_name="drained", replica_id=1))
        await w.until(lambda w: w.replicas[1].status == res.REPLICA_STATUS_SHUTTING_DOWN)
        await c.stub.DeleteService(api.DeleteServiceRequest(service_name="drained"))
        await w.until(lambda w: w.deleted, timeout=60)
        assert cl.replica_pids(c.tag) == []
        w.cancel()
    finally:
        await c.close()

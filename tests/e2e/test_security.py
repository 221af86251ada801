"""Security end to end, with the services as real processes: the bearer token on the public API,
mTLS between the controller, provisioner and probers, the audit log, and no secret in any log,
error or watch event of the run."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import time
import urllib.error
import urllib.request
import uuid

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.prober.v1 import prober_service_pb2_grpc as prober_grpc
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from services.common import security
from tests.e2e import test_replicactl, test_stack
from tests.helpers import balancer as lb
from tests.helpers import certs
from tests.helpers import cluster as cl

pytestmark = pytest.mark.e2e

READY = res.REPLICA_STATUS_READY


def _stub(addr: str, token: str = "") -> tuple[grpc.aio.Channel, api_grpc.ControllerServiceStub]:
    channel = grpc.aio.insecure_channel(addr, interceptors=security.token_interceptors(token))
    return channel, api_grpc.ControllerServiceStub(channel)


def _files_under(folder: str) -> str:
    """Every log and audit file of the run, concatenated."""
    text = []
    for path in glob.glob(os.path.join(folder, "**", "*"), recursive=True):
        if os.path.isfile(path) and path.endswith((".log", ".jsonl", ".out", ".err")):
            with open(path, encoding="utf-8", errors="replace") as fh:
                text.append(fh.read())
    return "\n".join(text)


async def test_bearer_token_guards_the_api_and_no_secret_reaches_logs_errors_or_watch(tmp_path) -> None:
    token = f"tok-{uuid.uuid4().hex}"
    wrong = f"wrong-{uuid.uuid4().hex}"
    header_secret = f"hdr-{uuid.uuid4().hex}"
    token_file = tmp_path / "tokens"
    token_file.write_text(f"# operators\nalice:{token}\n")
    audit_file = tmp_path / "audit" / "audit.jsonl"
    cluster = cl.Cluster(
        str(tmp_path),
        controller_env={
            "REPLICAPLANE_CONTROLLER_AUTH_TOKEN_FILE": str(token_file),
            "REPLICAPLANE_CONTROLLER_AUDIT_LOG_FILE": str(audit_file),
            "REPLICAPLANE_LOG_LEVEL": "DEBUG",
        },
        api_token=token,
    )
    addr = cluster.controller.addr
    try:
        # No token, and a wrong token: UNAUTHENTICATED, on unary calls and streams alike.
        for presented in ("", wrong):
            channel, stub = _stub(addr, presented)
            async with channel:
                for call in (
                    stub.ListServices(api.ListServicesRequest(), timeout=10),
                    stub.CreateService(api.CreateServiceRequest(yaml=cl.app_yaml("nope", cluster.tag)), timeout=10),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert wrong not in (err.value.details() or "")
                watch = stub.WatchService(api.WatchServiceRequest(service_name="nope"), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in watch:
                        pass
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                # Health and reflection stay open.
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
                listing = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
                names = [s.name async for r in listing for s in r.list_services_response.service]
                assert "replicaplane.controller.v1.ControllerService" in names
        # A bad-token spelling (wrong scheme) is refused too.
        channel = grpc.aio.insecure_channel(addr)
        async with channel:
            stub = api_grpc.ControllerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ListServices(api.ListServicesRequest(), metadata=[("authorization", token)], timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # The right token: the whole stack works, with a secret probe header planted.
        probe = (
            "    path: /health\n    initial_delay_seconds: 20\n    endpoint_probe_interval_seconds: 0.2\n"
            f"    headers:\n      X-Api-Key: {header_secret}\n      Authorization: Bearer {header_secret}\n"
        )
        yaml_text = cl.app_yaml("guarded", cluster.tag, replicas=1, probe=probe)
        created = await cluster.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text), timeout=20)
        assert header_secret not in str(created)
        events: list[str] = []
        call = cluster.stub.WatchService(api.WatchServiceRequest(service_name="guarded"))
        async for msg in call:
            events.append(str(msg))
            if msg.service.ready_replicas == 1:
                break
        call.cancel()
        # A bad update that carries the secret: the error names the field, never the value.
        bad = yaml_text.replace("  replicas: 1\n", "  replicas: 1\n  bogus_key: 1\n")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await cluster.stub.UpdateService(api.UpdateServiceRequest(service_name="guarded", yaml=bad), timeout=20)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert header_secret not in str(err.value.details()) + str(err.value.trailing_metadata())
        got = await cluster.stub.GetService(api.GetServiceRequest(service_name="guarded"), timeout=10)
        assert header_secret not in str(got)
        assert all(header_secret not in e for e in events)
        await cluster.stub.DeleteService(api.DeleteServiceRequest(service_name="guarded"), timeout=10)
    finally:
        await cluster.close()

    # The audit log: who (the token's name, or anonymous), what, when, and the outcome.
    records = [json.loads(line) for line in audit_file.read_text().splitlines()]
    by_method = {(r["method"], r["code"]) for r in records}
    assert ("CreateService", "UNAUTHENTICATED") in by_method
    assert ("CreateService", "OK") in by_method
    assert ("UpdateService", "INVALID_ARGUMENT") in by_method
    assert ("DeleteService", "OK") in by_method
    ok_create = next(r for r in records if r["method"] == "CreateService" and r["code"] == "OK")
    assert ok_create["principal"] == "alice"
    assert ok_create["service_name"] == "guarded"
    assert ok_create["time"] and ok_create["peer"]
    refused = next(r for r in records if r["code"] == "UNAUTHENTICATED")
    assert refused["principal"] == security.ANONYMOUS

    # No planted secret in any log of the run (services, replicas, audit), at DEBUG level.
    logs = _files_under(str(tmp_path))
    assert "guarded" in logs  # the logs were found and the service is in them
    for secret in (token, wrong, header_secret):
        assert secret not in logs


async def test_mtls_admits_only_the_controller(tmp_path) -> None:
    ca = certs.Authority(str(tmp_path / "pki"))
    controller_id, provisioner_id, prober_id = ca.issue("controller"), ca.issue("provisioner"), ca.issue("prober")
    intruder = ca.issue("intruder")
    cluster = cl.Cluster(
        str(tmp_path),
        controller_env=controller_id.env("controller"),
        provisioner_env=provisioner_id.env("provisioner"),
        prober_env=prober_id.env("prober"),
    )
    try:
        # Launch (provisioner) and readiness (prober) both work over mTLS.
        await cluster.stub.CreateService(api.CreateServiceRequest(yaml=cl.app_yaml("tls", cluster.tag, replicas=1)))
        w = cl.Watch(cluster.stub, "tls")
        await w.until(lambda w: w.count(READY) == 1, timeout=40)
        w.cancel()
        assert not w.service.probing_stale

        cert, key, ca_pem = controller_id.read()
        as_controller = grpc.ssl_channel_credentials(ca_pem, key, cert)
        i_cert, i_key, _ = intruder.read()
        as_intruder = grpc.ssl_channel_credentials(ca_pem, i_key, i_cert)
        no_cert = grpc.ssl_channel_credentials(ca_pem)
        request = prov_pb.ListReplicasRequest()
        for addr in (cluster.provisioner.addr, cluster.probers[0].addr):
            # Plaintext, and TLS without a client certificate: the handshake fails.
            for channel in (grpc.aio.insecure_channel(addr), grpc.aio.secure_channel(addr, no_cert)):
                async with channel:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            # A certificate from the right CA, but not the controller's: PERMISSION_DENIED
            # (health stays open to it).
            async with grpc.aio.secure_channel(addr, as_intruder) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                if addr == cluster.provisioner.addr:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await prov_grpc.ProvisionerServiceStub(channel).ListReplicas(request, timeout=10)
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                else:
                    stream = prober_grpc.ProberServiceStub(channel).Probe(iter(()), timeout=10)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in stream:
                            pass
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # The controller's certificate is accepted.
        async with grpc.aio.secure_channel(cluster.provisioner.addr, as_controller) as channel:
            reply = await prov_grpc.ProvisionerServiceStub(channel).ListReplicas(request, timeout=10)
            assert len(reply.replicas) == 1
    finally:
        await cluster.close()


def test_stack_runs_with_token_and_mtls_and_prints_no_secret(tmp_path) -> None:
    ca = certs.Authority(str(tmp_path / "pki"))
    token = f"tok-{uuid.uuid4().hex}"
    env = {
        **test_stack.stack_env(),
        "REPLICAPLANE_CONTROLLER_AUTH_TOKEN": token,
        **ca.issue("controller").env("controller"),
        **ca.issue("provisioner").env("provisioner"),
        **ca.issue("prober").env("prober"),
    }
    state_dir = tmp_path / "state"
    up = test_stack.stack(
        "up", "--detach", "--state-dir", str(state_dir), "--example", test_stack.EXAMPLE, env=env, timeout=240
    )
    try:
        assert up.returncode == 0, f"{up.stdout}{up.stderr}\n{test_stack.logs(state_dir)}"
        state = json.loads((state_dir / "stack.json").read_text())
        addrs = {p["name"]: p["addr"] for p in state["processes"]}
        with grpc.insecure_channel(state["controller"]) as channel:
            stub = api_grpc.ControllerServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.GetService(api.GetServiceRequest(service_name="hello"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
            auth = [("authorization", f"Bearer {token}")]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                svc = stub.GetService(api.GetServiceRequest(service_name="hello"), metadata=auth, timeout=10).service
                if svc.ready_replicas == 2:
                    break
                time.sleep(0.25)
            assert svc.ready_replicas == 2, test_stack.logs(state_dir)
        # The stack's balancer reaches the controller with the same token.
        balancer = f"{test_stack.service_url(state, [('authorization', f'Bearer {token}')])}/"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(balancer, timeout=10) as resp:
                    assert resp.status == 200
                    break
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and time.monotonic() < deadline, test_stack.logs(state_dir)
                time.sleep(0.2)
        prov = addrs["provisioner"].replace("0.0.0.0", "127.0.0.1")
        assert test_stack.stack("health", prov, "--tls", env=env, timeout=30).returncode == 0
        assert test_stack.stack("health", prov, "--timeout", "1", env=env, timeout=30).returncode == 1
    finally:
        down = test_stack.stack("down", "--state-dir", str(state_dir), env=env, timeout=200)
    assert down.returncode == 0, f"{down.stdout}{down.stderr}\n{test_stack.logs(state_dir)}"
    printed = up.stdout + up.stderr + down.stdout + down.stderr + test_stack.logs(state_dir)
    assert "hello" in printed
    assert token not in printed


async def test_load_balancer_follows_a_token_guarded_controller(tmp_path) -> None:
    token = f"tok-{uuid.uuid4().hex}"
    cluster = cl.Cluster(str(tmp_path), controller_env={"REPLICAPLANE_CONTROLLER_AUTH_TOKEN": token}, api_token=token)
    b = None
    try:
        yaml_text = lb.lb_app_yaml("fronted", cluster.tag, replicas=1)
        await cluster.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text), timeout=20)
        b = await lb.start(cluster.controller.addr, "fronted", str(tmp_path / "lb"), api_token=token)
        await b.until(lambda s: sum(r.ready for r in s.replicas) == 1, timeout=60)
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client,
            client.get(b.url + "/whoami") as resp,
        ):
            assert resp.status == 200
        assert token not in b.process.log()
    finally:
        if b is not None:
            await b.close()
        await cluster.close()


async def test_replicactl_output_never_shows_probe_header_secrets(cluster: cl.Cluster, tmp_path) -> None:
    secret = f"hdr-{uuid.uuid4().hex}"
    probe = (
        "    path: /health\n    initial_delay_seconds: 20\n    endpoint_probe_interval_seconds: 0.2\n"
        f"    headers:\n      Authorization: Bearer {secret}\n      X-Api-Key: {secret}\n"
    )
    spec = tmp_path / "svc.yaml"
    spec.write_text(cl.app_yaml("clisecret", cluster.tag, replicas=1, probe=probe))
    bigger = tmp_path / "svc2.yaml"
    bigger.write_text(spec.read_text().replace("replicas: 1", "replicas: 2"))
    addr = cluster.controller.addr
    runs = [await test_replicactl.ctl(addr, "up", str(spec), "--wait", "--timeout", "60")]
    # Commands that change nothing, run side by side (each is a Python process start).
    reads = (
        ("status",),
        ("status", "clisecret", "--all"),
        ("status", "clisecret", "--json"),
        ("update", "clisecret", str(bigger), "--dry-run", "--json"),
        ("update", "clisecret", str(tmp_path / "missing.yaml")),
        ("logs", "clisecret", "--replica-id", "1", "--launch"),
    )
    runs += await asyncio.gather(*(test_replicactl.ctl(addr, *args) for args in reads))
    assert runs[0].returncode == 0, runs[0].stdout + runs[0].stderr
    printed = "\n".join(r.stdout + r.stderr for r in runs)
    assert "clisecret" in printed
    assert secret not in printed

"""Internal services on Unix sockets are reachable by their user only, and a controller whose
API requires a token refuses to reach the provisioner or probers over plaintext TCP."""

from __future__ import annotations

import os
import stat

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2 as lb_api
from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2_grpc as lb_grpc
from services.common import errors, grpc_server
from services.controller import server as controller_server
from services.loadbalancer import server as lb_server
from services.prober import server as prober_server

TOKEN = "t" * 24


async def test_a_unix_socket_is_made_private_and_serves(tmp_path) -> None:
    sock = tmp_path / "run" / "prober.sock"  # the directory does not exist yet
    built = await prober_server.build_server(prober_server.load_settings(listen_addr=f"unix:{sock}"))
    await built.start()
    try:
        assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        async with grpc.aio.insecure_channel(f"unix:{sock}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await built.stop(None)


async def test_a_socket_in_a_directory_others_may_enter_is_refused(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(errors.ValidationError) as err:
        await prober_server.build_server(prober_server.load_settings(listen_addr=f"unix:{shared}/p.sock"))
    assert err.value.violations[0].field == "listen_addr"
    assert "0700" in err.value.violations[0].description
    assert not (shared / "p.sock").exists()


@pytest.mark.parametrize(
    ("addr", "path"),
    [
        ("unix:/a/b.sock", "/a/b.sock"),
        ("unix:///a/b.sock", "/a/b.sock"),
        ("unix:rel/b.sock", "rel/b.sock"),
        ("127.0.0.1:5", ""),
    ],
)
def test_unix_path(addr: str, path: str) -> None:
    assert grpc_server.unix_path(addr) == path


@pytest.mark.parametrize(
    ("settings", "fields"),
    [
        ({"auth_token": TOKEN}, ["controller.provisioner_addr", "controller.prober_addrs"]),
        (
            {"auth_token": TOKEN, "provisioner_addr": "unix:/s/p.sock", "prober_addrs": "unix:/s/a.sock,127.0.0.1:9"},
            ["controller.prober_addrs"],
        ),
    ],
)
async def test_a_token_on_the_api_with_open_internal_services_stops_the_controller(tmp_path, settings, fields) -> None:
    values = {"listen_addr": "127.0.0.1:0", "state_dir": str(tmp_path / "ctl"), **settings}
    with pytest.raises(errors.ValidationError) as err:
        await controller_server.start(controller_server.Settings(**values))
    assert [v.field for v in err.value.violations] == fields
    assert TOKEN not in str(err.value)


@pytest.mark.parametrize(
    "settings",
    [
        {},  # no auth at all: nothing to leave open
        {"auth_token": TOKEN, "provisioner_addr": "unix:/s/p.sock", "prober_addrs": "unix:/s/a.sock,unix:/s/b.sock"},
        {"auth_token": TOKEN, "allow_open_internal": True},
    ],
)
async def test_controller_starts_when_no_internal_service_is_left_open(tmp_path, settings) -> None:
    values = {
        "listen_addr": "127.0.0.1:0",
        "state_dir": str(tmp_path / "ctl"),
        "provisioner_addr": "127.0.0.1:9",
        "prober_addrs": "127.0.0.1:9",
        **settings,
    }
    running = await controller_server.start(controller_server.Settings(**values))
    await running.stop(None)


async def test_the_balancer_admin_api_wants_the_token_the_balancer_has(tmp_path) -> None:
    running = await lb_server.start(
        lb_server.load_settings(
            service_name="web",
            http_addr="127.0.0.1:0",
            listen_addr="127.0.0.1:0",
            controller_addr="127.0.0.1:9",
            api_token=TOKEN,
        )
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.built.port}") as channel:
            stub = lb_grpc.LoadBalancerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetBalancer(lb_api.GetBalancerRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = await stub.GetBalancer(
                lb_api.GetBalancerRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5
            )
            assert reply.service_name == "web"
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await running.stop(None)

"""A real load balancer process in front of a test cluster's controller."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Callable

import grpc

from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2 as lb_api
from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2_grpc as lb_grpc
from services.common import security
from tests.helpers import procs

LB_APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "apps", "lbapp.py")


def lb_app_yaml(name: str, tag: str, *, replicas: int = 2, policy: str = "", policy_yaml: str = "") -> str:
    """A service YAML running tests/helpers/apps/lbapp.py, probed fast."""
    return (
        f"name: {name}\n"
        "service:\n"
        "  readiness_probe:\n"
        "    path: /health\n"
        "    initial_delay_seconds: 60\n"
        "    endpoint_probe_interval_seconds: 0.2\n"
        + (policy_yaml or f"  replicas: {replicas}\n")
        + (f"  load_balancing_policy: {policy}\n" if policy else "")
        + "resources:\n"
        "  ports: 8080\n"
        f"run: {sys.executable} {LB_APP} --port 8080 --tag {tag}\n"
    )


@dataclasses.dataclass
class Balancer:
    """A `python -m services.loadbalancer` process and a client of its admin API."""

    process: procs.ServiceProcess
    url: str
    channel: grpc.aio.Channel
    stub: lb_grpc.LoadBalancerServiceStub

    async def state(self) -> lb_api.GetBalancerResponse:
        """The balancer's view."""
        return await self.stub.GetBalancer(lb_api.GetBalancerRequest(), timeout=5)

    async def until(self, pred: Callable[[lb_api.GetBalancerResponse], bool], timeout: float = 30.0) -> None:
        """Wait until pred holds for the balancer's view."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = await self.state()
            if pred(last):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"balancer never got there; last view: {last}")

    async def close(self) -> None:
        """Stop the process."""
        await self.channel.close()
        self.process.stop()


async def start(controller_addr: str, service: str, workdir: str, **env: str) -> Balancer:
    """Start a balancer for `service` on free ports; `env` adds REPLICAPLANE_LOADBALANCER_* settings.
    A fleet (`service` "", `fleet="true"`) reports its first HTTP port as `url`."""
    os.makedirs(workdir, exist_ok=True)
    http_port_file = os.path.join(workdir, "http.port")
    process = await asyncio.to_thread(
        procs.start_service,
        "loadbalancer",
        env={
            **({"REPLICAPLANE_LOADBALANCER_SERVICE_NAME": service} if service else {}),
            "REPLICAPLANE_LOADBALANCER_CONTROLLER_ADDR": controller_addr,
            "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": "127.0.0.1:0",
            "REPLICAPLANE_LOADBALANCER_HTTP_PORT_FILE": http_port_file,
            **{f"REPLICAPLANE_LOADBALANCER_{k.upper()}": v for k, v in env.items()},
        },
        workdir=workdir,
    )
    with open(http_port_file, encoding="utf-8") as fh:  # noqa: ASYNC230 - written before the port file
        url = f"http://127.0.0.1:{int(fh.read())}"
    # A balancer with a token wants it on its admin API too.
    channel = grpc.aio.insecure_channel(
        process.addr, interceptors=security.token_interceptors(env.get("api_token", ""))
    )
    return Balancer(process=process, url=url, channel=channel, stub=lb_grpc.LoadBalancerServiceStub(channel))

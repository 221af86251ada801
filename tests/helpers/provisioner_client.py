"""Small client-side helpers for provisioner tests and the benchmark."""

from __future__ import annotations

import asyncio
import os
import sys
import urllib.request
from collections.abc import AsyncIterator, Mapping

import grpc
from google.protobuf import duration_pb2

from replicaplane.common.v1 import spec_pb2
from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import resources_pb2

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HTTP_APP = os.path.join(REPO, "examples", "apps", "http_app.py")
# The test's own interpreter starts faster than a `python3` shim would.
HTTP_RUN = f"{sys.executable} {HTTP_APP} 8080"

L = resources_pb2.LaunchEventType
T = resources_pb2.TerminateEventType
R = resources_pb2.ReplicaEventType


def spec(
    run: str = HTTP_RUN,
    *,
    setup: str = "",
    ports: tuple[int, ...] = (8080,),
    envs: Mapping[str, str] | None = None,
    workdir: str = "",
) -> spec_pb2.ServiceSpec:
    """A service spec with the given commands."""
    return spec_pb2.ServiceSpec(
        run=run,
        setup=setup,
        envs=dict(envs or {}),
        workdir=workdir,
        resources=spec_pb2.Resources(ports=list(ports)),
    )


def launch_request(
    replica_id: int, service: str = "svc", *, spec_: spec_pb2.ServiceSpec | None = None, **fields: object
) -> pb.LaunchRequest:
    """A LaunchRequest for replica `{service}-{replica_id}`."""
    return pb.LaunchRequest(
        name=f"{service}-{replica_id}",
        service=service,
        replica_id=replica_id,
        version=1,
        spec=spec_ or spec(),
        **fields,  # type: ignore[arg-type]
    )


def duration(seconds: float) -> duration_pb2.Duration:
    """A Duration of `seconds`."""
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


async def collect(stream: AsyncIterator, timeout: float = 30.0) -> list:
    """Every message of a finite stream, within `timeout` seconds."""
    out = []
    async with asyncio.timeout(timeout):
        async for message in stream:
            out.append(message.event if hasattr(message, "event") else message)
    return out


def types(events: list) -> list[str]:
    """Event type names without their enum prefix, for readable assertions."""
    names = []
    for e in events:
        name = e.DESCRIPTOR.fields_by_name["type"].enum_type.values_by_number[e.type].name
        names.append(name.split("_TYPE_", 1)[1])
    return names


def get(url: str, timeout: float = 2.0) -> bytes:
    """GET `url`; raises on errors."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


async def wait_http(url: str, timeout: float = 15.0) -> bytes:
    """GET `url` until it answers (the app may still be starting), within `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            return await asyncio.to_thread(get, url)
        except OSError:
            if loop.time() >= deadline:
                raise
            await asyncio.sleep(0.05)


async def next_event(call: grpc.aio.UnaryStreamCall, type_: int, timeout: float = 10.0) -> resources_pb2.ReplicaEvent:
    """The next event of `type_` on a watch call (skipping others), within `timeout` seconds."""
    async with asyncio.timeout(timeout):
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                raise AssertionError("watch stream ended")
            if message.event.type == type_:
                return message.event


def worker_spec(
    setup: str = "",
    *,
    envs: Mapping[str, str] | None = None,
    secrets: Mapping[str, str] | None = None,
) -> spec_pb2.ServiceSpec:
    """A pool spec: a worker runs `setup`, then waits for jobs."""
    return spec_pb2.ServiceSpec(
        kind=spec_pb2.FLEET_KIND_POOL,
        setup=setup,
        envs=dict(envs or {}),
        secrets=dict(secrets or {}),
        service=spec_pb2.ServiceSection(pool=spec_pb2.PoolPolicy(min_workers=1, max_workers=1)),
    )


def worker_request(replica_id: int, service: str = "pool", *, setup: str = "", **fields: object) -> pb.LaunchRequest:
    """A LaunchRequest for pool worker `{service}-{replica_id}`."""
    return launch_request(replica_id, service, spec_=worker_spec(setup), **fields)


def job_request(job_id: str, replica: str, run: str, **fields: object) -> pb.RunJobRequest:
    """A RunJobRequest."""
    return pb.RunJobRequest(job_id=job_id, replica=replica, run=run, **fields)  # type: ignore[arg-type]

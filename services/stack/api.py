"""Controller and health-check calls the stack makes, and the lines it prints while watching."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import uuid
from collections.abc import Callable

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import controller_service_pb2_grpc, resources_pb2
from services.common import clients, security

Out = Callable[[str], None]

_TOP_LEVEL_WORKDIR = re.compile(r"^workdir:[^\n]*$", re.MULTILINE)


class StackError(Exception):
    """A step of the stack failed; the message says which and why."""


def resolve_workdir(yaml_text: str, base_dir: str) -> str:
    """Return the YAML with a relative `workdir` made absolute against `base_dir`.

    The provisioner copies `workdir` into each replica's working directory, and its own working
    directory is no guide to where the YAML came from, so a client resolves the path (as
    SkyPilot's CLI does) before sending it. Comments and layout are kept.

    Args:
        yaml_text: the task YAML.
        base_dir: directory relative paths are resolved against (the YAML file's directory).

    Returns:
        The YAML text, unchanged when there is no relative workdir.
    """
    doc = yaml.safe_load(yaml_text)
    workdir = doc.get("workdir") if isinstance(doc, dict) else None
    if not isinstance(workdir, str) or not workdir or os.path.isabs(os.path.expanduser(workdir)):
        return yaml_text
    absolute = os.path.normpath(os.path.join(os.path.abspath(base_dir), workdir))
    # A JSON string is a YAML scalar, so the quoting is always right.
    line = f"workdir: {json.dumps(absolute)}"
    replaced, count = _TOP_LEVEL_WORKDIR.subn(lambda _m: line, yaml_text)
    if count == 1 and yaml.safe_load(replaced).get("workdir") == absolute:
        return replaced
    doc["workdir"] = absolute
    return yaml.safe_dump(doc, sort_keys=False)


def read_spec(yaml_path: str) -> str:
    """Read a service YAML file, with a relative `workdir` resolved against its directory."""
    with open(yaml_path, encoding="utf-8") as fh:
        return resolve_workdir(fh.read(), os.path.dirname(os.path.abspath(yaml_path)))


def spec_name(yaml_path: str) -> str:
    """The `name:` of a service YAML file, or "" if it has none."""
    with open(yaml_path, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    return str(doc.get("name") or "") if isinstance(doc, dict) else ""


def _short(enum_value_name: str, prefix: str) -> str:
    return enum_value_name.removeprefix(prefix)


_FAILED = {
    resources_pb2.REPLICA_STATUS_FAILED,
    resources_pb2.REPLICA_STATUS_FAILED_CLEANUP,
    resources_pb2.REPLICA_STATUS_FAILED_INITIAL_DELAY,
    resources_pb2.REPLICA_STATUS_FAILED_PROBING,
    resources_pb2.REPLICA_STATUS_FAILED_PROVISION,
    resources_pb2.REPLICA_STATUS_UNKNOWN,
}
_HAS_ENDPOINT = {
    resources_pb2.REPLICA_STATUS_STARTING,
    resources_pb2.REPLICA_STATUS_READY,
    resources_pb2.REPLICA_STATUS_NOT_READY,
}


class WatchPrinter:
    """Turns WatchService messages into one line per replica or service status change."""

    def __init__(self) -> None:
        self._service_status: dict[str, int] = {}
        self._replica_status: dict[tuple[str, int], int] = {}

    def lines(self, resp: pb.WatchServiceResponse) -> list[str]:
        """The lines for one message; empty when nothing visible changed."""
        svc = resp.service
        name = svc.name
        out: list[str] = []
        counts = f"({svc.ready_replicas}/{svc.total_replicas} ready)"
        if resp.snapshot:
            # A snapshot lists every replica: the ones we knew that are missing are gone.
            present = {r.replica_id for r in resp.replicas}
            for key in sorted(k for k in self._replica_status if k[0] == name and k[1] not in present):
                del self._replica_status[key]
                out.append(f"{name}: replica {key[1]} removed {counts}")
        for replica in sorted(resp.replicas, key=lambda r: r.replica_id):
            key = (name, replica.replica_id)
            if self._replica_status.get(key) == replica.status:
                continue
            self._replica_status[key] = replica.status
            status = _short(resources_pb2.ReplicaStatus.Name(replica.status), "REPLICA_STATUS_")
            line = f"{name}: replica {replica.replica_id} {status}"
            if replica.status in _HAS_ENDPOINT and replica.endpoint:
                line += f" at {replica.endpoint}"
            if replica.status in _FAILED and replica.failure_reason:
                line += f" ({replica.failure_reason})"
            out.append(f"{line} {counts}")
        for replica_id in sorted(resp.removed_replica_ids):
            if self._replica_status.pop((name, replica_id), None) is not None:
                out.append(f"{name}: replica {replica_id} removed {counts}")
        if resp.deleted:
            self._service_status.pop(name, None)
            out.append(f"{name}: deleted")
        elif self._service_status.get(name) != svc.status:
            self._service_status[name] = svc.status
            status = _short(resources_pb2.ServiceStatus.Name(svc.status), "SERVICE_STATUS_")
            versions = ",".join(str(v) for v in svc.active_versions) or "-"
            line = f"{name}: service {status} {counts[:-1]}, versions {versions})"
            if svc.status_message:
                line += f": {svc.status_message}"
            out.append(line)
        return out


def _health_channel(addr: str, tls: bool) -> grpc.aio.Channel:
    credentials = security.client_tls() if tls else None
    if credentials is None:
        return grpc.aio.insecure_channel(addr)
    return grpc.aio.secure_channel(addr, credentials)


async def wait_serving(
    addr: str, service: str, *, timeout: float, alive: Callable[[], bool] = lambda: True, tls: bool = False
) -> None:
    """Wait until the gRPC health check of `service` at `addr` says SERVING.

    Args:
        addr: host:port.
        service: the gRPC service name to check.
        timeout: seconds to wait.
        alive: false once the process is gone.
        tls: check over mTLS with the credentials of security.client_tls().

    Raises:
        StackError: the process died (`alive()` is false) or `timeout` seconds passed.
    """
    deadline = time.monotonic() + timeout
    async with _health_channel(addr, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if not alive():
                raise StackError(f"{service} at {addr} exited before it was serving")
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() >= deadline:
                raise StackError(f"{service} at {addr} was not serving after {timeout:.0f} s")
            await asyncio.sleep(0.1)


async def check_health(addr: str, service: str = "", *, timeout: float = 3.0, tls: bool = False) -> bool:
    """One health check: True when `service` ("" = the whole server) at `addr` is SERVING."""
    async with _health_channel(addr, tls) as channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.aio.AioRpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


class Controller:
    """The few ControllerService calls the stack needs, over one channel."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        # The token (if any) comes from the environment: security.client_token().
        self._channel = clients.channel(addr, interceptors=security.token_interceptors(security.client_token()))
        self._stub = controller_service_pb2_grpc.ControllerServiceStub(self._channel)

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    async def create(self, yaml_path: str, out: Out) -> str:
        """Create the service in `yaml_path`; adopt it if it already exists.

        Returns:
            The service name.

        Raises:
            StackError: the controller refused the spec or could not be reached.
        """
        text = await asyncio.to_thread(read_spec, yaml_path)
        request = pb.CreateServiceRequest(yaml=text, request_id=str(uuid.uuid4()))
        try:
            resp = await self._stub.CreateService(request, timeout=30)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.ALREADY_EXISTS:
                name = (yaml.safe_load(text) or {}).get("name", "")
                out(f"{name}: already exists (left from an earlier run); following it")
                return str(name)
            raise StackError(f"creating {yaml_path} failed: {err.code().name}: {err.details()}") from None
        out(f"{resp.service.name}: created from {yaml_path}")
        return resp.service.name

    async def follow(self, name: str, printer: WatchPrinter, out: Out) -> None:
        """Print `name`'s changes until it is deleted or the task is cancelled.

        A cut stream is resumed from the last sequence number seen, with a growing pause.
        """
        after = 0
        failures = 0
        while True:
            try:
                call = self._stub.WatchService(pb.WatchServiceRequest(service_name=name, after_sequence=after))
                async for resp in call:
                    failures = 0
                    after = resp.sequence
                    for line in printer.lines(resp):
                        out(line)
                    if resp.deleted:
                        return
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    out(f"{name}: not found")
                    return
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    out(f"{name}: the controller cannot watch services yet; not following")
                    return
                if failures == 0:
                    out(f"{name}: watch interrupted ({err.code().name}); reconnecting")
                failures += 1
            await asyncio.sleep(min(0.2 * 2**failures, 5.0))

    async def delete_and_wait(self, name: str, *, timeout: float, out: Out) -> bool:
        """Delete `name` and wait (at most `timeout` s) until the controller says NOT_FOUND.

        Returns:
            True once the service is gone; False if it could not be confirmed in time.
        """
        try:
            await self._stub.DeleteService(pb.DeleteServiceRequest(service_name=name), timeout=10)
            out(f"{name}: deleting")
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return True
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION:  # already shutting down: wait
                out(f"{name}: DeleteService failed: {err.code().name}: {err.details()}")
                return False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                await self._stub.GetService(pb.GetServiceRequest(service_name=name), timeout=5)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    return True
            await asyncio.sleep(0.25)
        out(f"{name}: still not deleted after {timeout:.0f} s")
        return False

"""replicactl's connection to the controller: calls with a deadline and the token, errors as
one line with an exit code, watches that resume, and waiting for a service to be ready."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import grpc

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import controller_service_pb2_grpc as pb_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import exits, render
from services.common import grpc_errors, security, watchlines

_CODE_EXIT = {
    grpc.StatusCode.INVALID_ARGUMENT: exits.BAD_INPUT,
    grpc.StatusCode.NOT_FOUND: exits.NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE: exits.UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: exits.UNREACHABLE,
    grpc.StatusCode.UNAUTHENTICATED: exits.UNAUTHORIZED,
    grpc.StatusCode.PERMISSION_DENIED: exits.UNAUTHORIZED,
}
_FAILED_SERVICE = {
    res.SERVICE_STATUS_FAILED,
    res.SERVICE_STATUS_FAILED_CLEANUP,
    res.SERVICE_STATUS_CONTROLLER_FAILED,
}


def hint_overrides(violations: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """Violations, with the flag that fills an empty `envs:` or `secrets:` value named."""
    out = []
    for field, description in violations:
        section, _, key = field.partition(".")
        if description.startswith("needs a value") and key and section in ("envs", "secrets"):
            if section == "envs":
                description += f" (or pass --env {key}=VALUE)"
            else:
                description += f" (or pass --secret {key}=VALUE, or --secret {key} to take it from your environment)"
        out.append((field, description))
    return out


def rpc_error(err: grpc.RpcError, *, controller: str) -> exits.CliError:
    """The one error line (and exit code) for a failed call."""
    decoded = grpc_errors.RpcError(err)
    code = _CODE_EXIT.get(decoded.code, exits.REFUSED)
    status = decoded.code.name
    if code == exits.UNREACHABLE:
        return exits.CliError(f"error: cannot reach the controller at {controller} ({status})", code, status)
    if code == exits.UNAUTHORIZED:
        hint = f"set {security.CLIENT_TOKEN_ENV} or {security.CLIENT_TOKEN_FILE_ENV}"
        return exits.CliError(f"error: the controller refused the call ({status}): {hint}", code, status)
    line = render.error_line(status, decoded.message, hint_overrides(decoded.field_violations))
    return exits.CliError(line, code, status)


class Client:
    """One channel to the controller and the calls replicactl makes."""

    def __init__(self, addr: str, rpc_timeout: float, token: str = "") -> None:
        self.addr = addr
        self.timeout = rpc_timeout
        # The bearer token of a controller that requires one (never printed).
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = grpc.insecure_channel(addr)
        self.stub = pb_grpc.ControllerServiceStub(self._channel)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def call(self, method: str, request: Any) -> Any:
        """A unary call with the timeout; errors become exits.CliError."""
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            raise rpc_error(err, controller=self.addr) from None

    def stream(self, method: str, request: Any) -> Iterator[Any]:
        """A server stream; errors become exits.CliError."""
        try:
            yield from getattr(self.stub, method)(request, metadata=self.metadata)
        except grpc.RpcError as err:
            raise rpc_error(err, controller=self.addr) from None

    def watch(self, name: str, *, timeout: float | None = None) -> Iterator[pb.WatchServiceResponse]:
        """A snapshot of service `name`, then every change.

        The controller drops a watch that falls too far behind (RESOURCE_EXHAUSTED,
        WATCH_FELL_BEHIND); it is resumed from the last change received, so nothing is missed.

        Raises:
            grpc.RpcError: any other failure of the stream (DEADLINE_EXCEEDED after `timeout`).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        after = 0
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            request = pb.WatchServiceRequest(service_name=name, after_sequence=after)
            got = False
            try:
                for msg in self.stub.WatchService(request, timeout=left, metadata=self.metadata):
                    got = True
                    after = msg.sequence
                    yield msg
                return
            except grpc.RpcError as err:
                decoded = grpc_errors.RpcError(err)
                if not got or (decoded.code, decoded.reason) != (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "WATCH_FELL_BEHIND",
                ):
                    raise

    def replicas(self, name: str) -> list[res.Replica]:
        """Every replica of a service (all pages)."""
        out: list[res.Replica] = []
        token = ""
        for _ in range(10_000):
            resp = self.call(
                "ListReplicas", pb.ListReplicasRequest(service_name=name, page_size=1000, page_token=token)
            )
            out += resp.replicas
            token = resp.next_page_token
            if not token:
                break
        return out

    def services(self) -> list[res.Service]:
        """Every service (all pages)."""
        out: list[res.Service] = []
        token = ""
        for _ in range(10_000):
            resp = self.call("ListServices", pb.ListServicesRequest(page_size=1000, page_token=token))
            out += resp.services
            token = resp.next_page_token
            if not token:
                break
        return out


def say(out: TextIO, line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {line}", file=out, flush=True)


def wait_for(
    client: Client,
    name: str,
    *,
    done: Callable[[res.Service], bool],
    timeout: float,
    out: TextIO,
) -> res.Service:
    """Print the service's changes until `done(service)`; fail if it fails or time runs out."""
    printer = watchlines.WatchPrinter()
    deadline = time.monotonic() + timeout
    try:
        for msg in client.watch(name, timeout=timeout):
            for line in printer.lines(msg):
                say(out, line)
            svc = msg.service
            if msg.deleted:
                raise exits.CliError(f"error: service {name!r} was deleted while waiting", exits.REFUSED)
            if done(svc):
                return svc
            if svc.status in _FAILED_SERVICE or "scaling stopped" in svc.status_message:
                reason = svc.status_message or render.service_status(svc.status)
                raise exits.CliError(f"error: {name}: {reason}", exits.REFUSED)
            if time.monotonic() > deadline:
                break
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise rpc_error(err, controller=client.addr) from None
    raise exits.CliError(f"error: {name}: gave up waiting after {timeout:.0f} s", exits.TIMED_OUT)


def all_ready(svc: res.Service) -> bool:
    if svc.kind == spec_pb2.FLEET_KIND_POOL:  # a pool may want no worker until jobs come
        return svc.status != res.SERVICE_STATUS_CONTROLLER_INIT and svc.ready_replicas >= svc.target_replicas
    return svc.status == res.SERVICE_STATUS_READY and svc.ready_replicas >= max(1, svc.target_replicas)


def print_endpoints(svc: res.Service, out: TextIO) -> None:
    if svc.kind == spec_pb2.FLEET_KIND_POOL:
        print(f"{svc.name} is up: {svc.ready_replicas}/{svc.target_replicas} worker(s) READY", file=out)
        print(f"  submit jobs: replicactl jobs submit {svc.name} -- COMMAND", file=out)
        return
    print(f"{svc.name} is READY ({svc.ready_replicas}/{svc.total_replicas} ready)", file=out)
    for endpoint in sorted(svc.endpoints, key=lambda e: e.replica_id):
        print(f"  replica {endpoint.replica_id}: {endpoint.url}", file=out)

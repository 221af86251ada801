"""replicactl's connection to the controller: calls with a deadline and the token, errors as
one line with an exit code, watches that resume, and waiting for a service to be ready."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import grpc
import tenacity

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import controller_service_pb2_grpc as pb_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import exits, render
from services.common import clients, grpc_errors, security, watchlines

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


# Calls safe to send again after UNAVAILABLE from a lost connection (with several controllers
# given, the next one may answer): reads, and the mutations replicactl sends with a request id
# (the controller recognises a repeat). Any call is safe to repeat when the answer says it was
# not carried out: no controller leads (NO_LEADER), or the one that got it no longer leads and
# wrote nothing (NOT_LEADER). One controller that cannot be reached is reported at once.
_REPEATABLE = ("Get", "List", "Watch", "Stream", "CreateService", "UpdateService")
_NOT_DONE = ("NO_LEADER", "NOT_LEADER")
FAILOVER_S = 20.0
"""How long replicactl keeps retrying a call while controllers hand over the lead."""


def _failover(err: grpc.RpcError, *, method: str, several: bool) -> bool:
    """True if `err` says a failover is under way and `method` may be sent again."""
    if err.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    if grpc_errors.RpcError(err).reason in _NOT_DONE:
        return True
    return several and method.startswith(_REPEATABLE)


class Client:
    """One channel to the controller (or to whichever of several answers) and the calls
    replicactl makes. A call that finds no controller leading (a failover under way) is tried
    again for up to FAILOVER_S, so a user sees a pause, not an error."""

    def __init__(self, addr: str, rpc_timeout: float, token: str = "") -> None:
        self.addr = addr
        self.timeout = rpc_timeout
        # The bearer token of a controller that requires one (never printed).
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        try:
            target = clients.controller_target(addr)
        except ValueError as exc:
            raise exits.CliError(f"error: --controller: {exc}", exits.BAD_INPUT) from None
        self._channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.ControllerServiceStub(self._channel)
        self.failover_s = FAILOVER_S
        self._several = "," in addr

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def call(self, method: str, request: Any) -> Any:
        """A unary call with the timeout, retried through a failover; errors become exits.CliError."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(
                lambda exc: isinstance(exc, grpc.RpcError) and _failover(exc, method=method, several=self._several)
            ),
            wait=tenacity.wait_exponential_jitter(multiplier=0.2, max=2.0, jitter=0.2),
            stop=tenacity.stop_after_delay(self.failover_s),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    return getattr(self.stub, method)(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            raise rpc_error(err, controller=self.addr) from None
        raise AssertionError("unreachable")  # pragma: no cover

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
        lost_since: float | None = None  # when the stream was cut with no controller answering
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
                if got and (decoded.code, decoded.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "WATCH_FELL_BEHIND"):
                    continue
                if not _failover(err, method="WatchService", several=self._several):
                    raise
                # The controller went away (a failover): follow whichever leads next, from a
                # fresh snapshot (sequences are the old leader's), for up to failover_s.
                now = time.monotonic()
                lost_since = now if got or lost_since is None else lost_since
                if now - lost_since > self.failover_s:
                    raise
                after = 0
                time.sleep(0.3)

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

"""replicactl: a thin command line client of the controller's public API.

Exit codes (also in docs/cli.md):
    0  done
    1  the controller refused the call (state, conflict) or a waited-for service failed
    2  bad input: command line, unreadable file, or a spec the controller rejected (INVALID_ARGUMENT)
    3  not found: no such service or replica
    4  the controller could not be reached
    5  --wait gave up after --timeout seconds
    6  not authorized: no token, a wrong one, or one the controller does not accept
    130 interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TextIO

import grpc

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import controller_service_pb2_grpc as pb_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import render
from services.common import config, grpc_errors, security, specfile, watchlines

OK, REFUSED, BAD_INPUT, NOT_FOUND, UNREACHABLE, TIMED_OUT, UNAUTHORIZED, INTERRUPTED = 0, 1, 2, 3, 4, 5, 6, 130

ENV_CONTROLLER = "REPLICAPLANE_CONTROLLER"

_CODE_EXIT = {
    grpc.StatusCode.INVALID_ARGUMENT: BAD_INPUT,
    grpc.StatusCode.NOT_FOUND: NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE: UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: UNREACHABLE,
    grpc.StatusCode.UNAUTHENTICATED: UNAUTHORIZED,
    grpc.StatusCode.PERMISSION_DENIED: UNAUTHORIZED,
}
_FAILED_SERVICE = {
    res.SERVICE_STATUS_FAILED,
    res.SERVICE_STATUS_FAILED_CLEANUP,
    res.SERVICE_STATUS_CONTROLLER_FAILED,
}


class CliError(Exception):
    """Ends the command with one error line and an exit code."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.line = line
        self.code = code


def _rpc_error(err: grpc.RpcError, *, controller: str) -> CliError:
    decoded = grpc_errors.RpcError(err)
    code = _CODE_EXIT.get(decoded.code, REFUSED)
    if code == UNREACHABLE:
        return CliError(f"error: cannot reach the controller at {controller} ({decoded.code.name})", code)
    if code == UNAUTHORIZED:
        hint = f"set {security.CLIENT_TOKEN_ENV} or {security.CLIENT_TOKEN_FILE_ENV}"
        return CliError(f"error: the controller refused the call ({decoded.code.name}): {hint}", code)
    return CliError(render.error_line(decoded.code.name, decoded.message, decoded.field_violations), code)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(BAD_INPUT, f"error: {message}\n")


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = _Parser(prog="replicactl", description="Manage Replicaplane services (a thin client of the controller's API).")
    p.add_argument(
        "--controller",
        default=os.environ.get(ENV_CONTROLLER) or config.CONTROLLER_ADDR,
        help=f"controller address host:port (env {ENV_CONTROLLER}; default {config.CONTROLLER_ADDR})",
    )
    p.add_argument("--rpc-timeout", type=float, default=30.0, help="seconds each call may take (default 30)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    up = sub.add_parser("up", help="create a service from a task YAML")
    up.add_argument("spec", help="SkyPilot-style task YAML (a relative workdir is resolved against its directory)")
    up.add_argument("-n", "--name", default="", help="service name (default: the YAML's name:)")
    up.add_argument("--wait", action="store_true", help="show progress until READY (or failed)")
    up.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits (default 600)")

    status = sub.add_parser("status", help="services and replicas")
    status.add_argument("name", nargs="?", help="one service (default: every service)")
    status.add_argument("--all", action="store_true", help="more replica columns: zone, spot, replica name")
    status.add_argument("--json", action="store_true", help="the API's messages in protobuf's JSON mapping")

    update = sub.add_parser("update", help="update a service to a new spec (a new version)")
    update.add_argument("name")
    update.add_argument("spec")
    update.add_argument("--mode", choices=["rolling", "blue_green"], default="rolling")
    update.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    update.add_argument("--wait", action="store_true", help="show progress until the new version is READY")
    update.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits (default 600)")
    update.add_argument("--json", action="store_true", help="print the response as JSON")

    down = sub.add_parser("down", help="delete a service, or terminate one replica, or purge failed replicas")
    down.add_argument("name")
    down.add_argument("--replica-id", type=int, help="terminate only this replica (drained first)")
    down.add_argument("--purge", action="store_true", help="also clear failed records (FAILED_CLEANUP)")
    down.add_argument("--failed-only", action="store_true", help="purge every failed replica record, nothing else")
    down.add_argument("--wait", action="store_true", help="wait until the service is gone")
    down.add_argument("--timeout", type=float, default=300.0, help="seconds --wait waits (default 300)")

    logs = sub.add_parser("logs", help="a replica's output")
    logs.add_argument("name")
    logs.add_argument("--replica-id", type=int, required=True)
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing while the replica runs")
    logs.add_argument("--launch", action="store_true", help="the launch log (setup and provisioning), not the app")

    watch = sub.add_parser("watch", help="print every change of a service as it happens (Ctrl-C stops)")
    watch.add_argument("name")
    watch.add_argument("--json", action="store_true", help="one JSON message per line")

    stack = sub.add_parser("stack", help="run the local stack (controller, provisioner, probers)")
    stack_sub = stack.add_subparsers(dest="stack_command", required=True, parser_class=_Parser)
    stack_up = stack_sub.add_parser("up", help="start it; Ctrl-C stops it (deleting every service first)")
    stack_up.add_argument("--probers", type=int, default=1)
    stack_up.add_argument("--detach", action="store_true", help="run in the background; stop with `stack down`")
    stack_up.add_argument("--example", metavar="YAML", help="a service to create once the stack serves")
    stack_up.add_argument("--state-dir", default=".state")
    stack_down = stack_sub.add_parser("down", help="stop a stack started with --detach")
    stack_down.add_argument("--state-dir", default=".state")
    return p


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
        """A unary call with the timeout; errors become CliError."""
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            raise _rpc_error(err, controller=self.addr) from None

    def stream(self, method: str, request: Any) -> Iterator[Any]:
        """A server stream; errors become CliError."""
        try:
            yield from getattr(self.stub, method)(request, metadata=self.metadata)
        except grpc.RpcError as err:
            raise _rpc_error(err, controller=self.addr) from None

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


def _read_spec(path: str) -> str:
    try:
        return specfile.read_spec(path)
    except FileNotFoundError:
        raise CliError(f"error: no such file: {path}", BAD_INPUT) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"error: cannot read {path}: {exc}", BAD_INPUT) from None
    except Exception as exc:  # YAML syntax: the controller names the field, here the file
        raise CliError(f"error: yaml: {path} is not valid YAML: {str(exc).splitlines()[0]}", BAD_INPUT) from None


def _say(out: TextIO, line: str) -> None:
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
    call = client.stub.WatchService(
        pb.WatchServiceRequest(service_name=name), timeout=timeout, metadata=client.metadata
    )
    try:
        for msg in call:
            for line in printer.lines(msg):
                _say(out, line)
            svc = msg.service
            if msg.deleted:
                raise CliError(f"error: service {name!r} was deleted while waiting", REFUSED)
            if done(svc):
                return svc
            if svc.status in _FAILED_SERVICE or "scaling stopped" in svc.status_message:
                reason = svc.status_message or render.service_status(svc.status)
                raise CliError(f"error: {name}: {reason}", REFUSED)
            if time.monotonic() > deadline:
                break
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise _rpc_error(err, controller=client.addr) from None
    raise CliError(f"error: {name}: gave up waiting after {timeout:.0f} s", TIMED_OUT)


def _all_ready(svc: res.Service) -> bool:
    return svc.status == res.SERVICE_STATUS_READY and svc.ready_replicas >= max(1, svc.target_replicas)


def _print_endpoints(svc: res.Service, out: TextIO) -> None:
    print(f"{svc.name} is READY ({svc.ready_replicas}/{svc.total_replicas} ready)", file=out)
    for endpoint in sorted(svc.endpoints, key=lambda e: e.replica_id):
        print(f"  replica {endpoint.replica_id}: {endpoint.url}", file=out)


def cmd_up(args: argparse.Namespace, client: Client, out: TextIO) -> int:
    """Create a service."""
    text = _read_spec(args.spec)
    resp = client.call(
        "CreateService", pb.CreateServiceRequest(service_name=args.name, yaml=text, request_id=str(uuid.uuid4()))
    )
    name = resp.service.name
    print(f"{name}: created (version {resp.service.latest_version})", file=out, flush=True)
    if args.wait:
        _print_endpoints(wait_for(client, name, done=_all_ready, timeout=args.timeout, out=out), out)
    return OK


def cmd_status(args: argparse.Namespace, client: Client, out: TextIO) -> int:
    """Services and replicas tables, or JSON."""
    if args.name:
        services = [client.call("GetService", pb.GetServiceRequest(service_name=args.name)).service]
    else:
        services = client.services()
    replicas: list[res.Replica] = []
    for svc in services:
        try:
            replicas += client.replicas(svc.name)
        except CliError as exc:
            if exc.code != NOT_FOUND or args.name:  # a service deleted since the listing is skipped
                raise
    if args.json:
        print(render.to_json({"services": services, "replicas": replicas}), file=out)
        return OK
    if not services:
        print("No services.", file=out)
        return OK
    tty = out.isatty()
    width = 160
    if tty:
        with contextlib.suppress(OSError, ValueError):
            width = os.get_terminal_size(out.fileno()).columns or width
    out.write(render.status_text(services, replicas, tty=tty, show_all=args.all, width=width))
    return OK


def cmd_update(args: argparse.Namespace, client: Client, out: TextIO) -> int:
    """Update a service, or print the plan on a dry run."""
    text = _read_spec(args.spec)
    mode = res.UPDATE_MODE_BLUE_GREEN if args.mode == "blue_green" else res.UPDATE_MODE_ROLLING
    request = pb.UpdateServiceRequest(
        service_name=args.name, yaml=text, mode=mode, dry_run=args.dry_run, request_id=str(uuid.uuid4())
    )
    resp = client.call("UpdateService", request)
    if args.json:
        print(render.to_json({"service": resp.service, "plan": resp.plan}), file=out)
    else:
        out.write(render.plan_text(args.name, resp.plan, dry_run=args.dry_run))
        out.flush()
    if args.wait and not args.dry_run:
        version = resp.plan.new_version

        def done(svc: res.Service) -> bool:
            return _all_ready(svc) and list(svc.active_versions) == [version]

        _print_endpoints(wait_for(client, args.name, done=done, timeout=args.timeout, out=out), out)
    return OK


def cmd_down(args: argparse.Namespace, client: Client, out: TextIO) -> int:
    """Delete a service, terminate a replica, or purge failed replicas."""
    if args.replica_id is not None and args.failed_only:
        raise CliError("error: --replica-id and --failed-only: choose one", BAD_INPUT)
    if args.failed_only:
        resp = client.call("PurgeReplicas", pb.PurgeReplicasRequest(service_name=args.name))
        ids = ", ".join(str(i) for i in resp.replica_ids) or "none"
        print(f"{args.name}: purged failed replicas: {ids}", file=out)
        return OK
    if args.replica_id is not None:
        request = pb.TerminateReplicaRequest(service_name=args.name, replica_id=args.replica_id, purge=args.purge)
        replica = client.call("TerminateReplica", request).replica
        print(f"{args.name}: replica {replica.replica_id} {render.replica_status(replica.status)}", file=out)
        return OK
    svc = client.call("DeleteService", pb.DeleteServiceRequest(service_name=args.name, purge=args.purge)).service
    print(f"{args.name}: {render.service_status(svc.status)}; every replica is being torn down", file=out, flush=True)
    if args.wait:
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            try:
                client.call("GetService", pb.GetServiceRequest(service_name=args.name))
            except CliError as exc:
                if exc.code == NOT_FOUND:
                    print(f"{args.name}: deleted", file=out)
                    return OK
                raise
            time.sleep(0.25)
        raise CliError(f"error: {args.name}: still not deleted after {args.timeout:.0f} s", TIMED_OUT)
    return OK


def cmd_logs(args: argparse.Namespace, client: Client, out: TextIO) -> int:
    """Copy a replica's log to stdout."""
    kind = pb.REPLICA_LOG_KIND_LAUNCH if args.launch else pb.REPLICA_LOG_KIND_APP
    request = pb.StreamReplicaLogsRequest(
        service_name=args.name, replica_id=args.replica_id, kind=kind, follow=args.follow
    )
    binary = getattr(out, "buffer", None)
    for chunk in client.stream("StreamReplicaLogs", request):
        if binary is not None:
            binary.write(chunk.data)
            binary.flush()
        else:
            out.write(chunk.data.decode(errors="replace"))
    return OK


def cmd_watch(args: argparse.Namespace, client: Client, out: TextIO) -> int:
    """Print changes until the service is deleted (or Ctrl-C)."""
    printer = watchlines.WatchPrinter()
    for msg in client.stream("WatchService", pb.WatchServiceRequest(service_name=args.name)):
        if args.json:
            print(render.to_json({"change": msg}, indent=None), file=out, flush=True)
        else:
            for line in printer.lines(msg):
                _say(out, line)
        if msg.deleted:
            break
    return OK


def cmd_stack(args: argparse.Namespace) -> NoReturn:
    """Hand over to the local stack's own command line (same process, same exit code)."""
    argv = [sys.executable, "-m", "services.stack", args.stack_command, "--state-dir", args.state_dir]
    if args.stack_command == "up":
        argv += ["--probers", str(args.probers)]
        if args.detach:
            argv.append("--detach")
        if args.example:
            argv += ["--example", args.example]
    sys.stdout.flush()
    os.execv(sys.executable, argv)


_COMMANDS: dict[str, Callable[[argparse.Namespace, Client, TextIO], int]] = {
    "up": cmd_up,
    "status": cmd_status,
    "update": cmd_update,
    "down": cmd_down,
    "logs": cmd_logs,
    "watch": cmd_watch,
}


def run(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run one command; returns its exit code. Never raises for expected failures."""
    out = out or sys.stdout
    err = err or sys.stderr
    args = parser().parse_args(argv)
    if args.command == "stack":
        cmd_stack(args)
    try:
        token = security.client_token(target=args.controller)
    except OSError as exc:
        print(f"error: cannot read the API token file: {exc.strerror}", file=err)
        return BAD_INPUT
    client = Client(args.controller, args.rpc_timeout, token)
    try:
        return _COMMANDS[args.command](args, client, out)
    except CliError as exc:
        out.flush()
        print(exc.line, file=err)
        return exc.code
    except KeyboardInterrupt:
        return INTERRUPTED
    except BrokenPipeError:  # `replicactl logs ... | head`
        return OK
    finally:
        client.close()


def main() -> None:
    """Console script entry point."""
    sys.exit(run())

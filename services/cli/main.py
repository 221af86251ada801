"""replicactl: a thin command line client of the controller's public API, shaped like `sky serve`.

Exit codes (also in docs/cli.md and services/cli/exits.py):
    0  done
    1  the controller refused the call (state, conflict), a waited-for service failed, or a
       confirmation was declined
    2  bad input: command line, unreadable file, or a spec the controller rejected (INVALID_ARGUMENT)
    3  not found: no such service, replica or log
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
from collections.abc import Callable, Sequence
from typing import NoReturn, TextIO

import grpc
import yaml

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import client as client_mod
from services.cli import dashboard, exits, inputs, jobs, logs, orphans, render, rollouts
from services.common import config, security, specfile, watchlines

OK, REFUSED, BAD_INPUT, NOT_FOUND = exits.OK, exits.REFUSED, exits.BAD_INPUT, exits.NOT_FOUND
UNREACHABLE, TIMED_OUT, UNAUTHORIZED, INTERRUPTED = (
    exits.UNREACHABLE,
    exits.TIMED_OUT,
    exits.UNAUTHORIZED,
    exits.INTERRUPTED,
)
CliError = exits.CliError

ENV_CONTROLLER = "REPLICAPLANE_CONTROLLER"
DEFAULT_STATE_DIR = ".state"
# A generated name is tried again with another suffix if taken, this many times in all.
_NAME_ATTEMPTS = 5


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(BAD_INPUT, f"error: {message}\n")


EXAMPLE = """\
Example, against a local stack (`make up` in another terminal):
  replicactl up examples/hello/service.yaml --wait     # create "hello", follow it until READY
  replicactl status                                    # services and replicas
  curl "$(replicactl status --endpoint hello)"         # one request through its URL
  replicactl update hello examples/hello/service.yaml --dry-run   # what an update would change
  replicactl logs hello 1                              # replica 1's output as it runs (Ctrl-C stops)
  replicactl down hello -y                             # delete it and every replica

A YAML with empty envs:/secrets: values (SkyPilot's "give it at launch"):
  replicactl up task.yaml --env MODEL=llama --secret HF_TOKEN   # HF_TOKEN from your environment

`replicactl COMMAND --help` describes each command; docs/cli.md has the `sky serve` equivalents.
"""


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="set an environment variable of the replicas over the YAML's envs: (repeatable); "
        "a bare KEY takes its value from your environment",
    )
    p.add_argument(
        "--env-file",
        action="append",
        default=[],
        metavar="FILE",
        help="read KEY=VALUE lines (dotenv format: # comments, quotes, export) as --env; --env wins",
    )
    p.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="set a secret over the YAML's secrets: (repeatable), redacted wherever the spec is shown; "
        "a bare KEY takes its value from your environment and keeps it out of your shell history",
    )


def _add_wait(p: argparse.ArgumentParser, what: str, default: float) -> None:
    p.add_argument("--wait", action="store_true", help=what)
    p.add_argument(
        "--timeout", type=float, default=default, metavar="S", help=f"seconds --wait waits (default {default:.0f})"
    )


_UPDATE_MODES = {
    "rolling": res.UPDATE_MODE_ROLLING,
    "blue_green": res.UPDATE_MODE_BLUE_GREEN,
    "canary": res.UPDATE_MODE_CANARY,
}


def parser() -> argparse.ArgumentParser:
    """The command line."""
    p = _Parser(
        prog="replicactl",
        description="Manage Replicaplane services: a thin client of the controller's API, shaped like `sky serve`.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--controller",
        default=os.environ.get(ENV_CONTROLLER) or config.CONTROLLER_ADDR,
        metavar="HOST:PORT",
        help=f"controller address, or several (HOST:PORT,HOST:PORT) where controllers share a store "
        f"(env {ENV_CONTROLLER}; default {config.CONTROLLER_ADDR})",
    )
    p.add_argument(
        "--rpc-timeout", type=float, default=30.0, metavar="S", help="seconds each call may take (default 30)"
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text[:1].upper() + text[1:] + ".")

    up = command("up", "create a service from a task YAML")
    up.add_argument(
        "spec", metavar="SPEC.yaml", help="SkyPilot task YAML; a relative workdir is taken from the current directory"
    )
    up.add_argument(
        "-n",
        "--name",
        default="",
        help="service name (default: the YAML's name:, else a generated service-<word>-<hex>)",
    )
    _add_overrides(up)
    _add_wait(up, "show each change until every replica is READY (or the service fails)", 600)

    status = command("status", "show services and their replicas")
    status.add_argument("names", nargs="*", metavar="NAME", help="services to show (default: every service)")
    status.add_argument(
        "-a", "--all", action="store_true", help="every status message, the autoscaler, replica zone, spot and name"
    )
    status.add_argument(
        "-v", "--verbose", action="store_true", help="service columns for autoscaling, load balancing and resources"
    )
    status.add_argument(
        "--endpoint", action="store_true", help="print only the URL of the one service named (for scripts)"
    )
    status.add_argument("--json", action="store_true", help="the API's messages in protobuf's JSON mapping")

    update = command("update", "update a service to a new spec (a new version)")
    update.add_argument("name", metavar="NAME", help="the service to update")
    update.add_argument("spec", metavar="SPEC.yaml", help="the new task YAML")
    update.add_argument(
        "--mode",
        choices=list(_UPDATE_MODES),
        default=None,
        help="rolling: replace replicas a few at a time; blue_green: switch once the new version is ready; "
        "canary: move traffic in weighted steps, rolled back by itself on failure (see `replicactl rollout`). "
        "Default: the new spec's service.rollout.strategy, else rolling",
    )
    update.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    _add_overrides(update)
    _add_wait(update, "show each change until the new version alone is READY", 600)
    update.add_argument("--json", action="store_true", help="print the response (service and plan) as JSON")

    down = command("down", "delete services, terminate one replica, or purge failed replicas")
    down.add_argument("names", nargs="*", metavar="NAME", help="services to delete")
    down.add_argument("-a", "--all", action="store_true", help="delete every service")
    down.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    down.add_argument("--replica-id", type=int, metavar="N", help="terminate only this replica (drained first)")
    down.add_argument("--purge", action="store_true", help="also clear failed records (FAILED_CLEANUP)")
    down.add_argument("--failed-only", action="store_true", help="purge every failed replica record, nothing else")
    _add_wait(down, "wait until the services are gone", 300)

    logs_ = command("logs", "print a replica's, the controller's or the load balancer's log")
    logs_.add_argument("name", metavar="NAME", help="the service")
    logs_.add_argument("replica", nargs="?", type=int, metavar="REPLICA_ID", help="the replica whose output to print")
    logs_.add_argument("--replica-id", type=int, metavar="N", help="the same as REPLICA_ID")
    logs_.add_argument(
        "-f",
        "--follow",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep printing while it runs (default; --no-follow prints what there is and exits)",
    )
    logs_.add_argument(
        "--launch", action="store_true", help="the replica's launch log (setup, provisioning), not its app"
    )
    logs_.add_argument(
        "--controller",
        dest="controller_log",
        action="store_true",
        help="the controller's log lines about this service (local stack)",
    )
    logs_.add_argument(
        "--load-balancer", action="store_true", help="the log of this service's load balancer (local stack)"
    )
    logs_.add_argument(
        "--sync-down",
        action="store_true",
        help="write the logs (every replica's, the controller's, the balancer's; or the one chosen) to files",
    )
    logs_.add_argument(
        "--dir",
        metavar="DIR",
        help=f"folder --sync-down writes a <NAME>-<time> folder in (default {logs.DEFAULT_LOG_DIR})",
    )
    logs_.add_argument(
        "--state-dir",
        default=DEFAULT_STATE_DIR,
        metavar="DIR",
        help=f"the local stack's state dir, where its logs are (default {DEFAULT_STATE_DIR})",
    )

    watch = command("watch", "print every change of a service as it happens (Ctrl-C stops)")
    watch.add_argument("name", metavar="NAME", help="the service to watch")
    watch.add_argument("--json", action="store_true", help="one JSON message per line")

    orphans_cmd = command(
        "orphans", "list replicas the provisioner runs that no record of this controller refers to; --reap them"
    )
    orphans.add_parser(orphans_cmd)

    rollouts.add_parsers(command, _Parser)
    jobs_cmd = command("jobs", "submit jobs to a pool, list, show and cancel them, follow their output")
    jobs.add_parser(jobs_cmd, _Parser)

    dashboard_cmd = command("dashboard", "print (or open) the URL of the live web dashboard")
    dashboard.add_parser(dashboard_cmd, DEFAULT_STATE_DIR)

    stack = command("stack", "run the local stack (controller, provisioner, probers, load balancer)")
    stack_sub = stack.add_subparsers(dest="stack_command", required=True, parser_class=_Parser, metavar="ACTION")
    stack_up = stack_sub.add_parser("up", help="start it; Ctrl-C stops it (deleting every service first)")
    stack_up.add_argument("--probers", type=int, default=1, metavar="N", help="prober processes to run (default 1)")
    stack_up.add_argument("--detach", action="store_true", help="run in the background; stop with `stack down`")
    stack_up.add_argument("--example", metavar="YAML", help="a service to create once the stack serves")
    stack_up.add_argument(
        "--state-dir", default=DEFAULT_STATE_DIR, metavar="DIR", help="state, logs and pid file (default .state)"
    )
    stack_down = stack_sub.add_parser("down", help="stop a stack started with --detach")
    stack_down.add_argument(
        "--state-dir", default=DEFAULT_STATE_DIR, metavar="DIR", help="the stack's state dir (default .state)"
    )
    return p


def _read_spec(path: str) -> str:
    try:
        resolved = specfile.load(path)
    except specfile.PathError as exc:
        raise CliError(f"error: {exc}", BAD_INPUT) from None
    except FileNotFoundError:
        raise CliError(f"error: no such file: {path}", BAD_INPUT) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"error: cannot read {path}: {exc}", BAD_INPUT) from None
    except Exception as exc:  # YAML syntax: the controller names the field, here the file
        raise CliError(f"error: yaml: {path} is not valid YAML: {str(exc).splitlines()[0]}", BAD_INPUT) from None
    for note in resolved.notes:
        print(f"note: {note}", file=sys.stderr)
    return resolved.text


def _overrides(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    try:
        return inputs.overrides(envs=args.env, env_files=args.env_file, secrets=args.secret, environ=os.environ)
    except inputs.InputError as exc:
        raise CliError(f"error: {exc}", BAD_INPUT) from None


def _has_name(yaml_text: str) -> bool:
    """Whether the YAML names the service; True for YAML the controller will refuse anyway."""
    try:
        doc = yaml.safe_load(yaml_text)
    except yaml.YAMLError:
        return True
    return not isinstance(doc, dict) or bool(doc.get("name"))


def cmd_up(args: argparse.Namespace, client: client_mod.Client, out: TextIO) -> int:
    """Create a service; one without a name gets a generated one."""
    text = _read_spec(args.spec)
    envs, secrets = _overrides(args)
    name = args.name
    generated = not name and not _has_name(text)
    for _ in range(_NAME_ATTEMPTS if generated else 1):
        if generated:
            name = inputs.generate_name()
        request = pb.CreateServiceRequest(
            service_name=name, yaml=text, request_id=str(uuid.uuid4()), env_overrides=envs, secret_overrides=secrets
        )
        try:
            resp = client.call("CreateService", request)
            break
        except CliError as exc:
            if not generated or exc.status != "ALREADY_EXISTS":
                raise
    else:
        raise CliError(f"error: {_NAME_ATTEMPTS} generated names were taken; give one with -n NAME", REFUSED)
    name = resp.service.name
    if generated:
        print(f"no -n NAME and no name: in the YAML: naming the service {name}", file=out)
    print(f"{name}: created (version {resp.service.latest_version})", file=out, flush=True)
    if args.wait:
        client_mod.print_endpoints(
            client_mod.wait_for(client, name, done=client_mod.all_ready, timeout=args.timeout, out=out), out
        )
    return OK


def _unique(names: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(names))


def _width(out: TextIO, tty: bool) -> int | None:
    """The width tables fit: $COLUMNS if set (as `watch` sets it), else the terminal's; no limit
    in a pipe."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if tty:
        with contextlib.suppress(OSError, ValueError):
            return os.get_terminal_size(out.fileno()).columns or 80
        return 80
    return None


def cmd_status(args: argparse.Namespace, client: client_mod.Client, out: TextIO, err: TextIO) -> int:
    """Services and replicas tables, JSON, or one service's URL."""
    names = _unique(args.names)
    if args.endpoint:
        if len(names) != 1:
            raise CliError("error: --endpoint takes exactly one service name", BAD_INPUT)
        svc = client.call("GetService", pb.GetServiceRequest(service_name=names[0])).service
        if not svc.load_balancer_url:
            raise CliError(f"error: {svc.name} has no URL yet: no load balancer has reported for it", REFUSED)
        print(svc.load_balancer_url, file=out)
        return OK
    services: list[res.Service] = []
    missing: list[CliError] = []
    for name in names:
        try:
            services.append(client.call("GetService", pb.GetServiceRequest(service_name=name)).service)
        except CliError as exc:
            if exc.code != NOT_FOUND:
                raise
            missing.append(exc)
    if not names:
        services = client.services()
    replicas: list[res.Replica] = []
    for svc in services:
        try:
            replicas += client.replicas(svc.name)
        except CliError as exc:
            if exc.code != NOT_FOUND:  # a service deleted since it was read is skipped
                raise
    if args.json:
        print(render.to_json({"services": services, "replicas": replicas}), file=out)
    elif services:
        tty = out.isatty()
        text = render.status_text(
            services, replicas, tty=tty, show_all=args.all, verbose=args.verbose, width=_width(out, tty)
        )
        out.write(text)
    elif not missing:
        print("No services.", file=out)
    out.flush()
    for error in missing:
        print(error.line, file=err)
    return NOT_FOUND if missing else OK


def cmd_update(args: argparse.Namespace, client: client_mod.Client, out: TextIO) -> int:
    """Update a service, or print the plan on a dry run."""
    text = _read_spec(args.spec)
    envs, secrets = _overrides(args)
    mode = _UPDATE_MODES[args.mode] if args.mode else res.UPDATE_MODE_UNSPECIFIED
    request = pb.UpdateServiceRequest(
        service_name=args.name,
        yaml=text,
        mode=mode,
        dry_run=args.dry_run,
        request_id=str(uuid.uuid4()),
        env_overrides=envs,
        secret_overrides=secrets,
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
            return client_mod.all_ready(svc) and list(svc.active_versions) == [version]

        client_mod.print_endpoints(
            client_mod.wait_for(client, args.name, done=done, timeout=args.timeout, out=out), out
        )
    return OK


def _confirm(question: str, out: TextIO, stdin: TextIO) -> bool:
    print(f"{question} [y/N] ", end="", file=out, flush=True)
    return stdin.readline().strip().lower() in ("y", "yes")


def cmd_down(args: argparse.Namespace, client: client_mod.Client, out: TextIO, err: TextIO, stdin: TextIO) -> int:
    """Delete services, terminate a replica, or purge failed replicas.

    On a terminal it asks first (unless -y); in a script it asks nothing, but `--all` needs -y.
    """
    names = _unique(args.names)
    if args.all and names:
        raise CliError("error: give service names or --all, not both", BAD_INPUT)
    if not args.all and not names:
        raise CliError("error: name the services to delete (or --all)", BAD_INPUT)
    if (args.replica_id is not None or args.failed_only) and (args.all or len(names) != 1):
        raise CliError("error: --replica-id and --failed-only take exactly one service name", BAD_INPUT)
    if args.replica_id is not None and args.failed_only:
        raise CliError("error: --replica-id and --failed-only: choose one", BAD_INPUT)
    if args.failed_only:
        resp = client.call("PurgeReplicas", pb.PurgeReplicasRequest(service_name=names[0]))
        ids = ", ".join(str(i) for i in resp.replica_ids) or "none"
        print(f"{names[0]}: purged failed replicas: {ids}", file=out)
        return OK
    if args.all:
        names = [s.name for s in client.services()]
        if not names:
            print("No services to delete.", file=out)
            return OK
    if args.replica_id is not None:
        question = f"Terminate replica {args.replica_id} of {names[0]}?"
    else:
        question = f"Delete {', '.join(names)} and tear down every replica?"
    if not args.yes:
        if stdin.isatty():
            if not _confirm(question, out, stdin):
                print("Aborted: nothing changed.", file=out)
                return REFUSED
        elif args.all:
            raise CliError("error: down --all deletes every service: add -y to confirm", BAD_INPUT)
    if args.replica_id is not None:
        request = pb.TerminateReplicaRequest(service_name=names[0], replica_id=args.replica_id, purge=args.purge)
        replica = client.call("TerminateReplica", request).replica
        print(f"{names[0]}: replica {replica.replica_id} {render.replica_status(replica.status)}", file=out)
        return OK
    code = OK
    deleting = []
    for name in names:
        try:
            svc = client.call("DeleteService", pb.DeleteServiceRequest(service_name=name, purge=args.purge)).service
        except CliError as exc:
            if exc.code in (UNREACHABLE, UNAUTHORIZED):
                raise
            print(exc.line, file=err)
            code = code or exc.code
            continue
        deleting.append(name)
        print(f"{name}: {render.service_status(svc.status)}; every replica is being torn down", file=out, flush=True)
    if args.wait and deleting:
        _wait_deleted(client, deleting, timeout=args.timeout, out=out)
    return code


def _wait_deleted(client: client_mod.Client, names: list[str], *, timeout: float, out: TextIO) -> None:
    deadline = time.monotonic() + timeout
    left = list(names)
    while left:
        for name in list(left):
            try:
                client.call("GetService", pb.GetServiceRequest(service_name=name))
            except CliError as exc:
                if exc.code != NOT_FOUND:
                    raise
                print(f"{name}: deleted", file=out, flush=True)
                left.remove(name)
        if left and time.monotonic() >= deadline:
            raise CliError(f"error: {', '.join(left)}: still not deleted after {timeout:.0f} s", TIMED_OUT)
        if left:
            time.sleep(0.25)


def cmd_watch(args: argparse.Namespace, client: client_mod.Client, out: TextIO) -> int:
    """Print changes until the service is deleted (or Ctrl-C)."""
    printer = watchlines.WatchPrinter()
    try:
        for msg in client.watch(args.name):
            if args.json:
                print(render.to_json({"change": msg}, indent=None), file=out, flush=True)
            else:
                for line in printer.lines(msg):
                    client_mod.say(out, line)
            if msg.deleted:
                break
    except grpc.RpcError as err:
        raise client_mod.rpc_error(err, controller=client.addr) from None
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


def run(
    argv: Sequence[str] | None = None,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    stdin: TextIO | None = None,
) -> int:
    """Run one command; returns its exit code. Never raises for expected failures."""
    out = out or sys.stdout
    err = err or sys.stderr
    stdin = stdin or sys.stdin
    args = parser().parse_args(argv)
    if args.command == "stack":
        cmd_stack(args)
    if args.command == "dashboard":
        return dashboard.cmd_dashboard(args, out, err)
    try:
        # A command that names a stack's state dir (logs) finds that stack's token there.
        token = security.client_token(target=args.controller, state_dir=getattr(args, "state_dir", DEFAULT_STATE_DIR))
    except OSError as exc:
        print(f"error: cannot read the API token file: {exc.strerror}", file=err)
        return BAD_INPUT
    client = client_mod.Client(args.controller, args.rpc_timeout, token)
    commands: dict[str, Callable[[], int]] = {
        "up": lambda: cmd_up(args, client, out),
        "status": lambda: cmd_status(args, client, out, err),
        "update": lambda: cmd_update(args, client, out),
        "down": lambda: cmd_down(args, client, out, err, stdin),
        "logs": lambda: logs.cmd_logs(args, client, out, err),
        "watch": lambda: cmd_watch(args, client, out),
        "orphans": lambda: orphans.cmd_orphans(args, client, out),
        "events": lambda: rollouts.cmd_events(args, client, out),
        "history": lambda: rollouts.cmd_history(args, client, out),
        "rollback": lambda: rollouts.cmd_rollback(args, client, out),
        "rollout": lambda: rollouts.cmd_rollout(args, client, out),
        "jobs": lambda: jobs.cmd_jobs(args, client, out, err),
    }
    try:
        return commands[args.command]()
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

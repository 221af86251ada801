"""replicactl: a thin command line client of the controller's public API, shaped like `sky serve`.

This module holds the command line and hands each command to its module: lifecycle (up, update,
down), status (status, watch), logs, orphans, rollouts, jobs, dashboard; `stack` runs the local
stack's own command line.

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
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, TextIO

from services.cli import client as client_mod
from services.cli import dashboard, exits, jobs, lifecycle, logs, orphans, rollouts, status
from services.common import config, security

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

    lifecycle.add_up(command("up", "create a service from a task YAML"))
    status.add_status(command("status", "show services and their replicas"))
    lifecycle.add_update(command("update", "update a service to a new spec (a new version)"))
    lifecycle.add_down(command("down", "delete services, terminate one replica, or purge failed replicas"))
    logs.add_parser(
        command("logs", "print a replica's, the controller's or the load balancer's log"), DEFAULT_STATE_DIR
    )
    status.add_watch(command("watch", "print every change of a service as it happens (Ctrl-C stops)"))

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
        "up": lambda: lifecycle.cmd_up(args, client, out),
        "status": lambda: status.cmd_status(args, client, out, err),
        "update": lambda: lifecycle.cmd_update(args, client, out),
        "down": lambda: lifecycle.cmd_down(args, client, out, err, stdin),
        "logs": lambda: logs.cmd_logs(args, client, out, err),
        "watch": lambda: status.cmd_watch(args, client, out),
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

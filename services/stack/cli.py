"""Command line of the local stack: up, down, create, health."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping, Sequence

import yaml

from services.common import config, errors, logs, specfile
from services.stack import api, output, plan, runner

DEFAULT_STATE_DIR = ".state"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.stack",
        description="Run Replicaplane's three services locally (make up / make down).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start controller, provisioner and probers; Ctrl-C stops them")
    up.add_argument("--example", metavar="YAML", help="service YAML to create once the stack serves")
    up.add_argument("--probers", type=int, default=1, help="number of prober processes (default 1)")
    up.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="state, logs, pid file (default .state)")
    up.add_argument("--detach", action="store_true", help="run in the background; stop with `down`")
    up.add_argument("--ready-timeout", type=float, default=30.0, help="seconds each service gets to serve")
    up.add_argument(
        "--delete-timeout", type=float, default=90.0, help="seconds each created service gets to go on stop"
    )

    down = sub.add_parser("down", help="stop a stack started with --detach (or left behind)")
    down.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    down.add_argument("--timeout", type=float, default=150.0, help="seconds the stack gets to clean up")

    create = sub.add_parser("create", help="create a service from YAML through a running controller")
    create.add_argument("yaml", help="the service YAML; a relative workdir is taken from the current directory")
    create.add_argument("--controller", default=plan.dial_addr(plan.config.CONTROLLER_ADDR))
    create.add_argument("--follow", action="store_true", help="print status changes until Ctrl-C")

    health = sub.add_parser("health", help="exit 0 if the gRPC server at ADDR is SERVING (container checks)")
    health.add_argument("addr")
    health.add_argument("--service", default="", help="service name to check; default the whole server")
    health.add_argument("--timeout", type=float, default=3.0)
    health.add_argument(
        "--tls",
        action="store_true",
        help="check over mTLS with the REPLICAPLANE_<SERVICE>_TLS_* files of the environment",
    )
    return parser


async def _create(args: argparse.Namespace) -> int:
    client = api.Controller(args.controller)
    try:
        name = await client.create(args.yaml, output.say)
        if args.follow:
            await client.follow(name, api.WatchPrinter(), output.say)
    except api.StackError as exc:
        output.say(f"error: {exc}")
        return 1
    finally:
        await client.close()
    return 0


def _example_name(path: str) -> str:
    """The `name:` of the example YAML ("" for none), after checking it reads and parses.

    Raises:
        api.StackError: it cannot be read, is not YAML, or names a path that does not exist; the
            message names the file (and the line) in one line.
    """
    try:
        specfile.load(path)
        return api.spec_name(path)
    except FileNotFoundError:
        raise api.StackError(f"no such file: {path}") from None
    except specfile.PathError as exc:
        raise api.StackError(f"{path}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise api.StackError(f"cannot read {path}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        # Position only: the offending line may hold a secret.
        what = exc.problem or "syntax error"
        if exc.problem_mark is not None:
            what += f" at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}"
        if exc.context and exc.context_mark is not None:
            what += f" ({exc.context} at line {exc.context_mark.line + 1})"
        raise api.StackError(f"{path} is not valid YAML: {what}") from None
    except yaml.YAMLError:
        raise api.StackError(f"{path} is not valid YAML") from None


def _check_settings(environ: Mapping[str, str]) -> None:
    """The settings every process reads, checked once here rather than failing in each.

    Raises:
        errors.ValidationError: REPLICAPLANE_CONFIG cannot be read or is not a mapping.
        errors.StartupError: REPLICAPLANE_LOG_LEVEL is not a level.
    """
    if path := environ.get(config.CONFIG_FILE_ENV):
        config.read_file(path)
    logs.check_level(environ.get(logs.LEVEL_ENV, "INFO"))


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and run it; exits with the command's code.

    Every mistake the stack can see before it starts (a bad setting, an unreadable example, a
    port in use) is one line naming it, never a traceback.
    """
    args = _parser().parse_args(argv)
    if args.command == "up":
        state_dir = os.path.abspath(args.state_dir)
        try:
            _check_settings(os.environ)
            if args.example:
                _example_name(args.example)  # one line naming the file if it cannot be used
            specs = plan.plan(probers=args.probers, state_dir=state_dir)
        except (ValueError, api.StackError, errors.ValidationError, errors.StartupError) as exc:
            sys.exit(f"error: {exc}")
        if args.detach:
            child = ["up", "--state-dir", state_dir, "--probers", str(args.probers)]
            child += ["--ready-timeout", str(args.ready_timeout)]
            child += ["--delete-timeout", str(args.delete_timeout)]
            if args.example:
                child += ["--example", os.path.abspath(args.example)]
            timeout = args.ready_timeout * len(specs) + 60
            sys.exit(runner.detach(child, state_dir=state_dir, timeout=timeout, specs=specs))
        example = os.path.abspath(args.example) if args.example else None
        sys.exit(
            asyncio.run(
                runner.up(
                    specs,
                    state_dir=state_dir,
                    example=example,
                    ready_timeout=args.ready_timeout,
                    delete_timeout=args.delete_timeout,
                )
            )
        )
    elif args.command == "down":
        sys.exit(runner.down(state_dir=os.path.abspath(args.state_dir), timeout=args.timeout))
    elif args.command == "create":
        try:
            sys.exit(asyncio.run(_create(args)))
        except KeyboardInterrupt:
            sys.exit(0)
    elif args.command == "health":
        ok = asyncio.run(api.check_health(args.addr, args.service, timeout=args.timeout, tls=args.tls))
        sys.exit(0 if ok else 1)

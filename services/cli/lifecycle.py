"""`replicactl up`, `update` and `down`: create, change and delete services (and replicas).

The YAML is read through `specfile` (which resolves a relative workdir), with the `--env`,
`--env-file` and `--secret` overrides of `inputs`; the controller validates the rest.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from typing import TextIO

import yaml

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import client as client_mod
from services.cli import exits, inputs, render
from services.common import specfile

OK, REFUSED, BAD_INPUT, NOT_FOUND = exits.OK, exits.REFUSED, exits.BAD_INPUT, exits.NOT_FOUND
TIMED_OUT, UNREACHABLE, UNAUTHORIZED = exits.TIMED_OUT, exits.UNREACHABLE, exits.UNAUTHORIZED
CliError = exits.CliError

# A generated name is tried again with another suffix if taken, this many times in all.
_NAME_ATTEMPTS = 5


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


def add_up(p: argparse.ArgumentParser) -> None:
    """The up command's options."""
    p.add_argument(
        "spec", metavar="SPEC.yaml", help="SkyPilot task YAML; a relative workdir is taken from the current directory"
    )
    p.add_argument(
        "-n",
        "--name",
        default="",
        help="service name (default: the YAML's name:, else a generated service-<word>-<hex>)",
    )
    _add_overrides(p)
    _add_wait(p, "show each change until every replica is READY (or the service fails)", 600)


def add_update(p: argparse.ArgumentParser) -> None:
    """The update command's options."""
    p.add_argument("name", metavar="NAME", help="the service to update")
    p.add_argument("spec", metavar="SPEC.yaml", help="the new task YAML")
    p.add_argument(
        "--mode",
        choices=list(_UPDATE_MODES),
        default=None,
        help="rolling: replace replicas a few at a time; blue_green: switch once the new version is ready; "
        "canary: move traffic in weighted steps, rolled back by itself on failure (see `replicactl rollout`). "
        "Default: the new spec's service.rollout.strategy, else rolling",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    _add_overrides(p)
    _add_wait(p, "show each change until the new version alone is READY", 600)
    p.add_argument("--json", action="store_true", help="print the response (service and plan) as JSON")


def add_down(p: argparse.ArgumentParser) -> None:
    """The down command's options."""
    p.add_argument("names", nargs="*", metavar="NAME", help="services to delete")
    p.add_argument("-a", "--all", action="store_true", help="delete every service")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--replica-id", type=int, metavar="N", help="terminate only this replica (drained first)")
    p.add_argument("--purge", action="store_true", help="also clear failed records (FAILED_CLEANUP)")
    p.add_argument("--failed-only", action="store_true", help="purge every failed replica record, nothing else")
    _add_wait(p, "wait until the services are gone", 300)


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
    names = list(dict.fromkeys(args.names))  # each once, in order
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

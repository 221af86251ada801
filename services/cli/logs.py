"""`replicactl logs`: a replica's output, the local stack's controller and load balancer logs,
and `--sync-down` of them all into a folder."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator
from typing import TextIO

from replicaplane.controller.v1 import controller_service_pb2 as pb
from services.cli import client as client_mod
from services.cli import exits, stacklogs

DEFAULT_LOG_DIR = os.path.join("~", "replicaplane-logs")


def add_parser(p: argparse.ArgumentParser, default_state_dir: str) -> None:
    """The logs command's options."""
    p.add_argument("name", metavar="NAME", help="the service")
    p.add_argument("replica", nargs="?", type=int, metavar="REPLICA_ID", help="the replica whose output to print")
    p.add_argument("--replica-id", type=int, metavar="N", help="the same as REPLICA_ID")
    p.add_argument(
        "-f",
        "--follow",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep printing while it runs (default; --no-follow prints what there is and exits)",
    )
    p.add_argument("--launch", action="store_true", help="the replica's launch log (setup, provisioning), not its app")
    p.add_argument(
        "--controller",
        dest="controller_log",
        action="store_true",
        help="the controller's log lines about this service (local stack)",
    )
    p.add_argument("--load-balancer", action="store_true", help="the log of this service's load balancer (local stack)")
    p.add_argument(
        "--sync-down",
        action="store_true",
        help="write the logs (every replica's, the controller's, the balancer's; or the one chosen) to files",
    )
    p.add_argument(
        "--dir",
        metavar="DIR",
        help=f"folder --sync-down writes a <NAME>-<time> folder in (default {DEFAULT_LOG_DIR})",
    )
    p.add_argument(
        "--state-dir",
        default=default_state_dir,
        metavar="DIR",
        help=f"the local stack's state dir, where its logs are (default {default_state_dir})",
    )


def _write(out: TextIO, chunk: bytes) -> None:
    binary = getattr(out, "buffer", None)
    if binary is not None:
        binary.write(chunk)
        binary.flush()
    else:
        out.write(chunk.decode(errors="replace"))
        out.flush()


def _replica_log(
    client: client_mod.Client, name: str, replica_id: int, *, launch: bool, follow: bool
) -> Iterator[bytes]:
    kind = pb.REPLICA_LOG_KIND_LAUNCH if launch else pb.REPLICA_LOG_KIND_APP
    request = pb.StreamReplicaLogsRequest(service_name=name, replica_id=replica_id, kind=kind, follow=follow)
    for chunk in client.stream("StreamReplicaLogs", request):
        yield chunk.data


def _component_log(
    args: argparse.Namespace, component: str, client: client_mod.Client, err: TextIO
) -> stacklogs.ComponentLog:
    try:
        log = stacklogs.find(args.state_dir, component, service=args.name)
    except stacklogs.NotFound as exc:
        raise exits.CliError(f"error: {exc}", exits.NOT_FOUND) from None
    state = stacklogs.read_state(args.state_dir)
    if state and state.get("controller") and state["controller"] != client.addr:
        print(f"note: the stack in {args.state_dir} runs its controller at {state['controller']}", file=err)
    if log.note:
        print(f"note: {log.note} {log.path}", file=err)
    return log


def cmd_logs(args: argparse.Namespace, client: client_mod.Client, out: TextIO, err: TextIO) -> int:
    """Print (and follow) a replica's, the controller's or the load balancer's log, or write
    them all to files with --sync-down."""
    if args.replica is not None and args.replica_id is not None and args.replica != args.replica_id:
        raise exits.CliError("error: REPLICA_ID and --replica-id differ", exits.BAD_INPUT)
    replica = args.replica if args.replica is not None else args.replica_id
    chosen = [replica is not None, args.controller_log, args.load_balancer]
    if sum(chosen) > 1:
        raise exits.CliError("error: choose one of REPLICA_ID, --controller and --load-balancer", exits.BAD_INPUT)
    if args.launch and replica is None:
        raise exits.CliError("error: --launch is the launch log of a replica: give its REPLICA_ID", exits.BAD_INPUT)
    if args.sync_down:
        return _sync_down(args, client, replica, out, err)
    if replica is not None:
        for chunk in _replica_log(client, args.name, replica, launch=args.launch, follow=args.follow):
            _write(out, chunk)
        return exits.OK
    if not any(chosen):
        raise exits.CliError(
            "error: give a REPLICA_ID, --controller or --load-balancer (or --sync-down for all)", exits.BAD_INPUT
        )
    client.call("GetService", pb.GetServiceRequest(service_name=args.name))  # the service exists
    component = "controller" if args.controller_log else "loadbalancer"
    log = _component_log(args, component, client, err)
    keep = stacklogs.naming(args.name) if component == "controller" or log.shared else None
    try:
        for line in stacklogs.read(log, follow=args.follow, keep=keep):
            _write(out, line)
    except stacklogs.NotFound as exc:
        raise exits.CliError(f"error: {exc}", exits.NOT_FOUND) from None
    return exits.OK


def _sync_down(
    args: argparse.Namespace, client: client_mod.Client, replica: int | None, out: TextIO, err: TextIO
) -> int:
    """Write the chosen logs (all by default) to files in a new folder; print where."""
    name = args.name
    everything = replica is None and not args.controller_log and not args.load_balancer
    if replica is not None:
        client.call("GetReplica", pb.GetReplicaRequest(service_name=name, replica_id=replica))
        ids = [replica]
    elif everything:
        ids = [r.replica_id for r in client.replicas(name)]
    else:
        client.call("GetService", pb.GetServiceRequest(service_name=name))
        ids = []
    folder = os.path.join(os.path.expanduser(args.dir or DEFAULT_LOG_DIR), f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(folder, exist_ok=True)
    written: list[str] = []
    notes: list[str] = []

    def save(filename: str, chunks: Iterator[bytes]) -> None:
        path = os.path.join(folder, filename)
        with open(path, "wb") as fh:
            for chunk in chunks:
                fh.write(chunk)
        written.append(filename)

    for rid in ids:
        for launch, filename in ((False, f"replica-{rid}.log"), (True, f"replica-{rid}.launch.log")):
            try:
                save(filename, _replica_log(client, name, rid, launch=launch, follow=False))
            except exits.CliError as exc:
                if exc.code != exits.NOT_FOUND:
                    raise
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, filename))
                notes.append(f"replica {rid}: no {'launch' if launch else 'app'} log kept")
    for wanted, component, filename in (
        (everything or args.controller_log, "controller", "controller.log"),
        (everything or args.load_balancer, "loadbalancer", "load-balancer.log"),
    ):
        if not wanted:
            continue
        try:
            log = stacklogs.find(args.state_dir, component, service=name)
            keep = stacklogs.naming(name) if component == "controller" or log.shared else None
            save(filename, stacklogs.read(log, follow=False, keep=keep))
        except stacklogs.NotFound as exc:
            notes.append(str(exc))
    for note in notes:
        print(f"note: {note}", file=err)
    if not written:
        with contextlib.suppress(OSError):
            os.rmdir(folder)
        raise exits.CliError(f"error: {name}: no logs to write", exits.NOT_FOUND)
    print(f"{name}: {len(written)} log file(s) written to {folder}", file=out)
    for filename in written:
        print(f"  {filename}", file=out)
    return exits.OK

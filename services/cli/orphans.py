"""`replicactl orphans`: list replicas no record of this controller refers to, or reap them."""

from __future__ import annotations

import argparse
import time
from typing import TextIO

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import client as client_mod
from services.cli import exits, render


def add_parser(command: argparse.ArgumentParser) -> None:
    """The orphans command's options."""
    command.add_argument("--reap", action="store_true", help="tear them down (this controller's own by default)")
    who = command.add_mutually_exclusive_group()
    who.add_argument("--owner", default="", metavar="ID", help="only those of this owner (another controller's id)")
    who.add_argument(
        "--all-owners", action="store_true", help="with --reap: every owner's (another live controller may use them)"
    )
    command.add_argument(
        "--name", action="append", default=[], metavar="REPLICA", help="with --reap: only this replica (repeatable)"
    )
    command.add_argument("--wait", action="store_true", help="with --reap: wait until the reaped replicas are gone")
    command.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds --wait waits (default 300)")
    command.add_argument("--json", action="store_true", help="the API's messages in protobuf's JSON mapping")


def list_orphans(client: client_mod.Client, owner: str = "") -> tuple[list[res.Orphan], str]:
    """Every orphan (all pages), of `owner` only when given, and this controller's id."""
    out: list[res.Orphan] = []
    token, controller_id = "", ""
    for _ in range(10_000):
        resp = client.call("ListOrphans", pb.ListOrphansRequest(owner=owner, page_size=1000, page_token=token))
        out += resp.orphans
        controller_id = resp.controller_id
        token = resp.next_page_token
        if not token:
            break
    return out, controller_id


def cmd_orphans(args: argparse.Namespace, client: client_mod.Client, out: TextIO) -> int:
    """List orphans, or reap them (and wait until they are gone)."""
    if not args.reap and (args.all_owners or args.name or args.wait):
        raise exits.CliError("error: --all-owners, --name and --wait go with --reap", exits.BAD_INPUT)
    if not args.reap:
        found, controller_id = list_orphans(client, args.owner)
        if args.json:
            print(render.to_json({"controller_id": controller_id, "orphans": found}), file=out)
        else:
            out.write(render.orphans_text(found, controller_id, tty=out.isatty()))
        return exits.OK
    request = pb.ReapOrphansRequest(replica_names=args.name, owner=args.owner, all_owners=args.all_owners)
    resp = client.call("ReapOrphans", request)
    if args.json:
        print(render.to_json({"reaped": list(resp.reaped), "skipped": list(resp.skipped)}), file=out)
    else:
        for o in resp.reaped:
            owner = o.owner or "none"
            print(f"reaping {o.replica_name} (service {o.service_name}, owner {owner}): {o.reason}", file=out)
        for skip in resp.skipped:
            print(f"skipped {skip.replica_name}: {skip.reason}", file=out)
        if not resp.reaped and not resp.skipped:
            print("No orphans to reap.", file=out)
    out.flush()
    if args.wait and resp.reaped:
        names = {o.replica_name for o in resp.reaped}
        deadline = time.monotonic() + args.timeout
        while names & {o.replica_name for o in list_orphans(client)[0]}:
            if time.monotonic() >= deadline:
                raise exits.CliError(f"error: orphans still there after {args.timeout:.0f} s", exits.TIMED_OUT)
            time.sleep(0.25)
        if not args.json:
            print(f"reaped {len(names)} orphan{'s' if len(names) != 1 else ''}", file=out)
    return exits.OK

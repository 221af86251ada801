"""`replicactl events`, `history`, `rollback` and `rollout promote|abort`."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TextIO

import grpc

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import client as client_mod
from services.cli import exits, render
from services.common import grpc_errors

Command = Callable[[str, str], argparse.ArgumentParser]


def add_parsers(command: Command, sub_parser_class: type[argparse.ArgumentParser]) -> None:
    """The commands' options."""
    events = command("events", "print a service's events (launches, failures, rollout steps, rollbacks)")
    events.add_argument("name", metavar="NAME", help="the service")
    events.add_argument("-f", "--follow", action="store_true", help="keep printing new events (Ctrl-C stops)")
    events.add_argument("--json", action="store_true", help="one JSON event per line")

    history = command("history", "print a service's versions and what became of each")
    history.add_argument("name", metavar="NAME", help="the service")
    history.add_argument("--json", action="store_true", help="the API's messages in protobuf's JSON mapping")

    rollback = command("rollback", "update a service back to an earlier version's spec (a new version)")
    rollback.add_argument("name", metavar="NAME", help="the service")
    rollback.add_argument(
        "--to", type=int, default=0, metavar="V", help="the version to restore (default: the one before, that served)"
    )
    rollback.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    rollback.add_argument("--json", action="store_true", help="print the response as JSON")

    rollout = command("rollout", "move a canary rollout on, or abort it")
    actions = rollout.add_subparsers(dest="rollout_command", required=True, parser_class=sub_parser_class)
    promote = actions.add_parser("promote", help="go to the next step now (--full: all the traffic now)")
    promote.add_argument("name", metavar="NAME", help="the service")
    promote.add_argument("--full", action="store_true", help="skip every remaining step")
    abort = actions.add_parser("abort", help="send all the traffic back to the stable version and tear down the new")
    abort.add_argument("name", metavar="NAME", help="the service")


def _time(ts: object) -> str:
    seconds = ts.seconds + ts.nanos / 1e9  # type: ignore[attr-defined]
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) if seconds else "-"


def event_line(e: res.Event) -> str:
    """One event as a line: last time, type, reason, object, message, count."""
    kind = "Warning" if e.type == res.EVENT_TYPE_WARNING else "Normal"
    count = f" (x{e.count})" if e.count > 1 else ""
    return f"{_time(e.last_time)}  {kind:<7}  {e.reason:<18}  {e.object:<11}  {e.message}{count}"


def cmd_events(args: argparse.Namespace, client: client_mod.Client, out: TextIO) -> int:
    """Print the events, then with --follow every new one (resuming a cut stream)."""
    last = 0
    token = ""
    while True:
        resp = client.call("ListEvents", pb.ListEventsRequest(service_name=args.name, page_size=1000, page_token=token))
        for e in resp.events:
            _print_event(e, args.json, out)
            last = max(last, e.sequence)
        token = resp.next_page_token
        if not token:
            break
    if not args.follow:
        return exits.OK
    while True:
        try:
            for msg in client.stub.WatchEvents(
                pb.WatchEventsRequest(service_name=args.name, after_sequence=last), metadata=client.metadata
            ):
                _print_event(msg.event, args.json, out)
                last = msg.event.sequence
            return exits.OK  # the service is gone
        except grpc.RpcError as err:
            decoded = grpc_errors.RpcError(err)
            if decoded.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                time.sleep(0.5)
                continue
            raise client_mod.rpc_error(err, controller=client.addr) from None


def _print_event(e: res.Event, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(render.to_json({"event": e}, indent=None), file=out, flush=True)
    else:
        print(event_line(e), file=out, flush=True)


_OUTCOMES = {
    res.VERSION_OUTCOME_ACTIVE: "active",
    res.VERSION_OUTCOME_SUPERSEDED: "superseded",
    res.VERSION_OUTCOME_ROLLED_BACK: "rolled back",
    res.VERSION_OUTCOME_FAILED: "failed",
}
_MODES = {
    res.UPDATE_MODE_ROLLING: "rolling",
    res.UPDATE_MODE_BLUE_GREEN: "blue_green",
    res.UPDATE_MODE_CANARY: "canary",
}


def history_text(versions: list[res.ServiceVersion]) -> str:
    """The history as a table, oldest first."""
    lines = [f"{'VERSION':<8} {'CREATED':<19}  {'MODE':<10}  {'DIGEST':<12}  OUTCOME"]
    for v in versions:
        outcome = _OUTCOMES.get(v.outcome, "-")
        if v.reason:
            outcome += f": {v.reason}"
        mode = _MODES.get(v.update_mode, "-")
        lines.append(f"{v.version:<8} {_time(v.create_time):<19}  {mode:<10}  {v.spec_digest:<12}  {outcome}")
    return "\n".join(lines) + "\n"


def cmd_history(args: argparse.Namespace, client: client_mod.Client, out: TextIO) -> int:
    """Print the version history."""
    resp = client.call("ListVersions", pb.ListVersionsRequest(service_name=args.name))
    if args.json:
        print(render.to_json({"versions": list(resp.versions)}), file=out)
    else:
        out.write(history_text(list(resp.versions)))
    return exits.OK


def cmd_rollback(args: argparse.Namespace, client: client_mod.Client, out: TextIO) -> int:
    """Roll back to an earlier version's spec, or print the plan on a dry run."""
    request = pb.RollbackServiceRequest(service_name=args.name, to_version=args.to, dry_run=args.dry_run)
    resp = client.call("RollbackService", request)
    if args.json:
        print(render.to_json({"service": resp.service, "plan": resp.plan, "to_version": resp.to_version}), file=out)
        return exits.OK
    print(f"{args.name}: back to the spec of version {resp.to_version}", file=out)
    out.write(render.plan_text(args.name, resp.plan, dry_run=args.dry_run))
    return exits.OK


def cmd_rollout(args: argparse.Namespace, client: client_mod.Client, out: TextIO) -> int:
    """Promote or abort a canary rollout."""
    if args.rollout_command == "promote":
        svc = client.call("PromoteRollout", pb.PromoteRolloutRequest(service_name=args.name, full=args.full)).service
    else:
        svc = client.call("AbortRollout", pb.AbortRolloutRequest(service_name=args.name)).service
    r = svc.rollout
    print(f"{args.name}: {r.message or 'rollout ' + args.rollout_command + 'd'}", file=out)
    return exits.OK

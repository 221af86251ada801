"""`replicactl status` and `watch`: services and their replicas as tables or JSON, and each
change of one service as it happens."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import TextIO

import grpc

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import client as client_mod
from services.cli import exits, render
from services.common import watchlines

OK, BAD_INPUT, NOT_FOUND, REFUSED = exits.OK, exits.BAD_INPUT, exits.NOT_FOUND, exits.REFUSED
CliError = exits.CliError


def add_status(p: argparse.ArgumentParser) -> None:
    """The status command's options."""
    p.add_argument("names", nargs="*", metavar="NAME", help="services to show (default: every service)")
    p.add_argument(
        "-a", "--all", action="store_true", help="every status message, the autoscaler, replica zone, spot and name"
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="service columns for autoscaling, load balancing and resources"
    )
    p.add_argument("--endpoint", action="store_true", help="print only the URL of the one service named (for scripts)")
    p.add_argument("--json", action="store_true", help="the API's messages in protobuf's JSON mapping")


def add_watch(p: argparse.ArgumentParser) -> None:
    """The watch command's options."""
    p.add_argument("name", metavar="NAME", help="the service to watch")
    p.add_argument("--json", action="store_true", help="one JSON message per line")


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
    names = list(dict.fromkeys(args.names))  # each once, in order
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

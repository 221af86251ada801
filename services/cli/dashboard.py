"""`replicactl dashboard`: find the live web dashboard's URL, check it answers, open it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import urllib.error
import urllib.parse
import urllib.request
import webbrowser
from typing import TextIO

from services.cli import exits
from services.common import config, security

ENV_DASHBOARD_URL = "REPLICAPLANE_DASHBOARD_URL"


def add_parser(command: argparse.ArgumentParser, default_state_dir: str) -> None:
    """The dashboard command's options."""
    command.add_argument(
        "--url", default="", help=f"the dashboard's URL (env {ENV_DASHBOARD_URL}; default: the local stack's)"
    )
    command.add_argument(
        "--state-dir",
        default=default_state_dir,
        metavar="DIR",
        help=f"the local stack whose dashboard to find (default {default_state_dir})",
    )
    command.add_argument(
        "--open", action="store_true", help="open it in a browser (with the API token, if any, for the page)"
    )


def dashboard_url(args: argparse.Namespace) -> str:
    """The dashboard's URL: --url, else $REPLICAPLANE_DASHBOARD_URL, else the one the local stack
    in --state-dir recorded (its port may have been picked at start), else the default address."""
    url = args.url or os.environ.get(ENV_DASHBOARD_URL, "")
    if not url:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            with open(os.path.join(args.state_dir, "stack.json"), encoding="utf-8") as fh:
                processes = json.load(fh).get("processes", [])
            url = next((str(p["url"]) for p in processes if p.get("name") == "dashboard" and p.get("url")), "")
    if not url:
        addr = os.environ.get(config.env_name("dashboard", "http_addr")) or config.DASHBOARD_HTTP_ADDR
        host, _, port = addr.rpartition(":")
        url = f"http://{'127.0.0.1' if host in ('', '0.0.0.0', '[::]') else host}:{port}"
    return url if url.endswith("/") else url + "/"


def cmd_dashboard(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Print the dashboard's URL (and open it); exit 4 if nothing answers there."""
    url = dashboard_url(args)
    print(url, file=out, flush=True)
    try:
        with urllib.request.urlopen(urllib.parse.urljoin(url, "healthz"), timeout=3):
            pass
    except (urllib.error.URLError, OSError, ValueError):
        print(f"error: nothing answers at {url} (is the stack running? `make up`)", file=err)
        return exits.UNREACHABLE
    if args.open:
        try:
            token = security.client_token()
        except OSError as exc:
            print(f"error: cannot read the API token file: {exc.strerror}", file=err)
            return exits.BAD_INPUT
        # In the fragment, which the browser never sends; the page moves it to session storage.
        target = f"{url}#token={urllib.parse.quote(token, safe='')}" if token else url
        if not webbrowser.open(target):
            print("error: no browser to open; open the URL above yourself", file=err)
            return exits.REFUSED
    return exits.OK

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
from typing import Any, TextIO

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


def _stack_record(state_dir: str) -> dict[str, Any]:
    """The stack.json of the local stack in `state_dir`, or {}."""
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(state_dir, "stack.json"), encoding="utf-8") as fh:
            state = json.load(fh)
        if isinstance(state, dict):
            return state
    return {}


def _stack_dashboard(state: dict[str, Any]) -> dict[str, Any]:
    """The dashboard process the stack recorded, or {}."""
    processes = state.get("processes")
    if not isinstance(processes, list):
        return {}
    found = next((p for p in processes if isinstance(p, dict) and p.get("name") == "dashboard"), None)
    return found if found and found.get("url") else {}


def dashboard_url(args: argparse.Namespace) -> str:
    """The dashboard's URL: --url, else $REPLICAPLANE_DASHBOARD_URL, else the one the local stack
    in --state-dir recorded (its port may have been picked at start), else the default address."""
    return _find(args)[0]


def _find(args: argparse.Namespace) -> tuple[str, bool]:
    """dashboard_url(), and whether a token may go there: a URL the user named, or the stack's
    own dashboard. The default address may be anyone's once no stack holds it."""
    url = args.url or os.environ.get(ENV_DASHBOARD_URL, "")
    named = bool(url)
    if not url:
        url = str(_stack_dashboard(_stack_record(args.state_dir)).get("url", ""))
    if not url:
        addr = os.environ.get(config.env_name("dashboard", "http_addr")) or config.DASHBOARD_HTTP_ADDR
        host, _, port = addr.rpartition(":")
        url = f"http://{'127.0.0.1' if host in ('', '0.0.0.0', '[::]') else host}:{port}"
        return url + "/", False
    return (url if url.endswith("/") else url + "/"), named


def page_token(url: str, state_dir: str, *, named: bool) -> str:
    """The token to hand the page at `url`: the user's own (security.client_token()) for a URL
    the user named (`named`) or the stack's dashboard, else the token the local stack in
    `state_dir` generated, but only when `url` is that stack's own dashboard and its process still
    runs (so it, not another user's server, holds the port).

    Raises:
        OSError: the token file named in the environment cannot be read.
    """
    state = _stack_record(state_dir)
    dashboard = _stack_dashboard(state)
    ours = bool(dashboard) and str(dashboard["url"]).rstrip("/") == url.rstrip("/") and _running(dashboard.get("pid"))
    if not named and not ours:
        return ""
    if token := security.client_token():
        return token
    return security.stack_token(str(state.get("controller", "")), state_dir) if ours else ""


def _running(pid: object) -> bool:
    """Whether `pid` is a live process of this user (another user's gives PermissionError)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def cmd_dashboard(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Print the dashboard's URL (and open it); exit 4 if nothing answers there."""
    url, named = _find(args)
    print(url, file=out, flush=True)
    try:
        with urllib.request.urlopen(urllib.parse.urljoin(url, "healthz"), timeout=3):
            pass
    except (urllib.error.URLError, OSError, ValueError):
        print(f"error: nothing answers at {url} (is the stack running? `make up`)", file=err)
        return exits.UNREACHABLE
    if args.open:
        try:
            token = page_token(url, args.state_dir, named=named)
        except OSError as exc:
            print(f"error: cannot read the API token file: {exc.strerror}", file=err)
            return exits.BAD_INPUT
        # In the fragment, which the browser never sends; the page moves it to session storage.
        target = f"{url}#token={urllib.parse.quote(token, safe='')}" if token else url
        if not webbrowser.open(target):
            print("error: no browser to open; open the URL above yourself", file=err)
            return exits.REFUSED
    return exits.OK

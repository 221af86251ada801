"""`make demo`: start a local stack, deploy the 2-replica example, show it working, stop it all.

The stack runs on free loopback ports (each service binds port 0 and the stack records the port
it got) with its own state dir (.state/demo), so a `make up` stack on the default ports is left
alone. Every step prints what it does and how long it took.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from replicaplane.controller.v1 import controller_service_pb2 as pb
from services.cli import client as client_mod
from services.cli import exits
from services.cli import main as cli
from services.common import security

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "hello", "service.yaml")


def _step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def _stack(args: Sequence[str], env: dict[str, str], timeout: float) -> int:
    done = subprocess.run(
        [sys.executable, "-m", "services.stack", *args], cwd=REPO, env=env, timeout=timeout, check=False
    )
    return done.returncode


def _endpoint(addr: str, name: str, timeout: float = 30.0) -> str:
    """The service's URL, once its load balancer has reported it."""
    deadline = time.monotonic() + timeout
    with contextlib.closing(client_mod.Client(addr, 5.0, security.client_token())) as client:
        while True:
            url = str(client.call("GetService", pb.GetServiceRequest(service_name=name)).service.load_balancer_url)
            if url or time.monotonic() > deadline:
                return url
            time.sleep(0.1)


def _get_json(url: str, timeout: float = 10.0) -> object:
    """GET `url`; a 503 (the balancer has not got the READY endpoints yet) is retried briefly."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def run(state_dir: str) -> int:
    """Run the demo; returns 0 when every step worked and nothing is left running."""
    started = time.monotonic()
    # Port 0 for the public ports: each binds a free one and the stack writes it to stack.json.
    # The internal services listen on Unix sockets in the state dir.
    env = {
        **os.environ,
        "REPLICAPLANE_CONTROLLER_LISTEN_ADDR": "127.0.0.1:0",
        "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": "127.0.0.1:0",
        "REPLICAPLANE_DASHBOARD_HTTP_ADDR": "127.0.0.1:0",
    }
    _step(f"starting the local stack on free ports (state in {state_dir})")
    if _stack(["up", "--detach", "--state-dir", state_dir], env, timeout=180) != 0:
        print("demo failed: the stack did not start", file=sys.stderr)
        return 1
    token_file = os.path.join(state_dir, "api-token")
    if os.path.exists(token_file):  # the stack's own token (none when the user set theirs)
        os.environ.pop(security.CLIENT_TOKEN_ENV, None)
        os.environ[security.CLIENT_TOKEN_FILE_ENV] = token_file
    rc = 1
    try:
        with open(os.path.join(state_dir, "stack.json"), encoding="utf-8") as fh:
            state = json.load(fh)
        addr = state["controller"]
        _step("replicactl up examples/hello/service.yaml --wait")
        code = cli.run(["--controller", addr, "up", EXAMPLE, "--wait", "--timeout", "120"])
        if code != cli.OK:
            return code
        _step("replicactl status")
        cli.run(["--controller", addr, "status"])
        # One URL for the service: the stack's balancer fleet gives every service its own, within
        # about a second of its creation.
        url = f"{_endpoint(addr, 'hello')}/"
        _step(f"one request through the load balancer: GET {url}")
        print(json.dumps(_get_json(url)), flush=True)
        rc = 0
    except (OSError, IndexError, KeyError, StopIteration, ValueError, exits.CliError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
    finally:
        _step("stopping the stack (every service is deleted first)")
        if _stack(["down", "--state-dir", state_dir], env, timeout=200) != 0:
            rc = 1
    print(f"\ndemo {'finished' if rc == 0 else 'FAILED'} in {time.monotonic() - started:.1f} s", flush=True)
    return rc


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and run the demo."""
    parser = argparse.ArgumentParser(prog="python -m services.cli.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", default=os.path.join(REPO, ".state", "demo"))
    args = parser.parse_args(argv)
    sys.exit(run(os.path.abspath(args.state_dir)))


if __name__ == "__main__":
    main()

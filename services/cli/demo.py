"""`make demo`: start a local stack, deploy the 2-replica example, show it working, stop it all.

The stack runs on free loopback ports with its own state dir (.state/demo), so a `make up`
stack on the default ports is left alone. Every step prints what it does and how long it took.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

import grpc

from replicaplane.controller.v1 import controller_service_pb2 as pb
from replicaplane.controller.v1 import controller_service_pb2_grpc as pb_grpc
from services.cli import main as cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "hello", "service.yaml")


def _free_ports(n: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def _step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def _stack(args: Sequence[str], env: dict[str, str], timeout: float) -> int:
    done = subprocess.run(
        [sys.executable, "-m", "services.stack", *args], cwd=REPO, env=env, timeout=timeout, check=False
    )
    return done.returncode


def _through_balancer(url: str, timeout: float = 15.0) -> str:
    """The balancer's answer; it may answer 503 until it has the new service's endpoints (its
    endpoint watch retries a service that did not exist yet every 2 s at most)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return json.dumps(json.loads(resp.read()))
        except (OSError, ValueError) as exc:  # the replicas answered already; the balancer is extra
            if time.monotonic() > deadline:
                return f"the load balancer did not answer: {exc}"
        time.sleep(0.25)


def run(state_dir: str) -> int:
    """Run the demo; returns 0 when every step worked and nothing is left running."""
    started = time.monotonic()
    controller, provisioner, prober, balancer, balancer_http = _free_ports(5)
    env = {
        **os.environ,
        "REPLICAPLANE_CONTROLLER_LISTEN_ADDR": f"127.0.0.1:{controller}",
        "REPLICAPLANE_PROVISIONER_LISTEN_ADDR": f"127.0.0.1:{provisioner}",
        "REPLICAPLANE_PROBER_LISTEN_ADDR": f"127.0.0.1:{prober}",
        "REPLICAPLANE_LOADBALANCER_LISTEN_ADDR": f"127.0.0.1:{balancer}",
        "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": f"127.0.0.1:{balancer_http}",
    }
    addr = f"127.0.0.1:{controller}"
    _step(f"starting the local stack (controller at {addr}, state in {state_dir})")
    if _stack(["up", "--detach", "--state-dir", state_dir], env, timeout=180) != 0:
        print("demo failed: the stack did not start", file=sys.stderr)
        return 1
    rc = 1
    try:
        _step("replicactl up examples/hello/service.yaml --wait")
        code = cli.run(["--controller", addr, "up", EXAMPLE, "--wait", "--timeout", "120"])
        if code != cli.OK:
            return code
        _step("replicactl status")
        cli.run(["--controller", addr, "status"])
        with grpc.insecure_channel(addr) as channel:
            svc = (
                pb_grpc.ControllerServiceStub(channel)
                .GetService(pb.GetServiceRequest(service_name="hello"), timeout=10)
                .service
            )
        url = sorted(svc.endpoints, key=lambda e: e.replica_id)[0].url + "/"
        _step(f"one request: GET {url}")
        with urllib.request.urlopen(url, timeout=10) as resp:
            print(json.dumps(json.loads(resp.read())), flush=True)
        balanced = f"http://127.0.0.1:{balancer_http}/"
        _step(f"and one through the stack's load balancer: GET {balanced}")
        print(_through_balancer(balanced), flush=True)
        rc = 0
    except (OSError, grpc.RpcError, IndexError) as exc:
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

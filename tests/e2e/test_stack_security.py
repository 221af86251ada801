"""The local stack is safe on a shared host: another local user (uid 65534 here) can neither
create a service through the controller nor launch anything through the provisioner, call the
probers or the balancer's admin API, nor read the stack's token, whether or not the user set a
controller token of their own."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health
from grpc_health.v1 import health_pb2_grpc as health_grpc

from tests.e2e import test_stack

pytestmark = pytest.mark.e2e

NOBODY = 65534

# Run as the other user: every attempt an attacker on the host could make, each reported as
# "ok" (it worked) or the error it got. A command that ran would create MARKER.
ATTACK = r"""
import json, sys
import grpc
from replicaplane.controller.v1 import controller_service_pb2 as ctl, controller_service_pb2_grpc as ctl_grpc
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov, provisioner_service_pb2_grpc as prov_grpc
from replicaplane.prober.v1 import prober_service_pb2 as probe, prober_service_pb2_grpc as probe_grpc
from replicaplane.loadbalancer.v1 import loadbalancer_service_pb2 as lb, loadbalancer_service_pb2_grpc as lb_grpc
from services.common import spec as specs

targets, marker, token_file = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
yaml = f"service:\n  readiness_probe: /\n  replicas: 1\nresources:\n  ports: 8080\nrun: touch {marker}; sleep 60\n"
out = {}

def attempt(name, call):
    try:
        call()
        out[name] = "ok"
    except grpc.RpcError as exc:
        out[name] = exc.code().name
    except Exception as exc:
        out[name] = type(exc).__name__

def create():
    with grpc.insecure_channel(targets["controller"]) as ch:
        ctl_grpc.ControllerServiceStub(ch).CreateService(
            ctl.CreateServiceRequest(service_name="pwned", yaml=yaml), timeout=10)

def launch():
    with grpc.insecure_channel(targets["provisioner"]) as ch:
        request = prov.LaunchRequest(name="pwned-1", service="pwned", replica_id=1, version=1, spec=specs.parse(yaml))
        for _ in prov_grpc.ProvisionerServiceStub(ch).Launch(request, timeout=10):
            pass

def probe_once():
    with grpc.insecure_channel(targets["prober"]) as ch:
        target = probe.ProbeTarget(target_id="x", url="http://127.0.0.1:9", path="/")
        request = probe.ProbeRequest(upsert_targets=[target])
        for _ in probe_grpc.ProberServiceStub(ch).Probe(iter([request]), timeout=10):
            break

def balancer():
    with grpc.insecure_channel(targets["loadbalancer"]) as ch:
        lb_grpc.LoadBalancerServiceStub(ch).GetBalancer(lb.GetBalancerRequest(), timeout=10)

def read_token():
    with open(token_file) as fh:
        fh.read()

attempt("controller", create)
attempt("provisioner", launch)
attempt("prober", probe_once)
attempt("loadbalancer", balancer)
attempt("token", read_token)
print(json.dumps(out))
"""


GRPCURL = os.path.join(test_stack.REPO, ".venv", "bin", "grpcurl")


def internal_commands() -> list[str]:
    """docs/grpcurl.md's commands for the internal services' sockets."""
    with open(os.path.join(test_stack.REPO, "docs", "grpcurl.md"), encoding="utf-8") as fh:
        text = fh.read()
    block = re.search(r"for the controller and for operators:\s*```bash\n(.*?)```", text, re.S)
    assert block, "docs/grpcurl.md lost its internal services block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def public_env(**extra: str) -> dict[str, str]:
    """The default stack, with its public ports (the API, the balancer's and the dashboard's
    HTTP) on port 0 so other tests on this machine cannot clash; nothing else is set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLICAPLANE_")}
    return {
        **env,
        "REPLICAPLANE_CONTROLLER_LISTEN_ADDR": "127.0.0.1:0",
        "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": "127.0.0.1:0",
        "REPLICAPLANE_DASHBOARD_HTTP_ADDR": "127.0.0.1:0",
        **extra,
    }


def as_nobody(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([test_stack.REPO, os.path.join(test_stack.REPO, "gen", "python")])
    return subprocess.run(
        [
            "setpriv",
            "--reuid",
            str(NOBODY),
            "--regid",
            str(NOBODY),
            "--clear-groups",
            sys.executable,
            "-c",
            script,
            *args,
        ],
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": path, "HOME": "/"},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def state_dir():
    # pytest's tmp_path sits under a directory only root may enter, which would hide the stack
    # from the other user by accident: this one is world-readable, like a shared checkout.
    top = pathlib.Path(tempfile.mkdtemp(prefix="rp-shared-"))
    os.chmod(top, 0o755)
    state = top / ".state"  # as under `make up`, so the documented commands run from `top`
    yield state
    if (state / "stack.json").exists() or (state / "stack.pid").exists():
        test_stack.stack("down", "--state-dir", str(state), env=dict(os.environ), timeout=200)
    shutil.rmtree(top, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
@pytest.mark.parametrize("own_token", [False, True], ids=["default", "controller-token-set"])
def test_another_local_user_cannot_run_commands_through_the_stack(state_dir, own_token) -> None:
    extra = {"REPLICAPLANE_CONTROLLER_AUTH_TOKEN": f"tok-{uuid.uuid4().hex}"} if own_token else {}
    env = public_env(**extra)
    up = test_stack.stack("up", "--detach", "--state-dir", str(state_dir), env=env, timeout=180)
    assert up.returncode == 0, f"{up.stdout}{up.stderr}\n{test_stack.logs(state_dir)}"
    try:
        state = json.loads((state_dir / "stack.json").read_text())
        addrs = {p["name"].split("-")[0]: p["addr"] for p in state["processes"]}
        targets = {
            "controller": state["controller"],
            **{name: addrs[name] for name in ("provisioner", "prober", "loadbalancer")},
        }
        marker = state_dir.parent / "pwned"
        token_file = str(state_dir / "api-token")
        attack = as_nobody(ATTACK, json.dumps(targets), str(marker), token_file)
        assert attack.returncode == 0, attack.stderr
        got = json.loads(attack.stdout)
        assert got["controller"] == "UNAUTHENTICATED", got
        for name in ("provisioner", "prober", "loadbalancer"):
            assert got[name] in ("UNAVAILABLE", "UNAUTHENTICATED", "PERMISSION_DENIED"), (name, got, targets)
        assert got["token"] in ("PermissionError", "FileNotFoundError"), got
        assert not marker.exists(), "a command ran for another user"
        mode = os.stat(state_dir).st_mode & 0o777
        assert mode == 0o700, oct(mode)
        if not own_token:
            # The stack's own user reaches the internal services as docs/grpcurl.md shows.
            for command in internal_commands():
                done = subprocess.run(
                    ["bash", "-c", command.replace(".venv/bin/grpcurl", GRPCURL)],
                    cwd=state_dir.parent,
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=False,
                )
                assert done.returncode == 0, f"{command}\n{done.stderr}"
    finally:
        down = test_stack.stack("down", "--state-dir", str(state_dir), env=env, timeout=200)
    assert down.returncode == 0, f"{down.stdout}{down.stderr}\n{test_stack.logs(state_dir)}"


class _Recorder(grpc.ServerInterceptor):
    """Records whether any call carried an authorization header (never the value)."""

    def __init__(self) -> None:
        self.methods_with_token: list[str] = []

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        if any(k == "authorization" for k, _ in handler_call_details.invocation_metadata or ()):
            self.methods_with_token.append(handler_call_details.method)
        return continuation(handler_call_details)


def test_a_process_holding_the_controllers_port_first_gets_no_token(state_dir) -> None:
    # Another local user's server took the controller's port before the stack started, and
    # answers health checks SERVING for everything, hoping for the tokens clients send.
    recorder = _Recorder()
    squatter = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), interceptors=[recorder], options=[("grpc.so_reuseport", 0)]
    )
    health_grpc.add_HealthServicer_to_server(health.HealthServicer(), squatter)
    port = squatter.add_insecure_port("127.0.0.1:0")
    squatter.start()
    try:
        env = public_env(REPLICAPLANE_CONTROLLER_LISTEN_ADDR=f"127.0.0.1:{port}")
        up = test_stack.stack("up", "--detach", "--state-dir", str(state_dir), env=env, timeout=180)
        assert up.returncode == 1, f"{up.stdout}{up.stderr}"
        log = test_stack.logs(state_dir)
        # The stack finds the port taken before it starts anything, and says so.
        assert f"127.0.0.1:{port} (REPLICAPLANE_CONTROLLER_LISTEN_ADDR, controller gRPC) is in use" in up.stdout, (
            up.stdout
        )
        # The balancer and the dashboard never started, so nothing sent the squatter a token.
        assert recorder.methods_with_token == []
        assert not (state_dir / "logs" / "loadbalancer.log").exists(), log
    finally:
        squatter.stop(None)

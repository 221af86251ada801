"""SkyPilot's own serve YAMLs, unchanged, run the way their comments say (`sky serve up` becomes
`replicactl up`) from a SkyPilot-like folder layout: each reaches READY, or is refused with a
message that says how to run it here.

The YAMLs are copies (tests/fixtures/skypilot/README.md says from where); the Python apps they
run are stand-ins written for these tests. Every fixture runs at once on one stack, as a user
trying the examples one after another would leave them running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import sys
import time
import urllib.request

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.helpers import cluster as cl
from tests.helpers import procs

pytestmark = pytest.mark.e2e

FIXTURES = os.path.join(procs.REPO, "tests", "fixtures", "skypilot")
READY, NO_REPLICA, REFUSED = "READY", "NO_REPLICA", "REFUSED"


@dataclasses.dataclass(frozen=True)
class Fixture:
    """One YAML, the command to run it, and what must happen.

    Attributes:
        path: relative to the fixtures root, which is the current directory of the command.
        name: `-n` as the YAML's usage comment gives it, else one like SkyPilot's smoke tests pass.
        flags: more flags its comments ask for (`--secret KEY` for an empty secret).
        expect: READY, NO_REPLICA (accepted, scaled to zero) or REFUSED (exit code 2).
        says: for REFUSED, what the one-line error must contain: the field, and how to run it here.
        why: why this is the fair expectation on the local backend.
    """

    path: str
    name: str
    expect: str
    says: tuple[str, ...] = ()
    why: str = ""
    flags: tuple[str, ...] = ()


FIXTURE_TABLE = [
    Fixture("examples/serve/http_server/task.yaml", "http", READY, why="stdlib app, workdir relative to the root"),
    Fixture("examples/serve/minimal.yaml", "minimal", READY, why="python3 -m http.server, no workdir"),
    Fixture(
        "examples/serve/min_replicas_zero.yaml",
        "min-zero",
        NO_REPLICA,
        why="min_replicas 0: no replica until requests arrive",
    ),
    Fixture(
        "examples/serve/load_balancing_policies_example.yaml",
        "load_balancing_policy_test",
        REFUSED,
        says=("service_name", "lowercase letters, digits and '-'"),
        why="service names are DNS labels here (they name Pods and replicas); the error says which names work",
    ),
    Fixture(
        "examples/serve/authentication/task.yaml",
        "auth",
        READY,
        why="setup pip-installs fastapi and uvicorn into the version's venv",
    ),
    Fixture("examples/serve/misc/cancel/service.yaml", "cancel", READY, why="stdlib app on port 9000"),
    Fixture(
        "examples/serve/vllm.yaml",
        "vllm",
        REFUSED,
        says=("resources.accelerators", "REPLICAPLANE_PROVISIONER_LOCAL_ACCELERATORS=A100:1", "local_accelerators"),
        why="needs an A100 and conda: the local backend has no GPU unless local_accelerators pretends one",
    ),
    Fixture(
        "examples/serve/tgi_coder.yaml",
        "tgi",
        REFUSED,
        says=("resources.accelerators", "REPLICAPLANE_PROVISIONER_LOCAL_ACCELERATORS=A100:1"),
        why="needs an A100 and docker",
    ),
    Fixture(
        "examples/serve/spot_policy/spot_only.yaml",
        "spot-only",
        REFUSED,
        says=("resources.any_of[0].zone", "REPLICAPLANE_PROVISIONER_ZONES=us-central1-a:1.00"),
        why="asks for GCP zones; the local backend simulates the zones its `zones` setting names",
    ),
    Fixture(
        "examples/serve/spot_policy/base_on_demand_fallback_replicas.yaml",
        "spot-fallback",
        REFUSED,
        says=("service.replica_policy.max_replicas", "required when target_qps_per_replica is set"),
        why="SkyPilot's own validation refuses it too: target_qps_per_replica needs max_replicas",
    ),
    Fixture(
        "examples/serve/multi_node/multi_node.yaml",
        "multi-node",
        REFUSED,
        says=("num_nodes", "only 1 node per replica"),
        why="two nodes per replica, each with two A100s: not runnable on one machine",
    ),
    Fixture(
        "tests/skyserve/http/kubernetes.yaml", "http-k8s", READY, why="cloud: kubernetes is recorded, not enforced"
    ),
    Fixture("tests/skyserve/auto_restart.yaml", "auto-restart", READY, why="cloud: gcp is recorded, not enforced"),
    Fixture("tests/skyserve/update/new_autoscaler_before.yaml", "update-before", READY, why="stdlib app on 8081"),
    Fixture("tests/skyserve/update/old.yaml", "update-old", READY, why="stdlib app"),
    Fixture("tests/skyserve/readiness_timeout/task.yaml", "readiness", READY, why="pip setup, a slow /health"),
    Fixture("tests/skyserve/streaming/streaming.yaml", "streaming", READY, why="pip setup; runs `python`, not python3"),
    Fixture("tests/skyserve/failures/probing.yaml", "probing", READY, why="serves 20 requests, then exits"),
    Fixture(
        "tests/skyserve/llm/service.yaml",
        "llm",
        REFUSED,
        says=("resources.accelerators", "REPLICAPLANE_PROVISIONER_LOCAL_ACCELERATORS=L4:1"),
        why="its empty secret is filled with --secret as its comment says; then it needs an L4 and vllm",
        flags=("--secret", "AUTH_TOKEN"),
    ),
    Fixture(
        "tests/skyserve/spot/dynamic_ondemand_fallback.yaml",
        "spot-dynamic",
        REFUSED,
        says=("resources.zone", "REPLICAPLANE_PROVISIONER_ZONES=us-central1-a:1.00"),
        why="asks for a GCP zone",
    ),
]


def replicactl(addr: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", "--controller", addr, *args]


async def run_in_fixtures(argv: list[str]) -> tuple[int, str, str]:
    """Run a command from the fixtures root, as `sky serve up examples/...` is run from SkyPilot's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLICAPLANE_")}
    env["AUTH_TOKEN"] = "a-random-test-token"  # what `--secret AUTH_TOKEN` reads
    env["PYTHONPATH"] = os.pathsep.join([procs.REPO, os.path.join(procs.REPO, "gen", "python")])
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=FIXTURES, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def wait_statuses(c: cl.Cluster, wanted: dict[str, int], timeout: float) -> dict[str, res.Service]:
    """Services by name once each has its wanted status (bounded), else fail naming the laggards."""
    deadline = time.monotonic() + timeout
    while True:
        services = {s.name: s for s in (await c.stub.ListServices(api.ListServicesRequest(), timeout=10)).services}
        late = {n: res.ServiceStatus.Name(services[n].status) for n in wanted if services[n].status != wanted[n]}
        if not late:
            return services
        if time.monotonic() > deadline:
            details = [await _why(c, name) for name in late]
            pytest.fail(f"not there after {timeout:.0f} s: {late}; {details}")
        await asyncio.sleep(0.5)


async def _why(c: cl.Cluster, name: str) -> str:
    replicas = (await c.stub.ListReplicas(api.ListReplicasRequest(service_name=name), timeout=10)).replicas
    return f"{name}: " + "; ".join(f"{r.replica_id} {res.ReplicaStatus.Name(r.status)} {r.message}" for r in replicas)


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.read()


async def test_skypilot_serve_yamls_run_unchanged_or_say_how_to_run_them_here(tmp_path) -> None:
    c = cl.Cluster(str(tmp_path))
    try:
        addr = c.controller.addr
        results = await asyncio.gather(
            *(run_in_fixtures(replicactl(addr, "up", "-n", f.name, *f.flags, f.path)) for f in FIXTURE_TABLE)
        )
        wanted = {}
        for fixture, (code, out, err) in zip(FIXTURE_TABLE, results, strict=True):
            if fixture.expect == REFUSED:
                assert code == 2, f"{fixture.path}: {fixture.why}; got {code}: {out}{err}"
                assert err.count("\n") == 1, err  # one line
                for text in fixture.says:
                    assert text in err, f"{fixture.path}: {text!r} not in {err!r}"
            else:
                assert code == 0, f"{fixture.path}: {out}{err}"
                assert f"{fixture.name}: created (version 1)" in out
                wanted[fixture.name] = getattr(res, f"SERVICE_STATUS_{fixture.expect}")
        services = await wait_statuses(c, wanted, timeout=150)

        # The replicas answer as the examples say they do.
        http = services["http"]
        assert len(http.endpoints) == 2
        status, body = await asyncio.to_thread(get, http.endpoints[0].url + "/")
        assert status == 200 and b"http_server stand-in" in body
        status, body = await asyncio.to_thread(get, services["streaming"].endpoints[0].url + "/")
        assert body.split() == b"a replica streams its answer one word at a time".split()
        assert not services["min-zero"].endpoints
    finally:
        await c.close()


async def test_following_a_refusal_hint_runs_the_yaml_here(tmp_path) -> None:
    # Step 1: a stack as it comes refuses the spot example, naming the setting and a value.
    fixture = "examples/serve/spot_policy/spot_only.yaml"
    c = cl.Cluster(str(tmp_path / "first"))
    try:
        code, _, err = await run_in_fixtures(replicactl(c.controller.addr, "up", "-n", "spot", fixture))
    finally:
        await c.close()
    assert code == 2
    zones = re.findall(r"REPLICAPLANE_PROVISIONER_ZONES=([\w.-]+:[\d.]+)", err)
    assert sorted(zones) == ["us-central1-a:1.00", "us-east1-a:1.00"]

    # Step 2: a stack started the way the hints say runs it unchanged.
    c = cl.Cluster(str(tmp_path / "second"), provisioner_env={"REPLICAPLANE_PROVISIONER_ZONES": ",".join(zones)})
    try:
        code, out, err = await run_in_fixtures(replicactl(c.controller.addr, "up", "-n", "spot", fixture))
        assert code == 0, out + err
        services = await wait_statuses(c, {"spot": res.SERVICE_STATUS_READY}, timeout=90)
        assert services["spot"].ready_replicas == 1
        replicas = (await c.stub.ListReplicas(api.ListReplicasRequest(service_name="spot"), timeout=10)).replicas
        assert {r.zone for r in replicas} <= {"us-central1-a", "us-east1-a"}
    finally:
        with pytest.raises(grpc.aio.AioRpcError):  # nothing else was created
            await c.stub.GetService(api.GetServiceRequest(service_name="other"), timeout=5)
        await c.close()

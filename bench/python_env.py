"""Cost of giving local replicas a Python venv per service version.

Measures, with the local backend of an in-process provisioner on loopback:

- venv_create_ms: making one venv (`venv` module, no pip of its own, system site-packages
  visible), median over 20; venv_disk_kb: what one takes on disk.
- launch_running_p50_ms with venvs on and off: Launch to RUNNING of 20 replicas, each of its own
  service (so each makes a venv), one at a time, for a spec without setup.
- setup_first_ms / setup_shared_ms: a version of 3 replicas whose setup pip-installs a small
  local wheel (offline): the first replica's setup installs it, the two others (side by side,
  once the first succeeded) find it there. `--packages "fastapi uvicorn"` installs those from
  the configured package index instead.

Run from the repo root: `python bench/python_env.py [--packages "..."]`. Ends with `figure:` lines.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "gen", "python")]

import grpc  # noqa: E402

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb  # noqa: E402
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc  # noqa: E402
from services.provisioner import pyenvs, server  # noqa: E402
from tests.helpers import provisioner_client as client  # noqa: E402
from tests.helpers import provisioner_procs, wheels  # noqa: E402

LAUNCHES = 20


def disk_kb(path: str) -> float:
    total = 0
    for here, _, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(here, name)).st_blocks * 512
    return total / 1024


async def venv_cost(root: str) -> tuple[float, float]:
    envs = pyenvs.PythonEnvs(os.path.join(root, "envs"))
    times = []
    for i in range(20):
        started = time.perf_counter()
        env = await envs.acquire(f"bench-v{i}", lambda _line: None)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), disk_kb(env.path)


async def launches(state_dir: str, *, venv: bool, install: str) -> dict[str, float]:
    srv = await server.build_server(
        server.Settings(listen_addr="127.0.0.1:0", state_dir=state_dir, local_venv=venv)  # type: ignore[call-arg]
    )
    await srv.start()
    out: dict[str, float] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = pb_grpc.ProvisionerServiceStub(channel)
            times = []
            for i in range(LAUNCHES):
                started = time.perf_counter()
                events = await client.collect(stub.Launch(client.launch_request(1, f"bench{i}")), timeout=60)
                assert events[-1].type == client.L.LAUNCH_EVENT_TYPE_RUNNING, events[-1]
                times.append((time.perf_counter() - started) * 1000)
                await client.collect(stub.Terminate(pb.TerminateRequest(name=f"bench{i}-1")))
            out["launch_running_p50_ms"] = statistics.median(times)
            if venv:
                spec = client.spec(setup=f"pip install --quiet {install}")
                done: dict[int, float] = {}

                async def one(replica_id: int) -> None:
                    started = time.perf_counter()
                    request = client.launch_request(replica_id, "shared", spec_=spec)
                    events = await client.collect(stub.Launch(request), timeout=120)
                    assert events[-1].type == client.L.LAUNCH_EVENT_TYPE_RUNNING, events[-1]
                    done[replica_id] = (time.perf_counter() - started) * 1000

                await one(1)
                await asyncio.gather(one(2), one(3))
                out["setup_first_ms"] = done[1]
                out["setup_shared_ms"] = max(done[2], done[3])
                for i in (1, 2, 3):
                    await client.collect(stub.Terminate(pb.TerminateRequest(name=f"shared-{i}")))
    finally:
        await srv.stop(None)
        provisioner_procs.kill_replicas(state_dir)
    return out


async def main(packages: str) -> None:
    with tempfile.TemporaryDirectory(prefix="rp-bench-venv-") as tmp:
        create_ms, size_kb = await venv_cost(tmp)
        install = packages or f"--no-index {wheels.make_wheel(tmp)}"
        on = await launches(os.path.join(tmp, "on"), venv=True, install=install)
        off = await launches(os.path.join(tmp, "off"), venv=False, install=install)
    print(f"figure: venv_create_ms {create_ms:.1f}")
    print(f"figure: venv_disk_kb {size_kb:.0f}")
    print(f"figure: launch_running_p50_ms_venv {on['launch_running_p50_ms']:.0f}")
    print(f"figure: launch_running_p50_ms_no_venv {off['launch_running_p50_ms']:.0f}")
    print(f"figure: setup_first_ms {on['setup_first_ms']:.0f}")
    print(f"figure: setup_shared_ms {on['setup_shared_ms']:.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packages", default="", help="what setup installs (default: a small local wheel)")
    asyncio.run(main(parser.parse_args().packages))

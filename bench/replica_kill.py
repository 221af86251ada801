"""Kill benchmark: a replica or pool worker killed from outside (SIGKILL to its process group),
until its replacement is launched and READY, with the three real services (local backend).

- worker_kill_to_launch_ms / worker_kill_to_ready_ms: a READY worker of a pool (`workers: 1`,
  default failure window) is killed -> the replacement's launch accepted by the provisioner (its
  create time) / the replacement READY in a WatchService stream.
- replica_kill_to_launch_ms / replica_kill_to_ready_ms: the same for a READY replica of a service
  (`replicas: 1`, the spec's default probe interval and failure window).

Each figure is the median of the samples. The kill takes the whole process group (the app and
the provisioner's wrapper), so nothing is left to write an exit code: the provisioner sees the
group end and reports the replica vanished.

Run from the repo root: `python bench/replica_kill.py`. Prints `figure:` lines. BENCH_SMOKE=1 (or
--smoke) takes one sample of each.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
sys.path.insert(1, os.path.join(sys.path[0], "gen", "python"))

from replicaplane.controller.v1 import controller_service_pb2 as api  # noqa: E402
from replicaplane.controller.v1 import resources_pb2 as res  # noqa: E402
from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb  # noqa: E402
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc  # noqa: E402
from services.common import clients  # noqa: E402
from tests.helpers import bench  # noqa: E402
from tests.helpers import cluster as cl  # noqa: E402

SAMPLES = bench.pick(5, 1)
TIMEOUT_S = float(os.environ.get("BENCH_KILL_TIMEOUT_S", "60"))
"""How long one sample may wait for its replacement to be READY."""


def worker_yaml(name: str) -> str:
    return f"name: {name}\npool:\n  workers: 1\nsetup: echo ready\n"


def replica_yaml(name: str, tag: str) -> str:
    # The spec's defaults for the probe interval and the failure window: the kill, not a probe,
    # must be what replaces the replica.
    return cl.app_yaml(name, tag, replicas=1, probe="    path: /health\n    initial_delay_seconds: 20\n")


async def created_at(prov: prov_grpc.ProvisionerServiceStub, name: str) -> float:
    """The provisioner's create time of replica `name` (its launch accepted)."""
    async with asyncio.timeout(10):
        while True:
            try:
                got = await prov.GetReplica(prov_pb.GetReplicaRequest(name=name), timeout=5)
                return got.replica.create_time.seconds + got.replica.create_time.nanos / 1e9
            except Exception:  # not at the provisioner yet
                await asyncio.sleep(0.01)


async def sample(
    c: cl.Cluster, prov: prov_grpc.ProvisionerServiceStub, name: str, yaml_text: str
) -> tuple[float, float]:
    """Kill the one READY replica of a new service or pool: ms to the replacement's launch, to READY."""
    await c.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text))
    w = cl.Watch(c.stub, name)
    await w.until(lambda w: w.count(res.REPLICA_STATUS_READY) == 1, timeout=60)
    victim = next(r for r in w.replicas.values() if r.status == res.REPLICA_STATUS_READY)
    pgid = c.replica_pgid(victim.replica_name)
    t0 = time.time()
    os.killpg(pgid, signal.SIGKILL)

    def replaced(w: cl.Watch) -> bool:
        return any(i != victim.replica_id and r.status == res.REPLICA_STATUS_READY for i, r in w.replicas.items())

    await w.until(replaced, timeout=TIMEOUT_S)
    ready = time.time()
    new = next(r for i, r in w.replicas.items() if i != victim.replica_id and r.status == res.REPLICA_STATUS_READY)
    w.cancel()
    launched = await created_at(prov, new.replica_name)
    await c.stub.DeleteService(api.DeleteServiceRequest(service_name=name))
    return (launched - t0) * 1000, (ready - t0) * 1000


async def main() -> None:
    bench.announce()
    with tempfile.TemporaryDirectory(prefix="bench-kill-") as tmp:
        c = cl.Cluster(tmp)
        try:
            prov = prov_grpc.ProvisionerServiceStub(clients.channel(c.provisioner.addr))
            workers = [await sample(c, prov, f"pool{i}", worker_yaml(f"pool{i}")) for i in range(SAMPLES)]
            replicas = [await sample(c, prov, f"svc{i}", replica_yaml(f"svc{i}", c.tag)) for i in range(SAMPLES)]
        finally:
            await c.close()
    for kind, got in (("worker", workers), ("replica", replicas)):
        print(f"figure: {kind}_kill_to_launch_ms {statistics.median(g[0] for g in got):.2f} ms")
        print(f"figure: {kind}_kill_to_ready_ms {statistics.median(g[1] for g in got):.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())

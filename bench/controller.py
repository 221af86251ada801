"""Controller latency benchmark: dispatch (create -> launch at the provisioner) and readiness
(app answers -> READY seen in a watch), with the three real services and real replicas.

Run from the repo root: `python bench/controller.py`. Prints `figure:` lines. BENCH_SMOKE=1 (or
--smoke) runs 2 rounds of 2 replicas and 3 dispatch samples.
"""

from __future__ import annotations

import asyncio
import os
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

ROUNDS = bench.pick(10, 2)
REPLICAS = bench.pick(5, 2)
DISPATCH_SAMPLES = bench.pick(50, 3)


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def launch_started_ms(prov: prov_grpc.ProvisionerServiceStub, name: str, t0: float) -> float:
    """Milliseconds from t0 to the provisioner accepting the launch of `name`."""
    got = await prov.GetReplica(prov_pb.GetReplicaRequest(name=name))
    created = got.replica.create_time.seconds + got.replica.create_time.nanos / 1e9
    return (created - t0) * 1000


def read_time(path: str) -> float:
    """The time an app wrote to its ready file."""
    with open(path, encoding="utf-8") as fh:
        return float(fh.read())


async def main() -> None:
    bench.announce()
    tmp = tempfile.mkdtemp(prefix="rp-bench-ctl-")
    c = cl.Cluster(tmp)
    prov = prov_grpc.ProvisionerServiceStub(clients.channel(c.provisioner.addr))
    dispatch_ms: list[float] = []
    burst_ms: list[float] = []
    ready_ms: list[float] = []
    try:
        for i in range(ROUNDS):
            name = f"bench{i}"
            ready_dir = os.path.join(tmp, name)
            os.makedirs(ready_dir)
            yaml_text = cl.app_yaml(
                name,
                c.tag,
                replicas=REPLICAS,
                app_args=f"--ready-file {ready_dir}/$REPLICA_ID",
            )
            seen_ready: dict[int, float] = {}
            t0 = time.time()
            await c.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text))
            w = cl.Watch(c.stub, name)

            def track(w: cl.Watch, seen: dict[int, float] = seen_ready) -> bool:
                now = time.time()
                for rid, r in w.replicas.items():
                    if r.status == res.REPLICA_STATUS_READY and rid not in seen:
                        seen[rid] = now
                return len(seen) == REPLICAS

            await w.until(track, timeout=60)
            for rid, seen_at in seen_ready.items():
                answered_at = read_time(os.path.join(ready_dir, str(rid)))
                ready_ms.append((seen_at - answered_at) * 1000)
                burst_ms.append(await launch_started_ms(prov, w.replicas[rid].replica_name, t0))
            await c.stub.DeleteService(api.DeleteServiceRequest(service_name=name))
            await w.until(lambda w: w.deleted, timeout=30)
        # Dispatch alone: one replica per create, an app that costs no CPU to start, so the
        # figure is the controller's path and not the machine starting other replicas.
        for i in range(DISPATCH_SAMPLES):
            name = f"dispatch{i}"
            yaml_text = cl.app_yaml(name, c.tag, replicas=1, run="sleep 60")
            t0 = time.time()
            await c.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text))
            w = cl.Watch(c.stub, name)
            await w.until(lambda w: w.count(res.REPLICA_STATUS_STARTING) == 1)
            dispatch_ms.append(await launch_started_ms(prov, w.replicas[1].replica_name, t0))
            await c.stub.DeleteService(api.DeleteServiceRequest(service_name=name))
            await w.until(lambda w: w.deleted, timeout=30)
    finally:
        await c.close()
    print(f"samples: {len(ready_ms)} replicas over {ROUNDS} services")
    print(f"ready_in_watch mean {statistics.mean(ready_ms):.1f} ms, max {max(ready_ms):.1f} ms")
    print(f"figure: ready_in_watch_p50_ms {pct(ready_ms, 50):.1f} ms")
    print(f"figure: ready_in_watch_p99_ms {pct(ready_ms, 99):.1f} ms")
    print(f"figure: dispatch_p50_ms {pct(dispatch_ms, 50):.1f} ms")
    print(f"figure: dispatch_p99_ms {pct(dispatch_ms, 99):.1f} ms")
    print(f"figure: dispatch_burst5_p50_ms {pct(burst_ms, 50):.1f} ms")
    print(f"figure: dispatch_burst5_p99_ms {pct(burst_ms, 99):.1f} ms")


if __name__ == "__main__":
    asyncio.run(main())

"""Micro benchmark of the controller store: replica writes per second and listing 1000 replicas.

Run: .venv/bin/python bench/store.py [--puts N] [--smoke]
Prints `figure: <name> <value> <unit>` lines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "gen", "python")]

from replicaplane.common.v1 import spec_pb2  # noqa: E402
from replicaplane.controller.v1 import resources_pb2  # noqa: E402
from services.controller import store as store_mod  # noqa: E402
from tests.helpers import bench  # noqa: E402


def _replica(service: str, replica_id: int) -> resources_pb2.Replica:
    replica = resources_pb2.Replica(
        service=service,
        replica_id=replica_id,
        replica_name=f"{service}-{replica_id}",
        version=1,
        status=resources_pb2.REPLICA_STATUS_READY,
        endpoint=f"http://127.0.0.1:{20000 + replica_id % 40000}",
        zone="local-a",
    )
    replica.facts.launch_phase = resources_pb2.LAUNCH_PHASE_SUCCEEDED
    replica.facts.ready_now = True
    replica.facts.first_ready_time.FromSeconds(1_700_000_000)
    replica.create_time.FromSeconds(1_700_000_000)
    return replica


def put_rate(directory: str, puts: int, synchronous: str) -> float:
    """Replica upserts per second, each its own transaction (as the reconciler writes)."""
    with store_mod.Store(os.path.join(directory, f"put-{synchronous}.db"), synchronous=synchronous) as store:
        store.create_service("bench", spec_pb2.ServiceSpec(run="true"), now=0.0)
        replicas = [_replica("bench", i % 50 + 1) for i in range(puts)]
        start = time.perf_counter()
        for replica in replicas:
            store.put_replica(replica)
        return puts / (time.perf_counter() - start)


def list_ms(directory: str, count: int = 1000, runs: int = 20) -> float:
    """Median milliseconds of list_replicas over `count` stored replicas."""
    with store_mod.Store(os.path.join(directory, "list.db")) as store:
        store.create_service("bench", spec_pb2.ServiceSpec(run="true"), now=0.0)
        store.put_replicas(_replica("bench", i) for i in range(1, count + 1))
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            assert len(store.list_replicas("bench")) == count
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)


def main() -> None:
    """Run the benchmarks in a temporary directory and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--puts", type=int, default=bench.pick(3000, 200), help="replica upserts to time")
    parser.add_argument("--smoke", action="store_true", help="200 upserts, to check the bench runs (BENCH_SMOKE=1)")
    args = parser.parse_args()
    bench.announce()
    with tempfile.TemporaryDirectory(prefix="rp-bench-store-") as directory:
        print(f"figure: store_put_replica_per_s {put_rate(directory, args.puts, 'NORMAL'):.0f} ops/s")
        full = put_rate(directory, max(args.puts // 5, 100), "FULL")
        print(f"figure: store_put_replica_full_sync_per_s {full:.0f} ops/s")
        print(f"figure: store_list_replicas_1000_ms {list_ms(directory):.2f} ms")


if __name__ == "__main__":
    main()

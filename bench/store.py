"""Micro benchmark of the controller store: replica writes per second with `synchronous=FULL`
(the default: every commit fsynced) and NORMAL (no fsync per commit), a reconcile-pass-sized
transaction, and listing 1000 replicas.

Run: .venv/bin/python bench/store.py [--puts N] [--rounds R] [--smoke]
Prints `figure: <name> <value> <unit>` lines. FULL and NORMAL are measured in alternating rounds
on the same disk, and each figure is the median of its rounds, so machine load hits both alike.
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


def put_rate(directory: str, puts: int, synchronous: str, *, batch: int = 1) -> float:
    """Replica upserts per second: `batch` upserts per transaction (1: each its own, as a
    single change; 4: three replicas and the autoscaler state, as a reconcile pass writes)."""
    path = os.path.join(directory, f"put-{synchronous}-{batch}-{time.monotonic_ns()}.db")
    with store_mod.Store(path, synchronous=synchronous) as store:
        store.create_service("bench", spec_pb2.ServiceSpec(run="true"), now=0.0)
        replicas = [_replica("bench", i % 50 + 1) for i in range(puts)]
        start = time.perf_counter()
        for i in range(0, puts, batch):
            with store.transaction():
                store.put_replicas(replicas[i : i + batch - 1] if batch > 1 else replicas[i : i + 1])
                if batch > 1:
                    store.put_autoscaler_state("bench", b'{"target": 3}')
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
    """Run the benchmarks in a temporary directory (under the working directory, so on the
    disk a controller's state dir would be on, not a tmpfs) and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--puts", type=int, default=bench.pick(2000, 200), help="replica upserts per round")
    parser.add_argument("--rounds", type=int, default=bench.pick(3, 1), help="alternating FULL/NORMAL rounds")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the bench runs (BENCH_SMOKE=1)")
    args = parser.parse_args()
    bench.announce()
    base = os.environ.get("REPLICAPLANE_BENCH_DIR") or os.getcwd()
    with tempfile.TemporaryDirectory(prefix="rp-bench-store-", dir=base) as directory:
        rates: dict[tuple[str, int], list[float]] = {}
        for _ in range(max(1, args.rounds)):
            for sync in ("FULL", "NORMAL"):
                for batch in (1, 4):
                    rates.setdefault((sync, batch), []).append(put_rate(directory, args.puts, sync, batch=batch))
        med = {key: statistics.median(values) for key, values in rates.items()}
        full, normal = med[("FULL", 1)], med[("NORMAL", 1)]
        print(f"figure: store_put_replica_per_s_full {full:.0f} ops/s")
        print(f"figure: store_put_replica_per_s_normal {normal:.0f} ops/s")
        print(f"figure: store_commit_ms_full {1000 / full:.3f} ms")
        print(f"figure: store_commit_ms_normal {1000 / normal:.3f} ms")
        print(f"figure: store_full_sync_cost_x {normal / full:.1f} x")
        print(f"figure: store_pass_commits_per_s_full {med[('FULL', 4)] / 4:.0f} commits/s")
        print(f"figure: store_pass_commits_per_s_normal {med[('NORMAL', 4)] / 4:.0f} commits/s")
        print(f"figure: store_list_replicas_1000_ms {list_ms(directory):.2f} ms")


if __name__ == "__main__":
    main()

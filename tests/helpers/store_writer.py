"""Crash-test writer: commits batches to a controller store and acknowledges each after commit.

Usage: python tests/helpers/store_writer.py DB_PATH [MAX_BATCHES]

Each batch is one transaction: allocate three replica ids (a, b, c), put those replicas
tagged `batch-a`, delete the middle replica of the previous batch, store the autoscaler state
{"last": c, "version": v} and, every tenth batch, add a version. Only after the commit returns
does it print `ack a b c del d` (d is 0 when nothing was deleted) and flush, so every printed
line is an acknowledged write the store must keep through a SIGKILL.
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "gen", "python")]

from replicaplane.common.v1 import spec_pb2  # noqa: E402
from replicaplane.controller.v1 import resources_pb2  # noqa: E402
from services.controller import store as store_mod  # noqa: E402

SERVICE = "crash"


def main(argv: list[str]) -> int:
    """Write batches until killed or MAX_BATCHES are done."""
    path = argv[1]
    max_batches = int(argv[2]) if len(argv) > 2 else 1_000_000
    store = store_mod.Store(path)
    with store.transaction():
        if store.get_service(SERVICE) is None:
            store.create_service(SERVICE, spec_pb2.ServiceSpec(run="true", yaml="run: true\n"), now=0.0)
    print("ready", flush=True)
    for n in range(max_batches):
        with store.transaction():
            ids = [store.allocate_replica_id(SERVICE) for _ in range(3)]
            version = store.get_service(SERVICE).latest_version  # type: ignore[union-attr]
            if n % 10 == 9:
                version = store.add_version(SERVICE, spec_pb2.ServiceSpec(run=f"v{n}"))
            replicas = []
            for rid in ids:
                replica = resources_pb2.Replica(
                    service=SERVICE, replica_id=rid, version=version, zone=f"batch-{ids[0]}"
                )
                replica.facts.launch_phase = resources_pb2.LAUNCH_PHASE_RUNNING
                replicas.append(replica)
            store.put_replicas(replicas)
            deleted = 0
            previous_middle = ids[0] - 2
            if store.get_replica(SERVICE, previous_middle) is not None:
                store.delete_replica(SERVICE, previous_middle)
                deleted = previous_middle
            store.put_autoscaler_state(SERVICE, json.dumps({"last": ids[-1], "version": version}).encode())
        sys.stdout.write(f"ack {ids[0]} {ids[1]} {ids[2]} del {deleted}\n")
        sys.stdout.flush()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

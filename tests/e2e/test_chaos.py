"""Kill -9 the controller at random moments of a busy service, again and again: afterwards the
live replica processes are exactly the intended ones, and no replica id was ever used twice."""

from __future__ import annotations

import asyncio
import random

import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.helpers import cluster as cl

pytestmark = [pytest.mark.e2e, pytest.mark.drill]

ROUNDS = 6
READY = res.REPLICA_STATUS_READY


async def test_repeated_controller_kills_leak_and_duplicate_nothing(cluster: cl.Cluster) -> None:
    rng = random.Random(7)  # fixed seed: the same kill points on every run
    await cluster.stub.CreateService(api.CreateServiceRequest(yaml=cl.app_yaml("chaos", cluster.tag, replicas=3)))
    w = cl.Watch(cluster.stub, "chaos")
    await w.until(lambda w: w.count(READY) == 3)
    w.cancel()
    ever_seen: set[int] = set(w.replicas)

    for round_ in range(ROUNDS):
        replicas = (await cluster.stub.ListReplicas(api.ListReplicasRequest(service_name="chaos"))).replicas
        victim = rng.choice([r.replica_id for r in replicas if r.status == READY])
        await cluster.stub.TerminateReplica(api.TerminateReplicaRequest(service_name="chaos", replica_id=victim))
        await asyncio.sleep(rng.uniform(0.0, 0.8))  # somewhere in drain, teardown, launch or startup
        await cluster.restart_controller(kill=True)
        w = cl.Watch(cluster.stub, "chaos")
        await w.until(lambda w: w.count(READY) == 3 and len(w.replicas) == 3, timeout=40)
        w.cancel()
        ever_seen |= set(w.replicas)
        await asyncio.sleep(0.3)
        live = sorted(rid for _, rid in cl.replica_processes(cluster.tag).values())
        assert live == sorted(w.replicas), f"round {round_}"

    # One replica replaced per round, each with a fresh id.
    assert sorted(ever_seen) == list(range(1, 3 + ROUNDS + 1))

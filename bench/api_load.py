"""API load: many concurrent clients on ListServices, GetService, ListReplicas, GetReplica and
WatchService (open, read the snapshot, close), plus clients that hold a watch open throughout,
against the three real services with real replicas.

Run: .venv/bin/python bench/api_load.py [--clients 200] [--seconds 60] [--token]
Prints `figure: <name> <value> <unit>` lines: api_errors, api_p99_ms and friends. With
--token the controller requires a bearer token, so the figures include the check's cost.
--smoke (or BENCH_SMOKE=1) runs 20 clients for 3 s on 2 one-replica services.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
import uuid

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
sys.path.insert(1, os.path.join(sys.path[0], "gen", "python"))

import grpc  # noqa: E402

from replicaplane.controller.v1 import controller_service_pb2 as api  # noqa: E402
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc  # noqa: E402
from replicaplane.controller.v1 import resources_pb2 as res  # noqa: E402
from services.common import security  # noqa: E402
from tests.helpers import bench  # noqa: E402
from tests.helpers import cluster as cl  # noqa: E402

SERVICES = bench.pick(4, 2)
REPLICAS = bench.pick(2, 1)
CHANNELS = 8
HOLDERS_SHARE = 0.25  # of the clients hold one watch open for the whole run


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


class Load:
    """Counters shared by every client."""

    def __init__(self) -> None:
        self.latencies_ms: list[float] = []
        self.errors: dict[str, int] = {}
        self.watch_events = 0

    def error(self, exc: grpc.aio.AioRpcError) -> None:
        self.errors[exc.code().name] = self.errors.get(exc.code().name, 0) + 1


async def caller(stub: api_grpc.ControllerServiceStub, rng: random.Random, load: Load, until: float) -> None:
    """One client: random reads back to back until `until`."""
    while time.monotonic() < until:
        name = f"load{rng.randrange(SERVICES)}"
        kind = rng.randrange(5)
        started = time.monotonic()
        try:
            if kind == 0:
                await stub.ListServices(api.ListServicesRequest(), timeout=30)
            elif kind == 1:
                await stub.GetService(api.GetServiceRequest(service_name=name), timeout=30)
            elif kind == 2:
                await stub.ListReplicas(api.ListReplicasRequest(service_name=name), timeout=30)
            elif kind == 3:
                rid = rng.randrange(1, REPLICAS + 1)
                await stub.GetReplica(api.GetReplicaRequest(service_name=name, replica_id=rid), timeout=30)
            else:
                call = stub.WatchService(api.WatchServiceRequest(service_name=name), timeout=30)
                async for _ in call:
                    break
                call.cancel()
        except grpc.aio.AioRpcError as exc:
            load.error(exc)
            continue
        load.latencies_ms.append((time.monotonic() - started) * 1000)


async def holder(stub: api_grpc.ControllerServiceStub, name: str, load: Load, until: float) -> None:
    """One client that keeps a watch open for the whole run."""
    call = stub.WatchService(api.WatchServiceRequest(service_name=name))

    async def read() -> None:
        async for _ in call:
            load.watch_events += 1

    try:
        await asyncio.wait_for(read(), max(0.0, until - time.monotonic()))
    except TimeoutError:
        pass
    except grpc.aio.AioRpcError as exc:
        load.error(exc)
    finally:
        call.cancel()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=bench.pick(200, 20))
    parser.add_argument("--seconds", type=float, default=bench.pick(60.0, 3.0))
    parser.add_argument("--token", action="store_true", help="require a bearer token on the API")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the bench runs (BENCH_SMOKE=1)")
    args = parser.parse_args()
    bench.announce()
    token = f"bench-{uuid.uuid4().hex}" if args.token else ""
    env = {"REPLICAPLANE_CONTROLLER_AUTH_TOKEN": token} if token else {}
    tmp = tempfile.mkdtemp(prefix="rp-bench-api-")
    c = cl.Cluster(tmp, controller_env=env, api_token=token)
    channels = [
        grpc.aio.insecure_channel(
            c.controller.addr,
            options=[("grpc.use_local_subchannel_pool", 1)],
            interceptors=security.token_interceptors(token),
        )
        for _ in range(CHANNELS)
    ]
    try:
        for i in range(SERVICES):
            yaml_text = cl.app_yaml(f"load{i}", c.tag, replicas=REPLICAS)
            await c.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text), timeout=30)
        for i in range(SERVICES):
            w = cl.Watch(c.stub, f"load{i}")
            await w.until(lambda w: w.count(res.REPLICA_STATUS_READY) == REPLICAS, timeout=120)
            w.cancel()
        load = Load()
        stubs = [api_grpc.ControllerServiceStub(ch) for ch in channels]
        holders = int(args.clients * HOLDERS_SHARE)
        started = time.monotonic()
        until = started + args.seconds
        tasks = [
            holder(stubs[i % CHANNELS], f"load{i % SERVICES}", load, until)
            if i < holders
            else caller(stubs[i % CHANNELS], random.Random(i), load, until)
            for i in range(args.clients)
        ]
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - started
        lat = load.latencies_ms or [0.0]
        errors = sum(load.errors.values())
        if load.errors:
            print("errors: " + ", ".join(f"{k}={v}" for k, v in sorted(load.errors.items())))
        print(f"figure: api_clients {args.clients} count")
        print(f"figure: api_watch_holders {holders} count")
        print(f"figure: api_calls {len(load.latencies_ms)} count")
        print(f"figure: api_rps {len(load.latencies_ms) / elapsed:.0f} 1/s")
        print(f"figure: api_errors {errors} count")
        print(f"figure: api_p50_ms {pct(lat, 50):.1f} ms")
        print(f"figure: api_p99_ms {pct(lat, 99):.1f} ms")
        print(f"figure: api_watch_events {load.watch_events} count")
    finally:
        for ch in channels:
            await ch.close()
        await c.close()


if __name__ == "__main__":
    asyncio.run(main())

"""Load balancer benchmark: proxy overhead against going straight to a replica, and throughput.

Run from the repo root: `python bench/loadbalancer.py`. Prints `figure: <name> <value> <unit>` lines.

A real stack (controller, provisioner, prober) runs a service of two replicas of a small aiohttp
app (tests/helpers/apps/lbapp.py) and a real balancer process follows it. Overhead: the same
client sends small GETs, alternating straight to a replica and through the balancer, one at a
time over kept-alive connections (BENCH_REQUESTS pairs); the figures are the differences of the
p50 and p99 latencies. Throughput: BENCH_CONCURRENCY clients send GETs through the balancer for
BENCH_MEASURE seconds; on a 2-core machine the balancer, both replicas and the client share them.
Scale from zero: one request to a `min_replicas: 0` service with no replica, held by a second
balancer until the replica its arrival launched is READY; the figure is its response time.
Canary split: a balancer process follows a stand-in controller (tests/helpers/weighted_controller.py;
the real one cannot set weights yet) that gives version 1 (three replicas) weight 90 and version 2
(one replica) weight 10; BENCH_SPLIT_REQUESTS GETs, 16 at a time, go through the balancer, and the
figure is the largest difference, in percentage points, between a version's weight and its share.
BENCH_SMOKE=1 (or --smoke) sends 50 pairs, 4 clients for 1 s and 200 requests for the canary split.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "gen", "python")]

import aiohttp  # noqa: E402

from replicaplane.controller.v1 import controller_service_pb2 as api  # noqa: E402
from tests.helpers import balancer as lb  # noqa: E402
from tests.helpers import bench  # noqa: E402
from tests.helpers import cluster as cl  # noqa: E402
from tests.helpers import weighted_controller as wc  # noqa: E402

REQUESTS = int(os.environ.get("BENCH_REQUESTS", bench.pick("2000", "50")))
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", bench.pick("32", "4")))
MEASURE_S = float(os.environ.get("BENCH_MEASURE", bench.pick("5", "1")))
WARMUP = bench.pick(200, 10)
SPLIT_REQUESTS = int(os.environ.get("BENCH_SPLIT_REQUESTS", bench.pick("2000", "200")))


def pct(values: list[float], p: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1] if len(values) > 1 else values[0]


async def timed_get(session: aiohttp.ClientSession, url: str) -> float:
    start = time.perf_counter()
    async with session.get(url) as resp:
        await resp.read()
        assert resp.status == 200, resp.status
    return (time.perf_counter() - start) * 1000


async def scale_from_zero(c: cl.Cluster, tmp: str) -> float:
    policy = "  replica_policy:\n    min_replicas: 0\n    max_replicas: 1\n    target_qps_per_replica: 1\n"
    await c.stub.CreateService(
        api.CreateServiceRequest(yaml=lb.lb_app_yaml("zero", c.tag, policy_yaml=policy)), timeout=10
    )
    b = await lb.start(c.controller.addr, "zero", os.path.join(tmp, "lb-zero"))
    try:
        await b.until(lambda s: s.controller_connected)
        async with aiohttp.ClientSession() as session:
            start = time.perf_counter()
            async with session.get(b.url + "/whoami", timeout=aiohttp.ClientTimeout(total=120)) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
            return time.perf_counter() - start
    finally:
        await b.close()


async def canary_split_error_pct(tmp: str) -> float:
    """Weights 90/10 between two versions; the largest weight-minus-share error, in points."""
    weights = {1: 900, 2: 100}
    replicas = wc.Replicas()
    try:
        async with wc.serving("canary") as ctl:
            endpoints = [await replicas.start(1) for _ in range(3)] + [await replicas.start(2)]
            ctl.publish(endpoints, weights)
            b = await lb.start(ctl.addr, "canary", os.path.join(tmp, "lb-canary"))
            try:
                await b.until(lambda s: sum(r.ready for r in s.replicas) == len(endpoints))
                seen = {1: 0, 2: 0}
                left = iter(range(SPLIT_REQUESTS))

                async def client(session: aiohttp.ClientSession) -> None:
                    for _ in left:
                        async with session.get(b.url + "/x") as resp:
                            assert resp.status == 200, resp.status
                            seen[int((await resp.text()).split()[1])] += 1

                async with aiohttp.ClientSession() as session:
                    await asyncio.gather(*(client(session) for _ in range(16)))
            finally:
                await b.close()
    finally:
        await replicas.close()
    return max(abs(100 * seen[v] / SPLIT_REQUESTS - w / 10) for v, w in weights.items())


async def main() -> None:
    bench.announce()
    with tempfile.TemporaryDirectory(prefix="rp-bench-lb-") as tmp:
        c = cl.Cluster(tmp)
        b = None
        try:
            await c.stub.CreateService(
                api.CreateServiceRequest(yaml=lb.lb_app_yaml("bench", c.tag, replicas=2)), timeout=10
            )
            b = await lb.start(c.controller.addr, "bench", os.path.join(tmp, "lb"))
            await b.until(lambda s: sum(r.ready for r in s.replicas) == 2, timeout=120)
            direct = (await b.state()).replicas[0].url + "/whoami"
            via = b.url + "/whoami"
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                for _ in range(WARMUP):  # warm up connections and code paths
                    await timed_get(session, direct)
                    await timed_get(session, via)
                direct_ms, via_ms = [], []
                for _ in range(REQUESTS):
                    direct_ms.append(await timed_get(session, direct))
                    via_ms.append(await timed_get(session, via))

                done = 0
                stop_at = time.monotonic() + MEASURE_S

                async def worker() -> None:
                    nonlocal done
                    while time.monotonic() < stop_at:
                        await timed_get(session, via)
                        done += 1

                start = time.monotonic()
                await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
                rps = done / (time.monotonic() - start)
            print(f"figure: direct_p50_ms {pct(direct_ms, 50):.2f} ms")
            print(f"figure: via_balancer_p50_ms {pct(via_ms, 50):.2f} ms")
            print(f"figure: proxy_overhead_p50_ms {pct(via_ms, 50) - pct(direct_ms, 50):.2f} ms")
            print(f"figure: proxy_overhead_p99_ms {pct(via_ms, 99) - pct(direct_ms, 99):.2f} ms")
            print(f"figure: proxy_rps {rps:.0f} requests/s ({CONCURRENCY} concurrent clients)")
            print(f"figure: scale_from_zero_first_response_s {await scale_from_zero(c, tmp):.2f} s")
            error = await canary_split_error_pct(tmp)
            print(f"figure: canary_split_error_pct {error:.2f} points ({SPLIT_REQUESTS} requests, weights 90/10)")
        finally:
            if b is not None:
                await b.close()
            await c.close()


if __name__ == "__main__":
    asyncio.run(main())

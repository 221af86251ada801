"""Prober benchmark: probes per second with 1 and 2 prober processes, and ready-detection latency.

Run from the repo root: `python bench/prober.py`. Prints `figure: <name> <value> <unit>` lines.

Throughput: real prober processes, fed through the fleet client, probe a fast local HTTP server
(its own process). 100 targets each due every 5 ms offer 20,000 probes/s, more than the probers
can do, so the figure is their ceiling with at most 100 probes in flight (BENCH_TARGETS,
BENCH_INTERVAL and BENCH_MEASURE override). Ready detection: a starting target whose app is
down is probed at the default 100 ms fast interval; the app then starts listening; the figure
is the time from listening to the READY result arriving at the client, over 200 samples.
BENCH_SMOKE=1 (or --smoke): 10 targets for 0.5 s and 10 detection samples.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "gen", "python")]

from google.protobuf import duration_pb2  # noqa: E402

from replicaplane.prober.v1 import prober_service_pb2 as pb  # noqa: E402
from services.common import probe_fleet  # noqa: E402
from tests.helpers import bench, ports, prober_apps, procs  # noqa: E402

TARGETS = int(os.environ.get("BENCH_TARGETS", bench.pick("100", "10")))
INTERVAL_S = float(os.environ.get("BENCH_INTERVAL", "0.005"))
WARMUP_S = bench.pick(2.0, 0.3)
MEASURE_S = float(os.environ.get("BENCH_MEASURE", bench.pick("5", "0.5")))
DETECT_ROUNDS = bench.pick(200, 10)
DETECT_PARALLEL = bench.pick(10, 5)


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


async def throughput(probers: int) -> float:
    fast = prober_apps.start_fast_server()
    svcs = [procs.start_service("prober") for _ in range(probers)]
    count = 0
    failures = 0

    def on_results(results: list[pb.ProbeResult]) -> None:
        nonlocal count, failures
        count += len(results)
        failures += sum(1 for r in results if not r.ready)

    fleet = probe_fleet.ProbeFleet(",".join(s.addr for s in svcs), on_results=on_results)
    try:
        await fleet.start()
        for i in range(TARGETS):
            fleet.upsert(
                pb.ProbeTarget(
                    target_id=f"t{i}",
                    url=fast.url,
                    path="/health",
                    interval=_duration(INTERVAL_S),
                    timeout=_duration(5),
                )
            )
        await asyncio.sleep(WARMUP_S)
        start_count, start = count, time.perf_counter()
        await asyncio.sleep(MEASURE_S)
        rate = (count - start_count) / (time.perf_counter() - start)
        if failures:
            print(f"note: {failures} failed probes", file=sys.stderr)
        return rate
    finally:
        await fleet.stop()
        for svc in svcs:
            svc.stop()
        fast.stop()


async def _detect_once(fleet: probe_fleet.ProbeFleet, ready: dict[str, asyncio.Future[float]], i: int) -> float:
    """Upsert a starting target whose app is down, start the app, return ms until READY."""
    target_id = f"r{i}"
    down = ports.Reserved()  # refuses connections until the app listens on its socket
    loop = asyncio.get_running_loop()
    ready[target_id] = loop.create_future()
    fleet.upsert(pb.ProbeTarget(target_id=target_id, url=down.url, path="/", starting=True, interval=_duration(10)))
    # Let a few fast probes fail first, at a random phase of the fast interval.
    await asyncio.sleep(random.uniform(0.15, 0.35))
    app = prober_apps.App()
    started = time.perf_counter()
    await app.start(sock=down.take())
    try:
        seen = await asyncio.wait_for(ready[target_id], 5)
        return (seen - started) * 1000
    finally:
        fleet.remove(target_id)
        await app.stop()


async def ready_detection() -> list[float]:
    svc = procs.start_service("prober")
    ready: dict[str, asyncio.Future[float]] = {}

    def on_results(results: list[pb.ProbeResult]) -> None:
        now = time.perf_counter()
        for r in results:
            future = ready.get(r.target_id)
            if r.ready and future is not None and not future.done():
                future.set_result(now)

    fleet = probe_fleet.ProbeFleet(svc.addr, on_results=on_results)
    samples: list[float] = []
    try:
        await fleet.start()
        for batch in range(DETECT_ROUNDS // DETECT_PARALLEL):
            samples += await asyncio.gather(
                *(_detect_once(fleet, ready, batch * DETECT_PARALLEL + j) for j in range(DETECT_PARALLEL))
            )
        return samples
    finally:
        await fleet.stop()
        svc.stop()


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def main() -> None:
    bench.announce()
    one = await throughput(1)
    print(f"figure: probes_per_s_1 {one:.0f} probes/s", flush=True)
    two = await throughput(2)
    print(f"figure: probes_per_s_2 {two:.0f} probes/s", flush=True)
    samples = await ready_detection()
    print(f"figure: ready_detect_p50_ms {statistics.median(samples):.1f} ms", flush=True)
    print(f"figure: ready_detect_p99_ms {_percentile(samples, 0.99):.1f} ms", flush=True)


if __name__ == "__main__":
    asyncio.run(main())

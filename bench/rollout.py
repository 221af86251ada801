"""Canary rollout benchmark: how fast a failed canary's traffic goes back to the stable version, and
how exactly the real controller and balancer split the traffic.

Run from the repo root: `python bench/rollout.py`. Prints `figure: <name> <value> <unit>` lines.

A real stack (controller, provisioner, prober, balancer processes) runs a service of two replicas
of tests/helpers/apps/lbapp.py, which answer which version they run.

- `canary_split_error_pct`: a canary update at 10 % (one long step); once the canary replica is
  READY, BENCH_SPLIT_REQUESTS GETs go through the balancer, 8 at a time; the figure is how far the
  canary's share is from 10 %, in percentage points.
- `rollback_ms`: BENCH_ROUNDS times, a canary whose every answer is a 500 is rolled out at 50 %
  while a client sends GETs through the balancer non-stop; the analysis fails it (window 5 s, at
  least 20 requests). From the moment the controller decided the rollback (its `RolloutRolledBack`
  event) to the end of the last request the canary answered: the p50 and the p99 over the rounds.
BENCH_SMOKE=1 (or --smoke): 200 requests for the split and one rollback round.
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
from replicaplane.controller.v1 import resources_pb2 as res  # noqa: E402
from services.common import pbtime  # noqa: E402
from tests.helpers import balancer as lb  # noqa: E402
from tests.helpers import bench  # noqa: E402
from tests.helpers import cluster as cl  # noqa: E402

SPLIT_REQUESTS = int(os.environ.get("BENCH_SPLIT_REQUESTS", bench.pick("2000", "200")))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", bench.pick("10", "1")))


def app_yaml(tag: str, say: str, *, rollout: str = "", extra: str = "") -> str:
    """Two replicas of the test app answering `replica N <say>`."""
    return (
        "name: web\n"
        "service:\n"
        "  readiness_probe:\n"
        "    path: /health\n"
        "    initial_delay_seconds: 60\n"
        "    endpoint_probe_interval_seconds: 0.2\n"
        "  replicas: 2\n" + (f"  rollout: {rollout}\n" if rollout else "") + "resources:\n"
        "  ports: 8080\n"
        f"run: {sys.executable} {lb.LB_APP} --port 8080 --tag {tag} --say {say}{extra}\n"
    )


async def service(c: cl.Cluster) -> res.Service:
    return (await c.stub.GetService(api.GetServiceRequest(service_name="web"), timeout=5)).service


async def until(c: cl.Cluster, pred, timeout: float = 120.0) -> res.Service:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        svc = await service(c)
        if pred(svc):
            return svc
        if time.monotonic() > deadline:
            raise TimeoutError(f"never got there: {svc.status_message} / {svc.rollout.message}")
        await asyncio.sleep(0.05)


async def canary(c: cl.Cluster, yaml_text: str) -> int:
    resp = await c.stub.UpdateService(
        api.UpdateServiceRequest(service_name="web", yaml=yaml_text, mode=res.UPDATE_MODE_CANARY), timeout=10
    )
    return resp.plan.new_version


async def split(c: cl.Cluster, b: lb.Balancer, session: aiohttp.ClientSession) -> float:
    steps = "{strategy: canary, steps: [{weight: 10, pause_seconds: 3600}]}"
    version = await canary(c, app_yaml(c.tag, "canary", rollout=steps))
    await until(c, lambda s: s.rollout.step_start_time.seconds > 0)
    await b.until(lambda s: version in {v.version for v in s.versions if v.ready_replicas})
    seen = {"stable": 0, "canary": 0}
    left = SPLIT_REQUESTS

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            async with session.get(b.url + "/whoami") as resp:
                seen[(await resp.text()).split()[2]] += 1

    await asyncio.gather(*(worker() for _ in range(8)))
    # Back to the stable spec for the rollback rounds.
    await c.stub.AbortRollout(api.AbortRolloutRequest(service_name="web"), timeout=5)
    await until(c, lambda s: s.latest_version == version + 1 and s.ready_replicas == 2 and len(s.active_versions) == 1)
    return abs(100.0 * seen["canary"] / SPLIT_REQUESTS - 10.0)


async def rollback_round(c: cl.Cluster, b: lb.Balancer, session: aiohttp.ClientSession) -> float:
    rollout = "{strategy: canary, steps: [{weight: 50, pause_seconds: 3600}], analysis: {window_seconds: 5}}"
    version = await canary(c, app_yaml(c.tag, "canary", rollout=rollout, extra=" --fail-every 1"))
    last_canary = 0.0
    stop = asyncio.Event()

    async def client() -> None:
        nonlocal last_canary
        while not stop.is_set():
            async with session.get(b.url + "/whoami") as resp:
                await resp.read()
                if resp.status >= 500:
                    last_canary = time.time()
            await asyncio.sleep(0.002)

    clients = [asyncio.create_task(client()) for _ in range(4)]
    try:
        await until(c, lambda s: s.rollout.state == res.ROLLOUT_STATE_ROLLED_BACK)
        await until(c, lambda s: s.latest_version == version + 1 and s.ready_replicas == 2)
        await asyncio.sleep(1.0)  # keep sending: a canary answer after this would count too
    finally:
        stop.set()
        await asyncio.gather(*clients)
    found = (await c.stub.ListEvents(api.ListEventsRequest(service_name="web", page_size=1000), timeout=5)).events
    decided = max(pbtime.from_timestamp(e.last_time) for e in found if e.reason == "RolloutRolledBack")
    return max(last_canary - decided, 0.0) * 1000.0


async def main() -> None:
    bench.announce()
    with tempfile.TemporaryDirectory() as tmp:
        c = cl.Cluster(tmp)
        b = None
        try:
            await c.stub.CreateService(api.CreateServiceRequest(yaml=app_yaml(c.tag, "stable")), timeout=10)
            b = await lb.start(c.controller.addr, "web", os.path.join(tmp, "lb"))
            await b.until(lambda s: sum(r.ready for r in s.replicas) == 2, timeout=60)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
                error = await split(c, b, session)
                print(f"figure: canary_split_error_pct {error:.2f} points ({SPLIT_REQUESTS} requests at 10 %)")
                rounds = [await rollback_round(c, b, session) for _ in range(ROUNDS)]
            p50 = statistics.median(rounds)
            p99 = statistics.quantiles(rounds, n=100, method="inclusive")[98] if len(rounds) > 1 else rounds[0]
            print(f"figure: rollback_ms {p50:.0f} ms (p50 of {len(rounds)} rollbacks)")
            print(f"figure: rollback_ms_p99 {p99:.0f} ms")
        finally:
            if b is not None:
                await b.close()
            await c.close()


if __name__ == "__main__":
    asyncio.run(main())

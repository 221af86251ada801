"""Balancer URLs benchmark: how soon a new service shows its URL, how soon an idle drain ends, how
soon a dead balancer's URL goes.

Run from the repo root: `python bench/balancer_urls.py`. Prints `figure: <name> <value> <unit>` lines.

A real cluster (controller, provisioner, prober) and a balancer fleet process (one port per
service) run with the defaults that matter here: a 120 s drain, a 15 s balancer TTL, the fleet
listing services every second and reporting at least every 5 s.
- url_shown_s: CreateService of a one-replica service until GetService shows its URL (median
  over BENCH_SERVICES services; the fleet finds the service by listing, binds its port and reports).
- idle_drain_end_s: a two-replica service scaled down to one, until the victim's record is gone:
  the fleet reports nothing in flight for it, so the 120 s drain ends at once.
- dead_url_gone_s: the fleet is killed (SIGKILL: no last report), until the URL is gone from
  GetService: the TTL.
BENCH_SMOKE=1 (or --smoke) measures one service, with a 2 s TTL and reports every 0.5 s.
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

from replicaplane.controller.v1 import controller_service_pb2 as api  # noqa: E402
from tests.helpers import balancer as lb  # noqa: E402
from tests.helpers import bench  # noqa: E402
from tests.helpers import cluster as cl  # noqa: E402
from tests.helpers import procs as service_procs  # noqa: E402

SERVICES = int(os.environ.get("BENCH_SERVICES", bench.pick("5", "1")))
TTL_S = bench.pick("15", "2")
HEARTBEAT_S = bench.pick("5", "0.5")


async def url_of(c: cl.Cluster, name: str) -> str:
    return (await c.stub.GetService(api.GetServiceRequest(service_name=name), timeout=5)).service.load_balancer_url


async def replicas(c: cl.Cluster, name: str) -> int:
    return len((await c.stub.ListReplicas(api.ListReplicasRequest(service_name=name), timeout=5)).replicas)


async def ready(c: cl.Cluster, name: str) -> int:
    return (await c.stub.GetService(api.GetServiceRequest(service_name=name), timeout=5)).service.ready_replicas


async def waited(pred, timeout: float = 180.0) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not await pred():
        if time.monotonic() - start > timeout:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def main() -> None:
    bench.announce()
    with tempfile.TemporaryDirectory(prefix="rp-bench-urls-") as tmp:
        c = cl.Cluster(
            tmp,
            controller_env={"REPLICAPLANE_CONTROLLER_DRAIN_S": "120", "REPLICAPLANE_CONTROLLER_BALANCER_TTL_S": TTL_S},
        )
        fleet = None
        try:
            os.makedirs(os.path.join(tmp, "fleet"))
            fleet = await asyncio.to_thread(
                service_procs.start_service,
                "loadbalancer",
                env={
                    "REPLICAPLANE_LOADBALANCER_FLEET": "true",
                    "REPLICAPLANE_LOADBALANCER_CONTROLLER_ADDR": c.controller.addr,
                    "REPLICAPLANE_LOADBALANCER_HTTP_ADDR": "127.0.0.1:0",
                    "REPLICAPLANE_LOADBALANCER_REPORT_HEARTBEAT_S": HEARTBEAT_S,
                },
                workdir=os.path.join(tmp, "fleet"),
            )
            shown = []
            for i in range(SERVICES):
                name = f"svc{i}"
                await c.stub.CreateService(
                    api.CreateServiceRequest(yaml=lb.lb_app_yaml(name, c.tag, replicas=2 if i == 0 else 1)), timeout=10
                )
                shown.append(await waited(lambda name=name: _truthy(url_of(c, name))))
            await waited(lambda: _equals(ready(c, "svc0"), 2))
            await c.stub.UpdateService(
                api.UpdateServiceRequest(service_name="svc0", yaml=lb.lb_app_yaml("svc0", c.tag, replicas=1)),
                timeout=10,
            )
            drain = await waited(lambda: _equals(replicas(c, "svc0"), 1))
            fleet.kill()
            gone = await waited(lambda: _equals(url_of(c, "svc0"), ""))
            print(f"figure: url_shown_s {statistics.median(shown):.2f} s (median of {SERVICES} new services)")
            print(f"figure: idle_drain_end_s {drain:.2f} s (scale-down with a 120 s drain, nothing in flight)")
            print(f"figure: dead_url_gone_s {gone:.2f} s (balancer killed; TTL {TTL_S} s)")
        finally:
            if fleet is not None:
                fleet.stop()
            await c.close()


async def _truthy(value) -> bool:  # type: ignore[no-untyped-def]
    return bool(await value)


async def _equals(value, expected) -> bool:  # type: ignore[no-untyped-def]
    return await value == expected


if __name__ == "__main__":
    asyncio.run(main())

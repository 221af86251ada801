"""Controller latency benchmark: dispatch (create -> launch at the provisioner) and readiness
(app answers -> READY seen in a watch), with the three real services and real replicas, and the
latency and throughput of a cheap API call (GetService), where per-call overhead shows most.

Run from the repo root: `python bench/controller.py`. Prints `figure:` lines. BENCH_SMOKE=1 (or
--smoke) runs 2 rounds of 2 replicas, 3 dispatch samples and 200 API calls.
`--metrics off` runs the controller with metrics off (no gRPC metrics interceptor, no endpoint);
`--metrics traces` runs it with metrics on and traces on for the controller, provisioner and
prober (OTLP to a receiver in this process); `--metrics compare` runs off, on and traces in turn
(`--repeat`, three times each) and prints the median of each figure side by side with the change.
"""

from __future__ import annotations

import argparse
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
from tests.helpers import bench, otlp  # noqa: E402
from tests.helpers import cluster as cl  # noqa: E402

ROUNDS = bench.pick(10, 2)
REPLICAS = bench.pick(5, 2)
DISPATCH_SAMPLES = bench.pick(50, 3)
API_CALLS = bench.pick(4000, 200)
API_CONCURRENCY = 20
METRICS_OFF = {"REPLICAPLANE_CONTROLLER_METRICS_ADDR": ""}


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
    """The time an app wrote to its ready file. The app answers from another thread before it
    writes the file, so on a busy machine READY can be seen first: wait for it (bounded)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            with open(path, encoding="utf-8") as fh:
                return float(fh.read())
        except (FileNotFoundError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system) a process has used: a cost that other work on the machine
    barely changes, unlike latency."""
    with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
        fields = fh.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def api_figures(c: cl.Cluster) -> dict[str, float]:
    """GetService latency one call at a time, the controller's CPU per call, and calls per second
    from concurrent callers."""
    name = "apibench"
    await c.stub.CreateService(api.CreateServiceRequest(yaml=cl.app_yaml(name, c.tag, replicas=0, run="sleep 60")))
    request = api.GetServiceRequest(service_name=name)
    for _ in range(100):  # warm the channel and the server
        await c.stub.GetService(request)
    single: list[float] = []
    cpu_before = cpu_seconds(c.controller.proc.pid)
    for _ in range(API_CALLS):
        start = time.perf_counter()
        await c.stub.GetService(request)
        single.append((time.perf_counter() - start) * 1000)
    cpu_us = (cpu_seconds(c.controller.proc.pid) - cpu_before) / API_CALLS * 1e6

    async def caller(calls: int) -> None:
        for _ in range(calls):
            await c.stub.GetService(request)

    start = time.perf_counter()
    await asyncio.gather(*(caller(API_CALLS // API_CONCURRENCY) for _ in range(API_CONCURRENCY)))
    rate = API_CALLS / (time.perf_counter() - start)
    await c.stub.DeleteService(api.DeleteServiceRequest(service_name=name))
    return {
        "api_get_p50_ms": pct(single, 50),
        "api_get_p99_ms": pct(single, 99),
        "api_get_controller_cpu_us": cpu_us,
        "api_get_calls_per_s": rate,
    }


MODES = ("off", "on", "traces")


async def run(mode: str) -> dict[str, float]:
    """One full run with metrics off, on, or on with traces; the figures by name."""
    metrics = mode != "off"
    tmp = tempfile.mkdtemp(prefix="rp-bench-ctl-")
    receiver = otlp.serving()
    collector = next(receiver) if mode == "traces" else None
    traces = collector.env() if collector is not None else {}
    c = cl.Cluster(
        tmp,
        controller_env={**(METRICS_OFF if not metrics else {}), **traces},
        provisioner_env=traces,
        prober_env=traces,
    )
    prov = prov_grpc.ProvisionerServiceStub(clients.channel(c.provisioner.addr))
    dispatch_ms: list[float] = []
    burst_ms: list[float] = []
    ready_ms: list[float] = []
    api_calls: dict[str, float] = {}
    try:
        if not metrics:
            assert c.controller.metrics_port == 0, "the controller serves no metrics"
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
        api_calls = await api_figures(c)
    finally:
        await c.close()
        if collector is not None:
            spans = collector.receiver.spans()
            print(f"traces: {len(spans)} spans in {len({s.trace_id for s in spans})} traces received")
        receiver.close()
    print(f"samples: {len(ready_ms)} replicas over {ROUNDS} services (metrics {mode})")
    print(f"ready_in_watch mean {statistics.mean(ready_ms):.1f} ms, max {max(ready_ms):.1f} ms")
    return {
        "ready_in_watch_p50_ms": pct(ready_ms, 50),
        "ready_in_watch_p99_ms": pct(ready_ms, 99),
        "dispatch_p50_ms": pct(dispatch_ms, 50),
        "dispatch_p99_ms": pct(dispatch_ms, 99),
        "dispatch_burst5_p50_ms": pct(burst_ms, 50),
        "dispatch_burst5_p99_ms": pct(burst_ms, 99),
        **api_calls,
    }


def unit(name: str) -> str:
    return "calls/s" if name.endswith("_per_s") else "us" if name.endswith("_us") else "ms"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", choices=(*MODES, "compare"), default="on")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each mode with --metrics compare")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the bench runs (BENCH_SMOKE=1)")
    args = parser.parse_args()
    bench.announce()
    if args.metrics != "compare":
        for name, value in (await run(args.metrics)).items():
            print(f"figure: {name} {value:.2f} {unit(name)}")
        return
    # In turn, so a machine that gets busier or quieter during the run weighs on all alike.
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.repeat):
        for mode in MODES:
            runs[mode].append(await run(mode))
    print(f"\nmedian of {args.repeat} runs each")
    print(f"{'figure':26} {'metrics off':>12} {'metrics on':>12} {'change':>8} {'+ traces':>12} {'change':>8}")
    for name in runs["on"][0]:
        off, on, traced = (statistics.median(r[name] for r in runs[mode]) for mode in MODES)
        change = (on - off) / off * 100 if off else 0.0
        traced_change = (traced - off) / off * 100 if off else 0.0
        print(f"{name:26} {off:12.2f} {on:12.2f} {change:+7.1f} % {traced:12.2f} {traced_change:+7.1f} %")
        print(f"figure: {name}_metrics_off {off:.2f} {unit(name)}")
        print(f"figure: {name}_metrics_on {on:.2f} {unit(name)}")
        print(f"figure: {name}_traces_on {traced:.2f} {unit(name)}")


if __name__ == "__main__":
    asyncio.run(main())

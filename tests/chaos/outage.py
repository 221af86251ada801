"""Prober fleet outage drill: every prober gone (one SIGKILLed, one frozen with SIGSTOP) under a
READY service for `outage_s` seconds, with a failure window far shorter than the outage.

Expected: nothing is torn down (the same replica processes serve throughout, no replica leaves
READY), the service says probing is stale, and probing resumes when the probers return (a
replica that then stops answering is seen failing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Callable

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.helpers import cluster as cl

READY = res.REPLICA_STATUS_READY
# A frozen prober is noticed after this long without a heartbeat (the setting under drill).
LIVENESS_TIMEOUT_S = 1.0


def _touch(path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("stop")


async def _follow(w: cl.Watch) -> None:
    async for msg in w._call:
        w._apply(msg)


async def _wait(pred: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


@dataclasses.dataclass
class OutageReport:
    """What the drill saw."""

    outage_s: float
    stale_after_s: float = -1.0
    resumed_after_s: float = -1.0
    torn_down: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)


async def prober_outage(tmp: str, outage_s: float, *, replicas: int = 3) -> OutageReport:
    """Run the drill in `tmp`; violations are collected, not raised."""
    report = OutageReport(outage_s)
    stop_file = os.path.join(tmp, "stop")
    cluster = cl.Cluster(
        tmp,
        probers=2,
        controller_env={"REPLICAPLANE_CONTROLLER_PROBER_LIVENESS_TIMEOUT_S": str(LIVENESS_TIMEOUT_S)},
    )
    frozen = None
    try:
        yaml_text = cl.app_yaml("steady", cluster.tag, replicas=replicas, app_args=f"--stop-file {stop_file}")
        await cluster.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text), timeout=30)
        w = cl.Watch(cluster.stub, "steady")
        await w.until(lambda w: w.count(READY) == replicas, timeout=60)
        w.cancel()
        pids_before = set(cl.replica_processes(cluster.tag))
        w = cl.Watch(cluster.stub, "steady")
        follower = asyncio.create_task(_follow(w))
        await _wait(lambda: w.service is not None, 30)

        def stale() -> bool:
            return w.service is not None and w.service.probing_stale

        started = time.monotonic()
        cluster.stop_prober(0)
        frozen = cluster.probers[1].proc.pid
        os.kill(frozen, signal.SIGSTOP)
        if await _wait(stale, min(30, outage_s)):
            report.stale_after_s = time.monotonic() - started
            assert w.service is not None
            if "probing is stale" not in w.service.status_message:
                report.violations.append(f"status message does not say stale: {w.service.status_message!r}")
        else:
            report.violations.append(f"probing never reported stale: {w.describe()}")
        await asyncio.sleep(max(0.0, outage_s - (time.monotonic() - started)))
        svc = (await cluster.stub.GetService(api.GetServiceRequest(service_name="steady"), timeout=30)).service
        if svc.ready_replicas != replicas:
            report.violations.append(f"ready replicas fell to {svc.ready_replicas} during the outage")
        changed = {i: s for i, s in w.seen_statuses.items() if set(s) - {READY}}
        if changed:
            report.violations.append(f"replicas left READY during the outage: {changed}")
        pids_after = set(cl.replica_processes(cluster.tag))
        report.torn_down = len(pids_before - pids_after)
        if pids_after != pids_before:
            report.violations.append(f"replica processes changed: {sorted(pids_before)} -> {sorted(pids_after)}")

        back = time.monotonic()
        os.kill(frozen, signal.SIGCONT)
        frozen = None
        cluster.start_prober(0)
        if await _wait(lambda: not stale(), 30):
            report.resumed_after_s = time.monotonic() - back
        else:
            report.violations.append(f"probing never resumed: {w.describe()}")
        _touch(stop_file)  # the apps answer 503 from now on
        if not await _wait(lambda: w.count(READY) < replicas, 30):
            report.violations.append(f"failures after the outage were not seen: {w.describe()}")
        follower.cancel()
        w.cancel()
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
        await cluster.close()
    return report


def main_outage(outage_s: float) -> int:
    """Run the drill from the command line and print its figures; 1 if it found a violation."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rp-outage-") as tmp:
        report = asyncio.run(prober_outage(tmp, outage_s))
    print(f"figure: prober_outage_s {report.outage_s:.1f} s")
    print(f"figure: prober_outage_stale_after_s {report.stale_after_s:.2f} s")
    print(f"figure: prober_outage_resumed_after_s {report.resumed_after_s:.2f} s")
    print(f"figure: prober_outage_torn_down {report.torn_down} count")
    print(f"figure: prober_outage_violations {len(report.violations)} count")
    for line in report.violations:
        print(f"  {line}")
    return 1 if report.violations else 0

"""The pure lifecycle step decides what today's reconciler decides, event for event.

Each row stores a replica in given facts, resumes a real ServiceReconciler over a real store
(its provisioner unreachable: nothing it starts gets to run before the check), applies one event
through the reconciler's own handler, and compares the stored facts, the teardown started and
the stop rule's verdict with `lifecycle.step` and `failures.stops_version` on the same facts.
Rows whose outcome issue 19 changes are listed apart and left out.
"""

from __future__ import annotations

import dataclasses
import os
import time

import grpc
import pytest

from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.prober.v1 import prober_service_pb2 as prober_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.common import pbtime, spec
from services.controller import convert, reconciler, store
from services.controller.domain import failures
from services.controller.domain import lifecycle as lc
from services.controller.domain.failures import Cause
from services.controller.domain.lifecycle import Life
from services.controller.domain.status import LaunchPhase as LP

YAML = """
name: svc
service:
  readiness_probe:
    path: /health
    initial_delay_seconds: 10
    consecutive_failure_threshold_timeout: 30
  replicas: 1
resources:
  ports: 8080
run: serve
"""

T0 = 1_700_000_000.0  # probe times are wall-clock; any fixed epoch does
STARTING = Life(launch=LP.SUCCEEDED)
READY = Life(launch=LP.SUCCEEDED, ready_now=True, first_ready_time=T0)
NOT_READY = dataclasses.replace(READY, ready_now=False, streak_start=T0 + 100, streak_last=T0 + 110, failure_reason="x")
DELAYING = dataclasses.replace(STARTING, first_failure_time=T0)


class Probes:
    """Where probe targets go (the controller's probe fleet, not under test here)."""

    def __init__(self) -> None:
        self.targets: set[str] = set()

    def upsert(self, target: prober_pb.ProbeTarget) -> None:
        self.targets.add(target.target_id)

    def remove(self, target_id: str) -> None:
        self.targets.discard(target_id)


def _launch_event(type_: int, **fields: object) -> prov_res.LaunchEvent:
    return prov_res.LaunchEvent(sequence=1, time=pbtime.timestamp(T0), type=type_, **fields)  # type: ignore[arg-type]


def _probe(ready: bool, at: float, *, code: int = 0, error: str = "") -> prober_pb.ProbeResult:
    return prober_pb.ProbeResult(ready=ready, probe_time=pbtime.timestamp(at), http_code=code, error=error)


LE = prov_res.LaunchEventType
# (name, facts before, domain event, how the reconciler hears it)
ROWS = [
    ("provisioning", Life(), lc.LaunchProvisioning(), ("launch", _launch_event(LE.LAUNCH_EVENT_TYPE_PROVISIONING))),
    (
        "attempt failed",
        Life(launch=LP.RUNNING),
        lc.LaunchAttemptFailed(2, "quota"),
        ("launch", _launch_event(LE.LAUNCH_EVENT_TYPE_ATTEMPT_FAILED, attempt=2, message="quota")),
    ),
    ("running", Life(launch=LP.RUNNING), lc.LaunchRunning(), ("launch", _launch_event(LE.LAUNCH_EVENT_TYPE_RUNNING))),
    (
        "broken setup",
        Life(launch=LP.RUNNING),
        lc.LaunchFailed("setup exited with code 2", Cause.USER),
        (
            "launch",
            _launch_event(
                LE.LAUNCH_EVENT_TYPE_FAILED, message="setup exited with code 2", cause=prov_res.FAILURE_CAUSE_USER
            ),
        ),
    ),
    (
        "no capacity",
        Life(launch=LP.RUNNING),
        lc.LaunchFailed("no capacity", Cause.INFRASTRUCTURE, capacity=True),
        (
            "launch",
            _launch_event(
                LE.LAUNCH_EVENT_TYPE_FAILED,
                message="no capacity",
                capacity_unavailable=True,
                cause=prov_res.FAILURE_CAUSE_INFRASTRUCTURE,
            ),
        ),
    ),
    (
        "cancelled",
        Life(launch=LP.RUNNING),
        lc.LaunchFailed("stop", cancelled=True),
        ("launch", _launch_event(LE.LAUNCH_EVENT_TYPE_CANCELLED, message="stop")),
    ),
    ("app crash before ready", STARTING, lc.AppExited(1), ("exit", 1)),
    ("app crash once ready", READY, lc.AppExited(137), ("exit", 137)),
    ("app exit 0", READY, lc.AppExited(0), ("exit", 0)),
    ("exit before RUNNING", Life(launch=LP.RUNNING), lc.AppExited(3), ("exit", 3)),
    ("spot vanished", dataclasses.replace(READY, is_spot=True), lc.Gone(), ("gone", False)),
    ("preempted", READY, lc.Gone(preempted=True), ("gone", True)),
    ("on-demand vanished", READY, lc.Gone(), ("gone", False)),
    ("first failed probe", STARTING, lc.Probed(False, T0, http_code=503), ("probe", _probe(False, T0, code=503))),
    ("within the delay", DELAYING, lc.Probed(False, T0 + 10), ("probe", _probe(False, T0 + 10))),
    (
        "past the delay",
        DELAYING,
        lc.Probed(False, T0 + 10.5, error="refused"),
        ("probe", _probe(False, T0 + 10.5, error="refused")),
    ),
    ("first success", DELAYING, lc.Probed(True, T0 + 3), ("probe", _probe(True, T0 + 3))),
    ("ready again", READY, lc.Probed(True, T0 + 50), ("probe", _probe(True, T0 + 50))),
    (
        "streak starts",
        READY,
        lc.Probed(False, T0 + 50, error="timeout"),
        ("probe", _probe(False, T0 + 50, error="timeout")),
    ),
    ("streak short", NOT_READY, lc.Probed(False, T0 + 129), ("probe", _probe(False, T0 + 129))),
    ("streak spans the window", NOT_READY, lc.Probed(False, T0 + 130), ("probe", _probe(False, T0 + 130))),
    ("recovered", NOT_READY, lc.Probed(True, T0 + 131), ("probe", _probe(True, T0 + 131))),
]

# Issue 19 changes these: today an infrastructure failure of a launch stops the version.
CHANGED_BY_ISSUE_19 = [
    (
        "transient 503",
        Life(launch=LP.RUNNING),
        lc.LaunchFailed("HTTP 503", Cause.INFRASTRUCTURE),
        (
            "launch",
            _launch_event(LE.LAUNCH_EVENT_TYPE_FAILED, message="HTTP 503", cause=prov_res.FAILURE_CAUSE_INFRASTRUCTURE),
        ),
    ),
]

# Memory-only parts of a Life: the reconciler keeps them outside the record.
_MEMORY = {"pending_exit": None, "vanished": False}


@pytest.mark.parametrize(("name", "before", "event", "heard"), ROWS, ids=[r[0] for r in ROWS])
async def test_step_matches_the_reconciler(
    tmp_path: object, name: str, before: Life, event: lc.Event, heard: tuple[str, object]
) -> None:
    db = store.Store(os.path.join(str(tmp_path), "store.db"), synchronous="NORMAL")
    parsed = spec.parse(YAML, require_name=True)
    db.create_service("svc", parsed, now=time.time())
    rid = db.allocate_replica_id("svc")
    record = res.Replica(service="svc", replica_id=rid, replica_name=f"svc-{rid}", version=1, endpoint="http://x")
    record.is_spot = before.is_spot
    convert.put_life(record, before)
    record.status = convert.status_of(record)  # type: ignore[assignment]
    db.put_replica(record)
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # nothing listens: no call gets anywhere
    rec = reconciler.ServiceReconciler(
        "svc",
        db=db,
        provisioner=prov_grpc.ProvisionerServiceStub(channel),
        probes=Probes(),
        tuning=reconciler.Tuning(),
        on_gone=lambda _: None,
    )
    try:
        rec.start()
        stopped_before = dict(rec._state.stopped)
        kind, payload = heard
        if kind == "launch":
            assert isinstance(payload, prov_res.LaunchEvent)
            rec._on_launch_event(rid, payload)
        elif kind == "exit":
            rec.on_app_exit(rid, int(payload))  # type: ignore[call-overload]
        elif kind == "gone":
            rec.on_replica_gone(rid, preempted=bool(payload))
        else:
            assert isinstance(payload, prober_pb.ProbeResult)
            rec.on_probe_result(rid, payload)
        got = convert.life_of(rec.replicas[rid])
        torn_down = rid in rec._teardowns
        stopped = set(rec._state.stopped) - set(stopped_before)
    finally:
        await rec.stop()
        await channel.close()
        db.close()

    windows = convert.windows_of(parsed, parsed)
    want, actions = lc.step(before, event, windows)
    assert got == dataclasses.replace(want, drain_s=got.drain_s, **_MEMORY)
    assert want.drain_s == got.drain_s or not torn_down
    assert torn_down is any(isinstance(a, lc.StartTeardown) for a in actions)
    stops = any(
        failures.stops_version(a.failure, version=1, latest_version=1, ever_ready=before.first_ready_time is not None)
        for a in actions
        if isinstance(a, lc.Failed)
    )
    assert stopped == ({"1"} if stops else set())


def test_issue_19_rows_differ_only_where_it_says() -> None:
    # The domain retries what today's reconciler stops on: an infrastructure failure.
    for _, before, event, _ in CHANGED_BY_ISSUE_19:
        _, actions = lc.step(before, event)
        (failure,) = [a.failure for a in actions if isinstance(a, lc.Failed)]
        assert not failures.stops_version(failure, version=1, latest_version=1, ever_ready=False)
        assert failures.pauses_launches(failure)

"""The rollout driver: the spec's section as config, decisions persisted (a restarted controller
resumes the same step), analysis fed by load report samples, the status shown."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest

from replicaplane.controller.v1 import resources_pb2 as res
from services.common import spec
from services.controller import event_log, rollouts, store, writer
from services.controller.domain import analysis
from services.controller.domain import rollout as ro
from services.controller.domain import status as st

YAML = """
name: svc
service:
  readiness_probe: /health
  replicas: 4
  rollout:
    strategy: canary
    steps: [{weight: 25, pause_seconds: 10}]
    progress_deadline_seconds: 100
    analysis: {window_seconds: 10, min_requests: 10}
resources:
  ports: 8080
run: serve
"""
READY = st.ReplicaStatus.READY


@pytest.fixture
def db(tmp_path) -> Iterator[store.Store]:
    with store.Store(os.path.join(str(tmp_path), "state.db")) as s:
        s.create_service("svc", spec.parse(YAML), now=0.0)
        yield s


@pytest.fixture
async def log_(db: store.Store) -> AsyncIterator[event_log.Events]:
    db_writer = writer.Writer(db.path, db=db.reopen())
    e = event_log.Events(db=db, db_writer=db_writer)
    e.open("svc", {})
    yield e
    e.close()
    await db_writer.close()


def test_config_of_the_spec_and_defaults() -> None:
    config = rollouts.config_of(spec.parse(YAML))
    assert config.steps == (ro.Step(25, 10.0),)
    assert (config.progress_deadline_s, config.auto_rollback) == (100.0, True)
    assert (config.thresholds.window_s, config.thresholds.min_requests) == (10.0, 10)
    plain = spec.parse(YAML.replace("    strategy: canary\n    steps: [{weight: 25, pause_seconds: 10}]\n", ""))
    assert rollouts.config_of(plain).steps == ro.Config().steps  # --mode canary on a rolling spec


def views(stable: int, canary: int) -> list[st.ReplicaView]:
    out = [st.ReplicaView(i + 1, 1, READY) for i in range(stable)]
    return out + [st.ReplicaView(100 + i, 2, READY) for i in range(canary)]


async def test_a_rollout_resumes_at_the_same_step_after_a_restart(db: store.Store, log_: event_log.Events) -> None:
    r = rollouts.Rollout("svc", db=db, log_=log_)
    r.set_spec(spec.parse(YAML))
    r.begin(1, 2, now=0.0)
    first = r.decide(views(4, 0), target=4, canary_stopped="", now=1.0)
    assert first is not None
    assert (first.plan.launch, first.decision.weights) == (1, {1: 750, 2: 250})
    r.decide(views(4, 1), target=4, canary_stopped="", now=2.0)
    again = rollouts.Rollout("svc", db=db, log_=log_)  # a restarted controller
    again.set_spec(spec.parse(YAML))
    assert again.state == r.state and again.state is not None and again.state.step_ready_at == 2.0
    moved = again.decide(views(4, 1), target=4, canary_stopped="", now=12.0)
    assert moved is not None and moved.decision.state.step == 2 and moved.plan.launch == 3
    status = again.status()
    assert status is not None
    assert (status.state, status.step, status.step_count, status.canary_weight) == (
        res.ROLLOUT_STATE_PROGRESSING,
        2,
        1,
        100,
    )
    assert status.deadline_time.seconds == 112
    done = again.decide(views(4, 4), target=4, canary_stopped="", now=13.0)
    assert done is not None and done.decision.action is ro.Action.COMPLETE
    assert sorted(done.plan.teardown) == [1, 2, 3, 4]
    assert not again.active
    reasons = [e.reason for e in log_.list("svc", 0, "")[0]]
    assert reasons == ["RolloutStarted", "RolloutStep", "RolloutSucceeded"]


async def test_load_report_samples_fail_the_analysis_and_roll_back(db: store.Store, log_: event_log.Events) -> None:
    r = rollouts.Rollout("svc", db=db, log_=log_)
    r.set_spec(spec.parse(YAML))
    r.begin(1, 2, now=0.0)
    r.add_samples({1: analysis.Sample(requests=90), 2: analysis.Sample(requests=10, server_errors=5)}, now=1.0)
    out = r.decide(views(4, 1), target=4, canary_stopped="", now=1.5)
    assert out is not None
    assert (out.decision.action, out.decision.weights, out.plan.teardown) == (ro.Action.ROLLBACK, {1: 1000}, (100,))
    assert r.state is not None and r.state.message.startswith("rolled back: analysis failed: error rate 50.0 %")
    failed = [e for e in log_.list("svc", 0, "")[0] if e.reason == "RolloutRolledBack"]
    assert failed and failed[0].type == res.EVENT_TYPE_WARNING
    assert rollouts.Rollout("svc", db=db, log_=log_).state == r.state
    r.end()
    assert db.get_rollout_state("svc") is None and r.status() is None

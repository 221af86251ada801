"""Canary rollouts through the controller's API (real server and prober, scripted provisioner):
the traffic split pushed with the endpoints, each failure path (analysis, progress deadline, stop
rule, abort) rolling back, `auto_rollback: false` holding, promote, and an in-place update."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.service import test_controller as tc

READY = res.REPLICA_STATUS_READY
PROGRESSING, SUCCEEDED = res.ROLLOUT_STATE_PROGRESSING, res.ROLLOUT_STATE_SUCCEEDED
ROLLED_BACK, FAILED = res.ROLLOUT_STATE_ROLLED_BACK, res.ROLLOUT_STATE_FAILED


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[tc.Env]:
    async with tc.started(tmp_path) as e:
        yield e


def canary_spec(rollout: str = "", *, replicas: int = 2, run: str = "serve --v2") -> str:
    section = rollout or "{strategy: canary, steps: [{weight: 10, pause_seconds: 600}], analysis: {min_requests: 10}}"
    return tc.spec(replicas=replicas, run=run).replace("  replicas:", f"  rollout: {section}\n  replicas:")


async def service(env: tc.Env) -> res.Service:
    return (await env.stub.GetService(api.GetServiceRequest(service_name="svc"))).service


async def until(env: tc.Env, pred, timeout: float = 20.0) -> res.Service:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        svc = await service(env)
        if pred(svc):
            return svc
        assert asyncio.get_running_loop().time() < deadline, (svc.rollout, svc.status_message)
        await asyncio.sleep(0.05)


async def noted_history(env: tc.Env) -> list[res.ServiceVersion]:
    """The history once the rollback is noted in it (it is written just after the version)."""
    for _ in range(200):
        found = list((await env.stub.ListVersions(api.ListVersionsRequest(service_name="svc"))).versions)
        if found[-1].rollback_of:
            return found
        await asyncio.sleep(0.05)
    return found


async def weights(env: tc.Env) -> dict[int, int]:
    stream = env.stub.WatchEndpoints(api.WatchEndpointsRequest(service_name="svc"))
    msg = await stream.read()
    stream.cancel()
    return {w.version: w.weight for w in msg.version_weights}


async def settled_weights(env: tc.Env, expected: dict[int, int]) -> dict[int, int]:
    """The split pushed with the endpoints once it is `expected` (or after 5 s). The API shows a
    change as soon as it is made; the push follows once it is stored."""
    for _ in range(100):
        found = await weights(env)
        if found == expected:
            break
        await asyncio.sleep(0.05)
    return found


async def pushes_during(env: tc.Env, action: Coroutine[Any, Any, None]) -> list[api.WatchEndpointsResponse]:
    """Every endpoint push from now until `action` is done (and the last pushes after it)."""
    stream = env.stub.WatchEndpoints(api.WatchEndpointsRequest(service_name="svc"))
    pushes: list[api.WatchEndpointsResponse] = []

    async def collect() -> None:
        async for msg in stream:
            pushes.append(msg)

    task = asyncio.create_task(collect())
    try:
        await action
        await asyncio.sleep(0.2)
    finally:
        stream.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return pushes


def assert_routable(pushes: list[api.WatchEndpointsResponse], *, reaching: int) -> None:
    """The pushes reach endpoints of version `reaching`, and none carries a split that names no
    version with an endpoint (the balancer would route nothing)."""
    assert any(any(e.version == reaching for e in m.endpoints) for m in pushes)
    for m in pushes:
        weighted = {w.version for w in m.version_weights if w.weight > 0}
        if weighted and m.endpoints:
            versions = sorted({e.version for e in m.endpoints})
            assert weighted & set(versions), f"push {m.version}: weights {weighted}, endpoints of {versions}"


async def started(env: tc.Env, rollout: str = "") -> None:
    w = await tc.create(env, tc.spec(replicas=2))
    await w.until(lambda w: w.count(READY) == 2)
    w.cancel()
    await env.stub.UpdateService(
        api.UpdateServiceRequest(service_name="svc", yaml=canary_spec(rollout), mode=res.UPDATE_MODE_CANARY)
    )


async def report(env: tc.Env, seq: int, v1: tuple[int, int], v2: tuple[int, int]) -> None:
    await env.stub.ReportLoad(
        api.ReportLoadRequest(
            service_name="svc",
            balancer_id="b",
            sequence=seq,
            version_stats=[
                res.VersionStats(version=1, requests=v1[0], server_errors=v1[1]),
                res.VersionStats(version=2, requests=v2[0], server_errors=v2[1]),
            ],
        )
    )


async def test_a_canary_update_launches_the_steps_replicas_and_splits_the_traffic(env: tc.Env) -> None:
    await started(env)
    svc = await until(env, lambda s: s.rollout.step_start_time.seconds > 0 and s.ready_replicas == 3)
    r = svc.rollout
    assert (r.state, r.stable_version, r.canary_version, r.step, r.step_count, r.canary_weight) == (
        PROGRESSING,
        1,
        2,
        1,
        1,
        10,
    )
    assert r.message.startswith("step 1/1 (10 %): pausing")
    assert (svc.update_mode, svc.stable_version, list(svc.active_versions)) == (res.UPDATE_MODE_CANARY, 1, [1, 2])
    assert await settled_weights(env, {1: 900, 2: 100}) == {1: 900, 2: 100}
    replicas = (await env.stub.ListReplicas(api.ListReplicasRequest(service_name="svc"))).replicas
    assert sorted(r.version for r in replicas) == [1, 1, 2]  # one canary replica for 10 % of 2


async def test_a_failed_analysis_rolls_back_to_the_stable_spec(env: tc.Env) -> None:
    await started(env)
    await until(env, lambda s: s.ready_replicas == 3)
    await report(env, 1, (100, 0), (20, 10))
    svc = await until(env, lambda s: s.rollout.state == ROLLED_BACK)
    assert svc.rollout.message.startswith("rolled back: analysis failed: error rate 50.0 % over the last 30 s")
    svc = await until(env, lambda s: s.latest_version == 3 and s.ready_replicas == 2 and s.total_replicas == 2)
    assert await settled_weights(env, {3: 1000}) == {3: 1000}  # the restored spec alone, until the next update
    # The stable replicas, kept in place under the old spec (the canary's, shutting down and not
    # counted in the total, is gone once its teardown ends).
    for _ in range(400):
        replicas = (await env.stub.ListReplicas(api.ListReplicasRequest(service_name="svc"))).replicas
        if {r.version for r in replicas} == {3}:
            break
        await asyncio.sleep(0.05)
    assert {r.version for r in replicas} == {3} and len(replicas) == 2
    versions = await noted_history(env)
    assert [(v.version, v.outcome) for v in versions] == [
        (1, res.VERSION_OUTCOME_SUPERSEDED),
        (2, res.VERSION_OUTCOME_ROLLED_BACK),
        (3, res.VERSION_OUTCOME_ACTIVE),
    ]
    assert versions[1].reason.startswith("analysis failed: error rate 50.0 %")
    assert versions[2].rollback_of == 1 and versions[2].spec_digest == versions[0].spec_digest
    found = (await env.stub.ListEvents(api.ListEventsRequest(service_name="svc"))).events
    rolled = [e for e in found if e.reason == "RolloutRolledBack"]
    assert rolled and rolled[0].type == res.EVENT_TYPE_WARNING and rolled[0].object == "version/2"


async def test_every_endpoint_push_through_a_rollback_leaves_a_routable_version(env: tc.Env) -> None:
    # The restore relabels the stable replicas as version 3 between passes: the weights pushed
    # with those endpoints must already name version 3, or the balancer routes nothing (503s).
    await started(env)
    await until(env, lambda s: s.ready_replicas == 3)

    async def rollback() -> None:
        await report(env, 1, (100, 0), (20, 10))
        await until(env, lambda s: s.rollout.state == ROLLED_BACK)
        await until(env, lambda s: s.latest_version == 3 and s.ready_replicas == 2 and s.total_replicas == 2)

    assert_routable(await pushes_during(env, rollback()), reaching=3)


async def test_every_endpoint_push_of_an_update_after_a_rollback_leaves_a_routable_version(env: tc.Env) -> None:
    # After a rollback the split names the restored version; a rolling update then launches a new
    # version with no replica yet: the pushes until it ends the rollout must still route somewhere.
    await started(env)
    await until(env, lambda s: s.ready_replicas == 3)
    await report(env, 1, (100, 0), (20, 10))
    await until(env, lambda s: s.rollout.state == ROLLED_BACK)
    await until(env, lambda s: s.latest_version == 3 and s.ready_replicas == 2)
    assert await settled_weights(env, {3: 1000}) == {3: 1000}

    async def update() -> None:
        await env.stub.UpdateService(
            api.UpdateServiceRequest(service_name="svc", yaml=tc.spec(replicas=2, run="serve --v4"))
        )
        await until(env, lambda s: s.latest_version == 4 and list(s.active_versions) == [4] and s.ready_replicas == 2)

    assert_routable(await pushes_during(env, update()), reaching=4)


async def test_a_canary_that_never_gets_ready_is_rolled_back_at_the_deadline(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec(replicas=2))
    await w.until(lambda w: w.count(READY) == 2)
    env.provisioner.hold_launches = True
    rollout = "{strategy: canary, steps: [{weight: 10}], progress_deadline_seconds: 1}"
    await env.stub.UpdateService(
        api.UpdateServiceRequest(service_name="svc", yaml=canary_spec(rollout), mode=res.UPDATE_MODE_CANARY)
    )
    svc = await until(env, lambda s: s.rollout.state == ROLLED_BACK)
    assert svc.rollout.message == "rolled back: progress deadline: 0/1 replicas of version 2 READY after 1 s (step 1/1)"
    env.provisioner.hold_launches = False
    await until(env, lambda s: s.latest_version == 3 and s.ready_replicas == 2 and list(s.active_versions) == [3])
    w.cancel()


async def test_a_canary_whose_app_exits_before_ready_is_rolled_back_by_the_stop_rule(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec(replicas=2))
    await w.until(lambda w: w.count(READY) == 2)
    env.provisioner.dead_endpoint = True  # the canary never answers a probe...
    await env.stub.UpdateService(
        api.UpdateServiceRequest(service_name="svc", yaml=canary_spec(), mode=res.UPDATE_MODE_CANARY)
    )
    await w.until(
        lambda w: any(r.version == 2 and r.status == res.REPLICA_STATUS_STARTING for r in w.replicas.values())
    )
    canary = next(r for r in w.replicas.values() if r.version == 2)
    env.provisioner.dead_endpoint = False
    env.provisioner.app_exited(canary.replica_name, 1)  # ...and exits
    svc = await until(env, lambda s: s.rollout.state == ROLLED_BACK)
    assert svc.rollout.message.startswith("rolled back: scaling stopped: version 2 failed before ever being ready")
    await until(env, lambda s: s.latest_version == 3 and s.ready_replicas == 2)
    w.cancel()


async def test_without_auto_rollback_a_failed_canary_holds_until_aborted(env: tc.Env) -> None:
    await started(env, "{strategy: canary, steps: [{weight: 10}], auto_rollback: false, analysis: {min_requests: 10}}")
    await until(env, lambda s: s.ready_replicas == 3)
    await report(env, 1, (100, 0), (20, 10))
    svc = await until(env, lambda s: s.rollout.state == FAILED)
    assert svc.rollout.message.endswith("(auto_rollback is off: promote, abort or update)")
    assert svc.latest_version == 2 and await weights(env) == {1: 900, 2: 100}  # held as it was
    aborted = (await env.stub.AbortRollout(api.AbortRolloutRequest(service_name="svc"))).service
    assert aborted.rollout.state == ROLLED_BACK and aborted.rollout.message == "rolled back: aborted by a user"
    await until(env, lambda s: s.latest_version == 3 and s.ready_replicas == 2)
    err = await tc.rpc_error(env.stub.AbortRollout(api.AbortRolloutRequest(service_name="svc")))
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "NO_ROLLOUT_IN_PROGRESS")


async def test_promote_full_gives_the_canary_everything_and_retires_the_stable_version(env: tc.Env) -> None:
    await started(env)
    await until(env, lambda s: s.ready_replicas == 3)
    promoted = (await env.stub.PromoteRollout(api.PromoteRolloutRequest(service_name="svc", full=True))).service
    assert promoted.rollout.step == 2  # the final step
    svc = await until(env, lambda s: s.rollout.state == SUCCEEDED and list(s.active_versions) == [2])
    assert svc.stable_version == 2 and svc.rollout.canary_weight == 100
    await until(env, lambda s: s.total_replicas == 2 and s.ready_replicas == 2)
    assert await settled_weights(env, {}) == {}
    found = [e.reason for e in (await env.stub.ListEvents(api.ListEventsRequest(service_name="svc"))).events]
    assert "RolloutPromoted" in found and "RolloutSucceeded" in found


async def test_a_canary_update_that_changes_only_the_service_section_is_in_place(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec(replicas=2))
    await w.until(lambda w: w.count(READY) == 2)
    up = await env.stub.UpdateService(
        api.UpdateServiceRequest(service_name="svc", yaml=canary_spec(run="serve"), mode=res.UPDATE_MODE_CANARY)
    )
    assert up.plan.in_place
    svc = await service(env)
    assert not svc.HasField("rollout") and svc.latest_version == 2
    w.cancel()

"""Events, version history and rollbacks through the controller's API (real server, real prober,
scripted provisioner)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.service import test_cli_habits as cli_habits
from tests.service import test_controller as tc

READY = res.REPLICA_STATUS_READY


@pytest.fixture
async def env(tmp_path) -> AsyncIterator[tc.Env]:
    async with tc.started(tmp_path) as e:
        yield e


async def events(env: tc.Env, name: str = "svc") -> list[res.Event]:
    return list((await env.stub.ListEvents(api.ListEventsRequest(service_name=name))).events)


async def until_event(env: tc.Env, pred, timeout: float = 10.0) -> res.Event:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        found = [e for e in await events(env) if pred(e)]
        if found:
            return found[-1]
        assert asyncio.get_running_loop().time() < deadline, [(e.reason, e.message) for e in await events(env)]
        await asyncio.sleep(0.05)


async def test_events_say_what_happened_to_the_service_and_its_replicas(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec())
    await w.until(lambda w: w.count(READY) == 1)
    await until_event(env, lambda e: e.reason == "ReplicaReady")
    got = [(e.reason, e.object) for e in await events(env)]
    assert got[:3] == [("ServiceCreated", "service"), ("ReplicaLaunching", "replica/1"), ("ReplicaReady", "replica/1")]
    env.provisioner.app_exited(w.replicas[1].replica_name, 3)
    failed = await until_event(env, lambda e: e.reason == "ReplicaFailed")
    assert failed.type == res.EVENT_TYPE_WARNING
    assert failed.message == "replica 1 (version 1) failed: app exited with code 3"
    assert failed.first_time.seconds > 0 and failed.count == 1
    seqs = [e.sequence for e in await events(env)]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    w.cancel()


async def test_watch_events_replays_after_a_sequence_then_follows(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec())
    await w.until(lambda w: w.count(READY) == 1)
    ready = await until_event(env, lambda e: e.reason == "ReplicaReady")
    stream = env.stub.WatchEvents(api.WatchEventsRequest(service_name="svc", after_sequence=ready.sequence - 1))
    first = await stream.read()
    assert first.event.sequence == ready.sequence
    await env.stub.DeleteService(api.DeleteServiceRequest(service_name="svc"))
    seen = []
    while (msg := await stream.read()) is not grpc.aio.EOF:  # it ends when the service is gone
        seen.append(msg.event.reason)
    assert "DeleteRequested" in seen
    w.cancel()


async def test_list_events_pages_and_refuses_bad_input(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec(replicas=2))
    await w.until(lambda w: w.count(READY) == 2)
    await until_event(env, lambda e: e.reason == "ReplicaReady" and e.object == "replica/2")
    every = await events(env)
    first = await env.stub.ListEvents(api.ListEventsRequest(service_name="svc", page_size=2))
    rest = await env.stub.ListEvents(
        api.ListEventsRequest(service_name="svc", page_size=1000, page_token=first.next_page_token)
    )
    assert [e.sequence for e in [*first.events, *rest.events]] == [e.sequence for e in every]
    err = await tc.rpc_error(env.stub.ListEvents(api.ListEventsRequest(service_name="svc", page_token="bogus")))
    assert (err.code, err.field_violations[0][0]) == (grpc.StatusCode.INVALID_ARGUMENT, "page_token")
    err = await tc.rpc_error(env.stub.ListEvents(api.ListEventsRequest(service_name="nope")))
    assert err.code == grpc.StatusCode.NOT_FOUND
    err = await tc.rpc_error(env.stub.WatchEvents(api.WatchEventsRequest(service_name="nope")).read())
    assert err.code == grpc.StatusCode.NOT_FOUND
    w.cancel()


async def test_events_are_kept_across_a_controller_restart(tmp_path) -> None:
    async with tc.started(tmp_path) as env:
        w = await tc.create(env, tc.spec())
        await w.until(lambda w: w.count(READY) == 1)
        await until_event(env, lambda e: e.reason == "ReplicaReady")
        before = await events(env)
        w.cancel()
    async with tc.started(tmp_path) as env:
        after = await events(env)
        assert [(e.sequence, e.reason) for e in after[: len(before)]] == [(e.sequence, e.reason) for e in before]


async def versions(env: tc.Env) -> list[tuple[int, int, str, int]]:
    found = (await env.stub.ListVersions(api.ListVersionsRequest(service_name="svc"))).versions
    return [(v.version, v.outcome, v.reason, v.update_mode) for v in found]


async def test_history_and_a_rollback_to_the_version_before(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec(replicas=2))
    await w.until(lambda w: w.count(READY) == 2)
    await env.stub.UpdateService(api.UpdateServiceRequest(service_name="svc", yaml=tc.spec(replicas=2, run="v2")))
    await w.until(lambda w: w.count(READY) == 2 and list(w.service.active_versions) == [2])
    S, A, RB = res.VERSION_OUTCOME_SUPERSEDED, res.VERSION_OUTCOME_ACTIVE, res.VERSION_OUTCOME_ROLLED_BACK
    assert await versions(env) == [(1, S, "", 0), (2, A, "", res.UPDATE_MODE_ROLLING)]

    dry = await env.stub.RollbackService(api.RollbackServiceRequest(service_name="svc", dry_run=True))
    assert (dry.to_version, dry.plan.new_version, dry.service.latest_version) == (1, 3, 2)
    back = await env.stub.RollbackService(api.RollbackServiceRequest(service_name="svc"))
    assert (back.to_version, back.plan.new_version) == (1, 3)
    await w.until(lambda w: w.count(READY) == 2 and list(w.service.active_versions) == [3])
    assert await versions(env) == [
        (1, S, "", 0),
        (2, RB, "rolled back to version 1 by a user", res.UPDATE_MODE_ROLLING),
        (3, A, "rollback to version 1", res.UPDATE_MODE_ROLLING),
    ]
    found = (await env.stub.ListVersions(api.ListVersionsRequest(service_name="svc"))).versions
    assert found[0].spec_digest == found[2].spec_digest != found[1].spec_digest
    assert found[2].rollback_of == 1
    rolled = await until_event(env, lambda e: e.reason == "RolledBack")
    assert rolled.message == "rolled back to the spec of version 1 as version 3 (rolling)"
    # Rolling back again skips the rolled back version 2.
    again = await env.stub.RollbackService(api.RollbackServiceRequest(service_name="svc", dry_run=True))
    assert again.to_version == 1
    w.cancel()


async def test_rollback_refusals(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec())
    cases = [
        (api.RollbackServiceRequest(service_name="svc"), grpc.StatusCode.FAILED_PRECONDITION, "NO_ROLLBACK_TARGET"),
        (api.RollbackServiceRequest(service_name="svc", to_version=1), grpc.StatusCode.FAILED_PRECONDITION, ""),
        (api.RollbackServiceRequest(service_name="svc", to_version=9), grpc.StatusCode.NOT_FOUND, "VERSION_NOT_FOUND"),
        (api.RollbackServiceRequest(service_name="svc", to_version=-1), grpc.StatusCode.INVALID_ARGUMENT, ""),
        (api.RollbackServiceRequest(service_name="nope"), grpc.StatusCode.NOT_FOUND, "SERVICE_NOT_FOUND"),
    ]
    for request, code, reason in cases:
        err = await tc.rpc_error(env.stub.RollbackService(request))
        assert err.code == code, request
        if reason:
            assert err.reason == reason
    assert (await env.stub.GetService(api.GetServiceRequest(service_name="svc"))).service.latest_version == 1
    w.cancel()


async def test_promote_and_abort_without_a_canary_rollout_are_refused(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec())
    for call in (
        env.stub.PromoteRollout(api.PromoteRolloutRequest(service_name="svc")),
        env.stub.AbortRollout(api.AbortRolloutRequest(service_name="svc")),
    ):
        err = await tc.rpc_error(call)
        assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "NO_ROLLOUT_IN_PROGRESS")
    err = await tc.rpc_error(env.stub.AbortRollout(api.AbortRolloutRequest(service_name="nope")))
    assert err.code == grpc.StatusCode.NOT_FOUND
    w.cancel()


async def test_replicactl_events_history_and_rollback(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec())
    await w.until(lambda w: w.count(READY) == 1)
    await until_event(env, lambda e: e.reason == "ReplicaReady")
    code, out, err = await cli_habits.ctl(env, "events", "svc")
    assert code == 0, err
    lines = out.splitlines()
    assert "Normal" in lines[0] and "ServiceCreated" in lines[0] and lines[0].endswith("created with version 1")
    assert any("ReplicaReady" in line and "replica/1" in line for line in lines)

    await env.stub.UpdateService(api.UpdateServiceRequest(service_name="svc", yaml=tc.spec(run="v2")))
    code, out, err = await cli_habits.ctl(env, "rollback", "svc")
    assert code == 0, err
    assert out.startswith("svc: back to the spec of version 1\nsvc: version 3\n")
    code, out, _ = await cli_habits.ctl(env, "history", "svc")
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["VERSION", "CREATED", "MODE", "DIGEST", "OUTCOME"]
    assert [r[0] for r in rows[1:]] == ["1", "2", "3"]
    assert out.splitlines()[2].endswith("rolled back: rolled back to version 1 by a user")
    assert out.splitlines()[3].endswith("active: rollback to version 1")
    assert rows[1][4] == rows[3][4] != rows[2][4]  # the digests

    code, _, err = await cli_habits.ctl(env, "rollback", "svc", "--to", "9")
    assert code != 0 and "version 9 is not in the history" in err
    code, _, err = await cli_habits.ctl(env, "rollout", "promote", "svc")
    assert code != 0 and "no canary rollout in progress" in err
    w.cancel()


async def test_replicactl_events_follow_prints_new_events_until_the_service_is_gone(env: tc.Env) -> None:
    w = await tc.create(env, tc.spec())
    await w.until(lambda w: w.count(READY) == 1)
    follow = asyncio.create_task(cli_habits.ctl(env, "events", "svc", "--follow", "--json"))
    await asyncio.sleep(0.5)
    await env.stub.DeleteService(api.DeleteServiceRequest(service_name="svc"))
    code, out, err = await asyncio.wait_for(follow, 30)
    assert code == 0, err
    reasons = [json.loads(line)["event"]["reason"] for line in out.splitlines()]
    assert reasons[0] == "ServiceCreated" and "DeleteRequested" in reasons
    w.cancel()

"""Canary rollouts end to end: controller, provisioner, prober and the real load balancer as
processes, real replica processes answering which version they run."""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from tests.helpers import balancer as lb
from tests.helpers import cluster as cl

pytestmark = pytest.mark.e2e


def app_yaml(tag: str, say: str, *, replicas: int = 2, rollout: str = "", extra: str = "", setup: str = "") -> str:
    """The load balancer test app answering `replica N <say>`, probed fast."""
    return (
        "name: web\n"
        "service:\n"
        "  readiness_probe:\n"
        "    path: /health\n"
        "    initial_delay_seconds: 60\n"
        "    endpoint_probe_interval_seconds: 0.2\n"
        f"  replicas: {replicas}\n" + (f"  rollout: {rollout}\n" if rollout else "") + "resources:\n"
        "  ports: 8080\n"
        + (f"setup: {setup}\n" if setup else "")
        + f"run: {sys.executable} {lb.LB_APP} --port 8080 --tag {tag} --say {say}{extra}\n"
    )


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def service(c: cl.Cluster) -> res.Service:
    return (await c.stub.GetService(api.GetServiceRequest(service_name="web"), timeout=5)).service


async def until_service(c: cl.Cluster, pred, timeout: float = 60.0) -> res.Service:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        svc = await service(c)
        if pred(svc):
            return svc
        assert time.monotonic() < deadline, f"never got there: {svc.rollout} {svc.status_message}"
        await asyncio.sleep(0.1)


async def hits(client: aiohttp.ClientSession, url: str, n: int, *, workers: int = 8) -> collections.Counter[str]:
    """`n` requests to /whoami; counts of `v1`, `v2` and `500` (an error answer)."""
    out: collections.Counter[str] = collections.Counter()
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            async with client.get(url + "/whoami") as resp:
                text = await resp.text()
                out["500" if resp.status >= 500 else text.split()[2]] += 1

    await asyncio.gather(*(worker() for _ in range(workers)))
    return out


async def started(c: cl.Cluster, yaml_text: str) -> lb.Balancer:
    await c.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text), timeout=10)
    b = await lb.start(c.controller.addr, "web", os.path.join(c.tmp, f"lb-web-{c.tag}"))
    await b.until(lambda s: sum(r.ready for r in s.replicas) == 2)
    return b


async def canary_update(c: cl.Cluster, yaml_text: str) -> None:
    await c.stub.UpdateService(
        api.UpdateServiceRequest(service_name="web", yaml=yaml_text, mode=res.UPDATE_MODE_CANARY), timeout=10
    )


async def versions(c: cl.Cluster) -> list[tuple[int, int, str]]:
    """The history, once the last version's notes are in (they are written just after it)."""
    for _ in range(100):
        found = (await c.stub.ListVersions(api.ListVersionsRequest(service_name="web"), timeout=5)).versions
        if found[-1].update_mode:
            break
        await asyncio.sleep(0.1)
    return [(v.version, v.outcome, v.reason) for v in found]


async def test_a_good_canary_splits_traffic_by_weight_and_is_promoted_to_all_of_it(
    cluster: cl.Cluster, client: aiohttp.ClientSession
) -> None:
    b = await started(cluster, app_yaml(cluster.tag, "v1"))
    try:
        steps = "{strategy: canary, steps: [{weight: 10, pause_seconds: 600}, {weight: 50, pause_seconds: 1}]}"
        await canary_update(cluster, app_yaml(cluster.tag, "v2", rollout=steps))
        svc = await until_service(cluster, lambda s: s.rollout.step_start_time.seconds > 0)
        assert (svc.rollout.step, svc.rollout.canary_weight, svc.rollout.stable_version) == (1, 10, 1)
        await b.until(lambda s: {v.version for v in s.versions if v.ready_replicas} == {1, 2})
        # 2,000 requests through the balancer at 10 %: within 3 points.
        seen = await hits(client, b.url, 2000)
        assert seen["500"] == 0
        share = 100.0 * seen["v2"] / 2000
        assert abs(share - 10.0) <= 3.0, seen
        # The pause is long: a person promotes; step 2 (50 %), then all the traffic.
        await cluster.stub.PromoteRollout(api.PromoteRolloutRequest(service_name="web"), timeout=5)
        svc = await until_service(cluster, lambda s: s.rollout.state == res.ROLLOUT_STATE_SUCCEEDED)
        assert svc.stable_version == 2
        await until_service(cluster, lambda s: list(s.active_versions) == [2] and s.ready_replicas == 2)
        await b.until(lambda s: {v.version for v in s.versions if v.ready_replicas} == {2})
        after = await hits(client, b.url, 100)
        assert after == collections.Counter({"v2": 100})
        assert [(v, o) for v, o, _ in await versions(cluster)] == [
            (1, res.VERSION_OUTCOME_SUPERSEDED),
            (2, res.VERSION_OUTCOME_ACTIVE),
        ]
        reasons = [
            e.reason
            for e in (await cluster.stub.ListEvents(api.ListEventsRequest(service_name="web"), timeout=5)).events
        ]
        for reason in ("RolloutStarted", "RolloutStep", "RolloutPromoted", "RolloutSucceeded"):
            assert reason in reasons
    finally:
        await b.close()


async def test_a_canary_serving_errors_is_rolled_back_automatically(
    cluster: cl.Cluster, client: aiohttp.ClientSession
) -> None:
    b = await started(cluster, app_yaml(cluster.tag, "v1"))
    try:
        rollout = "{strategy: canary, steps: [{weight: 10, pause_seconds: 600}], analysis: {window_seconds: 10}}"
        await canary_update(cluster, app_yaml(cluster.tag, "v2", rollout=rollout, extra=" --fail-every 2"))
        await b.until(lambda s: {v.version for v in s.versions if v.ready_replicas} == {1, 2})
        seen: collections.Counter[str] = collections.Counter()
        deadline = time.monotonic() + 60
        while (await service(cluster)).rollout.state == res.ROLLOUT_STATE_PROGRESSING:
            assert time.monotonic() < deadline
            seen += await hits(client, b.url, 50, workers=4)
        svc = await service(cluster)
        assert svc.rollout.state == res.ROLLOUT_STATE_ROLLED_BACK
        assert svc.rollout.message.startswith("rolled back: analysis failed: error rate"), svc.rollout.message
        # Clients saw at most the errors of the analysis window: a few percent of the requests.
        assert 0 < seen["500"] <= 0.1 * sum(seen.values()) + 20, seen
        # All the traffic is back on the stable spec (once the balancer has the push that says
        # so: the status can be read a moment before), the canary's replicas are gone.
        await b.until(lambda s: all(v.share_per_mille == 0 for v in s.versions if v.version == 2), timeout=5)
        after = await hits(client, b.url, 200)
        assert after == collections.Counter({"v1": 200}), after
        svc = await until_service(cluster, lambda s: s.latest_version == 3 and s.ready_replicas == 2)
        replicas = (await cluster.stub.ListReplicas(api.ListReplicasRequest(service_name="web"), timeout=5)).replicas
        assert {r.version for r in replicas if r.status != res.REPLICA_STATUS_SHUTTING_DOWN} == {3}
        history = await versions(cluster)
        assert [(v, o) for v, o, _ in history] == [
            (1, res.VERSION_OUTCOME_SUPERSEDED),
            (2, res.VERSION_OUTCOME_ROLLED_BACK),
            (3, res.VERSION_OUTCOME_ACTIVE),
        ]
        assert history[1][2].startswith("analysis failed: error rate"), history[1][2]
    finally:
        await b.close()


async def test_a_canary_that_never_gets_ready_is_rolled_back_at_its_deadline(cluster: cl.Cluster) -> None:
    await cluster.stub.CreateService(api.CreateServiceRequest(yaml=app_yaml(cluster.tag, "v1")), timeout=10)
    await until_service(cluster, lambda s: s.ready_replicas == 2)
    rollout = "{strategy: canary, steps: [{weight: 10, pause_seconds: 1}], progress_deadline_seconds: 3}"
    await canary_update(cluster, app_yaml(cluster.tag, "v2", rollout=rollout, setup="sleep 600"))
    svc = await until_service(cluster, lambda s: s.rollout.state == res.ROLLOUT_STATE_ROLLED_BACK, timeout=30)
    assert svc.rollout.message.startswith("rolled back: progress deadline: 0/1 replicas of version 2 READY")
    await until_service(
        cluster, lambda s: s.latest_version == 3 and s.ready_replicas == 2 and list(s.active_versions) == [3]
    )


async def test_a_killed_controller_resumes_the_same_step_without_an_extra_launch(cluster: cl.Cluster) -> None:
    await cluster.stub.CreateService(api.CreateServiceRequest(yaml=app_yaml(cluster.tag, "v1")), timeout=10)
    await until_service(cluster, lambda s: s.ready_replicas == 2)
    rollout = "{strategy: canary, steps: [{weight: 50, pause_seconds: 600}]}"
    await canary_update(cluster, app_yaml(cluster.tag, "v2", rollout=rollout))
    before = await until_service(cluster, lambda s: s.rollout.step_start_time.seconds > 0)
    ids = {
        r.replica_id
        for r in (await cluster.stub.ListReplicas(api.ListReplicasRequest(service_name="web"), timeout=5)).replicas
    }
    await cluster.restart_controller(kill=True)
    await asyncio.sleep(2)
    after = await until_service(cluster, lambda s: s.ready_replicas == 3)
    assert (after.rollout.step, after.rollout.step_start_time) == (before.rollout.step, before.rollout.step_start_time)
    again = {
        r.replica_id
        for r in (await cluster.stub.ListReplicas(api.ListReplicasRequest(service_name="web"), timeout=5)).replicas
    }
    assert again == ids  # no extra launch
    await cluster.stub.AbortRollout(api.AbortRolloutRequest(service_name="web"), timeout=5)
    svc = await until_service(cluster, lambda s: s.rollout.state == res.ROLLOUT_STATE_ROLLED_BACK)
    assert svc.rollout.message == "rolled back: aborted by a user"

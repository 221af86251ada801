"""The kubernetes backend against the API server's protocol and failures.

The test API server (tests/helpers/kube_api.py) keeps the real one's watch protocol (versions,
resume, 410, bookmarks, server-side timeouts) and answers scripted errors: these tests check
that the backend resumes instead of relisting, relists when it must, retries what is transient
a bounded number of times and says clearly what failed. Also: the objects a replica owns go
with its Pod.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import resources_pb2
from services.provisioner import kube_objects
from tests.helpers import kube_emulator
from tests.helpers import kube_provisioner as kp
from tests.helpers import provisioner_client as client

R = client.R


@pytest.fixture
def emulator(tmp_path) -> Iterator[kube_emulator.Emulator]:
    emu = kube_emulator.Emulator(str(tmp_path / "emu"), bookmark_interval_s=0.2).start()
    try:
        yield emu
    finally:
        emu.stop()


@pytest.fixture
def instance() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def prov(tmp_path, emulator, instance) -> AsyncIterator[kp.Running]:
    running = await kp.start(kp.settings(str(tmp_path), emulator, instance, kubernetes_service_type="ClusterIP"))
    try:
        yield running
    finally:
        await running.stop()


async def _watch(stub) -> grpc.aio.UnaryStreamCall:
    call = stub.WatchReplicas(pb.WatchReplicasRequest())
    await client.next_event(call, R.REPLICA_EVENT_TYPE_SNAPSHOT_END)
    return call


async def _until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not await asyncio.to_thread(predicate):
            await asyncio.sleep(0.05)


def _posts(emulator: kube_emulator.Emulator, kind: str) -> int:
    return len([p for p, _ in emulator.logged("POST") if p.endswith(f"/{kind}")])


def _foreign_churn(emulator: kube_emulator.Emulator, count: int) -> None:
    """Changes the backend's watch does not select (another app's Secrets) move the version on."""
    for i in range(count):
        emulator.run(
            emulator.api._create,
            "secrets",
            emulator.namespace,
            {"metadata": {"name": f"other-{uuid.uuid4().hex[:6]}-{i}", "labels": {"app": "other"}}},
        )


# ---- the watch protocol ------------------------------------------------------------------------


async def test_watch_resumes_from_its_version_after_each_server_timeout(prov, emulator) -> None:
    await client.collect(prov.stub.Launch(client.launch_request(1)))
    await _until(lambda: len(emulator.watches()) >= 4)  # the server ended three watches (1 s each)
    watches = emulator.watches()
    assert len(emulator.lists()) == 1  # only the list at start: every watch resumed
    versions = [int(q["resourceVersion"]) for q in watches]
    assert all(v > 0 for v in versions) and versions == sorted(versions)
    assert all(q.get("allowWatchBookmarks") == "true" and q.get("timeoutSeconds") == "1" for q in watches)
    # Resuming lost nothing.
    watch = await _watch(prov.stub)
    await emulator.call(emulator.kubelet.delete_pod("svc-1"))
    assert (await client.next_event(watch, R.REPLICA_EVENT_TYPE_VANISHED)).replica.name == "svc-1"
    watch.cancel()


async def test_bookmarks_keep_a_quiet_watch_resumable_across_compaction(prov, emulator) -> None:
    await client.collect(prov.stub.Launch(client.launch_request(1)))
    start = len(emulator.watches())
    _foreign_churn(emulator, 5)  # the version moves on; this watch sees none of it but bookmarks
    await asyncio.sleep(0.5)  # more than two bookmark intervals
    emulator.run(emulator.api.compact)
    await _until(lambda: len(emulator.watches()) >= start + 2)
    assert len(emulator.lists()) == 1  # resumed from a bookmark's version: no 410, no relist
    last = int(emulator.watches()[-1]["resourceVersion"])
    assert last >= emulator.run(lambda: emulator.api.compacted)


async def test_an_expired_version_relists_and_reports_what_changed_meanwhile(prov, emulator) -> None:
    await client.collect(prov.stub.Launch(client.launch_request(1)))
    await client.collect(prov.stub.Launch(client.launch_request(2)))
    watch = await _watch(prov.stub)
    # The watch is down (the API server answers 503) while a Pod goes and the history is compacted.
    fault = emulator.run(emulator.api.fail, "watch", "pods", 503, times=10_000)
    emulator.run(emulator.api.end_watches)
    await _until(lambda: fault.hits >= 1)
    await emulator.call(emulator.kubelet.delete_pod("svc-1"))
    emulator.run(emulator.api.compact)
    lists = len(emulator.lists())
    fault.times = 0
    vanished = await client.next_event(watch, R.REPLICA_EVENT_TYPE_VANISHED)
    assert vanished.replica.name == "svc-1"
    assert len(emulator.lists()) == lists + 1  # the 410 made it relist, once
    watch.cancel()
    replica = (await prov.stub.GetReplica(pb.GetReplicaRequest(name="svc-2"))).replica
    assert replica.app_state == resources_pb2.APP_STATE_RUNNING


async def test_a_410_answer_to_opening_a_watch_relists(prov, emulator) -> None:
    await client.collect(prov.stub.Launch(client.launch_request(1)))
    lists = len(emulator.lists())
    emulator.run(emulator.api.fail, "watch", "pods", 410, times=1)
    emulator.run(emulator.api.end_watches)
    await _until(lambda: len(emulator.lists()) == lists + 1)
    watch = await _watch(prov.stub)
    await emulator.call(emulator.kubelet.delete_pod("svc-1"))
    assert (await client.next_event(watch, R.REPLICA_EVENT_TYPE_VANISHED)).replica.name == "svc-1"
    watch.cancel()


async def test_a_stalled_watch_is_reopened_from_its_version(tmp_path, emulator, instance) -> None:
    running = await kp.start(
        kp.settings(str(tmp_path), emulator, instance, kubernetes_watch_timeout_s=30, kubernetes_watch_idle_s=1)
    )
    try:
        await client.collect(running.stub.Launch(client.launch_request(1)))
        watch = await _watch(running.stub)
        before = len(emulator.watches())
        emulator.run(emulator.api.stall, 1)
        emulator.run(emulator.api.end_watches)  # the next watch is accepted and then silent
        await _until(lambda: len(emulator.watches()) >= before + 2)  # given up on after 1 s of silence
        assert len(emulator.lists()) == 1
        await emulator.call(emulator.kubelet.delete_pod("svc-1"))
        assert (await client.next_event(watch, R.REPLICA_EVENT_TYPE_VANISHED)).replica.name == "svc-1"
        watch.cancel()
    finally:
        await running.stop()


async def test_watch_errors_are_retried_until_the_watch_works_again(prov, emulator) -> None:
    await client.collect(prov.stub.Launch(client.launch_request(1)))
    watch = await _watch(prov.stub)
    forbidden = emulator.run(emulator.api.fail, "watch", "pods", 403, times=2)
    failing = emulator.run(emulator.api.fail, "watch", "pods", 500, times=2)
    emulator.run(emulator.api.end_watches)
    await _until(lambda: forbidden.hits == 2 and failing.hits == 2)
    await emulator.call(emulator.kubelet.delete_pod("svc-1"))
    assert (await client.next_event(watch, R.REPLICA_EVENT_TYPE_VANISHED)).replica.name == "svc-1"
    watch.cancel()


# ---- API errors on launch and teardown --------------------------------------------------------


async def test_transient_api_errors_are_retried_within_one_launch_attempt(prov, emulator) -> None:
    emulator.run(emulator.api.fail, "create", "secrets", 429, times=1, retry_after=0)
    emulator.run(emulator.api.fail, "create", "pods", 503, times=2)
    emulator.run(emulator.api.fail, "create", "services", 500, times=1)
    spec = client.spec()
    spec.secrets["TOKEN"] = "s3cret"
    events = await client.collect(prov.stub.Launch(client.launch_request(1, spec_=spec)))
    assert client.types(events) == ["QUEUED", "PROVISIONING", "RUNNING"]
    assert (_posts(emulator, "secrets"), _posts(emulator, "pods"), _posts(emulator, "services")) == (2, 3, 2)


async def test_a_create_whose_answer_was_lost_is_recognised_as_done(prov, emulator) -> None:
    emulator.run(emulator.api.fail, "create", "pods", 500, times=1, after_commit=True)
    events = await client.collect(prov.stub.Launch(client.launch_request(1)))
    assert client.types(events) == ["QUEUED", "PROVISIONING", "RUNNING"]
    assert _posts(emulator, "pods") == 2  # the retry met its own Pod (409) and took it
    assert await emulator.names("pod") == ["svc-1"]
    await client.wait_http(events[-1].endpoint + "/health")


async def test_a_persistent_server_error_fails_each_attempt_after_bounded_retries(prov, emulator) -> None:
    emulator.run(emulator.api.fail, "create", "pods", 503, times=10_000, message="etcdserver: request timed out")
    events = await client.collect(prov.stub.Launch(client.launch_request(1)))
    assert client.types(events)[-1] == "FAILED"
    assert client.types(events).count("ATTEMPT_FAILED") == 3
    assert _posts(emulator, "pods") == 9  # 3 launch attempts of 3 tries each
    assert events[-1].message == (
        f"could not create pod {emulator.namespace}/svc-1: the API server failed "
        "(503 ServiceUnavailable, 3 tries): etcdserver: request timed out"
    )
    assert not events[-1].permanent


async def test_forbidden_is_not_retried_per_call_and_says_so(prov, emulator) -> None:
    # No access is the cluster operator's to fix, not the spec's: each launch attempt fails at
    # its first try (no per-call retries), the launch is retried and never permanent, so it
    # recovers once the access is granted.
    emulator.run(emulator.api.fail, "create", "pods", 403, times=10_000)
    events = await client.collect(prov.stub.Launch(client.launch_request(1)))
    assert client.types(events).count("ATTEMPT_FAILED") == 3 and client.types(events)[-1] == "FAILED"
    assert not events[-1].permanent and events[-1].cause == resources_pb2.FAILURE_CAUSE_INFRASTRUCTURE
    assert events[-1].message.startswith(
        f"could not create pod {emulator.namespace}/svc-1: no access (403 Forbidden): "
    )
    assert _posts(emulator, "pods") == 3  # one per attempt


async def test_a_foreign_object_of_the_same_name_is_a_conflict_not_taken_over(prov, emulator) -> None:
    body = {"metadata": {"name": "svc-1", "labels": {"app": "someone-else"}}, "spec": {"containers": []}}
    emulator.run(emulator.api._create, "pods", emulator.namespace, body)
    events = await client.collect(prov.stub.Launch(client.launch_request(1)))
    assert client.types(events)[-1] == "FAILED"
    assert events[-1].message == (
        f"could not create pod {emulator.namespace}/svc-1: conflict (409 AlreadyExists): "
        'pods "svc-1" already exists (the object of that name is not this provisioner\'s)'
    )
    assert (await emulator.pod("svc-1"))["metadata"]["labels"] == {"app": "someone-else"}  # untouched


async def test_teardown_retries_transient_errors_and_names_a_lasting_one(prov, emulator) -> None:
    await client.collect(prov.stub.Launch(client.launch_request(1)))
    await client.collect(prov.stub.Launch(client.launch_request(2)))
    emulator.run(emulator.api.fail, "delete", "pods", 503, times=2, name="svc-1")
    teardown = await client.collect(prov.stub.Terminate(pb.TerminateRequest(name="svc-1")))
    assert client.types(teardown) == ["TERMINATING", "TERMINATED"]

    emulator.run(emulator.api.fail, "delete", "pods", 403, times=10_000, name="svc-2")
    teardown = await client.collect(prov.stub.Terminate(pb.TerminateRequest(name="svc-2")))
    assert client.types(teardown) == ["TERMINATING", "RETRYING", "RETRYING", "FAILED"]
    assert teardown[-1].message.startswith(
        f"teardown failed: could not delete Pod {emulator.namespace}/svc-2: no access (403 Forbidden): "
    )
    deletes = [p for p, _ in emulator.logged("DELETE") if p.endswith("/pods/svc-2")]
    assert len(deletes) == 3  # one per teardown attempt: a 403 is not retried by the call


async def test_a_provisioner_that_may_not_list_pods_stops_at_start_saying_why(tmp_path, emulator, instance) -> None:
    emulator.run(emulator.api.fail, "list", "pods", 403, times=10_000)
    with pytest.raises(RuntimeError) as caught:
        await kp.start(kp.settings(str(tmp_path), emulator, instance))
    assert str(caught.value).startswith(
        f"kubernetes backend: cannot list Pods in namespace {emulator.namespace}: no access (403 Forbidden): "
    )


# ---- objects owned by the Pod -----------------------------------------------------------------


async def test_secret_and_service_are_owned_by_the_pod_and_go_with_it(prov, emulator) -> None:
    spec = client.spec()
    spec.secrets["API_TOKEN"] = "s3cret-value"
    await client.collect(prov.stub.Launch(client.launch_request(1, spec_=spec)))
    pod = await emulator.pod("svc-1")
    for kind in ("secrets", "services"):
        owned = emulator.run(emulator.api.get, kind, emulator.namespace, "svc-1")
        assert owned["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Pod", "name": "svc-1", "uid": pod["metadata"]["uid"]}
        ]
    # The Pod goes while nobody runs the provisioner (no record, no teardown): nothing is left.
    await prov.stop()
    await emulator.call(emulator.kubelet.delete_pod("svc-1"))
    await _until(lambda: not emulator.run(emulator.api.names, "secrets", emulator.namespace))
    assert emulator.run(emulator.api.names, "services", emulator.namespace) == []


async def test_leftovers_of_an_interrupted_launch_do_not_block_the_next_one(prov, emulator, instance) -> None:
    # A crash between creating the Secret and the Pod leaves a Secret of ours with no Pod.
    labels = {**kube_objects.selector(instance), kube_objects.LABEL_POD: "svc-1"}
    body = {"metadata": {"name": "svc-1", "labels": labels}, "data": {"API_TOKEN": "b2xk"}}
    emulator.run(emulator.api._create, "secrets", emulator.namespace, body)
    spec = client.spec()
    spec.secrets["API_TOKEN"] = "new"
    events = await client.collect(prov.stub.Launch(client.launch_request(1, spec_=spec)))
    assert client.types(events) == ["QUEUED", "PROVISIONING", "RUNNING"]
    secret = emulator.run(emulator.api.get, "secrets", emulator.namespace, "svc-1")
    assert secret["data"] == {"API_TOKEN": "bmV3"}  # the new value, not the leftover's


async def test_orphaned_secrets_and_services_are_removed_at_start(tmp_path, emulator, instance) -> None:
    ours = {**kube_objects.selector(instance), kube_objects.LABEL_POD: "svc-9"}
    emulator.run(emulator.api._create, "secrets", emulator.namespace, {"metadata": {"name": "svc-9", "labels": ours}})
    emulator.run(emulator.api._create, "services", emulator.namespace, {"metadata": {"name": "svc-9", "labels": ours}})
    theirs = {**kube_objects.selector("someone-else"), kube_objects.LABEL_POD: "svc-8"}
    emulator.run(emulator.api._create, "secrets", emulator.namespace, {"metadata": {"name": "svc-8", "labels": theirs}})
    running = await kp.start(kp.settings(str(tmp_path), emulator, instance))
    try:
        assert await emulator.names("secret") == ["svc-8"]
        assert await emulator.names("service") == []
    finally:
        await running.stop()

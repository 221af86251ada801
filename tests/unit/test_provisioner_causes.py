"""Failure causes: the per-backend classifiers (tables) and how the provisioner core reports them."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator

import pytest

from services.provisioner import backend, causes, logstore, manager, model, store
from tests.helpers.provisioner_fakes import FakeBackend

USER = model.FailureCause.USER
INFRA = model.FailureCause.INFRASTRUCTURE
L = model.LaunchEventType
R = model.ReplicaEventType
Local = causes.Local
Kube = causes.Kube

FAST = manager.Options(
    launch_backoff_initial_s=0.01,
    launch_backoff_max_s=0.02,
    teardown_backoff_initial_s=0.01,
    teardown_backoff_max_s=0.02,
    cancel_timeout_s=2,
    kill_grace_s=0,
)


@pytest.mark.parametrize(
    ("failure", "err", "cause"),
    [
        (Local.SETUP_EXITED, None, USER),
        (Local.APP_EXITED, None, USER),
        (Local.UNRUNNABLE_SPEC, None, USER),
        (Local.MISSING_FILES, None, USER),
        (Local.COPY_FAILED, errno.EACCES, USER),  # the user's files cannot be read
        (Local.COPY_FAILED, errno.ELOOP, USER),
        (Local.COPY_FAILED, errno.ENOENT, USER),  # changed under the copy
        (Local.COPY_FAILED, errno.ENOSPC, INFRA),  # this host's disk is full
        (Local.COPY_FAILED, errno.EROFS, INFRA),
        (Local.COPY_FAILED, errno.EMFILE, INFRA),
        (Local.COPY_FAILED, None, INFRA),
        (Local.START_FAILED, None, INFRA),
        (Local.NO_ADDRESS, None, INFRA),
        (Local.NO_CAPACITY, None, INFRA),
        (Local.DELETED_DURING_LAUNCH, None, INFRA),
        (Local.VANISHED, None, INFRA),
        (Local.PREEMPTED, None, INFRA),
        (Local.WORKER_EXITED, None, INFRA),  # a worker's holder never exits by itself
    ],
)
def test_local_failures_are_classified(failure: causes.Local, err: int | None, cause: model.FailureCause) -> None:
    assert causes.local(failure, errno=err) == cause


def test_every_local_failure_has_a_cause() -> None:
    for failure in Local:
        assert causes.local(failure) in (USER, INFRA)


@pytest.mark.parametrize(
    ("failure", "status", "message", "cause"),
    [
        (Kube.API_ERROR, 0, "ClientConnectorError: connection refused", INFRA),
        (Kube.API_ERROR, 500, "etcdserver: request timed out", INFRA),
        (Kube.API_ERROR, 502, "", INFRA),
        (Kube.API_ERROR, 503, "the server is currently unable to handle the request", INFRA),
        (Kube.API_ERROR, 504, "", INFRA),
        (Kube.API_ERROR, 429, "too many requests", INFRA),
        (Kube.API_ERROR, 409, 'pods "svc-1" already exists', INFRA),
        (Kube.API_ERROR, 408, "", INFRA),
        (Kube.API_ERROR, 403, 'pods "svc-1" is forbidden: exceeded quota: compute, requested: cpu=2', INFRA),
        (Kube.API_ERROR, 403, 'pods is forbidden: User "system:serviceaccount:x" cannot create', INFRA),
        # A LimitRange refusing what the spec asks for: the spec cannot run in this namespace.
        (Kube.API_ERROR, 403, 'pods "svc-1" is forbidden: maximum cpu usage per Container is 2, but limit is 4', USER),
        (Kube.API_ERROR, 403, 'pods "svc-1" is forbidden: minimum memory usage per Container is 64Mi', USER),
        (Kube.API_ERROR, 401, "Unauthorized", INFRA),
        (Kube.API_ERROR, 404, 'namespaces "replicas" not found', INFRA),
        (Kube.API_ERROR, 422, 'Pod "svc-1" is invalid: spec.containers[0].resources.limits: Invalid value', USER),
        (Kube.API_ERROR, 400, "quantities must match the regular expression", USER),
        (Kube.IMAGE_PULL, 0, "rpc error: manifest for example/app:v9 not found: manifest unknown", USER),
        (Kube.IMAGE_PULL, 0, "pull access denied, repository does not exist or may require authorization", USER),
        (Kube.IMAGE_PULL, 0, "couldn't parse image reference", USER),
        (Kube.IMAGE_PULL, 0, "toomanyrequests: You have reached your pull rate limit", INFRA),
        (Kube.IMAGE_PULL, 0, "dial tcp 1.2.3.4:443: i/o timeout", INFRA),
        (Kube.IMAGE_PULL, 0, "received unexpected HTTP status: 503 Service Unavailable", INFRA),
        (Kube.CONTAINER_ERROR, 0, 'secret "svc-1" not found', USER),
        (Kube.UNRUNNABLE_SPEC, 0, "", USER),
        (Kube.SETUP_EXITED, 0, "", USER),
        (Kube.APP_EXITED, 0, "", USER),
        (Kube.WORKER_EXITED, 0, "", INFRA),
        (Kube.UNSCHEDULABLE, 0, "0/3 nodes are available: 3 Insufficient cpu.", INFRA),
        (Kube.START_TIMEOUT, 0, "", INFRA),
        (Kube.DELETED, 0, "", INFRA),
        (Kube.DISRUPTED, 0, "evicted: the node was low on resource: memory", INFRA),
    ],
)
def test_kubernetes_failures_are_classified(
    failure: causes.Kube, status: int, message: str, cause: model.FailureCause
) -> None:
    assert causes.kubernetes(failure, status=status, message=message) == cause


def test_every_kubernetes_failure_has_a_cause() -> None:
    for failure in Kube:
        assert causes.kubernetes(failure) in (USER, INFRA)


def test_app_events_without_a_cause_get_one_by_state() -> None:
    assert causes.of_app_state(model.AppState.EXITED) == USER
    assert causes.of_app_state(model.AppState.VANISHED) == INFRA
    assert causes.of_app_state(model.AppState.PREEMPTED) == INFRA


def test_an_infrastructure_failure_cannot_be_permanent() -> None:
    with pytest.raises(ValueError, match="never permanent"):
        backend.LaunchError("quota", cause=INFRA, permanent=True)
    assert backend.LaunchError("bad image name", cause=USER, permanent=True).permanent


def test_launch_events_keep_their_cause_through_a_record_and_old_records_read_unspecified() -> None:
    replica = model.Replica(name="svc-1", service="svc", replica_id=1, version=1)
    event = model.LaunchEvent(1, 1.0, L.FAILED, replica, message="m", cause=INFRA)
    assert model.LaunchEvent.from_dict(event.to_dict()) == event
    old = event.to_dict()
    del old["cause"]
    assert model.LaunchEvent.from_dict(old).cause == model.FailureCause.UNSPECIFIED


# ---- the provisioner core ------------------------------------------------------------------


def _request(replica_id: int = 1, zone: str = "") -> model.LaunchRequest:
    return model.LaunchRequest(
        name=f"svc-{replica_id}",
        service="svc",
        replica_id=replica_id,
        version=1,
        spec=model.ReplicaSpec(run="serve 8080", ports=(8080,), serving_port=8080),
        zone=zone,
    )


async def _all(stream: AsyncIterator, limit: int = 100) -> list:
    out = []
    async for item in stream:
        out.append(item)
        if len(out) >= limit:
            break
    return out


async def _until(stream: AsyncIterator[model.ReplicaEvent], type_: model.ReplicaEventType) -> model.ReplicaEvent:
    async with asyncio.timeout(5):
        async for event in stream:
            if event.type == type_:
                return event
    raise AssertionError(f"no {type_} event")


def _build(fake: FakeBackend, tmp_path) -> manager.Provisioner:
    return manager.Provisioner(
        backend=fake,
        records=store.RecordStore(str(tmp_path)),
        logs=logstore.LogStore(str(tmp_path)),
        options=FAST,
    )


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
async def prov(fake: FakeBackend, tmp_path) -> AsyncIterator[manager.Provisioner]:
    p = _build(fake, tmp_path)
    await p.start()
    yield p
    await p.close()


async def test_a_user_failure_is_reported_on_every_failed_attempt_and_the_end(
    prov: manager.Provisioner, fake: FakeBackend
) -> None:
    fake.outcomes["svc-1"] = [backend.LaunchError("setup exited with code 1", cause=USER)] * 3
    events = await _all(prov.launch(_request()))
    failed = [e for e in events if e.type in (L.ATTEMPT_FAILED, L.FAILED)]
    assert [e.type for e in failed] == [L.ATTEMPT_FAILED] * 3 + [L.FAILED]
    assert {e.cause for e in failed} == {USER}
    others = [e for e in events if e.type not in (L.ATTEMPT_FAILED, L.FAILED)]
    assert {e.cause for e in others} == {model.FailureCause.UNSPECIFIED}


async def test_an_infrastructure_failure_is_retried_and_ends_not_permanent(
    prov: manager.Provisioner, fake: FakeBackend
) -> None:
    fake.outcomes["svc-1"] = [backend.LaunchError("the API server failed (503)", cause=INFRA)] * 3
    events = await _all(prov.launch(_request()))
    assert [e.type for e in events].count(L.PROVISIONING) == 3
    assert events[-1].type == L.FAILED and events[-1].cause == INFRA and not events[-1].permanent


async def test_a_capacity_failure_goes_back_at_once_not_permanent(prov: manager.Provisioner, fake: FakeBackend) -> None:
    # The controller places it again (another zone, after its backoff): no retry here.
    fake.outcomes["svc-1"] = [backend.LaunchError("no capacity", cause=INFRA, capacity_unavailable=True)]
    events = await _all(prov.launch(_request(zone="zone-a")))
    assert [e.type for e in events] == [L.QUEUED, L.PROVISIONING, L.ATTEMPT_FAILED, L.FAILED]
    assert events[-1].capacity_unavailable and not events[-1].permanent and events[-1].cause == INFRA
    assert len(fake.creates) == 1


async def test_a_capacity_failure_where_the_backend_chooses_is_retried_here(
    prov: manager.Provisioner, fake: FakeBackend
) -> None:
    fake.outcomes["svc-1"] = [backend.LaunchError("no capacity", cause=INFRA, capacity_unavailable=True)]
    events = await _all(prov.launch(_request()))
    assert events[-1].type == L.RUNNING and len(fake.creates) == 2


async def test_an_unexpected_backend_error_is_the_infrastructures(prov: manager.Provisioner, fake: FakeBackend) -> None:
    fake.outcomes["svc-1"] = [RuntimeError("bug")] * 3
    events = await _all(prov.launch(_request()))
    failed = [e for e in events if e.type in (L.ATTEMPT_FAILED, L.FAILED)]
    assert failed and {e.cause for e in failed} == {INFRA}


async def test_app_events_carry_their_cause(prov: manager.Provisioner, fake: FakeBackend) -> None:
    for i in (1, 2, 3, 4):
        await _all(prov.launch(_request(i)))
    watch = prov.watch(0)
    await _until(watch, R.SNAPSHOT_END)
    fake.exit("svc-1", 3)
    assert (await _until(watch, R.APP_EXITED)).cause == USER
    fake.vanish("svc-2")
    assert (await _until(watch, R.VANISHED)).cause == INFRA
    await prov.preempt("svc-3")
    assert (await _until(watch, R.PREEMPTED)).cause == INFRA
    # A backend's own classification wins over the default by state.
    token = fake.running["svc-4"].token
    fake._events.put_nowait(
        backend.BackendEvent("svc-4", token, model.AppState.EXITED, 137, 0.0, "killed", cause=INFRA)
    )
    assert (await _until(watch, R.APP_EXITED)).cause == INFRA
    await watch.aclose()


async def test_a_provisioner_restart_mid_launch_is_an_infrastructure_failed_attempt(
    fake: FakeBackend, tmp_path
) -> None:
    first = _build(fake, tmp_path)
    await first.start()
    fake.gates["svc-1"] = asyncio.Event()
    pending = asyncio.create_task(_all(first.launch(_request(1))))
    await asyncio.wait_for(fake.started.wait(), 5)
    await first.close()
    await pending
    fake.gates["svc-1"].set()

    second = _build(fake, tmp_path)
    await second.start()
    try:
        events = await _all(second.launch(_request(1), attach_only=True))
        interrupted = next(e for e in events if e.type == L.ATTEMPT_FAILED)
        assert interrupted.cause == INFRA and interrupted.attempt == 1
        assert interrupted.message == "attempt 1 was interrupted by a provisioner restart"
        assert events[-1].type == L.RUNNING
    finally:
        await second.close()


async def test_a_running_replica_gone_after_a_restart_vanished_by_the_infrastructure(
    fake: FakeBackend, tmp_path
) -> None:
    first = _build(fake, tmp_path)
    await first.start()
    await _all(first.launch(_request(1)))
    await first.close()
    del fake.running["svc-1"]
    second = _build(fake, tmp_path)
    watch = second.watch(second._hub.last_sequence)  # from before start: the restart's own events
    await second.start()
    try:
        assert second.get("svc-1").app_state == model.AppState.VANISHED
        assert (await _until(watch, R.VANISHED)).cause == INFRA
    finally:
        await watch.aclose()
        await second.close()

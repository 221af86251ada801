"""The provisioner core against a scripted fake backend: events, retries, cancel, re-attach."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from services.common import errors
from services.provisioner import backend, launches, logstore, manager, model, store
from tests.helpers.provisioner_fakes import FakeBackend

L = model.LaunchEventType
T = model.TerminateEventType
R = model.ReplicaEventType

FAST = manager.Options(
    max_in_flight=8,
    launch_backoff_initial_s=0.01,
    launch_backoff_max_s=0.02,
    teardown_backoff_initial_s=0.01,
    teardown_backoff_max_s=0.02,
    cancel_timeout_s=2,
    kill_grace_s=0,
)


def _request(replica_id: int = 1, service: str = "svc", zone: str = "") -> model.LaunchRequest:
    return model.LaunchRequest(
        name=f"{service}-{replica_id}",
        service=service,
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


async def _watch_until(stream: AsyncIterator[model.ReplicaEvent], type_: model.ReplicaEventType) -> list:
    seen = []
    async with asyncio.timeout(5):
        async for event in stream:
            seen.append(event)
            if event.type == type_:
                return seen
    return seen


async def _live_watch(prov: manager.Provisioner) -> AsyncIterator[model.ReplicaEvent]:
    """A watch already past its snapshot, so every later change shows up live."""
    stream = prov.watch(0)
    await _watch_until(stream, R.SNAPSHOT_END)
    return stream


@pytest.fixture
async def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
async def prov(fake: FakeBackend, tmp_path) -> AsyncIterator[manager.Provisioner]:
    p = manager.Provisioner(
        backend=fake,
        records=store.RecordStore(str(tmp_path)),
        logs=logstore.LogStore(str(tmp_path)),
        options=FAST,
    )
    await p.start()
    yield p
    await p.close()


async def test_launch_reports_queued_provisioning_running(prov: manager.Provisioner) -> None:
    events = await _all(prov.launch(_request()))
    assert [e.type for e in events] == [L.QUEUED, L.PROVISIONING, L.RUNNING]
    assert [e.sequence for e in events] == [1, 2, 3]
    running = events[-1]
    assert running.endpoint.startswith("http://127.0.0.1:")
    assert running.replica.state == model.ReplicaState.RUNNING
    assert prov.get("svc-1").app_state == model.AppState.RUNNING


async def test_retryable_failures_make_three_attempts_with_backoff_then_fail(
    prov: manager.Provisioner, fake: FakeBackend
) -> None:
    fake.outcomes["svc-1"] = [backend.LaunchError("setup exited with code 1")] * 3
    events = await _all(prov.launch(_request()))
    assert [e.type for e in events] == [
        L.QUEUED,
        L.PROVISIONING,
        L.ATTEMPT_FAILED,
        L.RETRYING,
        L.PROVISIONING,
        L.ATTEMPT_FAILED,
        L.RETRYING,
        L.PROVISIONING,
        L.ATTEMPT_FAILED,
        L.FAILED,
    ]
    assert [e.attempt for e in events if e.type == L.PROVISIONING] == [1, 2, 3]
    assert all(0 < e.retry_delay_s <= 0.02 for e in events if e.type == L.RETRYING)
    assert events[-1].message == "setup exited with code 1" and not events[-1].permanent
    assert fake.deletes == ["svc-1"] * 3  # every failed attempt's leftovers, before the next
    assert prov.get("svc-1").state == model.ReplicaState.FAILED


async def test_a_later_attempt_can_succeed(prov: manager.Provisioner, fake: FakeBackend) -> None:
    fake.outcomes["svc-1"] = [backend.LaunchError("flaky")]
    events = await _all(prov.launch(_request()))
    assert events[-1].type == L.RUNNING and events[-1].attempt == 2


async def test_permanent_errors_fail_at_once(prov: manager.Provisioner, fake: FakeBackend) -> None:
    fake.outcomes["svc-1"] = [backend.LaunchError("no capacity", permanent=True, capacity_unavailable=True)]
    events = await _all(prov.launch(_request()))
    assert [e.type for e in events] == [L.QUEUED, L.PROVISIONING, L.ATTEMPT_FAILED, L.FAILED]
    assert events[-1].permanent and events[-1].capacity_unavailable
    assert len(fake.creates) == 1


async def test_unexpected_backend_errors_are_retryable_failures(prov: manager.Provisioner, fake: FakeBackend) -> None:
    fake.outcomes["svc-1"] = [RuntimeError("bug")]
    events = await _all(prov.launch(_request()))
    failed = [e for e in events if e.type == L.ATTEMPT_FAILED]
    assert failed[0].message == "backend error: RuntimeError"
    assert events[-1].type == L.RUNNING


async def test_second_launch_attaches_and_replays(prov: manager.Provisioner, fake: FakeBackend) -> None:
    gate = fake.gates["svc-1"] = asyncio.Event()
    first = asyncio.create_task(_all(prov.launch(_request())))
    await asyncio.wait_for(fake.started.wait(), 5)
    second = asyncio.create_task(_all(prov.launch(_request(), after_sequence=1)))
    await asyncio.sleep(0.01)
    gate.set()
    a, b = await asyncio.gather(first, second)
    assert [e.sequence for e in a] == [1, 2, 3]
    assert [e.sequence for e in b] == [2, 3]
    assert len(fake.creates) == 1
    replay = await _all(prov.launch(_request(), attach_only=True))
    assert [e.type for e in replay] == [L.QUEUED, L.PROVISIONING, L.RUNNING]
    assert await _all(prov.launch(_request(), after_sequence=3)) == []


async def test_attach_only_for_an_unknown_name_is_not_found(prov: manager.Provisioner) -> None:
    with pytest.raises(errors.NotFoundError):
        await _all(prov.launch(_request(), attach_only=True))


async def test_bad_request_is_rejected_before_anything_starts(prov: manager.Provisioner, fake: FakeBackend) -> None:
    bad = model.LaunchRequest(name="other-1", service="svc", replica_id=1, version=1, spec=model.ReplicaSpec())
    with pytest.raises(errors.ValidationError):
        await _all(prov.launch(bad))
    assert fake.creates == []
    with pytest.raises(errors.NotFoundError):
        prov.get("other-1")


async def test_cancel_stops_an_in_flight_launch_and_removes_leftovers(
    prov: manager.Provisioner, fake: FakeBackend
) -> None:
    fake.gates["svc-1"] = asyncio.Event()  # never set: the launch hangs in create()
    stream = asyncio.create_task(_all(prov.launch(_request())))
    await asyncio.wait_for(fake.started.wait(), 5)
    assert await prov.cancel_launch("svc-1")
    events = await asyncio.wait_for(stream, 5)
    assert events[-1].type == L.CANCELLED
    assert fake.deletes == ["svc-1"]
    assert prov.get("svc-1").state == model.ReplicaState.TERMINATED
    assert not await prov.cancel_launch("svc-1")
    assert not await prov.cancel_launch("nope")


async def test_terminate_cancels_an_in_flight_launch_first(prov: manager.Provisioner, fake: FakeBackend) -> None:
    fake.gates["svc-1"] = asyncio.Event()
    launch = asyncio.create_task(_all(prov.launch(_request())))
    await asyncio.wait_for(fake.started.wait(), 5)
    teardown = await _all(prov.terminate("svc-1", drain_s=5))
    assert [e.type for e in teardown] == [T.TERMINATING, T.TERMINATED]  # no drain: never served
    assert (await asyncio.wait_for(launch, 5))[-1].type == L.CANCELLED
    with pytest.raises(errors.NotFoundError):
        prov.get("svc-1")


async def test_terminate_of_an_unknown_replica_is_one_terminated_event(prov: manager.Provisioner) -> None:
    events = await _all(prov.terminate("ghost-1", after_sequence=4))
    assert [(e.type, e.sequence) for e in events] == [(T.TERMINATED, 5)]


async def test_terminate_drains_then_tears_down_and_reports_on_watch(
    prov: manager.Provisioner, fake: FakeBackend, tmp_path
) -> None:
    await _all(prov.launch(_request()))
    watch = prov.watch(0)
    assert [e.type for e in [await anext(watch), await anext(watch)]] == [R.SNAPSHOT, R.SNAPSHOT_END]
    events = await _all(prov.terminate("svc-1", drain_s=0.05, keep_logs=False))
    assert [e.type for e in events] == [T.DRAINING, T.TERMINATING, T.TERMINATED]
    assert events[0].delay_s == 0.05
    assert events[1].time - events[0].time >= 0.04
    seen = await _watch_until(watch, R.TERMINATED)
    assert seen[-1].replica.name == "svc-1"
    await watch.aclose()
    assert "svc-1" not in fake.running
    assert not (tmp_path / "replicas" / "svc-1.json").exists()
    assert not (tmp_path / "logs" / "svc-1").exists()


async def test_failed_replicas_keep_their_logs(prov: manager.Provisioner, fake: FakeBackend, tmp_path) -> None:
    fake.outcomes["svc-1"] = [backend.LaunchError("bad", permanent=True)]
    await _all(prov.launch(_request()))
    await _all(prov.terminate("svc-1", keep_logs=True))
    text = b"".join(await _all(prov.stream_logs("svc-1", model.LogKind.LAUNCH, follow=False))).decode()
    assert "attempt_failed: bad" in text and "teardown terminated" in text


async def test_teardown_retries_then_succeeds(prov: manager.Provisioner, fake: FakeBackend) -> None:
    await _all(prov.launch(_request()))
    fake.delete_failures["svc-1"] = 2
    events = await _all(prov.terminate("svc-1"))
    assert [e.type for e in events] == [T.TERMINATING, T.RETRYING, T.RETRYING, T.TERMINATED]
    assert [e.attempt for e in events if e.type == T.RETRYING] == [2, 3]


async def test_teardown_that_keeps_failing_fails_and_can_be_asked_again(
    prov: manager.Provisioner, fake: FakeBackend
) -> None:
    await _all(prov.launch(_request()))
    fake.delete_failures["svc-1"] = 3
    failed = await _all(prov.terminate("svc-1"))
    assert failed[-1].type == T.FAILED and "scripted teardown failure" in failed[-1].message
    assert prov.get("svc-1").state == model.ReplicaState.TERMINATING
    with pytest.raises(errors.FailedPreconditionError):
        await _all(prov.launch(_request()))
    # A client that lost the stream mid-teardown sees how it ended.
    assert (await _all(prov.terminate("svc-1", after_sequence=1)))[-1].type == T.FAILED
    again = await _all(prov.terminate("svc-1"))
    assert [e.type for e in again] == [T.TERMINATING, T.TERMINATED]
    assert again[0].sequence == failed[-1].sequence + 1


async def test_concurrency_cap_queues_fifo_and_hands_over_at_once(prov: manager.Provisioner, fake: FakeBackend) -> None:
    limited = manager.Provisioner(
        backend=fake,
        records=prov._records,
        logs=prov._logs,
        options=manager.Options(max_in_flight=1, kill_grace_s=0),
    )
    await limited.start()
    try:
        gate = fake.gates["q-1"] = asyncio.Event()
        first = asyncio.create_task(_all(limited.launch(_request(1, "q"))))
        await asyncio.wait_for(fake.started.wait(), 5)
        second = asyncio.create_task(_all(limited.launch(_request(2, "q"))))
        await asyncio.sleep(0.02)
        assert [c.name for c in fake.creates] == ["q-1"]
        gate.set()
        a, b = await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert b[0].type == L.QUEUED and "waiting for a launch slot" in b[0].message
        assert b[-1].type == L.RUNNING and b[1].time >= a[-1].time
        assert [c.name for c in fake.creates] == ["q-1", "q-2"]
    finally:
        await limited.close()


async def test_app_exit_is_pushed_on_the_watch(prov: manager.Provisioner, fake: FakeBackend) -> None:
    await _all(prov.launch(_request(1)))
    await _all(prov.launch(_request(2)))
    watch = await _live_watch(prov)
    fake.exit("svc-1", 3)
    fake.vanish("svc-2")
    seen = await _watch_until(watch, R.VANISHED)
    exited = next(e for e in seen if e.type == R.APP_EXITED)
    assert exited.replica.exit_code == 3 and exited.replica.app_state == model.AppState.EXITED
    fake.exit("svc-2", 0)  # nothing more after a replica vanished
    await asyncio.sleep(0.02)
    assert prov.get("svc-2").app_state == model.AppState.VANISHED
    await watch.aclose()


async def test_app_exit_before_running_is_read_still_ends_running(prov: manager.Provisioner, fake: FakeBackend) -> None:
    watch = await _live_watch(prov)
    fake.exit_during_create["svc-1"] = 1
    events = await _all(prov.launch(_request()))
    assert events[-1].type == L.RUNNING
    seen = await _watch_until(watch, R.APP_EXITED)
    assert [e.type for e in seen] == [R.APP_RUNNING, R.APP_EXITED]
    assert prov.get("svc-1").exit_code == 1
    await watch.aclose()


async def test_preempt(prov: manager.Provisioner, fake: FakeBackend) -> None:
    with pytest.raises(errors.NotFoundError):
        await prov.preempt("svc-1")
    fake.gates["svc-1"] = asyncio.Event()
    launch = asyncio.create_task(_all(prov.launch(_request())))
    await asyncio.wait_for(fake.started.wait(), 5)
    with pytest.raises(errors.FailedPreconditionError):
        await prov.preempt("svc-1")
    fake.gates["svc-1"].set()
    await launch
    watch = await _live_watch(prov)
    replica = await prov.preempt("svc-1")
    assert replica.app_state == model.AppState.PREEMPTED
    assert (await _watch_until(watch, R.PREEMPTED))[-1].replica.name == "svc-1"
    assert fake.preempted == ["svc-1"]
    assert (await prov.preempt("svc-1")).app_state == model.AppState.PREEMPTED  # idempotent
    await watch.aclose()


async def test_list_filters_by_service_and_pages(prov: manager.Provisioner) -> None:
    for i in range(1, 6):
        await _all(prov.launch(_request(i, "a")))
    await _all(prov.launch(_request(1, "b")))
    page, token = prov.list(service="a", page_size=2)
    names = [r.name for r in page]
    while token:
        page, token = prov.list(service="a", page_size=2, page_token=token)
        names += [r.name for r in page]
    assert names == ["a-1", "a-2", "a-3", "a-4", "a-5"]
    assert [r.name for r in prov.list()[0]] == ["a-1", "a-2", "a-3", "a-4", "a-5", "b-1"]
    with pytest.raises(errors.ValidationError):
        prov.list(page_size=-1)


async def test_restart_refinds_running_replicas_and_resumes_launches(fake: FakeBackend, tmp_path) -> None:
    def build() -> manager.Provisioner:
        return manager.Provisioner(
            backend=fake,
            records=store.RecordStore(str(tmp_path)),
            logs=logstore.LogStore(str(tmp_path)),
            options=FAST,
        )

    first = build()
    await first.start()
    await _all(first.launch(_request(1)))
    await _all(first.launch(_request(2)))
    fake.gates["svc-3"] = asyncio.Event()
    pending = asyncio.create_task(_all(first.launch(_request(3))))
    await asyncio.wait_for(fake.started.wait(), 5)
    await first.close()
    await pending
    del fake.running["svc-2"]  # gone while the provisioner was down
    fake.gates["svc-3"].set()

    second = build()
    await second.start()
    try:
        assert second.get("svc-1").app_state == model.AppState.RUNNING
        watch = second.watch(0)
        snapshot = await _watch_until(watch, R.SNAPSHOT_END)
        by_name = {e.replica.name: e.replica for e in snapshot if e.replica}
        assert by_name["svc-2"].app_state == model.AppState.VANISHED
        resumed = await _all(second.launch(_request(3), after_sequence=2, attach_only=True))
        assert resumed[-1].type == L.RUNNING
        assert any(e.type == L.QUEUED and "resumed" in e.message for e in resumed)
        await watch.aclose()
    finally:
        await second.close()


async def test_restart_resumes_an_interrupted_teardown(fake: FakeBackend, tmp_path) -> None:
    records = store.RecordStore(str(tmp_path))
    logs = logstore.LogStore(str(tmp_path))
    first = manager.Provisioner(backend=fake, records=records, logs=logs, options=FAST)
    await first.start()
    await _all(first.launch(_request()))
    teardown = asyncio.create_task(_all(first.terminate("svc-1", drain_s=30)))
    await asyncio.sleep(0.02)
    await first.close()
    await teardown
    second = manager.Provisioner(backend=fake, records=records, logs=logs, options=FAST)
    await second.start()
    try:
        events = await _all(second.terminate("svc-1", after_sequence=1))
        assert events[-1].type == T.TERMINATED
        assert "svc-1" not in fake.running
    finally:
        await second.close()


async def test_a_teardown_waits_for_a_slot_and_says_so(fake: FakeBackend, tmp_path) -> None:
    limited = manager.Provisioner(
        backend=fake,
        records=store.RecordStore(str(tmp_path)),
        logs=logstore.LogStore(str(tmp_path)),
        options=manager.Options(max_in_flight=1, kill_grace_s=0),
    )
    await limited.start()
    try:
        await _all(limited.launch(_request(1)))
        gate = fake.gates["svc-2"] = asyncio.Event()
        second = asyncio.create_task(_all(limited.launch(_request(2))))
        await asyncio.wait_for(fake.started.wait(), 5)
        teardown = asyncio.create_task(_all(limited.terminate("svc-1")))
        await asyncio.sleep(0.02)
        assert not teardown.done() and "svc-1" in fake.running
        gate.set()
        events = await asyncio.wait_for(teardown, 5)
        assert [e.type for e in events] == [T.QUEUED, T.TERMINATING, T.TERMINATED]
        assert "waiting for a teardown slot" in events[0].message
        await second
    finally:
        await limited.close()


async def test_an_error_applying_one_app_event_never_ends_the_event_stream(
    prov: manager.Provisioner, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    await _all(prov.launch(_request(1)))
    await _all(prov.launch(_request(2)))
    stream = await _live_watch(prov)
    real_save = prov._records.save

    def broken_save(name: str, record: dict) -> None:
        if name == "svc-1":
            raise RuntimeError("store on fire")
        real_save(name, record)

    monkeypatch.setattr(prov._records, "save", broken_save)
    fake.exit("svc-1", 1)
    fake.exit("svc-2", 2)
    seen = set()
    while len(seen) < 2:
        event = await asyncio.wait_for(anext(stream), 5)
        if event.type == R.APP_EXITED:
            seen.add(event.replica.name)
    assert seen == {"svc-1", "svc-2"}
    assert "store on fire" in caplog.text  # logged with its traceback, not swallowed


async def test_the_sweep_restarts_a_launch_whose_task_died(fake: FakeBackend, tmp_path) -> None:
    prov = manager.Provisioner(
        backend=fake,
        records=store.RecordStore(str(tmp_path)),
        logs=logstore.LogStore(str(tmp_path)),
        options=dataclasses.replace(FAST, sweep_interval_s=0.05),
    )
    await prov.start()
    try:
        gate = fake.gates["svc-1"] = asyncio.Event()
        launch = prov.launch(_request(1))
        await anext(launch)  # QUEUED
        await fake.started.wait()
        entry = prov._entries["svc-1"]
        entry.launch_task.cancel()  # the task dies without an end event (as after an uncaught error)
        prov._closing = True  # ...so that it does not report a cancellation either
        await asyncio.sleep(0)
        await asyncio.wait({entry.launch_task})
        prov._closing = False
        gate.set()
        events = await asyncio.wait_for(_all(prov.launch(_request(1), after_sequence=0)), 5)
        assert events[-1].type == model.LaunchEventType.RUNNING
    finally:
        await prov.close()


async def test_owner_is_kept_across_a_restart_and_old_records_load_unowned(fake: FakeBackend, tmp_path) -> None:
    records = store.RecordStore(str(tmp_path))
    logs = logstore.LogStore(str(tmp_path))
    first = manager.Provisioner(backend=fake, records=records, logs=logs, options=FAST)
    await first.start()
    events = await _all(first.launch(dataclasses.replace(_request(1), owner="ctl-a")))
    assert events[-1].replica.owner == "ctl-a"
    await _all(first.launch(_request(2)))
    await first.close()
    # A record written before replicas had owners has no owner keys at all.
    data = next(r for r in records.load_all() if r["request"]["name"] == "svc-2")
    del data["request"]["owner"], data["replica"]["owner"]
    records.save("svc-2", data)

    second = manager.Provisioner(backend=fake, records=records, logs=logs, options=FAST)
    await second.start()
    try:
        assert second.get("svc-1").owner == "ctl-a"
        assert second.get("svc-2").owner == ""
        assert second.get("svc-2").app_state == model.AppState.RUNNING
    finally:
        await second.close()


def test_an_overlong_or_unprintable_owner_is_invalid() -> None:
    for owner in ("x" * 129, "a\nb"):
        with pytest.raises(errors.ValidationError) as info:
            launches.validate(dataclasses.replace(_request(1), owner=owner))
        assert [v.field for v in info.value.violations] == ["owner"]
    launches.validate(dataclasses.replace(_request(1), owner="x" * 128))

"""The event log's rules: numbering, repeats counted in one entry, the bound, and which change
is which event."""

from __future__ import annotations

import pytest

from services.controller.domain import events as ev

W, N = ev.EventType.WARNING, ev.EventType.NORMAL


def draft(reason: str = "ReplicaFailed", message: str = "m", obj: str = "replica/1") -> ev.Draft:
    return ev.Draft(W, reason, message, obj)


def test_a_repeat_is_counted_in_its_entry_which_moves_to_the_end_under_a_new_sequence() -> None:
    log = ev.EventLog()
    first, replaced = log.record(draft(), 100.0)
    assert (first.sequence, first.count, replaced) == (1, 1, None)
    log.record(draft(reason="Other"), 101.0)
    again, replaced = log.record(draft(), 102.0)
    assert (again.sequence, again.count, again.first_time, again.last_time, replaced) == (3, 2, 100.0, 102.0, 1)
    assert [e.sequence for e in log.entries()] == [2, 3]
    assert [e.sequence for e in log.entries(after=2)] == [3]


@pytest.mark.parametrize(
    ("other", "counted"),
    [
        (draft(), True),
        (draft(message="other message"), False),
        (draft(obj="replica/2"), False),
        (ev.Draft(N, "ReplicaFailed", "m", "replica/1"), False),
    ],
)
def test_only_the_same_type_reason_object_and_message_count_as_a_repeat(other: ev.Draft, counted: bool) -> None:
    log = ev.EventLog()
    log.record(draft(), 0.0)
    entry, _ = log.record(other, 1.0)
    assert (entry.count == 2) is counted
    assert len(log) == (1 if counted else 2)


def test_a_repeat_long_after_is_a_new_entry() -> None:
    log = ev.EventLog()
    log.record(draft(), 0.0)
    entry, replaced = log.record(draft(), ev.AGGREGATE_S + 1)
    assert (entry.count, replaced, len(log)) == (1, None, 2)


def test_the_log_keeps_the_last_entries_only() -> None:
    log = ev.EventLog(kept=3)
    for i in range(5):
        log.record(draft(message=str(i)), float(i))
    assert [e.draft.message for e in log.entries()] == ["2", "3", "4"]
    entry, _ = log.record(draft(message="0"), 10.0)  # its entry was dropped: a new one
    assert entry.count == 1


def test_a_log_reloaded_from_its_entries_goes_on_numbering_and_counting() -> None:
    log = ev.EventLog()
    log.record(draft(), 0.0)
    log.record(draft(reason="X"), 1.0)
    again = ev.EventLog(log.entries())
    entry, replaced = again.record(draft(), 2.0)
    assert (entry.sequence, entry.count, replaced) == (3, 2, 1)


@pytest.mark.parametrize(
    ("before", "after", "reason", "message"),
    [
        (None, "PENDING", "ReplicaLaunching", "launching replica 3 (version 2)"),
        ("PENDING", "PROVISIONING", None, None),
        ("STARTING", "READY", "ReplicaReady", "replica 3 (version 2) is ready"),
        ("NOT_READY", "READY", "ReplicaReady", "replica 3 (version 2) is ready again"),
        ("READY", "NOT_READY", "ReplicaNotReady", "replica 3 failed a readiness probe"),
        ("READY", "SHUTTING_DOWN", "ReplicaTerminating", "tearing down replica 3"),
        ("STARTING", "FAILED", "ReplicaFailed", "replica 3 (version 2) failed: app exited with code 1"),
        (
            "SHUTTING_DOWN",
            "FAILED_PROBING",
            "ReplicaFailed",
            "replica 3 (version 2) failed probing: app exited with code 1",
        ),
        ("FAILED", "SHUTTING_DOWN", None, None),
        ("READY", "PREEMPTED", "ReplicaPreempted", "replica 3 was preempted"),
        ("READY", None, "ReplicaRemoved", "replica 3 (version 2) removed"),
        ("READY", "READY", None, None),
    ],
)
def test_replica_changes_and_their_events(
    before: str | None, after: str | None, reason: str | None, message: str | None
) -> None:
    got = ev.replica_change(3, 2, before, after, failure_reason="app exited with code 1")
    if reason is None:
        assert got is None
    else:
        assert got is not None
        assert (got.reason, got.message, got.object) == (reason, message, "replica/3")


def test_service_changes_say_the_new_status_message_and_target() -> None:
    drafts = ev.service_change(
        before_message="",
        after_message="scaling stopped: version 2 failed before ever being ready",
        before_target=2,
        after_target=3,
        decision="scale up to 3",
    )
    assert [(d.type, d.reason) for d in drafts] == [(W, "StatusChanged"), (N, "TargetChanged")]
    assert drafts[1].message == "target replicas 2 -> 3: scale up to 3"
    first = ev.service_change(before_message="", after_message="", before_target=None, after_target=2, decision="")
    assert first == []


def test_status_messages_that_only_count_replicas_are_no_events() -> None:
    for message in ("2/3 ready, target 3", "shutting down: 2 replica(s) left"):
        same = {"before_target": 1, "after_target": 1, "decision": ""}
        assert ev.service_change(before_message="", after_message=message, **same) == []  # type: ignore[arg-type]

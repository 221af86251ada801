"""The dashboard's picture of the fleet, built from watch changes: rows, history, events."""

from __future__ import annotations

import pytest

from services.dashboard import bridge, fleet

T0 = 1_700_000_000_000  # ms


def svc(name: str = "hello", **fields: object) -> fleet.ServiceInfo:
    base: dict[str, object] = {
        "name": name,
        "uid": "u1",
        "status": "REPLICA_INIT",
        "message": "",
        "ready": 0,
        "total": 1,
        "target": 1,
        "active_versions": [1],
        "latest_version": 1,
    }
    return fleet.ServiceInfo(**{**base, **fields})  # type: ignore[arg-type]


def rep(replica_id: int = 1, status: str = "PENDING", **fields: object) -> fleet.ReplicaInfo:
    return fleet.ReplicaInfo(replica_id=replica_id, status=status, version=1, **fields)  # type: ignore[arg-type]


def change(service: fleet.ServiceInfo, *replicas: fleet.ReplicaInfo, **fields: object) -> fleet.Change:
    return fleet.Change(service=service, replicas=list(replicas), **fields)  # type: ignore[arg-type]


def statuses(row: dict) -> list[tuple[str, int, bool]]:
    return [(h["status"], h["since"], h["inferred"]) for h in row["history"]]


def test_a_replica_seen_live_gets_one_history_entry_per_status_it_goes_through() -> None:
    f = fleet.Fleet()
    f.apply(change(svc(), rep(1, "PENDING", create_ms=T0), snapshot=True), now_ms=T0)
    f.apply(change(svc(), rep(1, "PROVISIONING", create_ms=T0)), now_ms=T0 + 100)
    f.apply(change(svc(), rep(1, "PROVISIONING", create_ms=T0)), now_ms=T0 + 150)  # no status change
    update = f.apply(
        change(svc(status="READY", ready=1), rep(1, "READY", create_ms=T0, endpoint="http://127.77.0.1:8080")),
        now_ms=T0 + 900,
    )
    (row,) = update["replicas"]
    assert row["key"] == "hello/u1/1"
    assert (row["status"], row["endpoint"], row["version"]) == ("READY", "http://127.77.0.1:8080", 1)
    assert statuses(row) == [("PENDING", T0, True), ("PROVISIONING", T0 + 100, False), ("READY", T0 + 900, False)]
    assert update["service"]["status"] == "READY"
    assert [e["text"] for e in update["events"]] == [
        "hello: replica 1 READY at http://127.77.0.1:8080 (1/1 ready)",
        "hello: service READY (1/1 ready, versions 1)",
    ]


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        # Seen first while READY: the replica's own timestamps tell what came before.
        (
            "READY",
            [("PROVISIONING", T0, True), ("STARTING", T0 + 2_000, True), ("READY", T0 + 3_000, True)],
        ),
        ("STARTING", [("PROVISIONING", T0, True), ("STARTING", T0 + 2_000, True)]),
        ("PENDING", [("PENDING", T0, True)]),
        # Failed some time after it was ready: when is unknown, so the failure starts when seen.
        (
            "FAILED",
            [
                ("PROVISIONING", T0, True),
                ("STARTING", T0 + 2_000, True),
                ("READY", T0 + 3_000, True),
                ("FAILED", T0 + 10_000, False),
            ],
        ),
        # Not ready since the first failure of the current streak.
        (
            "NOT_READY",
            [
                ("PROVISIONING", T0, True),
                ("STARTING", T0 + 2_000, True),
                ("READY", T0 + 3_000, True),
                ("NOT_READY", T0 + 5_000, True),
            ],
        ),
    ],
)
def test_history_of_a_replica_first_seen_in_a_snapshot_comes_from_its_timestamps(status, expected) -> None:
    times = {"create_ms": T0, "launch_ms": T0 + 2_000, "first_ready_ms": T0 + 3_000, "streak_start_ms": T0 + 5_000}
    if status in ("PENDING",):
        times = {"create_ms": T0}
    if status == "STARTING":
        times = {"create_ms": T0, "launch_ms": T0 + 2_000}
    f = fleet.Fleet()
    update = f.apply(change(svc(), rep(1, status, **times), snapshot=True), now_ms=T0 + 10_000)
    assert statuses(update["replicas"][0]) == expected


def test_timestamps_from_a_skewed_clock_never_run_backwards_or_past_now() -> None:
    f = fleet.Fleet()
    replica = rep(1, "READY", create_ms=T0 + 50_000, launch_ms=T0 + 1_000, first_ready_ms=T0 + 99_000)
    update = f.apply(change(svc(), replica, snapshot=True), now_ms=T0 + 20_000)
    since = [h["since"] for h in update["replicas"][0]["history"]]
    assert since == sorted(since)
    assert max(since) <= T0 + 20_000


def test_removed_replicas_leave_the_table_but_keep_their_timeline_row() -> None:
    f = fleet.Fleet()
    f.apply(change(svc(), rep(1, "READY", create_ms=T0), rep(2, "READY", create_ms=T0), snapshot=True), now_ms=T0)
    update = f.apply(change(svc(), removed=[2]), now_ms=T0 + 500)
    assert [(r["id"], r["removed"]) for r in update["replicas"]] == [(2, T0 + 500)]
    assert [e["text"] for e in update["events"]] == ["hello: replica 2 removed (0/1 ready)"]
    snap = f.snapshot(now_ms=T0 + 600)
    assert [(r["id"], r["removed"]) for r in snap["replicas"]] == [(1, None), (2, T0 + 500)]


def test_a_snapshot_after_a_reconnect_removes_the_replicas_it_no_longer_lists() -> None:
    f = fleet.Fleet()
    f.apply(change(svc(), rep(1, "READY"), rep(2, "READY"), snapshot=True), now_ms=T0)
    update = f.apply(change(svc(), rep(2, "READY"), snapshot=True), now_ms=T0 + 5_000)
    assert {r["id"]: r["removed"] for r in update["replicas"]} == {1: T0 + 5_000, 2: None}
    assert "hello: replica 1 removed (0/1 ready)" in [e["text"] for e in update["events"]]


def test_a_deleted_service_goes_and_its_replicas_end() -> None:
    f = fleet.Fleet()
    f.apply(change(svc(), rep(1, "READY"), snapshot=True), now_ms=T0)
    update = f.apply(change(svc(status="SHUTTING_DOWN"), deleted=True), now_ms=T0 + 1_000)
    assert update["deleted"] == "hello"
    assert [(r["id"], r["removed"]) for r in update["replicas"]] == [(1, T0 + 1_000)]
    assert update["events"][-1]["text"] == "hello: deleted"
    assert f.snapshot(now_ms=T0 + 1_000)["services"] == []
    # Gone without a last message (NOT_FOUND on a new watch): the same.
    f.apply(change(svc("web"), rep(1, "READY"), snapshot=True), now_ms=T0)
    update = f.forget("web", now_ms=T0 + 2_000)
    assert update is not None and update["deleted"] == "web"
    assert f.forget("web", now_ms=T0 + 3_000) is None, "forgetting twice says nothing"


def test_a_service_created_again_under_the_same_name_starts_new_rows() -> None:
    f = fleet.Fleet()
    f.apply(change(svc(uid="u1"), rep(1, "READY"), snapshot=True), now_ms=T0)
    update = f.apply(change(svc(uid="u2"), rep(1, "PENDING"), snapshot=True), now_ms=T0 + 1_000)
    keys = {r["key"]: r["removed"] for r in update["replicas"]}
    assert keys == {"hello/u1/1": T0 + 1_000, "hello/u2/1": None}


def test_service_events_name_status_versions_and_the_balancer_once() -> None:
    f = fleet.Fleet()
    first = f.apply(change(svc(status="READY", ready=1, message="1/1 ready"), snapshot=True), now_ms=T0)
    assert [e["text"] for e in first["events"]] == ["hello: service READY (1/1 ready, versions 1): 1/1 ready"]
    lb = svc(status="READY", ready=1, load_balancer_url="http://127.0.0.1:30001")
    assert [e["text"] for e in f.apply(change(lb), now_ms=T0 + 1)["events"]] == [
        "hello: endpoint http://127.0.0.1:30001 (load balancer)"
    ]
    assert f.apply(change(lb), now_ms=T0 + 2)["events"] == []
    updating = svc(status="READY", ready=1, load_balancer_url="http://127.0.0.1:30001", latest_version=2)
    updating.active_versions = [1, 2]
    assert [e["text"] for e in f.apply(change(updating), now_ms=T0 + 3)["events"]] == [
        "hello: version 2 created",
        "hello: versions 1,2 take traffic",
    ]


def test_failed_replicas_carry_their_reason_and_a_failure_kind() -> None:
    f = fleet.Fleet()
    update = f.apply(change(svc(), rep(1, "FAILED", failure_reason="app exited with code 1"), snapshot=True), now_ms=T0)
    (event,) = [e for e in update["events"] if e["replica_id"] == 1]
    assert event["text"] == "hello: replica 1 FAILED (app exited with code 1) (0/1 ready)"
    assert event["level"] == "error"
    assert update["replicas"][0]["failure_reason"] == "app exited with code 1"


def test_memory_is_bounded_history_events_and_removed_rows() -> None:
    f = fleet.Fleet(max_history=5, max_events=10, max_removed=3, keep_removed_ms=60_000)
    states = ["READY", "NOT_READY"]
    f.apply(change(svc(), rep(1, "READY"), snapshot=True), now_ms=T0)
    for i in range(20):
        f.apply(change(svc(), rep(1, states[i % 2])), now_ms=T0 + i + 1)
    snap = f.snapshot(now_ms=T0 + 100)
    assert len(snap["replicas"][0]["history"]) == 5
    assert snap["replicas"][0]["history"][-1]["since"] == T0 + 20
    assert len(snap["events"]) == 10
    for i in range(2, 8):
        f.apply(change(svc(), rep(i, "READY")), now_ms=T0 + 200)
        f.apply(change(svc(), removed=[i]), now_ms=T0 + 200 + i)
    removed = [r["id"] for r in f.snapshot(now_ms=T0 + 300)["replicas"] if r["removed"]]
    assert removed == [5, 6, 7], "only the newest removed rows are kept"
    assert [r["id"] for r in f.snapshot(now_ms=T0 + 120_000)["replicas"]] == [1], "old removed rows age out"


def test_snapshot_lists_services_and_replicas_in_order_with_recent_events() -> None:
    f = fleet.Fleet()
    f.apply(change(svc("web"), rep(2, "READY"), rep(1, "READY"), snapshot=True), now_ms=T0)
    f.apply(change(svc("api"), rep(1, "STARTING"), snapshot=True), now_ms=T0 + 1)
    snap = f.snapshot(now_ms=T0 + 2)
    assert [s["name"] for s in snap["services"]] == ["api", "web"]
    assert [(r["service"], r["id"]) for r in snap["replicas"]] == [("api", 1), ("web", 1), ("web", 2)]
    assert [e["t"] for e in snap["events"]] == sorted(e["t"] for e in snap["events"])


async def test_a_subscriber_that_falls_behind_drops_its_backlog_and_asks_for_a_snapshot() -> None:
    sub = bridge.Subscriber(limit=2)
    sub.push("change", {"n": 1})
    sub.push("change", {"n": 2})
    assert not sub.resync
    sub.push("change", {"n": 3})
    assert sub.resync
    assert await sub.take(0.01) == [], "the backlog is gone; a snapshot replaces it"
    sub.push("change", {"n": 4})
    sub.end("denied", {"message": "no"})
    sub.push("change", {"n": 5})
    assert await sub.take(0.01) == [("change", {"n": 4}), ("denied", {"message": "no"})]
    assert sub.ended

"""Load-balancing policies, in-flight accounting, held requests and load reports (no network)."""

from __future__ import annotations

import asyncio
import collections

import pytest

from services.loadbalancer import balancer as bal
from services.loadbalancer import policies


def replicas(*ids: int, accelerator: str = "unknown") -> list[policies.Replica]:
    return [policies.Replica(replica_id=i, url=f"http://127.0.0.1:{9000 + i}", accelerator=accelerator) for i in ids]


def test_round_robin_is_a_strict_cycle() -> None:
    rr = policies.RoundRobin(policies.InFlight())
    rr.set_replicas(replicas(1, 2, 3))
    picks = [rr.select().replica_id for _ in range(30)]
    first = picks[:3]
    assert sorted(first) == [1, 2, 3]
    assert picks == first * 10


def test_round_robin_reshuffles_only_when_the_set_changes() -> None:
    orders = []

    def shuffle(items: list[policies.Replica]) -> None:
        orders.append([r.replica_id for r in items])
        items.reverse()

    rr = policies.RoundRobin(policies.InFlight(), shuffle=shuffle)
    rr.set_replicas(replicas(1, 2, 3))
    assert [rr.select().replica_id for _ in range(2)] == [3, 2]
    rr.set_replicas(replicas(3, 2, 1))  # same set: the cycle goes on
    assert rr.select().replica_id == 1
    rr.set_replicas(replicas(1, 2, 4))  # new set: reshuffled and restarted
    assert [rr.select().replica_id for _ in range(3)] == [4, 2, 1]
    assert len(orders) == 2


def test_round_robin_skips_excluded_replicas_unless_all_are() -> None:
    rr = policies.RoundRobin(policies.InFlight(), shuffle=lambda items: None)
    rr.set_replicas(replicas(1, 2))
    assert rr.select(frozenset({1})).replica_id == 2
    assert rr.select(frozenset({1, 2})).replica_id in (1, 2)
    rr.set_replicas([])
    assert rr.select() is None


def test_least_load_picks_fewest_in_flight_and_rotates_ties() -> None:
    flight = policies.InFlight()
    ll = policies.LeastLoad(flight)
    ll.set_replicas(replicas(1, 2, 3))
    # Concurrent requests (each still in flight) spread evenly.
    picks = []
    for _ in range(9):
        r = ll.select()
        flight.acquire(r.replica_id)
        picks.append(r.replica_id)
    assert collections.Counter(picks) == {1: 3, 2: 3, 3: 3}
    # Sequential requests on an idle fleet are shared too, not all sent to the first.
    for rid in (1, 2, 3):
        for _ in range(3):
            flight.release(rid)
    assert flight.counts == {}
    seq = []
    for _ in range(6):
        r = ll.select()
        flight.acquire(r.replica_id)
        flight.release(r.replica_id)
        seq.append(r.replica_id)
    assert set(seq) == {1, 2, 3}
    flight.acquire(2)
    flight.acquire(3)
    assert ll.select().replica_id == 1


def test_in_flight_never_goes_negative_and_forgets_drained_replicas() -> None:
    flight = policies.InFlight()
    flight.release(7)
    assert flight.get(7) == 0
    flight.acquire(7)
    flight.release(7)
    flight.release(7)
    assert flight.get(7) == 0
    assert flight.counts == {}
    assert flight.totals == {7: 1}


async def test_request_totals_forget_replicas_that_left_the_ready_set() -> None:
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1)
    for version, ids in enumerate([(1, 2), (3, 4), (5, 6)], start=1):
        b.set_endpoints(replicas(*ids), version=version)
        for _ in range(2):
            b.release(await b.pick())
    assert b.in_flight.totals == {5: 1, 6: 1}
    # A replica that leaves with a request still running keeps its total until that request ends.
    running = await b.pick(frozenset({6}))
    assert running.replica_id == 5
    b.set_endpoints(replicas(6, 7), version=4)
    assert b.in_flight.totals == {5: 2, 6: 1}
    b.release(running)
    assert b.in_flight.totals == {6: 1}
    # Churn leaves no trace.
    for version in range(5, 1005):
        b.set_endpoints(replicas(version), version=version)
        b.release(await b.pick())
    assert list(b.in_flight.totals) == [1004]


def test_least_load_counts_survive_replica_removal_and_return() -> None:
    flight = policies.InFlight()
    ll = policies.LeastLoad(flight)
    ll.set_replicas(replicas(1, 2))
    r = ll.select(frozenset({2}))
    flight.acquire(r.replica_id)
    ll.set_replicas(replicas(2))  # replica 1 leaves while its request runs
    assert flight.get(1) == 1
    ll.set_replicas(replicas(1, 2))  # and comes back before it ends
    assert ll.select().replica_id == 2
    flight.release(1)
    assert flight.counts == {}


def test_instance_aware_divides_load_by_accelerator_target_qps() -> None:
    flight = policies.InFlight()
    ia = policies.InstanceAware(flight, {"A100": 10.0, "T4:1": 2.0, "L4": 0.0})
    fast = policies.Replica(1, "http://a", accelerator="A100:1")  # base name match -> 10
    slow = policies.Replica(2, "http://b", accelerator="T4:1")  # exact -> 2
    ia.set_replicas([fast, slow])
    picks = collections.Counter()
    for _ in range(12):
        r = ia.select()
        flight.acquire(r.replica_id)
        picks[r.replica_id] += 1
    assert picks == {1: 10, 2: 2}
    assert ia.capacity("L4") == 1.0  # non-positive
    assert ia.capacity("H100") == 1.0  # unknown


def test_make_knows_the_three_policies() -> None:
    flight = policies.InFlight()
    assert policies.make("", flight).name == "least_load"
    assert [policies.make(n, flight).name for n in policies.NAMES] == list(policies.NAMES)
    with pytest.raises(ValueError, match="unknown load balancing policy"):
        policies.make("random", flight)


async def test_pick_without_replicas_fails_at_once_unless_scaling_from_zero() -> None:
    b = bal.Balancer("web", hold_timeout_s=5.0, hold_max=10)
    with pytest.raises(bal.NoReplicaError, match="no ready replica for service 'web'"):
        await b.pick()
    assert b.held == 0


async def test_held_request_is_reported_at_once_and_served_when_a_replica_is_ready() -> None:
    b = bal.Balancer("web", hold_timeout_s=5.0, hold_max=10)
    b.configure(bal.Config(scales_from_zero=True))
    reported = asyncio.Event()
    b.on_held = reported.set
    task = asyncio.create_task(b.pick())
    await asyncio.wait_for(reported.wait(), 2)
    assert b.held == 1
    b.set_endpoints(replicas(4), version=2)
    got = await asyncio.wait_for(task, 2)
    assert got.replica_id == 4
    assert b.in_flight.get(4) == 1
    assert b.held == 0
    b.release(got)
    assert b.in_flight.counts == {}


async def test_hold_is_bounded_in_time_and_queue() -> None:
    b = bal.Balancer("web", hold_timeout_s=0.2, hold_max=1)
    b.configure(bal.Config(scales_from_zero=True))
    first = asyncio.create_task(b.pick())
    await asyncio.sleep(0.05)
    with pytest.raises(bal.NoReplicaError, match="already waiting"):
        await b.pick()
    with pytest.raises(bal.NoReplicaError, match=r"became ready within 0\.2 s"):
        await first
    assert b.held == 0


def test_unsent_reports_are_kept_in_order_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(1, 100))
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1, clock=lambda: float(next(clock)))
    for _ in range(3):
        b.record_arrival()
    times, count = b.take_report()
    assert (times, count) == ([1.0, 2.0, 3.0], 0)
    b.record_arrival()
    b.restore_report(times, count)  # the controller was down
    assert b.pending_times == [1.0, 2.0, 3.0, 4.0]
    assert b.unreported == 4
    monkeypatch.setattr(bal, "MAX_PENDING_TIMES", 2)
    b.restore_report([], 1)
    assert b.pending_times == [3.0, 4.0]
    assert b.pending_count == 3
    b.record_arrival()
    assert b.unreported == 6


def test_configure_switches_policy_and_keeps_the_ready_set() -> None:
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1)
    b.set_endpoints(replicas(1, 2), version=5)
    b.configure(bal.Config(policy="round_robin"))
    assert b.policy.name == "round_robin"
    assert sorted(b.policy.replicas) == [1, 2]
    pinned = bal.Balancer("web", hold_timeout_s=0, hold_max=1, policy_override="round_robin")
    pinned.configure(bal.Config(policy="least_load"))
    assert pinned.policy.name == "round_robin"


async def test_a_request_right_after_start_waits_for_the_first_endpoint_set() -> None:
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1, startup_wait_s=5.0)
    task = asyncio.create_task(b.pick())
    await asyncio.sleep(0.05)
    assert not task.done()
    b.set_endpoints(replicas(3), version=1)
    assert (await asyncio.wait_for(task, 2)).replica_id == 3
    b.set_endpoints([], version=2)  # synced: no replica now means 503 at once
    with pytest.raises(bal.NoReplicaError):
        await asyncio.wait_for(b.pick(), 1)


async def test_startup_wait_is_bounded() -> None:
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1, startup_wait_s=0.1)
    with pytest.raises(bal.NoReplicaError, match="no ready replica"):
        await b.pick()

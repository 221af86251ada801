"""Traffic split between versions by weight, per-version request statistics, and how they ride in
load reports (no network)."""

from __future__ import annotations

import asyncio
import collections

import pytest

from services.common import latency
from services.loadbalancer import balancer as bal
from services.loadbalancer import link, policies, versions


def fleet(**by_version: list[int]) -> list[policies.Replica]:
    """Replicas by version: fleet(v1=[1, 2], v2=[3])."""
    return [
        policies.Replica(replica_id=rid, url=f"http://127.0.0.1:{9000 + rid}", version=int(v[1:]))
        for v, ids in by_version.items()
        for rid in ids
    ]


async def picks(b: bal.Balancer, n: int) -> collections.Counter[int]:
    """Versions of `n` sequential picks, each released at once."""
    seen: collections.Counter[int] = collections.Counter()
    for _ in range(n):
        r = await b.pick()
        seen[r.version] += 1
        b.release(r)
    return seen


@pytest.mark.parametrize(
    ("weights", "by_version", "n", "expected"),
    [
        # Weights, not replica counts, decide: one canary replica still gets 10 %.
        ({1: 900, 2: 100}, {"v1": [1, 2, 3, 4], "v2": [5]}, 1000, {1: 900, 2: 100}),
        ({1: 100, 2: 900}, {"v1": [1, 2, 3], "v2": [4]}, 2000, {1: 200, 2: 1800}),
        # A weighted version without a ready replica: its share goes to the others by weight.
        ({1: 500, 2: 300, 3: 200}, {"v1": [1], "v2": [2]}, 800, {1: 500, 2: 300}),
        # Weight 0, or not listed: no requests.
        ({1: 1000, 2: 0}, {"v1": [1], "v2": [2], "v3": [3]}, 50, {1: 50}),
        # Weights need not add up to 1000: they are relative.
        ({1: 1, 2: 3}, {"v1": [1], "v2": [2]}, 400, {1: 100, 2: 300}),
        # No weights: every replica shares, whatever its version (as before).
        ({}, {"v1": [1], "v2": [2, 3]}, 300, {1: 100, 2: 200}),
        # Only zero weights: the same as none.
        ({1: 0, 2: 0}, {"v1": [1], "v2": [2]}, 100, {1: 50, 2: 50}),
    ],
)
async def test_requests_split_by_version_weight(
    weights: dict[int, int], by_version: dict[str, list[int]], n: int, expected: dict[int, int]
) -> None:
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1, policy_override="round_robin")
    b.set_endpoints(fleet(**by_version), version=1, weights=weights)
    assert dict(await picks(b, n)) == expected


async def test_split_is_exact_over_every_window_not_only_the_total() -> None:
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1)
    b.set_endpoints(fleet(v1=[1, 2], v2=[3]), version=1, weights={1: 900, 2: 100})
    for _ in range(5):
        assert (await picks(b, 10))[2] == 1


async def test_the_policy_picks_the_replica_inside_the_chosen_version() -> None:
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1, policy_override="round_robin")
    b.set_endpoints(fleet(v1=[1, 2, 3], v2=[4, 5]), version=1, weights={1: 500, 2: 500})
    seen: collections.Counter[int] = collections.Counter()
    for _ in range(60):
        r = await b.pick()
        seen[r.replica_id] += 1
        b.release(r)
    assert seen == {1: 10, 2: 10, 3: 10, 4: 15, 5: 15}
    # Least load inside a version: in-flight requests of that version's replicas count.
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1)
    b.set_endpoints(fleet(v1=[1, 2], v2=[3]), version=1, weights={1: 1000})
    held = [await b.pick() for _ in range(4)]
    assert sorted(r.replica_id for r in held) == [1, 1, 2, 2]
    assert b.in_flight.counts == {1: 2, 2: 2}


async def test_a_retry_avoids_the_failed_replica_even_across_versions() -> None:
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1)
    b.set_endpoints(fleet(v1=[1], v2=[2]), version=1, weights={1: 100, 2: 900})
    for _ in range(20):
        r = await b.pick(frozenset({2}))  # the canary's only replica refused the first attempt
        assert r.replica_id == 1
        b.release(r)
    # Every ready replica tried: one of the weighted versions' replicas again.
    r = await b.pick(frozenset({1, 2}))
    assert r.replica_id in (1, 2)


async def test_weights_change_with_the_endpoint_set_and_a_new_split_starts() -> None:
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1)
    replicas = fleet(v1=[1], v2=[2])
    b.set_endpoints(replicas, version=1, weights={1: 900, 2: 100})
    assert (await picks(b, 100))[2] == 10
    b.set_endpoints(replicas, version=2, weights={1: 500, 2: 500})
    assert (await picks(b, 100))[2] == 50
    b.set_endpoints(replicas, version=3, weights={})  # back to the policy over every replica
    assert b.split is None
    assert sum((await picks(b, 100)).values()) == 100


async def test_no_ready_replica_of_a_weighted_version_means_503_not_the_unweighted_one() -> None:
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1)
    b.set_endpoints(fleet(v1=[1]), version=1, weights={2: 1000})
    with pytest.raises(bal.NoReplicaError):
        await b.pick()


async def test_a_held_request_waits_for_a_replica_of_a_weighted_version() -> None:
    b = bal.Balancer("web", hold_timeout_s=5.0, hold_max=10)
    b.configure(bal.Config(scales_from_zero=True))
    task = asyncio.create_task(b.pick())
    await asyncio.sleep(0.05)
    b.set_endpoints(fleet(v1=[1]), version=1, weights={2: 1000})  # v1 takes no traffic
    await asyncio.sleep(0.05)
    assert not task.done()
    b.set_endpoints(fleet(v1=[1], v2=[2]), version=2, weights={2: 1000})
    assert (await asyncio.wait_for(task, 2)).replica_id == 2


def test_split_shares_and_ties() -> None:
    split = versions.Split({1: 500, 2: 500, 3: 0, 4: -5})
    assert split.weights == {1: 500, 2: 500}
    assert [split.choose({1, 2}) for _ in range(4)] == [1, 2, 1, 2]
    assert split.choose({3}) is None
    assert split.shares({1}) == {1: 1.0, 2: 0.0}
    assert versions.Split({1: 5000}).weights == {1: 1000}


def test_outcomes_are_counted_per_version_and_taken_once() -> None:
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1)
    v1, v2 = fleet(v1=[1], v2=[2])
    b.record_answer(v1, 200, 0.010)
    b.record_answer(v1, 503, 0.020)
    b.record_answer(v2, 500, 0.001)
    b.record_transport_error(v2)
    b.record_answer(v2, 404, 0.004)  # a 4xx is the client's error, not the version's
    assert b.has_stats
    stats = b.take_stats()
    assert not b.has_stats and b.take_stats() == {}
    assert (stats[1].requests, stats[1].server_errors, stats[1].transport_errors) == (2, 1, 0)
    assert (stats[2].requests, stats[2].server_errors, stats[2].transport_errors) == (3, 1, 1)
    assert sum(stats[2].latency_buckets.values()) == 2  # transport errors have no latency
    assert stats[1].latency_sum_s == pytest.approx(0.030)
    assert latency.quantile(stats[1].latency_buckets, 1.0) == pytest.approx(0.020, rel=0.2)


async def test_admin_view_shows_weights_shares_and_totals() -> None:
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1)
    v1, _, v2 = fleet(v1=[1, 2], v2=[3])
    b.set_endpoints([v1, _, v2], version=1, weights={1: 900, 2: 100, 3: 200})
    b.record_answer(v2, 500, 0.01)
    b.record_transport_error(v2)
    b.take_stats()  # reported: the totals stay
    view = {v.version: v for v in b.versions_view()}
    assert sorted(view) == [1, 2, 3]
    assert (view[1].weight, view[1].share_per_mille, view[1].ready_replicas) == (900, 900, 2)
    assert (view[3].weight, view[3].share_per_mille, view[3].ready_replicas) == (200, 0, 0)
    assert (view[2].totals.requests, view[2].totals.server_errors, view[2].totals.transport_errors) == (2, 1, 1)
    b.set_endpoints([v1, _], version=2, weights={})  # v2 left and has no weight: forgotten
    view = {v.version: v for v in b.versions_view()}
    assert sorted(view) == [1]
    assert (view[1].weight, view[1].share_per_mille) == (0, 1000)


def test_a_report_carries_its_stats_and_a_resend_carries_the_same() -> None:
    stats = versions.Stats()
    stats.answered(500, 0.25)
    stats.transport_error()
    report = link.Report(sequence=7, times=[99.0], count=0, stats={2: stats})
    first = link.request_of(report, service="web", balancer_id="b", url="", now=100.0)
    again = link.request_of(report, service="web", balancer_id="b", url="", now=105.0)
    assert [(s.version, s.requests, s.server_errors, s.transport_errors) for s in first.version_stats] == [(2, 2, 1, 1)]
    assert first.version_stats == again.version_stats
    assert first.sequence == again.sequence == 7
    (entry,) = first.version_stats
    assert dict(entry.latency_buckets) == {latency.key_of(0.25): 1}
    assert entry.latency_sum.ToTimedelta().total_seconds() == pytest.approx(0.25)


def test_a_report_takes_at_most_64_versions_and_the_rest_wait_for_the_next() -> None:
    b = bal.Balancer("web", hold_timeout_s=0, hold_max=1)
    for v in range(1, 71):
        b.record_answer(policies.Replica(replica_id=v, url="http://x", version=v), 200, 0.01)
    first = b.take_stats()
    assert sorted(first) == list(range(1, 65))
    assert b.has_stats
    assert sorted(b.take_stats()) == list(range(65, 71))
    assert not b.has_stats

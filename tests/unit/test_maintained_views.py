"""The views a service is shown from are kept in step with its records, change by change (issue
24): the counts behind its status and ready/total (`tally.Views`) and its endpoints
(`view.Endpoints`) always equal what a count from scratch over the records gives, through puts,
status changes, deletes, active-version switches and a rebuild (a restart)."""

from __future__ import annotations

import collections
import random

from replicaplane.controller.v1 import resources_pb2 as res
from services.controller import convert, view
from services.controller.domain import scaling, tally
from services.controller.domain import status as st

STATUSES = [s for s in res.ReplicaStatus.values() if s != res.REPLICA_STATUS_UNSPECIFIED]


def _record(rid: int, rng: random.Random) -> res.Replica:
    r = res.Replica(
        service="svc",
        replica_id=rid,
        version=rng.choice([1, 2, 3]),
        status=rng.choice(STATUSES + [res.REPLICA_STATUS_READY] * 4),
        endpoint=f"http://127.0.0.1:{rng.randint(1, 3)}/r/{rid}",
        accelerator=rng.choice(["", "A100"]),
    )
    if rng.random() < 0.2:
        r.facts.teardown_phase = res.TEARDOWN_PHASE_SUCCEEDED
    return r


def _expected_endpoints(records: dict[int, res.Replica], active: list[int]) -> list[tuple[int, str, int, str]]:
    return [
        (rid, r.endpoint, r.version, r.accelerator or "unknown")
        for rid, r in sorted(records.items())
        if r.status == res.REPLICA_STATUS_READY and r.version in active
    ]


def _shown(container: object) -> list[tuple[int, str, int, str]]:
    return [(e.replica_id, e.url, e.version, e.accelerator) for e in container]  # type: ignore[attr-defined]


def _check(records: dict[int, res.Replica], views: tally.Views, endpoints: view.Endpoints) -> None:
    statuses = [st.ReplicaStatus(r.status) for r in records.values()]
    assert dict(views.statuses) == dict(collections.Counter(statuses))
    assert st.ready_and_total(views.statuses) == st.ready_and_total(statuses)
    for launching in (False, True):
        assert st.service_status(views.statuses, launching=launching) == st.service_status(
            statuses, launching=launching
        )
    listed = [convert.view_of(r) for r in records.values()]
    for blue_green in (False, True):
        assert scaling.active_versions_of(
            views.ready_by_version, latest_version=3, target=2, blue_green=blue_green
        ) == scaling.active_versions(listed, latest_version=3, target=2, blue_green=blue_green)
    torn = {rid: r.version for rid, r in records.items() if r.facts.teardown_phase == res.TEARDOWN_PHASE_SUCCEEDED}
    assert views.torn_down == torn
    assert views.held == len(records) - len(torn)
    for active in ([1, 2, 3], [3], [1, 2]):
        svc = res.Service()
        endpoints.into(svc, active)
        want = _expected_endpoints(records, active)
        assert _shown(svc.endpoints) == want
        assert _shown(endpoints.watch_part.endpoints) == want


def test_counts_and_endpoints_follow_every_change_delete_and_rebuild() -> None:
    rng = random.Random(24)
    records: dict[int, res.Replica] = {}
    views = convert.tally_of(records)
    endpoints = view.Endpoints(records)
    for step in range(600):
        # As a stored batch: each record put (as it is now) or deleted, never both.
        puts: dict[int, res.Replica] = {}
        deletes: set[int] = set()
        for _ in range(rng.randint(1, 8)):
            rid = rng.randint(1, 60)
            if rid in records and rng.random() < 0.3:
                del records[rid]
                views.pop(rid)
                deletes.add(rid)
                puts.pop(rid, None)
            else:
                r = _record(rid, rng)
                records[rid] = r
                torn_down = r.facts.teardown_phase == res.TEARDOWN_PHASE_SUCCEEDED
                views.set(rid, convert.view_of(r), torn_down=torn_down)
                puts[rid] = r
                deletes.discard(rid)
        endpoints.stored(puts.values(), deletes)
        if step % 7 == 0:
            _check(records, views, endpoints)
        if step % 150 == 149:  # a restart: everything built again from the records as stored
            views, endpoints = convert.tally_of(records), view.Endpoints(records)
            _check(records, views, endpoints)
    _check(records, views, endpoints)


def test_endpoint_generation_moves_only_when_the_endpoints_do() -> None:
    r = res.Replica(replica_id=1, version=1, status=res.REPLICA_STATUS_READY, endpoint="http://a")
    endpoints = view.Endpoints({})
    endpoints.activate([1])
    g = endpoints.generation
    endpoints.stored([r], [])
    assert endpoints.generation > g
    g = endpoints.generation
    endpoints.stored([r], [])  # the same endpoint stored again (another field changed)
    assert endpoints.generation == g
    endpoints.stored([], [1])
    assert endpoints.generation > g and not endpoints.service_part.endpoints

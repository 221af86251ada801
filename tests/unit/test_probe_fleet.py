"""Unit tests of the fleet client's address parsing and target assignment (no network)."""

from __future__ import annotations

import asyncio
import collections

import pytest

from replicaplane.prober.v1 import prober_service_pb2 as pb
from services.common import probe_fleet, probe_placement


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:50053", ("list", ["127.0.0.1:50053"])),
        ("a:1, b:2,,c:3", ("list", ["a:1", "b:2", "c:3"])),
        ("ipv4:10.0.0.1:1,10.0.0.2:1", ("list", ["10.0.0.1:1", "10.0.0.2:1"])),
        ("dns:///prober.default.svc:50053", ("dns", ["prober.default.svc:50053"])),
        ("dns:prober:50053", ("dns", ["prober:50053"])),
    ],
)
def test_parse_targets(text: str, expected: tuple[str, list[str]]) -> None:
    assert probe_fleet.parse_targets(text) == expected


@pytest.mark.parametrize("text", ["", " , ", "dns:///"])
def test_parse_targets_refuses_empty(text: str) -> None:
    with pytest.raises(ValueError):
        probe_fleet.parse_targets(text)


class Harness:
    """A fleet whose streams are driven by hand: no channels, no probers."""

    def __init__(self, probers: int, streams: int = 4) -> None:
        self.results: list[pb.ProbeResult] = []
        self.stale: list[bool] = []
        self.fleet = probe_fleet.ProbeFleet(
            ",".join(f"p{i}:1" for i in range(probers)),
            on_results=self.results.extend,
            on_stale=self.stale.append,
        )
        self.fleet._started = True
        self.streams = {
            f"p{i}:1": [probe_placement.Stream(addr=f"p{i}:1", index=j) for j in range(streams)] for i in range(probers)
        }

    def up(self, addr: str) -> None:
        for stream in self.streams[addr]:
            self.fleet._went_live(stream)

    def down(self, addr: str) -> None:
        for stream in self.streams[addr]:
            self.fleet._went_dead(stream)

    def loads(self) -> dict[str, int]:
        return {addr: sum(len(s.targets) for s in streams) for addr, streams in self.streams.items()}

    def stream_loads(self) -> list[int]:
        return sorted(len(s.targets) for streams in self.streams.values() for s in streams if s.live)

    def check_each_target_on_one_live_stream(self) -> None:
        seen = collections.Counter(t for streams in self.streams.values() for s in streams for t in s.targets)
        assert set(seen) == set(self.fleet._placement.targets)
        assert all(count == 1 for count in seen.values())
        for target_id, stream in self.fleet._placement.assigned.items():
            assert stream.live
            assert target_id in stream.targets


def upsert_many(fleet: probe_fleet.ProbeFleet, n: int, prefix: str = "t") -> None:
    for i in range(n):
        fleet.upsert(pb.ProbeTarget(target_id=f"{prefix}{i}", url="http://127.0.0.1:1"))


async def test_targets_spread_evenly_over_probers_and_streams() -> None:
    h = Harness(3)
    for addr in h.streams:
        h.up(addr)
    upsert_many(h.fleet, 31)
    assert sorted(h.loads().values()) == [10, 10, 11]
    assert max(h.stream_loads()) - min(h.stream_loads()) <= 1
    h.check_each_target_on_one_live_stream()


async def test_late_probers_get_a_fair_share_by_rebalancing() -> None:
    h = Harness(3)
    h.up("p0:1")
    upsert_many(h.fleet, 30)
    assert h.loads()["p0:1"] == 30
    h.up("p1:1")
    h.up("p2:1")
    assert sorted(h.loads().values()) == [10, 10, 10]
    h.check_each_target_on_one_live_stream()
    # Moved targets are removed from their old stream and sent to the new one.
    assert sum(len(s.removes) for s in h.streams["p0:1"]) >= 20
    assert sum(len(s.upserts) for s in h.streams["p1:1"] + h.streams["p2:1"]) == 20


async def test_lost_prober_targets_move_to_the_others() -> None:
    h = Harness(3)
    for addr in h.streams:
        h.up(addr)
    upsert_many(h.fleet, 30)
    h.down("p1:1")
    assert h.loads() == {"p0:1": 15, "p1:1": 0, "p2:1": 15}
    h.check_each_target_on_one_live_stream()
    assert not h.fleet.stale
    await asyncio.sleep(0)
    assert h.results == []  # moved, not unavailable


async def test_losing_every_prober_makes_results_unavailable_not_failures() -> None:
    h = Harness(2, streams=1)
    for addr in h.streams:
        h.up(addr)
    upsert_many(h.fleet, 4)
    h.streams["p0:1"][0].prober_id = "p0-id"
    h.down("p0:1")
    h.down("p1:1")
    assert h.fleet.stale
    assert h.stale == [False, True]
    h.fleet.upsert(pb.ProbeTarget(target_id="new", url="http://127.0.0.1:1"))
    h.fleet.remove("t0")
    await asyncio.sleep(0)
    assert sorted(r.target_id for r in h.results) == ["new", "t1", "t2", "t3"]
    assert all(r.outcome == pb.PROBE_OUTCOME_PROBE_UNAVAILABLE and not r.ready for r in h.results)
    assert {r.error for r in h.results} == {"prober went away", "no prober reachable"}

    h.up("p1:1")
    assert not h.fleet.stale
    assert h.stale == [False, True, False]
    assert h.loads()["p1:1"] == 4
    h.check_each_target_on_one_live_stream()


async def test_remove_and_unchanged_upsert() -> None:
    h = Harness(1, streams=1)
    h.up("p0:1")
    (stream,) = h.streams["p0:1"]
    target = pb.ProbeTarget(target_id="a", url="http://127.0.0.1:1")
    h.fleet.upsert(target)
    stream.upserts.clear()
    h.fleet.upsert(target)
    assert stream.upserts == {}  # nothing to send
    h.fleet.upsert(pb.ProbeTarget(target_id="a", url="http://127.0.0.1:2"))
    assert list(stream.upserts) == ["a"]
    h.fleet.remove("a")
    assert stream.upserts == {}
    assert stream.removes == {"a"}
    assert h.fleet.prober_loads() == {}
    assert h.loads() == {"p0:1": 0}


async def test_the_fleet_keeps_its_own_copy_of_a_target() -> None:
    h = Harness(1, streams=1)
    h.up("p0:1")
    target = pb.ProbeTarget(target_id="a", url="http://127.0.0.1:1")
    h.fleet.upsert(target)
    target.url = "http://changed"
    assert h.fleet._placement.targets["a"].url == "http://127.0.0.1:1"

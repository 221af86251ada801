"""Service tests of the fleet client against real probers (processes and in-process servers)."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time
from collections.abc import AsyncIterator, Callable

import pytest

from replicaplane.prober.v1 import prober_service_pb2 as pb
from services.common import probe_fleet
from services.prober import server
from tests.helpers import ports, prober_apps, procs
from tests.helpers.prober_stream import target


class Recorder:
    """Collects what a fleet reports: every result (with receive time) and stale changes."""

    def __init__(self) -> None:
        self.results: list[tuple[float, pb.ProbeResult]] = []
        self.stale: list[bool] = []

    def on_results(self, results: list[pb.ProbeResult]) -> None:
        now = time.monotonic()
        self.results += [(now, r) for r in results]

    def since(self, when: float) -> list[pb.ProbeResult]:
        return [r for t, r in self.results if t >= when]

    async def wait(self, condition: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError("condition not met")
            await asyncio.sleep(0.02)


@pytest.fixture
async def app() -> AsyncIterator[prober_apps.App]:
    a = await prober_apps.App().start()
    yield a
    await a.stop()


async def start_prober(prober_id: str = "") -> server.Built:
    built = await server.build_server(server.Settings(listen_addr="127.0.0.1:0", prober_id=prober_id))
    await built.start()
    return built


def fleet_of(addresses: str, rec: Recorder, **tuning: object) -> probe_fleet.ProbeFleet:
    return probe_fleet.ProbeFleet(
        addresses,
        on_results=rec.on_results,
        on_stale=rec.stale.append,
        **tuning,  # type: ignore[arg-type]
    )


def ids(n: int) -> list[str]:
    return [f"svc/{i}" for i in range(n)]


async def test_three_prober_processes_spread_survive_a_kill_and_never_invent_failures(
    app: prober_apps.App,
) -> None:
    # On this process's own loopback address: the victim comes back on the port it had.
    probers = [procs.start_service("prober", host=ports.private_host()) for _ in range(3)]
    rec = Recorder()
    fleet = fleet_of(",".join(p.addr for p in probers), rec, streams_per_prober=4)
    targets = ids(30)
    try:
        await fleet.start()
        assert not fleet.stale
        assert rec.stale == [False]
        for target_id in targets:
            fleet.upsert(target(target_id, app.url, "/health", interval=0.2))

        # Spread over all three: a prober whose stream opened after the targets came (a loaded
        # machine) gets its share when it joins, as one that comes back does below.
        await rec.wait(lambda: {r.target_id for _, r in rec.results if r.ready} == set(targets))
        await rec.wait(lambda: sorted(fleet.prober_loads().values()) == [10, 10, 10], timeout=5)
        settled = time.monotonic()
        await rec.wait(lambda: {r.target_id for r in rec.since(settled)} == set(targets))
        by_prober = collections.defaultdict(set)
        for r in rec.since(settled):
            by_prober[r.prober_id].add(r.target_id)
        assert len(by_prober) == 3
        assert all(len(t) == 10 for t in by_prober.values())

        # SIGKILL one: every target keeps being probed by the other two.
        victim = probers[0]
        victim_id = next(p for p, t in by_prober.items() if p.endswith(f":{victim.proc.pid}"))
        victim.kill()
        killed = time.monotonic()
        await rec.wait(lambda: {r.target_id for r in rec.since(killed) if r.ready} == set(targets), timeout=3)
        moved_in = time.monotonic() - killed
        later = time.monotonic()
        await rec.wait(lambda: {r.target_id for r in rec.since(later) if r.ready} == set(targets), timeout=3)
        assert victim_id not in {r.prober_id for r in rec.since(later)}
        assert sorted(fleet.prober_loads()[p.addr] for p in probers[1:]) == [15, 15]
        assert moved_in < 2.0
        assert not fleet.stale

        # It comes back on the same address: rebalanced targets use it again.
        probers[0] = procs.start_service("prober", host=victim.host, port=victim.port)
        back_id = f":{probers[0].proc.pid}"
        await rec.wait(lambda: any(r.prober_id.endswith(back_id) for _, r in rec.results), timeout=5)
        await rec.wait(lambda: sorted(fleet.prober_loads().values()) == [10, 10, 10], timeout=5)

        # Kill all three: stale, and nothing claims a replica failed.
        for p in probers:
            p.kill()
        gone = time.monotonic()
        await rec.wait(lambda: fleet.stale, timeout=3)
        assert rec.stale == [False, True]
        await rec.wait(
            lambda: (
                {r.target_id for r in rec.since(gone) if r.outcome == pb.PROBE_OUTCOME_PROBE_UNAVAILABLE}
                == set(targets)
            )
        )
        for target_id in ("svc/new", "svc/0"):
            fleet.upsert(target(target_id, app.url, interval=0.2))
        await rec.wait(
            lambda: any(
                r.target_id == "svc/new" and r.outcome == pb.PROBE_OUTCOME_PROBE_UNAVAILABLE for r in rec.since(gone)
            )
        )
        await asyncio.sleep(0.3)
        outcomes = collections.Counter(r.outcome for _, r in rec.results)
        assert outcomes[pb.PROBE_OUTCOME_REPLICA_FAILURE] == 0, outcomes
        assert all(not r.ready for r in rec.since(gone) if r.outcome == pb.PROBE_OUTCOME_PROBE_UNAVAILABLE)
    finally:
        await fleet.stop()
        for p in probers:
            p.kill()
    assert all(p.proc.poll() is not None for p in probers)


async def test_streams_are_spread_evenly_over_one_prober(app: prober_apps.App) -> None:
    built = await start_prober()
    rec = Recorder()
    fleet = fleet_of(f"127.0.0.1:{built.port}", rec, streams_per_prober=4)
    try:
        await fleet.start()
        for target_id in ids(41):
            fleet.upsert(target(target_id, app.url, interval=10))
        await rec.wait(lambda: len({r.target_id for _, r in rec.results}) == 41)
        assert built.engine is not None
        counts = sorted(s.target_count for s in built.engine._streams)
        assert counts == [10, 10, 10, 11]
    finally:
        await fleet.stop()
        await built.stop(0)


async def test_no_prober_means_stale_and_unavailable_then_recovery(app: prober_apps.App, tmp_path) -> None:
    # The prober comes up later at an address the fleet already dials: a Unix socket path,
    # which no other process can take in the meantime (as it could a free TCP port).
    address = f"unix:{tmp_path}/prober.sock"
    rec = Recorder()
    fleet = fleet_of(address, rec, start_wait_s=0.3)
    built = None
    try:
        fleet.upsert(target("early", app.url, interval=0.1))
        await fleet.start()
        assert fleet.stale
        assert rec.stale == [True]
        fleet.upsert(target("late", app.url, interval=0.1))
        await rec.wait(lambda: {r.target_id for _, r in rec.results} == {"early", "late"})
        for _, r in rec.results:
            assert r.outcome == pb.PROBE_OUTCOME_PROBE_UNAVAILABLE
            assert not r.ready
            assert r.error == "no prober reachable"

        built = await server.build_server(server.Settings(listen_addr=address))
        await built.start()
        await rec.wait(lambda: not fleet.stale, timeout=5)
        assert rec.stale == [True, False]
        back = time.monotonic()
        await rec.wait(lambda: {r.target_id for r in rec.since(back) if r.ready} == {"early", "late"})
    finally:
        await fleet.stop()
        if built is not None:
            await built.stop(0)


async def test_graceful_prober_stop_moves_targets_at_once(app: prober_apps.App) -> None:
    a, b = await start_prober(prober_id="a"), await start_prober(prober_id="b")
    rec = Recorder()
    fleet = fleet_of(f"127.0.0.1:{a.port},127.0.0.1:{b.port}", rec, streams_per_prober=2)
    try:
        await fleet.start()
        for target_id in ids(10):
            fleet.upsert(target(target_id, app.url, interval=10))
        await rec.wait(lambda: len({r.target_id for _, r in rec.results}) == 10)
        assert {r.prober_id for _, r in rec.results} == {"a", "b"}
        stopped = time.monotonic()
        await a.stop(5.0)
        # Moved targets are probed at once on b, although their interval is 10 s.
        await rec.wait(lambda: len({r.target_id for r in rec.since(stopped)}) == 5, timeout=2)
        assert {r.prober_id for r in rec.since(stopped)} == {"b"}
        assert not fleet.stale
        assert all(r.outcome != pb.PROBE_OUTCOME_PROBE_UNAVAILABLE for _, r in rec.results)
    finally:
        await fleet.stop()
        await b.stop(0)


async def test_removed_targets_get_no_more_results(app: prober_apps.App) -> None:
    built = await start_prober()
    rec = Recorder()
    fleet = fleet_of(f"127.0.0.1:{built.port}", rec)
    try:
        await fleet.start()
        fleet.upsert(target("gone", app.url, interval=0.02))
        fleet.upsert(target("kept", app.url, interval=0.02))
        await rec.wait(lambda: {r.target_id for _, r in rec.results} == {"gone", "kept"})
        fleet.remove("gone")
        removed = time.monotonic()
        await asyncio.sleep(0.3)
        assert {r.target_id for r in rec.since(removed)} == {"kept"}
        assert fleet.prober_loads() == {f"127.0.0.1:{built.port}": 1}
    finally:
        await fleet.stop()
        await built.stop(0)


async def test_changed_target_reaches_its_prober(app: prober_apps.App) -> None:
    built = await start_prober()
    rec = Recorder()
    fleet = fleet_of(f"127.0.0.1:{built.port}", rec)
    try:
        await fleet.start()
        fleet.upsert(target("t", app.url, "/old", interval=10))
        await rec.wait(lambda: len(rec.results) == 1)
        fleet.upsert(target("t", app.url, "/new", interval=10))
        await rec.wait(lambda: len(rec.results) == 2)
        assert [r.path for r in app.requests] == ["/old", "/new"]
    finally:
        await fleet.stop()
        await built.stop(0)


async def test_invalid_targets_are_reported_and_a_failing_callback_does_not_break_the_stream(
    app: prober_apps.App,
) -> None:
    built = await start_prober()
    seen: list[pb.ProbeResult] = []

    def on_results(results: list[pb.ProbeResult]) -> None:
        seen.extend(results)
        raise RuntimeError("controller bug")

    fleet = probe_fleet.ProbeFleet(f"127.0.0.1:{built.port}", on_results=on_results)
    try:
        await fleet.start()
        fleet.upsert(target("bad", "ftp://x"))
        fleet.upsert(target("ok", app.url, interval=0.05))
        deadline = time.monotonic() + 5
        while sum(1 for r in seen if r.target_id == "ok") < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        bad = [r for r in seen if r.target_id == "bad"]
        assert bad[0].outcome == pb.PROBE_OUTCOME_INVALID_TARGET
        assert sum(1 for r in seen if r.target_id == "ok") >= 3
    finally:
        await fleet.stop()
        await built.stop(0)


async def test_dns_name_reaches_the_probers_it_resolves_to(app: prober_apps.App) -> None:
    built = await start_prober(prober_id="by-dns")
    rec = Recorder()
    fleet = fleet_of(f"dns:///localhost:{built.port}", rec, resolve_interval_s=0.2)
    try:
        await fleet.start()
        fleet.upsert(target("t", app.url, interval=10))
        await rec.wait(lambda: any(r.ready for _, r in rec.results))
        assert {r.prober_id for _, r in rec.results} == {"by-dns"}
        assert f"127.0.0.1:{built.port}" in fleet.prober_loads()
        await asyncio.sleep(0.5)  # re-resolution keeps the same probers and targets
        assert fleet.prober_loads()[f"127.0.0.1:{built.port}"] == 1
    finally:
        await fleet.stop()
        await built.stop(0)


async def test_a_prober_that_never_answers_is_stale_and_stop_does_not_hang(app: prober_apps.App) -> None:
    """A peer that accepts TCP connections and stays silent (a hung host, a black hole)."""
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    rec = Recorder()
    fleet = fleet_of(f"127.0.0.1:{port}", rec, connect_timeout_s=0.3, start_wait_s=0.2)
    try:
        await fleet.start()
        fleet.upsert(target("t", app.url, interval=0.1))
        await asyncio.sleep(0.5)
        assert fleet.stale
        assert [r.outcome for _, r in rec.results] == [pb.PROBE_OUTCOME_PROBE_UNAVAILABLE]
    finally:
        started = time.monotonic()
        await fleet.stop()
        assert time.monotonic() - started < 1.0
        silent.close()


async def test_a_frozen_prober_is_noticed_within_the_liveness_timeout(app: prober_apps.App) -> None:
    """SIGSTOP: the connection stays open with no reset, and the prober answers nothing."""
    probers = [procs.start_service("prober") for _ in range(2)]
    rec = Recorder()
    fleet = fleet_of(",".join(p.addr for p in probers), rec, streams_per_prober=2)
    targets = ids(8)
    frozen = probers[0]
    try:
        await fleet.start()
        for target_id in targets:
            fleet.upsert(target(target_id, app.url, "/health", interval=0.2))
        await rec.wait(lambda: sorted(fleet.prober_loads().values()) == [4, 4])
        await rec.wait(lambda: {r.target_id for _, r in rec.results if r.ready} == set(targets))
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        # Every target is probed again, by the live prober, within the documented bound.
        bound = probe_fleet.DEFAULT_LIVENESS_TIMEOUT_S + 2.0
        await rec.wait(lambda: {r.target_id for r in rec.since(stopped) if r.ready} == set(targets), timeout=bound)
        assert fleet.prober_loads()[probers[1].addr] == 8
        assert not fleet.stale
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
        await fleet.stop()
        for p in probers:
            p.kill()

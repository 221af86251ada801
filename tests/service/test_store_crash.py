"""Crash test of the controller store: SIGKILL a writer process mid-write, repeatedly."""

from __future__ import annotations

import json
import os
import random
import selectors
import signal
import sqlite3
import subprocess
import sys
import time

from services.controller import store as store_mod
from tests.helpers import store_writer

WRITER = os.path.abspath(store_writer.__file__)
ROUNDS = 5


def _wait_ready(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Block until the writer prints `ready` (bounded)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError("writer did not start")
    line = proc.stdout.readline()
    assert line == b"ready\n", line


def _run_and_kill(db_path: str, delay: float) -> list[tuple[list[int], int]]:
    """Start a writer, SIGKILL it after `delay` s of writing; return its acknowledged batches."""
    # Unbuffered: communicate() below reads the raw pipe, so a buffered reader would hide lines.
    proc = subprocess.Popen([sys.executable, WRITER, db_path], stdout=subprocess.PIPE, bufsize=0)
    try:
        _wait_ready(proc, timeout=20)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    acks = []
    for line in out.decode().splitlines():
        # A kill between write and flush can cut the last line; it was never acknowledged.
        parts = line.split()
        if len(parts) == 6 and parts[0] == "ack" and parts[4] == "del" and parts[5].isdigit():
            acks.append(([int(p) for p in parts[1:4]], int(parts[5])))
    return acks


def test_sigkilled_writer_loses_no_acknowledged_write(tmp_path: object) -> None:
    db_path = os.path.join(str(tmp_path), "state.db")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    acked_batches: list[list[int]] = []
    acked_deletes: set[int] = set()
    procs_started = 0
    for _ in range(ROUNDS):
        batches = _run_and_kill(db_path, rng.uniform(0.05, 0.3))
        procs_started += 1
        assert batches, f"writer acknowledged nothing (seed {seed})"
        for ids, deleted in batches:
            acked_batches.append(ids)
            if deleted:
                acked_deletes.add(deleted)
    acked = [rid for ids in acked_batches for rid in ids]

    # Ids handed out across every crash and restart were never reused.
    assert acked == sorted(set(acked)), f"replica id reused (seed {seed})"

    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        conn.close()

    with store_mod.Store(db_path) as store:
        service = store.get_service(store_writer.SERVICE)
        assert service is not None
        replicas = store.list_replicas(store_writer.SERVICE)
        present = {r.replica_id for r in replicas}

        # Every acknowledged write is there; every acknowledged delete is gone. A middle
        # replica may also be gone when the next batch committed but was killed before its ack.
        missing = [
            rid
            for a, b, c in acked_batches
            for rid in (a, b, c)
            if rid not in present and rid not in acked_deletes and not (rid == b and a + 3 in present)
        ]
        assert not missing, f"lost acknowledged replicas {missing[:10]} (seed {seed})"
        assert not (acked_deletes & present), f"acknowledged deletes came back (seed {seed})"

        # Each batch was one transaction: whole, with only its middle replica deleted by the
        # next batch; the autoscaler state and versions moved with it.
        by_batch: dict[str, list[int]] = {}
        for r in replicas:
            by_batch.setdefault(r.zone, []).append(r.replica_id)
        last = max(present)
        for zone, ids in by_batch.items():
            first = int(zone.removeprefix("batch-"))
            expected = [first, first + 1, first + 2] if first + 2 == last else [first, first + 2]
            assert ids == expected, f"torn batch {zone}: {ids} (seed {seed})"
        state = json.loads(store.get_autoscaler_state(store_writer.SERVICE) or b"{}")
        assert state["last"] == last
        assert state["version"] == service.latest_version
        assert store.list_versions(store_writer.SERVICE) == list(range(1, service.latest_version + 1))
        assert service.next_replica_id == last + 1
        assert {r.version for r in replicas} <= set(range(1, service.latest_version + 1))

        # The store keeps working after the crashes, and ids keep going up.
        assert store.allocate_replica_id(store_writer.SERVICE) == last + 1
    assert procs_started == ROUNDS

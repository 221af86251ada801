"""Find, wait for and kill replica processes a test's provisioner started (by its state dir).

Every replica process of the local backend carries REPLICAPLANE_OWNER=<state dir>, so a test
can check the process table for leftovers and clean up whatever a failed test left behind.
Zombies do not count: they are dead, only not reaped yet.
"""

from __future__ import annotations

import os
import signal
import time

from services.provisioner import local, procs


def owner(state_dir: str) -> str:
    """The owner marker value of replicas of a provisioner using `state_dir`."""
    return os.path.abspath(os.path.expanduser(state_dir))


def replica_pids(state_dir: str, token: str | None = None) -> list[int]:
    """Live processes of replicas started by the provisioner of `state_dir`."""
    pids = procs.pids_with_env(local.OWNER_ENV, owner(state_dir))
    if token is not None:
        pids = [p for p in pids if procs.env_value(p, local.TOKEN_ENV) == token]
    return pids


def wait_no_replicas(state_dir: str, timeout: float = 5.0) -> list[int]:
    """Wait (bounded) until no replica process of `state_dir` lives; return the ones left."""
    deadline = time.monotonic() + timeout
    while True:
        left = replica_pids(state_dir)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def kill_replicas(state_dir: str) -> int:
    """SIGKILL every replica process (and its process group) of `state_dir`; return how many."""
    pids = replica_pids(state_dir)
    for pid in pids:
        info = procs.read_stat(pid)
        if info is not None and info.pgid > 1 and info.pgid != os.getpgid(0):
            procs.signal_group(info.pgid, signal.SIGKILL)
    procs.signal_pids(pids, signal.SIGKILL)
    wait_no_replicas(state_dir, timeout=2.0)
    return len(pids)

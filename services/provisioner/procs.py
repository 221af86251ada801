"""Process and process-group helpers for the local backend (Linux: pidfd and /proc).

Exits are noticed without polling: a pidfd becomes readable when its process exits, for
children and non-children alike (the latter matters after a provisioner restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Generic, TypeVar

_PROC = "/proc"
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class ProcInfo:
    """One line of the process table."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    start_ticks: int

    @property
    def alive(self) -> bool:
        """False for zombies and dead processes (waiting to be reaped counts as gone)."""
        return self.state not in ("Z", "X", "x")


def read_stat(pid: int) -> ProcInfo | None:
    """The process table entry of `pid`, or None when there is none."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as fh:
            raw = fh.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name is in parentheses and may contain spaces; fields follow the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return ProcInfo(pid, int(fields[1]), int(fields[2]), int(fields[3]), fields[0], int(fields[19]))
    except (IndexError, ValueError):
        return None


def all_pids() -> Iterator[int]:
    """Every pid in the process table."""
    try:
        names = os.listdir(_PROC)
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name)


def read_environ(pid: int) -> bytes:
    """The raw environment of `pid` (NUL-separated), or b"" if it cannot be read."""
    try:
        with open(f"{_PROC}/{pid}/environ", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def pids_with_env(name: str, value: str | None = None) -> list[int]:
    """Live processes whose environment has `name` (set to `value`, when given)."""
    needle = f"{name}=".encode() if value is None else f"{name}={value}\0".encode()
    own = os.getpid()
    found = []
    for pid in all_pids():
        if pid == own:
            continue
        env = read_environ(pid)
        if not env:
            continue
        hit = (
            (b"\0" + needle) in (b"\0" + env)
            if value is not None
            else any(item.startswith(needle) for item in env.split(b"\0"))
        )
        if hit:
            info = read_stat(pid)
            if info is not None and info.alive:
                found.append(pid)
    return found


def env_value(pid: int, name: str) -> str | None:
    """The value of environment variable `name` of process `pid`, if readable."""
    prefix = f"{name}=".encode()
    for item in read_environ(pid).split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def env_table(names: tuple[str, ...]) -> dict[int, dict[str, str]]:
    """Live processes that have any of the environment variables `names`, with their values.

    One pass over the process table; it takes milliseconds and grows with the host's
    processes, so async code runs it through a Scanner (off the event loop).
    """
    prefixes = [(name, f"{name}=".encode()) for name in names]
    own = os.getpid()
    found: dict[int, dict[str, str]] = {}
    for pid in all_pids():
        if pid == own:
            continue
        env = read_environ(pid)
        if not env:
            continue
        values = {}
        for item in env.split(b"\0"):
            for name, prefix in prefixes:
                if item.startswith(prefix):
                    values[name] = item[len(prefix) :].decode(errors="replace")
        if values:
            info = read_stat(pid)
            if info is not None and info.alive:
                found[pid] = values
    return found


def live_groups() -> set[int]:
    """Process groups with at least one live (non-zombie) member: one pass over the table."""
    groups = set()
    for pid in all_pids():
        info = read_stat(pid)
        if info is not None and info.alive:
            groups.add(info.pgid)
    return groups


def group_exists(pgid: int) -> bool:
    """Whether group `pgid` has any member, zombies included (one signal-0, no scan)."""
    if pgid <= 1:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class Coalesced(Generic[_T]):
    """Runs a blocking `scan` in a worker thread, shared by the callers waiting for it.

    A caller always gets a scan that started after it asked: callers arriving while a scan
    runs share the next one. However many teardowns poll at once, at most one scan runs and
    one is queued, and the event loop never walks /proc itself.
    """

    def __init__(self, scan: Callable[[], _T]) -> None:
        self._scan = scan
        self._next: asyncio.Future[_T] | None = None
        self._runner: asyncio.Task[None] | None = None

    async def get(self) -> _T:
        """The result of a scan that started after this call."""
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        waiting = self._next
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run())
        return await asyncio.shield(waiting)

    async def _run(self) -> None:
        try:
            while self._next is not None:
                batch, self._next = self._next, None
                try:
                    result = await asyncio.to_thread(self._scan)
                except Exception as exc:
                    batch.set_exception(exc)
                    batch.add_done_callback(lambda f: f.exception())  # the waiters may be gone
                else:
                    batch.set_result(result)
        finally:
            self._runner = None

    def close(self) -> None:
        """Stop scanning; callers still waiting are cancelled."""
        if self._runner is not None:
            self._runner.cancel()
        if self._next is not None:
            self._next.cancel()
            self._next = None


class Scanner:
    """Async process-table queries for one backend; every scan runs in a worker thread.

    Args:
        env_names: the environment variables `env_table` reports.
    """

    def __init__(self, env_names: tuple[str, ...]) -> None:
        self._groups = Coalesced(live_groups)
        self._env = Coalesced(lambda: env_table(env_names))

    async def group_alive(self, pgid: int) -> bool:
        """Whether group `pgid` has a live (non-zombie) member."""
        if not group_exists(pgid):
            return False  # the common case after a kill: no scan at all
        return pgid in await self._groups.get()

    async def env_table(self) -> dict[int, dict[str, str]]:
        """Live processes carrying any of the scanner's variables, with their values."""
        return await self._env.get()

    def close(self) -> None:
        """Stop the scans in progress."""
        self._groups.close()
        self._env.close()


def group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a live (non-zombie) member (blocking: scans /proc)."""
    # Zombies still count as group members for killpg; look for a live one.
    return group_exists(pgid) and pgid in live_groups()


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to group `pgid`; False when the group is gone."""
    if pgid <= 1:
        return False
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def signal_pids(pids: list[int], sig: int) -> None:
    """Send `sig` to each pid, ignoring the ones already gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def leader_alive(pid: int, start_ticks: int) -> bool:
    """Whether `pid` is still the live process that started at `start_ticks`."""
    info = read_stat(pid)
    return info is not None and info.alive and (not start_ticks or info.start_ticks == start_ticks)


def start_ticks(pid: int) -> int:
    """When `pid` started, in clock ticks since boot; 0 if unknown."""
    info = read_stat(pid)
    return info.start_ticks if info else 0


async def kill_group(
    pgid: int,
    *,
    grace_s: float,
    alive: Callable[[int], Awaitable[bool]],
    reap: Callable[[], object] | None = None,
    poll_s: float = 0.02,
) -> bool:
    """SIGTERM group `pgid`, wait up to `grace_s`, then SIGKILL; wait up to 2 s more.

    Args:
        pgid: the process group.
        grace_s: seconds between SIGTERM and SIGKILL; 0 sends SIGKILL at once.
        alive: whether a group still has a live member (Scanner.group_alive: off the loop).
        reap: called on each check, to reap a child leader so it does not linger as a zombie.
        poll_s: how often to look at the group while waiting (bounded by the deadlines).

    Returns:
        True when no live process of the group remains.
    """
    if grace_s > 0 and signal_group(pgid, signal.SIGTERM):
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if reap:
                reap()
            if not await alive(pgid):
                return True
            await asyncio.sleep(poll_s)
    signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while True:
        if reap:
            reap()
        if not await alive(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)


class ExitWatcher:
    """Calls back once when a process exits, using a pidfd on the event loop (no polling)."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pid -> pidfd

    def watch(self, pid: int, callback: Callable[[], None]) -> bool:
        """Call `callback` (on the loop) when `pid` exits.

        Returns:
            False when `pid` is already gone (the callback is not called then).
        """
        self.cancel(pid)
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        loop = asyncio.get_running_loop()
        self._fds[pid] = fd

        def ready() -> None:
            if self._fds.get(pid) != fd:
                return
            self.cancel(pid)
            callback()

        loop.add_reader(fd, ready)
        return True

    def cancel(self, pid: int) -> None:
        """Stop watching `pid`."""
        fd = self._fds.pop(pid, None)
        if fd is None:
            return
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(fd)
        with contextlib.suppress(OSError):
            os.close(fd)

    def close(self) -> None:
        """Stop watching everything."""
        for pid in list(self._fds):
            self.cancel(pid)


async def wait_exit(pid: int) -> None:
    """Return once `pid` has exited (it may remain a zombie until reaped)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, ready)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)

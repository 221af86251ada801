"""The stack's child processes: their environment, their tie to the stack's life, finding out
whether a pid is still ours, stopping them, and reading why one exited from its log."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from services.stack import api

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STOP_TIMEOUT_S = 10.0
"""How long a service process gets to exit after SIGTERM before SIGKILL."""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: ours, with the repo and generated code importable."""
    path = [REPO, os.path.join(REPO, "gen", "python")]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1", **(extra or {})}


_HAVE_PROC = os.path.isdir("/proc/self")
_PR_SET_PDEATHSIG = 1


def _prctl() -> Any:
    """libc's prctl, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


_PRCTL = _prctl()  # resolved here, so the forked child only calls it


def die_with_this_process() -> Callable[[], None] | None:
    """A preexec_fn that makes a child get SIGTERM when this process dies, even by SIGKILL.

    Linux ties the signal to the thread that forked the child, so call Popen from the main thread
    (the event loop's), never from a worker thread that may end first. The hook runs between fork
    and exec and does no more than two system calls.
    """
    if _PRCTL is None:
        return None
    parent = os.getpid()
    prctl = _PRCTL

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call above took effect
            os._exit(1)

    return hook


def _cmdline(pid: int) -> str | None:
    """The command line of a live process, "" if unknown, None if it is gone (zombies are gone)."""
    if not _HAVE_PROC:  # not Linux: a signal-0 probe, without the command line
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            if fh.read().rpartition(")")[2].split()[0] == "Z":
                return None
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, IndexError):
        return None


def is_ours(pid: int, marker: str) -> bool:
    """True when `pid` is alive and its command line contains `marker` (guards against pid reuse)."""
    cmd = _cmdline(pid)
    return cmd is not None and (cmd == "" or marker in cmd)


def wait_gone(pid: int, marker: str, timeout: float) -> bool:
    """Wait up to `timeout` s for `pid` to be gone (or no longer ours); True once it is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_ours(pid, marker):
            return True
        time.sleep(0.05)
    return not is_ours(pid, marker)


def terminate_pids(named_pids: Sequence[tuple[str, int, str]], out: api.Out) -> None:
    """SIGTERM each (name, pid, marker) in order, wait for it, SIGKILL after STOP_TIMEOUT_S."""
    for name, pid, marker in named_pids:
        if not is_ours(pid, marker):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not wait_gone(pid, marker, STOP_TIMEOUT_S):
            out(f"{name} (pid {pid}) did not stop in {STOP_TIMEOUT_S:.0f} s; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            wait_gone(pid, marker, 2.0)


# The line a service logs when a setting or port keeps it from starting (logs.setup).
_CANNOT_START = re.compile(r" CRITICAL \S+: cannot start: (.*)$")
# The last line of a Python traceback: `package.module.SomeError: message`.
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")
# How much of a log's end is searched for the reason.
_LOG_TAIL_BYTES = 64 * 1024


def exit_reason(log_path: str) -> str:
    """The error a service process logged as it stopped, in one line, or "" if none is found.

    It is read from the end of the process's log (since its last start): the `cannot start:`
    line a service writes for a bad setting or a taken port, else the last line of a traceback.
    Logs are redacted as they are written, so the line holds no secret.
    """
    try:
        with open(log_path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - _LOG_TAIL_BYTES))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return ""
    lines = tail.rpartition("\n--- ")[2].splitlines()
    for line in reversed(lines):
        if match := _CANNOT_START.search(line):
            return match.group(1).strip()
    for line in reversed(lines):
        if match := _EXCEPTION.match(line.strip()):
            return f"{match.group(1)}: {match.group(2)}"
    return ""

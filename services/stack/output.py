"""Where the stack's progress lines go: stdout with the time of day, a file once stdout is gone."""

from __future__ import annotations

import contextlib
import os
import sys
import time


class _Output:
    """Where progress lines go once stdout is gone (the file, else nowhere)."""

    fallback = os.devnull


def keep_output_in(path: str) -> None:
    """Send progress lines to `path` if stdout goes away (a pipe's reader died, the terminal closed)."""
    _Output.fallback = path


def _lose_stdout() -> None:
    """Point stdout and stderr at the fallback file, so every later write (ours, grpc's) works."""
    fd = os.open(_Output.fallback, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def say(line: str) -> None:
    """Print a progress line with the time of day.

    Never raises for a dead stdout: Ctrl-C on `make up 2>&1 | tee FILE` stops tee as well, and the
    stack must still delete its services and stop its processes, so the line goes to the
    fallback file (keep_output_in) instead.
    """
    text = f"{time.strftime('%H:%M:%S')} {line}\n"
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError:  # EPIPE (SIGPIPE is ignored in Python), EIO from a closed terminal
        with contextlib.suppress(OSError):
            _lose_stdout()
            sys.stdout.write(text)  # the failed write left nothing buffered
            sys.stdout.flush()


def dashboard_line(url: str) -> str:
    """The line that tells the operator where the web dashboard is."""
    return f"dashboard at {url}/ (services, replicas and events, live; `replicactl dashboard --open`)"

"""The local stack's own logs for `replicactl logs --controller / --load-balancer / --sync-down`.

The stack (`make up`, `replicactl stack up`) writes each process's output to a file under its
state dir and records, in `<state dir>/stack.json`, every process with its component, pid, log
file and (for a load balancer) the service it balances. replicactl reads that record: the
controller's API does not serve its own log, and a balancer is a process of its own. A stack
that has stopped leaves its logs in `<state dir>/logs/`, which are read without following.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

STATE_FILE = "stack.json"
LOG_DIR = "logs"
# A line of a service's log starts with its time; other lines continue the one before
# (a traceback, a multi-line message).
_NEW_LINE = re.compile(rb"^\d{4}-\d\d-\d\d[ T]")
# The line the stack writes before it starts a process.
_MARK = b"--- "


class NotFound(Exception):
    """No such log here; the message says where it looked."""


@dataclasses.dataclass(frozen=True)
class ComponentLog:
    """One process's log file.

    Attributes:
        path: the log file.
        pid: the process while the stack runs; 0 when the stack has stopped.
        note: a line to tell the user before the log, if any.
        shared: the process serves every service (a balancer fleet): read the lines naming one.
    """

    path: str
    pid: int = 0
    note: str = ""
    shared: bool = False

    def alive(self) -> bool:
        """True while the process that writes the log runs."""
        return self.pid > 0 and _alive(self.pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_state(state_dir: str) -> dict[str, Any] | None:
    """The record of the stack running with `state_dir`, or None if none runs there."""
    try:
        with open(os.path.join(state_dir, STATE_FILE), encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not _alive(int(state.get("pid") or 0)):
        return None
    return state


def find(state_dir: str, component: str, *, service: str = "") -> ComponentLog:
    """The log of the stack's `component` ("controller" or "loadbalancer" serving `service`).

    Raises:
        NotFound: no running stack has it and no stopped stack left it in `state_dir`.
    """
    where = os.path.abspath(state_dir)
    state = read_state(state_dir)
    if state is not None:
        processes = [p for p in state.get("processes", []) if isinstance(p, dict)]
        matching = [p for p in processes if _component(p) == component]
        if component == "loadbalancer":
            served = sorted({str(p.get("service", "")) for p in matching} - {""})
            # A fleet serves every service; its log names each service's requests.
            matching = [p for p in matching if p.get("service") == service or p.get("fleet")]
            if not matching:
                also = f" (its balancers serve: {', '.join(served)})" if served else ""
                raise NotFound(f"no load balancer of the stack in {where} serves {service!r}{also}")
        if matching:
            p = matching[0]
            path = str(p.get("log") or os.path.join(state_dir, LOG_DIR, f"{p.get('name', component)}.log"))
            return ComponentLog(path, pid=int(p.get("pid") or 0), shared=bool(p.get("fleet")))
    path = os.path.join(state_dir, LOG_DIR, f"{component}.log")
    if os.path.isfile(path):
        return ComponentLog(path, note=f"the stack in {where} is not running; its last {_what(component)} log:")
    raise NotFound(
        f"no {_what(component)} log in {where}: replicactl reads the local stack's logs (pass the stack's "
        f"--state-dir); a {_what(component)} elsewhere keeps its log where it runs"
    )


def _component(process: dict[str, Any]) -> str:
    # Records written before `component` was added name the process after it.
    return str(process.get("component") or re.sub(r"-\d+$", "", str(process.get("name", ""))))


def _what(component: str) -> str:
    return "load balancer" if component == "loadbalancer" else component


def naming(service: str) -> Callable[[bytes], bool]:
    """A line filter: lines that name `service` (as a whole word), for the controller's log and a
    balancer fleet's."""
    word = re.compile(rb"(?<![-a-z0-9_])" + re.escape(service.encode()) + rb"(?![-a-z0-9_])")
    return lambda line: word.search(line) is not None


def read(
    log: ComponentLog,
    *,
    follow: bool,
    keep: Callable[[bytes], bool] | None = None,
    poll_s: float = 0.25,
) -> Iterator[bytes]:
    """The log's lines (with `keep`, those it keeps and the lines continuing them).

    With `follow`, new lines as they are written, until the process exits. A file that is
    truncated or replaced is read again from its start.
    """
    show = True

    def shown(line: bytes) -> bool:
        nonlocal show
        if keep is None:
            return True
        if line.startswith(_MARK):  # the stack started the process: always worth seeing
            show = False
            return True
        if _NEW_LINE.match(line):
            show = keep(line)
        return show

    rest = b""
    with _open(log.path) as state:
        while True:
            chunk = state.read()
            if chunk:
                lines = (rest + chunk).split(b"\n")
                rest = lines.pop()  # a line still being written
                yield from (line + b"\n" for line in lines if shown(line))
                continue
            if not follow or not log.alive():
                break
            time.sleep(poll_s)
    if rest and shown(rest):
        yield rest + b"\n"


class _open:
    """A log file read from where it was left, reopened when truncated or replaced."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._fh: BinaryIO | None = None
        self._inode = 0

    def __enter__(self) -> _open:
        try:
            self._fh = open(self._path, "rb")
        except FileNotFoundError:
            raise NotFound(f"no log file {self._path}") from None
        self._inode = os.fstat(self._fh.fileno()).st_ino
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fh is not None:
            self._fh.close()

    def read(self) -> bytes:
        """What was written since the last read (up to 1 MiB)."""
        assert self._fh is not None
        data = self._fh.read(1 << 20)
        if data:
            return data
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return b""
        if st.st_ino != self._inode or st.st_size < self._fh.tell():
            self._fh.close()
            self._fh = open(self._path, "rb")  # noqa: SIM115
            self._inode = os.fstat(self._fh.fileno()).st_ino
            return self._fh.read(1 << 20)
        return b""

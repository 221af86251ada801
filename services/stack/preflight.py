"""Checks the stack makes before it starts anything: every fixed port it will bind is free.

A stack whose controller port is taken used to start its other processes first and fail later,
or worse, find another stack answering on its port. So each TCP address of the plan with a
fixed port is bound once (and released) before the first process starts, and a taken one is
reported in one line with the setting that moves it and, where /proc tells, the process that
holds it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import socket
from collections.abc import Sequence

from services.common import config
from services.stack import plan


@dataclasses.dataclass(frozen=True)
class Need:
    """One TCP address the stack will bind.

    Attributes:
        addr: host:port, the port fixed (not 0).
        setting: the environment variable that moves it.
        what: what listens there, for the message.
    """

    addr: str
    setting: str
    what: str


def needs(specs: Sequence[plan.ProcessSpec]) -> list[Need]:
    """Every TCP address with a fixed port that the processes of `specs` will bind."""
    out: list[Need] = []
    for spec in specs:
        section = spec.component
        candidates = [
            (spec.addr, config.env_name(section, "listen_addr"), f"{spec.name} gRPC"),
            (spec.metrics_addr, config.env_name(section, "metrics_addr"), f"{spec.name} metrics"),
        ]
        if spec.url:
            http = config.env_name(section, "http_addr")
            candidates.append((spec.env.get(http, ""), http, f"{spec.name} HTTP"))
        for addr, setting, what in candidates:
            if addr and not plan.is_unix(addr) and plan.split_addr(addr)[1] != 0:
                out.append(Need(addr=addr, setting=setting, what=what))
    return out


def _overlap(a: str, b: str) -> bool:
    """True when binding both addresses would clash: same port, and same host or a wildcard."""
    (host_a, port_a), (host_b, port_b) = plan.split_addr(a), plan.split_addr(b)
    wildcard = ("", "0.0.0.0", "::", "[::]")
    return port_a == port_b and (host_a == host_b or host_a in wildcard or host_b in wildcard)


def _bind_error(addr: str) -> OSError | None:
    """Bind `addr` as the services do (SO_REUSEADDR, so a port in TIME_WAIT counts as free) and
    release it; the error, or None when it is free."""
    host, port = plan.split_addr(addr)
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return OSError(errno.EADDRNOTAVAIL, f"unknown host {host!r} ({exc.strerror})")
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                return exc
    return None


def _listening_inodes(port: int) -> set[str]:
    """Inodes of the TCP sockets listening on `port`, from /proc/net/tcp and tcp6."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table, encoding="ascii") as fh:
            next(fh, None)  # the header
            for line in fh:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                    inodes.add(fields[9])
    return inodes


def _pids_holding(inodes: set[str]) -> list[int]:
    """The processes with one of the socket `inodes` open (those whose fds this user may read)."""
    wanted = {f"socket:[{i}]" for i in inodes}
    found: list[int] = []
    for entry in os.listdir("/proc") if inodes else []:
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/fd/{fd}") in wanted:
                        found.append(int(entry))
                        break
    return sorted(found)


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def _parent(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("PPid:"):
                return int(line.split()[1])
    return 0


def _stack_of(pid: int) -> str:
    """`the stack of DIR (pid N)` when `pid` is a service process of a local stack, else ""."""
    parent = _parent(pid)
    argv = _cmdline(parent)
    if not any(a == "services.stack" for a in argv) or "up" not in argv:
        return ""
    state_dir = argv[argv.index("--state-dir") + 1] if "--state-dir" in argv[:-1] else ".state"
    with contextlib.suppress(OSError):
        state_dir = os.path.join(os.readlink(f"/proc/{parent}/cwd"), state_dir)
    return f"the stack of {os.path.normpath(state_dir)} (pid {parent})"


def holder(port: int) -> str:
    """Who listens on `port`, as far as /proc tells: a stack, a process, or "" if unknown."""
    inodes = _listening_inodes(port)
    pids = _pids_holding(inodes)
    if not pids:
        return "a process of another user" if inodes else ""
    if stack := _stack_of(pids[0]):
        return stack
    argv = _cmdline(pids[0])
    command = " ".join(" ".join([os.path.basename(argv[0]), *argv[1:]]).split()) if argv else ""
    if len(command) > 60:
        command = command[:57] + "..."
    return f"pid {pids[0]} ({command})" if command else f"pid {pids[0]}"


def _why(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "in use"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "not an address of this host"
    if exc.errno == errno.EACCES:
        return "not allowed for this user (ports below 1024 need privileges)"
    return (exc.strerror or str(exc)).lower()


def check_ports(specs: Sequence[plan.ProcessSpec]) -> str:
    """One line naming every fixed port of `specs` that cannot be bound now, or "" if all can.

    Two settings on one port are named too. The line says what holds a port in use (another
    stack, with its state dir, or a process), and which setting moves it.
    """
    wanted = needs(specs)
    clashes: list[str] = []
    # (why, who) -> the addresses it concerns, in plan order.
    groups: dict[tuple[str, str], list[Need]] = {}
    for i, need in enumerate(wanted):
        other = next((n for n in wanted[:i] if _overlap(n.addr, need.addr)), None)
        if other is not None:
            clashes.append(f"{need.setting} and {other.setting} both use port {plan.split_addr(need.addr)[1]}")
            continue
        exc = _bind_error(need.addr)
        if exc is None:
            continue
        who = holder(plan.split_addr(need.addr)[1]) if exc.errno == errno.EADDRINUSE else ""
        groups.setdefault((_why(exc), who), []).append(need)
    problems = list(clashes)
    for (why, who), group in groups.items():
        names = ", ".join(f"{n.addr} ({n.setting}, {n.what})" for n in group)
        verb = "is" if len(group) == 1 else "are"
        problems.append(f"{names} {verb} {why}" + (f" by {who}" if who else ""))
    if not problems:
        return ""
    settings = [n.setting for g in groups.values() for n in g]
    if len(settings) == 1 and not clashes:
        hint = f"stop what holds it, or set {settings[0]} to a free address (port 0 picks one)"
    else:
        hint = "stop what holds them, or move them with those settings (port 0 picks a free port)"
    return "; ".join(problems) + "; " + hint

"""Runs the local stack: starts the service processes, creates the example, cleans up on stop.

Children run in their own sessions, so Ctrl-C reaches only the stack, which then deletes every
service (so the provisioner tears every replica down) before it stops the children. The stack
finishes that cleanup whatever happened to its terminal: a pipe whose reader died with the same
Ctrl-C (`make up | tee`) or a closed terminal sends its lines to `stack.log` instead. Should the
stack itself be killed (SIGKILL), the kernel sends each child SIGTERM (PR_SET_PDEATHSIG), so no
service outlives it; `down` then deletes the services left behind.

The state dir is private (0700): it holds the internal services' sockets, the API token the
stack generates (0600), the stores, replica logs and specs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from services.common import config, security
from services.stack import api, plan, preflight

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STOP_TIMEOUT_S = 10.0
"""How long a service process gets to exit after SIGTERM before SIGKILL."""
# The setting that names the service a load balancer process serves.
_BALANCED = "REPLICAPLANE_LOADBALANCER_SERVICE_NAME"
# Set on a balancer fleet: it serves every service, each on its own port.
_FLEET = "REPLICAPLANE_LOADBALANCER_FLEET"


FOLLOW_MAX = 100
"""Services the stack's terminal follows at most; the rest are named once (the dashboard and
`replicactl status` show every one)."""
DISCOVER_INTERVAL_S = 1.0
"""How often the stack looks for services created or deleted through the API."""


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


def _wait_gone(pid: int, marker: str, timeout: float) -> bool:
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
        if not _wait_gone(pid, marker, STOP_TIMEOUT_S):
            out(f"{name} (pid {pid}) did not stop in {STOP_TIMEOUT_S:.0f} s; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, marker, 2.0)


@dataclasses.dataclass
class StateFiles:
    """The stack's files under its state dir: pid file, state (JSON) and logs."""

    state_dir: str

    @property
    def pid_path(self) -> str:
        """Pid file of the running stack."""
        return os.path.join(self.state_dir, "stack.pid")

    @property
    def state_path(self) -> str:
        """JSON: the stack pid, readiness, controller address, children and created services."""
        return os.path.join(self.state_dir, "stack.json")

    @property
    def log_dir(self) -> str:
        """One log file per service process."""
        return os.path.join(self.state_dir, "logs")

    @property
    def token_path(self) -> str:
        """The API token the stack generates when the user set none."""
        return os.path.join(self.state_dir, plan.TOKEN_FILE)

    @property
    def port_dir(self) -> str:
        """Port files: each process writes the port it bound there (`<name>.port`, and
        `<name>.http.port` for an HTTP port) once it serves."""
        return os.path.join(self.state_dir, "ports")

    @property
    def targets_path(self) -> str:
        """Every process's metrics address, in Prometheus' file_sd format (see deploy/prometheus/)."""
        return os.path.join(self.state_dir, "prometheus", "targets.json")

    @property
    def result_path(self) -> str:
        """JSON the stopping stack leaves for `down`: the services it could not delete."""
        return os.path.join(self.state_dir, "stack.result.json")

    def running_pid(self) -> int | None:
        """Pid of a live stack using this state dir, if any."""
        try:
            with open(self.pid_path, encoding="utf-8") as fh:
                pid = int(fh.read().strip() or 0)
        except (FileNotFoundError, ValueError):
            return None
        return pid if pid and pid != os.getpid() and is_ours(pid, "services.stack") else None

    def write(self, path: str, text: str) -> None:
        """Write atomically, so a reader never sees half a file."""
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)

    def read_state(self) -> dict[str, Any] | None:
        """The state written by a stack, or None."""
        try:
            with open(self.state_path, encoding="utf-8") as fh:
                return dict(json.load(fh))
        except (FileNotFoundError, ValueError):
            return None

    def remove(self) -> None:
        """Remove the pid, state, token and scrape target files."""
        for path in (self.pid_path, self.state_path, self.token_path, self.targets_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def new_token(self) -> str:
        """Generate the API token and write it, readable by this user only."""
        token = secrets.token_urlsafe(32)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.token_path)  # never reuse a file someone else may hold open
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(f"{token}\n")
        return token

    def token(self) -> str:
        """The generated API token, or "" when there is none."""
        try:
            with open(self.token_path, encoding="utf-8") as fh:
                return fh.read().strip()
        except FileNotFoundError:
            return ""


def private_dir(path: str, out: api.Out) -> bool:
    """Create `path` as a directory only this user may enter (0700), or make it one.

    Returns:
        False when it belongs to another user (then nothing in it can be trusted).
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        out(f"error: {path} belongs to another user (uid {st.st_uid}); use a state dir of your own")
        return False
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # sockets, token, stores and replica logs: this user only
    return True


class Stack:
    """The service processes of one stack and the services it created."""

    def __init__(
        self,
        specs: Sequence[plan.ProcessSpec],
        files: StateFiles,
        out: api.Out,
        *,
        token: str = "",
        announce: bool = True,
    ) -> None:
        self.specs = list(specs)
        self.files = files
        self.out = out
        # False: say nothing about where each process serves (a stack that only cleans up).
        self.announce = announce
        self.served: set[str] = set()  # processes that answered their health check
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.created: list[str] = []
        self.ready = False
        # Where each process listens and serves HTTP; a planned port 0 becomes the bound one.
        self.addrs = {s.name: s.addr for s in self.specs}
        self.urls = {s.name: s.url for s in self.specs if s.url}
        self.metrics = {s.name: s.metrics_addr for s in self.specs if s.metrics_addr}
        self._controller = next(s.name for s in self.specs if s.component == "controller")
        self.generated_token = bool(token)
        # The generated token, else the user's own (from the environment).
        self.token = token or security.client_token()

    @property
    def controller_addr(self) -> str:
        """Where clients dial the controller (known once it bound its port)."""
        return plan.dial_addr(self.addrs[self._controller])

    def save(self) -> None:
        """Record what is running, for `down` and for a waiting `up --detach`."""
        state = {
            "pid": os.getpid(),
            "ready": self.ready,
            "metrics": {name: url for name in self.metrics if (url := self.metrics_url(name))},
            "controller": self.controller_addr,
            "token_file": self.files.token_path if self.generated_token else "",
            "services": self.created,
            # replicactl reads `component`, `pid`, `log` and a balancer's `service` to find logs.
            "processes": [
                {
                    "name": s.name,
                    "component": s.component,
                    "pid": self.procs[s.name].pid,
                    "addr": self.addrs[s.name],
                    "log": os.path.abspath(os.path.join(self.files.log_dir, f"{s.name}.log")),
                }
                | ({"url": self.urls[s.name]} if s.name in self.urls else {})
                | ({"service": s.env[_BALANCED]} if _BALANCED in s.env else {})
                | ({"fleet": True} if s.env.get(_FLEET) == "true" else {})
                for s in self.specs
                if s.name in self.procs
            ],
        }
        self.files.write(self.files.state_path, json.dumps(state, indent=2) + "\n")
        self._write_targets()

    def metrics_url(self, name: str) -> str:
        """The metrics URL of process `name`; "" when it has none or its port is not known yet."""
        addr = self.metrics.get(name, "")
        return f"http://{plan.dial_addr(addr)}/metrics" if addr and plan.split_addr(addr)[1] else ""

    def _write_targets(self) -> None:
        """Tell a Prometheus that reads this file (file_sd) where to scrape, one job per component."""
        groups = [
            {
                "targets": [plan.dial_addr(self.metrics[s.name])],
                "labels": {"job": s.component, "process": s.name, "stack": "local"},
            }
            for s in self.specs
            if self.metrics_url(s.name)
        ]
        os.makedirs(os.path.dirname(self.files.targets_path), exist_ok=True)
        self.files.write(self.files.targets_path, json.dumps(groups, indent=2) + "\n")

    def _port_files(self, spec: plan.ProcessSpec) -> dict[str, str]:
        files = {config.env_name(spec.component, "port_file"): os.path.join(self.files.port_dir, f"{spec.name}.port")}
        if spec.url:
            http = os.path.join(self.files.port_dir, f"{spec.name}.http.port")
            files[config.env_name(spec.component, "http_port_file")] = http
        if spec.metrics_addr:
            metrics = os.path.join(self.files.port_dir, f"{spec.name}.metrics.port")
            files[config.env_name(spec.component, "metrics_port_file")] = metrics
        return files

    def _launch(self, spec: plan.ProcessSpec, env: dict[str, str]) -> None:
        for path in self._port_files(spec).values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a stale port from an earlier run
        log_path = os.path.join(self.files.log_dir, f"{spec.name}.log")
        with open(log_path, "ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {spec.name}\n".encode())
            log.flush()
            self.procs[spec.name] = subprocess.Popen(
                spec.argv,
                cwd=REPO,
                env=child_env(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_this_process(),
            )

    async def start(self, timeout: float) -> None:
        """Start every process, each in its own session, logging to the log dir.

        A process that dials others starts once they have bound their TCP ports (with port 0 it
        learns them from their port files); the others start at once. So the balancer and the
        dashboard, which send tokens to the controller, start only once the stack's controller
        holds its port, never while another process may hold it.

        Raises:
            api.StackError: a process it waits for exited or reported no port in `timeout` s.
        """
        os.makedirs(self.files.log_dir, exist_ok=True)
        os.makedirs(self.files.port_dir, exist_ok=True)
        for spec in self.specs:
            for name in {n for names in spec.needs.values() for n in names}:
                await self.bound(name, timeout)
            self._launch(spec, {**plan.resolve(spec, self.addrs), **self._port_files(spec)})
            self.save()

    async def bound(self, name: str, timeout: float) -> None:
        """Wait until process `name` has bound its TCP ports (its address, URL and metrics) and
        serves, and take the ports it got for a planned port 0. Its port files prove it: a health answer
        alone does not (another process may hold a fixed port, and would collect the token of
        every client that connects). A Unix socket's address is known in advance.

        Raises:
            api.StackError: it exited first, or wrote no port file in `timeout` s.
        """
        spec = next(s for s in self.specs if s.name == name)
        files = self._port_files(spec)
        # Port file -> what it holds the port of; a Unix socket's address has nothing to wait for.
        kinds = {} if plan.is_unix(self.addrs[name]) else {files[config.env_name(spec.component, "port_file")]: "addr"}
        if spec.url:
            kinds[files[config.env_name(spec.component, "http_port_file")]] = "url"
        if spec.metrics_addr:
            kinds[files[config.env_name(spec.component, "metrics_port_file")]] = "metrics"
        deadline = time.monotonic() + timeout
        while not _all_exist(list(kinds)):
            if self.procs[name].poll() is not None:
                raise api.StackError(self.failure(name))
            if time.monotonic() > deadline:
                raise api.StackError(f"{name} reported no port in {timeout:.0f} s (log: {self.log_path(name)})")
            await asyncio.sleep(0.05)
        changed = False
        for path, kind in kinds.items():
            port = int(await asyncio.to_thread(_read, path))
            if kind == "addr":
                host, planned = plan.split_addr(self.addrs[name])
                self.addrs[name] = f"{host}:{port}"
            elif kind == "metrics":
                host, planned = plan.split_addr(self.metrics[name])
                self.metrics[name] = f"{host}:{port}"
            else:
                host, planned = plan.split_addr(self.urls[name].removeprefix("http://"))
                self.urls[name] = f"http://{host}:{port}"
            changed = changed or planned != port
        if changed:
            self.save()

    def log_path(self, name: str) -> str:
        """The log file of process `name`."""
        return os.path.join(self.files.log_dir, f"{name}.log")

    def failure(self, name: str) -> str:
        """One line on why process `name` exited: the error it logged last (the setting or port at
        fault), its exit code otherwise, and its log."""
        proc = self.procs[name]
        log = self.log_path(name)
        started = name in self.served
        if reason := exit_reason(log):
            return f"{name} {'stopped' if started else 'did not start'}: {reason} (log: {log})"
        return f"{name} exited with code {proc.returncode}{'' if started else ' before it served'} (log: {log})"

    def exited(self) -> str | None:
        """A message naming the first process that exited, or None while all run."""
        for spec in self.specs:
            proc = self.procs.get(spec.name)
            if proc is not None and proc.poll() is not None:
                return self.failure(spec.name)
        return None

    async def wait_serving(self, timeout: float) -> None:
        """Wait until every process's health check says SERVING."""
        for spec in self.specs:
            await self.bound(spec.name, timeout)
            proc = self.procs[spec.name]
            alive = lambda p=proc: p.poll() is None  # noqa: E731 - binds this loop's process
            var = f"REPLICAPLANE_{spec.component.upper()}_TLS_CERT_FILE"
            tls = spec.component != "controller" and bool(spec.env.get(var) or os.environ.get(var))
            addr = self.addrs[spec.name]
            try:
                await api.wait_serving(plan.dial_addr(addr), spec.grpc_service, timeout=timeout, alive=alive, tls=tls)
            except api.StackError:
                if proc.poll() is not None:
                    raise api.StackError(self.failure(spec.name)) from None
                raise api.StackError(
                    f"{spec.name} on {addr} was not serving after {timeout:.0f} s (log: {self.log_path(spec.name)})"
                ) from None
            self.served.add(spec.name)
            if not self.announce:
                continue
            self.out(f"{spec.name} serving on {addr} (log: {self.log_path(spec.name)})")
            if metrics_url := self.metrics_url(spec.name):
                self.out(f"{spec.name} metrics: {metrics_url}")
            if spec.component == "dashboard":
                self.out(dashboard_line(self.urls[spec.name]))
            elif spec.url and spec.env.get(_FLEET) == "true":
                self.out(
                    f"{spec.name}: every service gets its own URL, from {self.urls[spec.name]} up "
                    "(`replicactl status` shows each)"
                )
            elif spec.url:
                service = spec.env.get(_BALANCED, "")
                self.out(f"{spec.name}: {service} at {self.urls[spec.name]}")

    async def watch_exits(self) -> str:
        """Return once a process exits (bounded by the caller's cancellation)."""
        while (message := self.exited()) is None:
            await asyncio.sleep(0.5)
        return message

    async def delete_services(self, delete_timeout: float) -> list[str]:
        """Delete every service the controller has (not only the ones this stack created) and
        wait until they are gone, so no replica is left.

        Returns:
            Services that could not be confirmed deleted.
        """
        controller = self.procs.get("controller")
        if controller is not None and controller.poll() is None:
            client = api.Controller(self.controller_addr, token=self.token)
            try:
                return await client.delete_everything(timeout=delete_timeout, out=self.out, also=self.created)
            finally:
                await client.close()
        if self.created:
            self.out("warning: the controller is not running, so services could not be deleted")
        return list(self.created)

    async def stop_processes(self) -> None:
        """SIGTERM every process and wait for it (SIGKILL after STOP_TIMEOUT_S)."""
        # The dashboard and the balancer, then the controller, so nothing calls a stopped service;
        # the provisioner last.
        rank = {"dashboard": -2, "loadbalancer": -1, "controller": 0, "prober": 1}
        order = sorted(self.specs, key=lambda s: rank.get(s.component, 2))
        pids = [(s.name, p.pid, f"services.{s.component}") for s in order if (p := self.procs.get(s.name))]
        await asyncio.to_thread(terminate_pids, pids, self.out)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1.0)  # reap
        self.out("stack stopped")


async def _run(stack: Stack, example: str | None, ready_timeout: float, *, follow: bool = True) -> None:
    await stack.start(ready_timeout)
    await stack.wait_serving(ready_timeout)
    if not follow:  # a stack started only to clean up after a killed one
        stack.ready = True
        stack.save()
        return
    client = api.Controller(stack.controller_addr, token=stack.token)
    try:
        if example:
            # Recorded before the call, so a stop during an in-flight create still deletes it.
            if name := await asyncio.to_thread(api.spec_name, example):
                stack.created.append(name)
                stack.save()
            if (created := await client.create(example, stack.out)) not in stack.created:
                stack.created.append(created)
        stack.ready = True
        stack.save()
        stack.out(f"stack ready: controller at {stack.controller_addr}; Ctrl-C (or make down) stops it")
        # Every service, the ones created through the API later too, until the stack stops.
        await client.follow_all(stack.out, first=stack.created, interval=DISCOVER_INTERVAL_S, limit=FOLLOW_MAX)
    finally:
        await client.close()


async def up(
    specs: Sequence[plan.ProcessSpec],
    *,
    state_dir: str,
    example: str | None,
    ready_timeout: float = 30.0,
    delete_timeout: float = 90.0,
    out: api.Out = say,
    cleanup_only: bool = False,
) -> int:
    """Run the stack until SIGTERM, SIGINT or SIGHUP, then clean up.

    Before it starts anything, every fixed TCP port of `specs` must be free; a taken one is
    named in one line (with what holds it) and nothing starts.

    Args:
        specs: the processes, from plan.plan().
        state_dir: absolute state directory.
        example: a service YAML to create once the stack serves, or None.
        ready_timeout: seconds each process gets to serve.
        delete_timeout: seconds each created service gets to be deleted on stop.
        out: where progress lines go.
        cleanup_only: start the processes quietly, delete every service and stop (what `down`
            does after a killed stack).

    Returns:
        The exit code: 0 after a requested stop, 1 if anything failed.
    """
    files = StateFiles(state_dir)
    if not private_dir(state_dir, out):
        return 1
    if (other := files.running_pid()) is not None:
        out(f"a stack is already running from {state_dir} (pid {other}); stop it with `make down`")
        return 1
    if problem := await asyncio.to_thread(preflight.check_ports, specs):
        out(f"error: {problem}")
        return 1
    keep_output_in(os.path.join(state_dir, "stack.log"))
    files.write(files.pid_path, f"{os.getpid()}\n")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(files.result_path)  # a stale report of an earlier stack
    controller = next(s for s in specs if s.component == "controller")
    token = ""
    if controller.env.get("REPLICAPLANE_CONTROLLER_AUTH_TOKEN_FILE") == files.token_path:
        token = files.new_token()
        if not cleanup_only:
            out(f"API token (for grpcurl and scripts): {files.token_path}")
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(files.token_path)  # the user's own tokens guard the API
    stack = Stack(specs, files, out, token=token, announce=not cleanup_only)
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():  # an impatient second Ctrl-C: the cleanup goes on, say what it waits for
            out(f"already stopping: deleting every service first (at most {delete_timeout:.0f} s each)")
        stop.set()

    loop = asyncio.get_running_loop()
    # SIGHUP: the terminal closed; clean up as for Ctrl-C (lines go to stack.log from then on).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)
    main = asyncio.create_task(_run(stack, example, ready_timeout, follow=not cleanup_only))
    exits = asyncio.create_task(stack.watch_exits())
    stopped = asyncio.create_task(stop.wait())
    rc = 0
    try:
        done, _ = await asyncio.wait({main, exits, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if main in done and main.exception() is not None:
            exc = main.exception()
            out(f"error: {exc}" if isinstance(exc, api.StackError) else f"error: {exc!r}")
            rc = 1
        elif exits in done:
            out(f"error: {exits.result()}")
            rc = 1
        elif not cleanup_only:
            out("stopping")
    finally:
        for task in (exits, stopped):
            task.cancel()
        if not stack.ready:  # still starting: cancel an in-flight create before deleting by name
            main.cancel()
            await asyncio.gather(main, return_exceptions=True)
        # While the deletes run, the watch (if running) keeps printing the teardown.
        services_left = await stack.delete_services(delete_timeout)
        if services_left:
            rc = 1
        files.write(files.result_path, json.dumps({"services_left": services_left}) + "\n")
        main.cancel()
        await asyncio.gather(main, exits, stopped, return_exceptions=True)
        await stack.stop_processes()
        files.remove()
    return rc


def detach(
    argv: Sequence[str],
    *,
    state_dir: str,
    timeout: float,
    out: api.Out = say,
    specs: Sequence[plan.ProcessSpec] = (),
) -> int:
    """Run `python -m services.stack <argv>` in the background and wait until it is ready.

    Args:
        argv: the `up` command line of the background stack.
        state_dir: its state dir.
        timeout: seconds it gets to be ready.
        out: where progress lines go.
        specs: its processes; their fixed ports are checked first, as `up` does.

    Returns:
        0 once the background stack is ready; 1 if it failed or took longer than `timeout` s.
    """
    files = StateFiles(state_dir)
    if not private_dir(state_dir, out):
        return 1
    if (other := files.running_pid()) is not None:
        out(f"a stack is already running from {state_dir} (pid {other}); stop it with `make down`")
        return 1
    if problem := preflight.check_ports(specs):
        out(f"error: {problem}")
        return 1
    log_path = os.path.join(state_dir, "stack.log")
    start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.stack", *argv],
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, encoding="utf-8", errors="replace") as fh:
                fh.seek(start)
                lines = fh.read().splitlines()
            # Its own one-line error says it all; otherwise show how it ended.
            if errors := [line.split(" ", 1)[-1] for line in lines if " error: " in f" {line}"]:
                for line in errors:
                    out(f"{line} (the stack's output: {log_path})")
                return 1
            out(f"the stack failed to start (exit code {proc.returncode}); last lines of {log_path}:")
            for line in lines[-20:]:
                print(f"  {line}", flush=True)
            return 1
        state = files.read_state()
        if state and state.get("pid") == proc.pid and state.get("ready"):
            out(f"stack running in the background (pid {proc.pid}); controller at {state['controller']}")
            for name, url in (state.get("metrics") or {}).items():
                out(f"{name} metrics: {url}")
            for process in state.get("processes", []):
                if process.get("name") == "dashboard" and process.get("url"):
                    out(dashboard_line(process["url"]))
            out(f"output: {log_path}; stop it with `make down` (python -m services.stack down)")
            return 0
        time.sleep(0.1)
    out(f"the stack was not ready after {timeout:.0f} s; stopping it (see {log_path})")
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout + 30)
    return 1


def down(*, state_dir: str, timeout: float, out: api.Out = say) -> int:
    """Stop the stack running from `state_dir`, the same way Ctrl-C does.

    Every service the controller has is deleted (not only the ones the stack created), and the
    services that could not be deleted are reported.

    If the stack process itself is gone without cleaning up (killed), its processes went with it
    (or are stopped now), but its services' replicas still run: the provisioner and controller
    are started again from the same state, quietly, to delete every service, then stopped.

    Returns:
        0 when nothing of the stack is left running and every service was deleted, 1 otherwise.
    """
    files = StateFiles(state_dir)
    pid = files.running_pid()
    state = files.read_state() or {}
    if pid is None and not state:
        out(f"no stack is running from {state_dir}")
        files.remove()
        return 0
    failed = False
    crashed = pid is None
    if pid is not None:
        out(f"stopping the stack (pid {pid})")
        os.kill(pid, signal.SIGTERM)
        if not _wait_gone(pid, "services.stack", timeout):
            out(f"the stack did not stop in {timeout:.0f} s; killing it and cleaning up after it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, "services.stack", 2.0)
            crashed = True
        result = None if crashed else _read_result(files)
        if crashed:
            pass  # cleaned up below
        elif result is None:
            out("the stack did not say whether every service was deleted; see its log")
        elif result:
            out(f"services left: {', '.join(result)} (their replicas may still run)")
            failed = True
        else:
            out("services left: none")
    else:
        out(f"cleaning up after a stack that is gone (pid {state.get('pid', '?')})")
    left = [
        (p["name"], int(p["pid"]), f"services.{p['name'].split('-')[0]}")
        for p in state.get("processes", [])
        if is_ours(int(p["pid"]), f"services.{p['name'].split('-')[0]}")
    ]
    if left:
        # A killed stack's processes got SIGTERM from the kernel already; wait for them (or end them).
        out("stopping what it left running: " + ", ".join(n for n, _, _ in left))
        terminate_pids(sorted(left, key=lambda t: t[0] != "controller"), out)
        if still := [n for n, p, m in left if is_ours(p, m)]:
            out("still running: " + ", ".join(still))
            return 1
    if crashed:
        return _clean_up_after_crash(state_dir, timeout, out)
    files.remove()
    out("stack stopped")
    return 1 if failed else 0


def cleanup_specs(state_dir: str, environ: dict[str, str] | None = None) -> list[plan.ProcessSpec]:
    """The processes that delete a killed stack's services: its provisioner, one prober and its
    controller on the same state, the controller's API on a port of its own choosing, no
    metrics, no balancer or dashboard (nothing for users to reach)."""
    env = dict(os.environ if environ is None else environ)
    env["REPLICAPLANE_CONTROLLER_LISTEN_ADDR"] = "127.0.0.1:0"
    env["REPLICAPLANE_LOADBALANCER_HTTP_ADDR"] = "127.0.0.1:0"
    env["REPLICAPLANE_DASHBOARD_HTTP_ADDR"] = "127.0.0.1:0"
    for section in ("controller", "provisioner", "prober", "loadbalancer", "dashboard"):
        env[config.env_name(section, "metrics_addr")] = ""
    specs = plan.plan(probers=1, state_dir=state_dir, environ=env)
    return [s for s in specs if s.component in ("provisioner", "prober", "controller")]


def _clean_up_after_crash(state_dir: str, timeout: float, out: api.Out) -> int:
    try:
        specs = cleanup_specs(state_dir)
    except ValueError as exc:
        out(f"error: cannot start the stack again to delete its services: {exc}")
        return 1
    out("starting its provisioner and controller again to delete every service")
    rc = asyncio.run(up(specs, state_dir=state_dir, example=None, delete_timeout=timeout, out=out, cleanup_only=True))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(StateFiles(state_dir).result_path)
    return rc


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


def _all_exist(paths: Sequence[str]) -> bool:
    return all(os.path.exists(p) for p in paths)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read().strip()


def _read_result(files: StateFiles) -> list[str] | None:
    """The services a stopped stack could not delete (read once, then removed), or None."""
    try:
        with open(files.result_path, encoding="utf-8") as fh:
            left = json.load(fh).get("services_left")
    except (FileNotFoundError, ValueError, AttributeError):
        return None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(files.result_path)
    return [str(n) for n in left] if isinstance(left, list) else None

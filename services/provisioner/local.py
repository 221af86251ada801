"""The `local` backend: each replica is a process group on this machine, on a loopback port.

Per replica, under `<state_dir>/local/<name>/`: `handle.json` (what is needed to find the
replica again after a restart), `work/` (its working directory, a copy of the spec's
`workdir`) and `exit_code` (written by the wrapper when the app exits).

A launch attempt runs `setup` with bash as its own process group (output to the launch log),
then starts `run` under a tiny bash wrapper as another process group (output to the app log).
The wrapper writes the app's exit code to a file, so the code survives a provisioner restart.
Exits are noticed through a pidfd on the wrapper. Every replica process carries two
environment markers (owner state dir and replica token), so strays that left their process
group are still found and killed, and processes of unknown replicas are killed on start.
Zones and preemption are simulated (see zones.py).

A pool worker has no port and no address. After its setup it runs a holder (a shell that sleeps
until it is killed) under the same wrapper instead of `run`, so its process group lives until
teardown and its end is noticed as an app's. Mixed into `LocalBackend`: launching replicas
(`local_launch.LocalLaunches`) and the jobs that run on workers (`local_jobs.LocalJobs`); what
is kept of an incarnation is `local_handles.Handle`; the markers and the wrapper are in
`local_marks` (`OWNER_ENV`, `TOKEN_ENV` and `JOB_ENV` are re-exported here).
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable

from services.common import errors
from services.provisioner import (
    addresses,
    backend,
    capability,
    causes,
    copies,
    local_handles,
    local_jobs,
    local_launch,
    local_marks,
    model,
    ports,
    procs,
    pyenvs,
    zones,
)

log = logging.getLogger(__name__)

OWNER_ENV = local_marks.OWNER_ENV
TOKEN_ENV = local_marks.TOKEN_ENV
JOB_ENV = local_marks.JOB_ENV
_HANDLE_FILE = "handle.json"
DEFAULT_COPY_LIMITS = copies.Limits(max_bytes=1024 << 20, max_entries=100_000)
"""What one replica's workdir and file mounts may take together, unless settings say otherwise."""


class LocalBackend(local_launch.LocalLaunches, local_jobs.LocalJobs, backend.Backend):
    """Replicas as local process groups; see the module docstring."""

    name = "local"

    def __init__(
        self,
        state_dir: str,
        *,
        zone_list: list[model.Zone] | None = None,
        clock: Callable[[], float] = time.time,
        replica_host: str = "127.0.0.1",
        advertise_host: str = "",
        network: str = "port",
        accelerators: dict[str, float] | None = None,
        copy_limits: copies.Limits = DEFAULT_COPY_LIMITS,
        python_envs: bool = True,
        system_site_packages: bool = True,
    ) -> None:
        # Local replicas get no accelerators unless a setting declares (fake) ones for tests.
        self._accelerators = dict(accelerators or {})
        self._copy_limits = copy_limits
        self._state_dir = os.path.abspath(os.path.expanduser(state_dir))
        self._root = os.path.join(self._state_dir, "local")
        self._zones = zones.ZoneTable(zone_list or zones.parse(zones.DEFAULT_ZONES))
        self._clock = clock
        self._replica_host = replica_host
        # Endpoints name a host the probers can reach: the bind address unless it is a wildcard.
        self._advertise_host = advertise_host or (
            "127.0.0.1" if replica_host in ("0.0.0.0", "", "::") else replica_host
        )
        self._ports = ports.PortAllocator(replica_host)
        # "address": each replica on its own loopback address, declared ports unchanged;
        # "port": one address, each declared port mapped to a free one (containers, non-Linux).
        if network not in ("address", "port"):
            raise ValueError(f"network must be address or port, got {network!r}")
        self._network = network
        self._addresses = addresses.AddressAllocator()
        self._shim_dir = os.path.join(self._state_dir, "local-shim")
        self._envs = (
            pyenvs.PythonEnvs(os.path.join(self._state_dir, "envs"), system_site_packages=system_site_packages)
            if python_envs
            else None
        )
        self._handles: dict[str, local_handles.Handle] = {}
        self._jobs: dict[str, local_jobs.JobHandle] = {}  # by job token
        self._job_events: asyncio.Queue[backend.JobEnded] = asyncio.Queue()
        self._job_endings: dict[str, asyncio.Task[None]] = {}  # by job token
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._watcher = procs.ExitWatcher()
        # /proc scans take milliseconds per call and grow with the host's processes: they
        # run in a worker thread, one at a time, shared by every teardown that waits.
        self._scanner = procs.Scanner((OWNER_ENV, TOKEN_ENV, JOB_ENV))
        self._events: asyncio.Queue[backend.BackendEvent] = asyncio.Queue()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load handles, watch the apps still running, report the ones that ended, kill strays."""
        os.makedirs(self._root, mode=0o700, exist_ok=True)
        if self._network == "address":
            addresses.write_shim(self._shim_dir)
        for name in sorted(os.listdir(self._root)):
            handle = self._load_handle(name)
            if handle is None:
                continue
            self._handles[name] = handle
            if handle.address:
                self._addresses.hold(handle.address)
            else:
                for port in (handle.port, *handle.port_map.values()):
                    self._ports.hold(port)
            if handle.pgid and handle.app_state == model.AppState.RUNNING.value:
                self._watch_app(handle)
            if handle.env_key and self._envs is not None:
                self._envs.hold(handle.env_key)
            if handle.worker:
                self._load_jobs(handle.name)
        if self._envs is not None:
            await asyncio.to_thread(self._envs.prune)
        known = {h.token for h in self._handles.values()}
        # A job process whose start was not recorded (a crash right after it was spawned) is a
        # stray too: its job is reported as never started, so it must not run on.
        started = {j.token for j in self._jobs.values() if j.pid}
        strays = [
            pid
            for pid, env in (await self._scanner.env_table()).items()
            if env.get(OWNER_ENV) == self._state_dir
            and (env.get(TOKEN_ENV) not in known or (JOB_ENV in env and env[JOB_ENV] not in started))
        ]
        if strays:
            log.warning("killing %d processes of replicas this provisioner does not know", len(strays))
            procs.signal_pids(strays, signal.SIGKILL)

    async def close(self) -> None:
        """Stop watching; the replica processes keep running and are re-found on start()."""
        self._watcher.close()
        await self._close_jobs()
        self._scanner.close()

    # ---- backend interface -----------------------------------------------------------------

    async def delete(self, name: str, *, grace_s: float) -> None:
        """Stop the replica's process groups (SIGTERM, grace, SIGKILL) and remove its files."""
        handle = self._handles.get(name)
        if handle is None:
            await asyncio.to_thread(shutil.rmtree, self._dir(name), True)
            return
        if not await self._kill_processes(handle, grace_s=grace_s):
            raise backend.TeardownError(f"processes of replica {name} did not exit after SIGKILL")
        for job in [j for j in self._jobs.values() if j.worker == name]:
            self._watcher.cancel(job.pid)
            del self._jobs[job.token]
        if self._handles.get(name) is handle:
            del self._handles[name]
        self._release(handle)
        await asyncio.to_thread(shutil.rmtree, self._dir(name), True)
        if handle.env_key and self._envs is not None:
            await self._envs.release(handle.env_key)

    def get(self, name: str) -> backend.BackendReplica | None:
        """The replica `name`, if this backend runs it."""
        handle = self._handles.get(name)
        return self._describe(handle) if handle else None

    def list(self) -> list[backend.BackendReplica]:
        """Every replica this backend runs, by name."""
        return [self._describe(h) for _, h in sorted(self._handles.items())]

    async def watch(self) -> AsyncIterator[backend.BackendEvent]:
        """App exits and disappearances, as they happen."""
        while True:
            yield await self._events.get()

    def zones(self) -> builtins.list[model.Zone]:
        """Simulated zones, cheapest first."""
        return self._zones.list()

    def set_zone_availability(self, zone: str, refuse_for_s: float) -> model.Zone:
        """Make `zone` refuse launches for `refuse_for_s` seconds (0 accepts again)."""
        return self._zones.set_refusal(zone, refuse_for_s, self._clock())

    async def preempt(self, name: str) -> None:
        """SIGKILL the replica's processes at once, as a spot preemption would."""
        handle = self._handles.get(name)
        if handle is None:
            return
        await self._kill_processes(handle, grace_s=0)
        handle.app_state = model.AppState.PREEMPTED.value
        self._save_handle(handle)

    # ---- internals -------------------------------------------------------------------------

    def _dir(self, name: str) -> str:
        return os.path.join(self._root, name)

    def _release(self, handle: local_handles.Handle) -> None:
        if handle.address:
            self._addresses.release(handle.address)
        else:
            for port in (handle.port, *handle.port_map.values()):
                self._ports.release(port)

    def offered_accelerators(self) -> dict[str, float] | None:
        return dict(self._accelerators)

    def accelerator_hint(self, wanted: str) -> str:
        # Short: a violation's description is clipped at 240 characters.
        setting = f"REPLICAPLANE_PROVISIONER_LOCAL_ACCELERATORS={wanted}"
        return f"to run it here anyway: {setting} (its local_accelerators setting)"

    async def path_problems(self, needs: capability.Needs) -> builtins.list[errors.FieldViolation]:
        cancel = threading.Event()
        check = functools.partial(
            capability.path_problems, needs, state_dir=self._state_dir, limits=self._copy_limits, cancel=cancel
        )
        return await copies.in_thread(check, cancel)

    def _spawn(self, args: builtins.list[str], cwd: str, env: dict[str, str], log_path: str) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as out:
            child = subprocess.Popen(
                args,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._children[child.pid] = child
        return child

    def _reap(self, pid: int) -> int | None:
        child = self._children.get(pid)
        if child is None:
            return None
        code = child.poll()
        if code is not None:
            del self._children[pid]
        return code

    def _watch_app(self, handle: local_handles.Handle) -> None:
        pgid, token = handle.pgid, handle.token
        alive = procs.leader_alive(pgid, handle.start_ticks) or pgid in self._children
        if not alive or not self._watcher.watch(pgid, lambda: self._app_ended(handle.name, token)):
            self._app_ended(handle.name, token)

    def _app_ended(self, name: str, token: str) -> None:
        handle = self._handles.get(name)
        if handle is None or handle.token != token or handle.app_state != model.AppState.RUNNING.value:
            return
        self._reap(handle.pgid)
        try:
            with open(os.path.join(self._dir(name), local_marks.EXIT_FILE), encoding="utf-8") as fh:
                code: int | None = int(fh.read().strip())
        except (OSError, ValueError):
            code = None
        if code is None:
            handle.app_state = model.AppState.VANISHED.value
            message = "the replica's process group vanished without a teardown"
            cause = causes.local(causes.Local.VANISHED)
        elif handle.worker:
            handle.app_state = model.AppState.EXITED.value
            handle.exit_code = code
            message = f"the worker's holder process exited with code {code}"
            cause = causes.local(causes.Local.WORKER_EXITED)
        else:
            handle.app_state = model.AppState.EXITED.value
            handle.exit_code = code
            message = f"app exited with code {code}"
            cause = causes.local(causes.Local.APP_EXITED)
        self._save_handle(handle)
        self._events.put_nowait(
            backend.BackendEvent(
                name=name,
                token=token,
                app_state=model.AppState(handle.app_state),
                exit_code=handle.exit_code,
                time=self._clock(),
                message=message,
                cause=cause,
            )
        )

    async def _kill_processes(self, handle: local_handles.Handle, *, grace_s: float) -> bool:
        """Kill the app and setup groups and any stray process of this incarnation."""
        self._watcher.cancel(handle.pgid)
        ok = True
        for pgid in (handle.pgid, handle.setup_pgid):
            if pgid:
                reap = functools.partial(self._reap, pgid)
                alive = self._scanner.group_alive
                ok = await procs.kill_group(pgid, grace_s=grace_s, alive=alive, reap=reap) and ok
                self._reap(pgid)  # it may have turned zombie right after the last look
        for _ in range(50):  # bounded: strays get SIGKILL and die within milliseconds
            table = await self._scanner.env_table()
            strays = [pid for pid, env in table.items() if env.get(TOKEN_ENV) == handle.token]
            if not strays:
                break
            procs.signal_pids(strays, signal.SIGKILL)
            await asyncio.sleep(0.02)
        else:
            ok = False
        return ok

    def _describe(self, handle: local_handles.Handle) -> backend.BackendReplica:
        return backend.BackendReplica(
            name=handle.name,
            token=handle.token,
            endpoint=handle.endpoint,
            zone=handle.zone,
            price_per_hour=handle.price_per_hour,
            is_spot=handle.is_spot,
            app_state=model.AppState(handle.app_state),
            exit_code=handle.exit_code,
            start_time=handle.start_time,
        )

    def _save_handle(self, handle: local_handles.Handle) -> None:
        root = self._dir(handle.name)
        os.makedirs(root, mode=0o700, exist_ok=True)
        path = os.path.join(root, _HANDLE_FILE)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(dataclasses.asdict(handle), fh)
        os.replace(tmp, path)

    def _load_handle(self, name: str) -> local_handles.Handle | None:
        path = os.path.join(self._dir(name), _HANDLE_FILE)
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            return local_handles.Handle(**data)
        except (OSError, ValueError, TypeError):
            log.warning("ignoring unreadable replica handle %s", path)
            return None

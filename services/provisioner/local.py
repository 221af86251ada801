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
teardown and its end is noticed as an app's. The jobs that run on workers are
`local_jobs.LocalJobs`, mixed into `LocalBackend`; the markers and the wrapper are in
`local_marks` (`OWNER_ENV`, `TOKEN_ENV` and `JOB_ENV` are re-exported here).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
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
import uuid
from collections.abc import AsyncIterator, Callable

from services.common import errors, localpaths
from services.provisioner import (
    addresses,
    backend,
    capability,
    causes,
    copies,
    local_jobs,
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


@dataclasses.dataclass
class _Handle:
    """Persisted facts about one replica incarnation."""

    name: str
    token: str
    replica_id: int
    zone: str
    price_per_hour: float
    is_spot: bool
    port: int
    port_map: dict[str, int] = dataclasses.field(default_factory=dict)
    setup_pgid: int = 0
    pgid: int = 0
    start_ticks: int = 0
    start_time: float = 0.0
    app_state: str = model.AppState.UNSPECIFIED.value
    exit_code: int = 0
    host: str = "127.0.0.1"
    address: str = ""  # the replica's own loopback address ("address" network), else empty
    env_key: str = ""  # its python environment (pyenvs), shared with its version's replicas
    worker: bool = False  # a pool worker: no port, a holder instead of `run`

    @property
    def endpoint(self) -> str:
        return "" if self.worker else f"http://{self.host}:{self.port}"


class LocalBackend(local_jobs.LocalJobs, backend.Backend):
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
        self._handles: dict[str, _Handle] = {}
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

    async def create(self, request: backend.CreateRequest) -> backend.BackendReplica:
        """Prepare the working directory, run setup, start the app; see the module docstring."""
        launch = request.launch
        spec = launch.spec
        if spec.num_nodes > 1:
            raise _failure(
                causes.Local.UNRUNNABLE_SPEC,
                f"num_nodes={spec.num_nodes}: the local backend runs single-node replicas",
                permanent=True,
            )
        try:
            zone = self._zones.pick(launch.zone, self._clock())
        except zones.UnknownZoneError as exc:
            raise _failure(causes.Local.UNRUNNABLE_SPEC, str(exc), permanent=True) from None
        except zones.NoCapacityError as exc:
            raise _failure(causes.Local.NO_CAPACITY, str(exc), capacity_unavailable=True) from None
        if launch.name in self._handles:
            # Leftovers of an earlier attempt that could not be removed then.
            await self.delete(launch.name, grace_s=0)

        declared = ports.declared(spec.ports, spec.serving_port)
        try:
            # A pool worker serves nothing: no address, no port.
            address, port_map, port = ("", {}, 0) if spec.worker else self._allocate(declared)
        except OSError as exc:
            raise _failure(causes.Local.NO_ADDRESS, f"could not place the replica: {exc}") from None
        handle = _Handle(
            name=launch.name,
            token=uuid.uuid4().hex,
            replica_id=launch.replica_id,
            zone=zone.name,
            price_per_hour=zone.price_per_hour,
            is_spot=launch.use_spot,
            port=port,
            port_map={str(k): v for k, v in port_map.items()},
            host=address or self._advertise_host,
            address=address,
            worker=spec.worker,
        )
        self._handles[launch.name] = handle
        root = self._dir(launch.name)
        try:
            # In a thread of its own and cancellable: a teardown never waits behind a long copy.
            budget = copies.Budget(self._copy_limits)
            prepare = functools.partial(self._prepare_dir, root, spec, request.launch_log, budget)
            await copies.in_thread(prepare, budget.cancel)
            self._save_handle(handle)
            self._ensure_current(handle)
            if spec.resources:
                recorded = ", ".join(f"{k}={v}" for k, v in sorted(spec.resources.items()))
                _note(request.launch_log, f"recorded, not enforced by the local backend: {recorded}")
            env = self._environment(launch, spec, port_map, port, handle)
            python_env = await self._python_env(launch, handle, request.launch_log)
            if python_env is not None:
                env = pyenvs.PythonEnvs.environment(python_env, env)
            work = os.path.join(root, "work")
            if spec.setup.strip():
                async with self._setup_turn(python_env):
                    await self._setup(handle, ports.substitute(spec.setup, port_map), work, env, request.launch_log)
                if python_env is not None:
                    python_env.ready = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, local_marks.EXIT_FILE))
            if spec.worker:
                run = local_marks.HOLDER
                _note(request.launch_log, f"worker ready for jobs in zone {zone.name} (setup done)")
            else:
                run = ports.substitute(spec.run, port_map)
                _note(request.launch_log, f"starting the app on port {port} in zone {zone.name}")
            wrapper = self._spawn(
                ["bash", "-c", local_marks.WRAPPER, "replicaplane-run", run, os.path.join(root, local_marks.EXIT_FILE)],
                work,
                env,
                request.app_log,
            )
            handle.pgid = wrapper.pid
            handle.start_ticks = procs.start_ticks(wrapper.pid)
            handle.start_time = self._clock()
            handle.app_state = model.AppState.RUNNING.value
            self._save_handle(handle)
            self._watch_app(handle)
            return self._describe(handle)
        except asyncio.CancelledError:
            await self._kill_processes(handle, grace_s=0)
            raise
        except OSError as exc:
            raise _failure(causes.Local.START_FAILED, f"could not start the replica: {exc}") from exc

    async def _python_env(self, launch: model.LaunchRequest, handle: _Handle, launch_log: str) -> pyenvs.Env | None:
        """The version's venv (made by its first replica), or None when venvs are off."""
        if self._envs is None:
            return None
        key = pyenvs.PythonEnvs.key(launch)
        try:
            python_env = await self._envs.acquire(key, functools.partial(_note, launch_log))
        except (pyenvs.EnvError, OSError) as exc:
            raise _failure(causes.Local.START_FAILED, str(exc)) from None
        handle.env_key = key  # released with the replica, in delete()
        self._save_handle(handle)
        self._ensure_current(handle)
        return python_env

    def _setup_turn(self, python_env: pyenvs.Env | None) -> contextlib.AbstractAsyncContextManager[None]:
        if self._envs is None or python_env is None:
            return contextlib.nullcontext()
        return self._envs.setup_turn(python_env)

    async def _setup(self, handle: _Handle, setup_text: str, work: str, env: dict[str, str], launch_log: str) -> None:
        """Run `setup` as its own process group; a non-zero exit fails the attempt."""
        _note(launch_log, "running setup")
        setup = self._spawn(["bash", "-c", setup_text], work, env, launch_log)
        handle.setup_pgid = setup.pid
        self._save_handle(handle)
        # On cancellation create() kills (and reaps) the setup group.
        await procs.wait_exit(setup.pid)
        code = setup.wait()
        self._children.pop(setup.pid, None)
        self._ensure_current(handle)
        if code != 0:
            raise _failure(causes.Local.SETUP_EXITED, f"setup exited with code {_describe_code(code)}")
        _note(launch_log, "setup succeeded")

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

    def _release(self, handle: _Handle) -> None:
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

    def _allocate(self, declared: builtins.list[int]) -> tuple[str, dict[int, int], int]:
        """(address or "", declared port -> port, serving port) of a new replica.

        Raises:
            OSError: no free address or port.
        """
        if self._network == "address":
            address = self._addresses.allocate(declared)  # a few bind() calls: fast
            port = declared[0] if declared else ports.PortAllocator(address).allocate()
            return address, {p: p for p in declared}, port
        taken: builtins.list[int] = []
        try:
            for _ in range(len(declared) or 1):
                taken.append(self._ports.allocate())
        except OSError:
            for port in taken:
                self._ports.release(port)
            raise
        port_map = dict(zip(declared, taken, strict=False))
        return "", port_map, taken[0]

    def _ensure_current(self, handle: _Handle) -> None:
        """Stop an attempt whose replica was deleted while it ran (a cancel that timed out)."""
        if self._handles.get(handle.name) is not handle:
            # Not retried: the manager never retries a launch whose replica is being torn down.
            raise _failure(causes.Local.DELETED_DURING_LAUNCH, "the replica was deleted during its launch")

    def _prepare_dir(self, root: str, spec: model.ReplicaSpec, launch_log: str, budget: copies.Budget) -> None:
        """Make the replica's working directory: the workdir and file mounts copied in (in a thread)."""
        if os.path.exists(root):
            shutil.rmtree(root, ignore_errors=True)
        work = os.path.join(root, "work")
        os.makedirs(os.path.dirname(root), mode=0o700, exist_ok=True)
        sources = self._copy_sources(spec, work, launch_log)
        # Count first, so a copy over the limits fails before writing anything.
        counted = copies.Budget(budget.limits, budget.cancel)
        try:
            for label, source, _ in sources:
                copies.measure(label, source, counted)
            os.makedirs(work, mode=0o700, exist_ok=True)
            for label, source, target in sources:
                for skipped in copies.copy(label, source, target, budget):
                    _note(launch_log, f"{label}: skipped {os.path.relpath(skipped, source)} (not a file)")
        except copies.TooLargeError as exc:
            raise _failure(causes.Local.UNRUNNABLE_SPEC, str(exc), permanent=True) from None
        except copies.CancelledCopyError:
            raise _failure(causes.Local.DELETED_DURING_LAUNCH, "the copy was cancelled") from None
        except OSError as exc:
            # Whose fault a failed read or write was, its errno says (a file we may not read: the user's).
            cause = causes.local(causes.Local.COPY_FAILED, errno=exc.errno)
            raise backend.LaunchError(f"could not copy into the replica: {str(exc)[:300]}", cause=cause) from None
        if sources:
            _note(launch_log, f"copied {budget.bytes} bytes in {budget.entries} files and directories")

    def _copy_sources(self, spec: model.ReplicaSpec, work: str, launch_log: str) -> builtins.list[tuple[str, str, str]]:
        """(label, source, target) of every local path to copy; refuses the ones that cannot be."""
        wanted: builtins.list[tuple[str, str, str]] = []
        if spec.workdir:
            wanted.append((f"workdir {spec.workdir}", spec.workdir, work))
        for destination, source in sorted(spec.file_mounts.items()):
            if not localpaths.is_local_source(source):
                _note(launch_log, f"file mount {destination}: {source} is not a local path; skipped")
                continue
            target = os.path.normpath(os.path.join(work, destination.removeprefix("~/").lstrip("/")))
            if os.path.commonpath([work, target]) != work:
                outside = f"file mount {destination} is outside the working directory"
                raise _failure(causes.Local.MISSING_FILES, outside, permanent=True)
            wanted.append((f"file mount {destination} (source {source})", source, target))
        out = []
        for label, source, target in wanted:
            if localpaths.is_relative(source):
                relative = f"{label}: a relative path; the provisioner needs an absolute one"
                raise _failure(causes.Local.MISSING_FILES, relative, permanent=True)
            local = os.path.expanduser(source)
            if not os.path.exists(local) or (target == work and not os.path.isdir(local)):
                kind = "directory" if target == work else "path"
                raise _failure(causes.Local.MISSING_FILES, f"{label}: no such {kind} on this host", permanent=True)
            if why := copies.overlap(local, self._state_dir):
                raise _failure(causes.Local.UNRUNNABLE_SPEC, f"{label} {why}", permanent=True)
            out.append((label, local, target))
        return out

    def _environment(
        self,
        launch: model.LaunchRequest,
        spec: model.ReplicaSpec,
        port_map: dict[int, int],
        port: int,
        handle: _Handle,
    ) -> dict[str, str]:
        # The provisioner's own settings stay out of replicas.
        env = {k: v for k, v in os.environ.items() if not k.startswith("REPLICAPLANE_")}
        env["PYTHONUNBUFFERED"] = "1"  # app output reaches the log as it is written
        env.update({k: ports.substitute(v, port_map) for k, v in spec.envs.items()})
        env.update(spec.secrets)
        if port:
            env["PORT"] = str(port)
        env.update(
            {
                "HOST": handle.address or self._replica_host,
                "REPLICA_ID": str(launch.replica_id),
                "SKYPILOT_SERVE_REPLICA_ID": str(launch.replica_id),
                OWNER_ENV: self._state_dir,
                TOKEN_ENV: handle.token,
            }
        )
        if handle.address:
            env[addresses.BIND_HOST_ENV] = handle.address
            env[addresses.BIND_PORTS_ENV] = ",".join(str(p) for p in sorted({port, *port_map}))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (self._shim_dir, env.get("PYTHONPATH", "")) if p)
        return env

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

    def _watch_app(self, handle: _Handle) -> None:
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

    async def _kill_processes(self, handle: _Handle, *, grace_s: float) -> bool:
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

    def _describe(self, handle: _Handle) -> backend.BackendReplica:
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

    def _save_handle(self, handle: _Handle) -> None:
        root = self._dir(handle.name)
        os.makedirs(root, mode=0o700, exist_ok=True)
        path = os.path.join(root, _HANDLE_FILE)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(dataclasses.asdict(handle), fh)
        os.replace(tmp, path)

    def _load_handle(self, name: str) -> _Handle | None:
        path = os.path.join(self._dir(name), _HANDLE_FILE)
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            return _Handle(**data)
        except (OSError, ValueError, TypeError):
            log.warning("ignoring unreadable replica handle %s", path)
            return None


def _failure(
    failure: causes.Local, message: str, *, permanent: bool = False, capacity_unavailable: bool = False
) -> backend.LaunchError:
    """A launch error with its cause."""
    return backend.LaunchError(
        message,
        cause=causes.local(failure),
        permanent=permanent,
        capacity_unavailable=capacity_unavailable,
    )


def _describe_code(code: int) -> str:
    return f"{code} (signal {-code})" if code < 0 else str(code)


def _note(path: str, text: str) -> None:
    """Append a provisioner line to a launch log."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as fh:
        fh.write(f"[{stamp}Z provisioner] {text}\n")

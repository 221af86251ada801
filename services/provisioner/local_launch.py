"""Launching local replicas, the local backend's part (mixed into `local.LocalBackend`).

A launch attempt picks a zone and an address (or ports), copies the workdir and file mounts
into the replica's working directory, makes its environment (and its version's venv), runs
`setup` as its own process group, then starts `run` (a pool worker's holder) under the wrapper
of `local_marks`, saying each step in the launch log.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.common import localpaths
from services.provisioner import (
    addresses,
    backend,
    causes,
    copies,
    local_handles,
    local_marks,
    model,
    ports,
    procs,
    pyenvs,
    zones,
)


class LocalLaunches:
    """The launch operations of `local.LocalBackend`, which owns the state declared here."""

    _state_dir: str
    _clock: Callable[[], float]
    _zones: zones.ZoneTable
    _replica_host: str
    _advertise_host: str
    _network: str
    _ports: ports.PortAllocator
    _addresses: addresses.AddressAllocator
    _shim_dir: str
    _envs: pyenvs.PythonEnvs | None
    _copy_limits: copies.Limits
    _handles: dict[str, local_handles.Handle]
    _children: dict[int, subprocess.Popen[bytes]]

    if TYPE_CHECKING:

        async def delete(self, name: str, *, grace_s: float) -> None: ...

        def _dir(self, name: str) -> str: ...

        def _spawn(
            self, args: builtins.list[str], cwd: str, env: dict[str, str], log_path: str
        ) -> subprocess.Popen[bytes]: ...

        def _watch_app(self, handle: local_handles.Handle) -> None: ...

        async def _kill_processes(self, handle: local_handles.Handle, *, grace_s: float) -> bool: ...

        def _describe(self, handle: local_handles.Handle) -> backend.BackendReplica: ...

        def _save_handle(self, handle: local_handles.Handle) -> None: ...

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
        handle = local_handles.Handle(
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

    async def _python_env(
        self, launch: model.LaunchRequest, handle: local_handles.Handle, launch_log: str
    ) -> pyenvs.Env | None:
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

    async def _setup(
        self, handle: local_handles.Handle, setup_text: str, work: str, env: dict[str, str], launch_log: str
    ) -> None:
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

    def _ensure_current(self, handle: local_handles.Handle) -> None:
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
        handle: local_handles.Handle,
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
                local_marks.OWNER_ENV: self._state_dir,
                local_marks.TOKEN_ENV: handle.token,
            }
        )
        if handle.address:
            env[addresses.BIND_HOST_ENV] = handle.address
            env[addresses.BIND_PORTS_ENV] = ",".join(str(p) for p in sorted({port, *port_map}))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (self._shim_dir, env.get("PYTHONPATH", "")) if p)
        return env


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

"""Jobs on pool workers, the local backend's part (mixed into `local.LocalBackend`).

Each job is a process group of its own (so it can be cancelled without the worker), in the
worker's working directory with the worker's environment and venv, carrying the worker's token
(teardown and preemption kill it with the worker) and its own job token. Under
`<name>/jobs/<token>/` it keeps `job.json` (written before the process starts: a job without a
pid there never ran, and starts when the provisioner resumes it) and `exit_code` (written by the
wrapper), so a restarted provisioner re-finds running jobs and the codes of those that ended.
When a job's process exits, what it left running (its group, and every process carrying its
token) gets SIGTERM, then SIGKILL after the kill grace, before its end is reported: the worker
is clean for the next job.
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
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from services.provisioner import backend, local_handles, local_marks, model, procs, pyenvs

log = logging.getLogger(__name__)

_JOBS_DIR = "jobs"
_JOB_FILE = "job.json"


@dataclasses.dataclass
class JobHandle:
    """Persisted facts about one job incarnation on a worker."""

    token: str
    job_id: str
    worker: str
    pid: int = 0  # 0 until its process started: a job without a pid never ran
    start_ticks: int = 0
    start_time: float = 0.0
    running: bool = False
    exit_code: int | None = None
    grace_s: float = 0.0  # SIGTERM to SIGKILL for what the job leaves running when it ends


class LocalJobs:
    """The job operations of `local.LocalBackend`, which owns the state declared here."""

    _state_dir: str
    _clock: Callable[[], float]
    _envs: pyenvs.PythonEnvs | None
    _handles: dict[str, local_handles.Handle]
    _jobs: dict[str, JobHandle]  # by job token
    _job_events: asyncio.Queue[backend.JobEnded]
    _job_endings: dict[str, asyncio.Task[None]]  # by job token: stopping what a job left running
    _children: dict[int, subprocess.Popen[bytes]]
    _watcher: procs.ExitWatcher
    _scanner: procs.Scanner

    if TYPE_CHECKING:

        def _dir(self, name: str) -> str: ...

        def _reap(self, pid: int) -> int | None: ...

        def _spawn(
            self, args: builtins.list[str], cwd: str, env: dict[str, str], log_path: str
        ) -> subprocess.Popen[bytes]: ...

        def _environment(
            self,
            launch: model.LaunchRequest,
            spec: model.ReplicaSpec,
            port_map: dict[int, int],
            port: int,
            handle: local_handles.Handle,
        ) -> dict[str, str]: ...

    async def run_job(self, start: backend.JobStart) -> backend.BackendJob:
        """Start the job as a process group of its own in the worker's directory and environment."""
        known = self._jobs.get(start.token)
        if known is not None:
            return self._describe_job(known)  # started already: never twice
        worker = start.job.replica
        handle = self._handles.get(worker)
        if handle is None or handle.token != start.worker_token:
            raise backend.JobStartError(f"worker {worker} is gone")
        if handle.app_state != model.AppState.RUNNING.value:
            raise backend.JobStartError(f"worker {worker} is not running ({handle.app_state.lower()})")
        job = JobHandle(token=start.token, job_id=start.job.job_id, worker=worker, grace_s=start.grace_s)
        jdir = self._job_dir(worker, start.token)
        try:
            os.makedirs(jdir, mode=0o700, exist_ok=True)
            self._jobs[start.token] = job
            self._save_job(job)  # before the process exists: a crash in between leaves "never ran"
            spec = start.worker.spec
            port_map = {int(k): v for k, v in handle.port_map.items()}
            env = self._environment(start.worker, spec, port_map, handle.port, handle)
            if handle.env_key and self._envs is not None:
                env = self._envs.activate(handle.env_key, env)
            env.update(start.job.envs)
            env.update(backend.job_environment(start.job.job_id))
            env.update(
                {
                    local_marks.OWNER_ENV: self._state_dir,
                    local_marks.TOKEN_ENV: handle.token,
                    local_marks.JOB_ENV: start.token,
                }
            )
            child = self._spawn(
                [
                    "bash",
                    "-c",
                    local_marks.WRAPPER,
                    "replicaplane-job",
                    start.job.run,
                    os.path.join(jdir, local_marks.EXIT_FILE),
                ],
                os.path.join(self._dir(worker), "work"),
                env,
                start.log,
            )
        except OSError as exc:
            self._jobs.pop(start.token, None)
            raise backend.JobStartError(f"could not start the job: {exc}") from None
        job.pid = child.pid
        job.start_ticks = procs.start_ticks(child.pid)
        job.start_time = self._clock()
        job.running = True
        self._save_job(job)
        if not self._watcher.watch(child.pid, lambda: self._job_ended(start.token)):
            self._job_ended(start.token)
        return self._describe_job(job)

    async def cancel_job(self, token: str, *, grace_s: float) -> None:
        """SIGTERM the job's process group, SIGKILL after `grace_s`, and kill its strays."""
        job = self._jobs.get(token)
        if job is None or not job.pid:
            return
        if job.running:
            reap = functools.partial(self._reap, job.pid)
            await procs.kill_group(job.pid, grace_s=grace_s, alive=self._scanner.group_alive, reap=reap)
        for _ in range(50):  # bounded: a process that left the group still carries the job's token
            strays = [
                pid for pid, env in (await self._scanner.env_table()).items() if env.get(local_marks.JOB_ENV) == token
            ]
            if not strays:
                break
            procs.signal_pids(strays, signal.SIGKILL)
            await asyncio.sleep(0.02)

    def get_job(self, token: str) -> backend.BackendJob | None:
        """Job `token`, if this backend started it and its worker still exists."""
        job = self._jobs.get(token)
        return self._describe_job(job) if job else None

    async def watch_jobs(self) -> AsyncIterator[backend.JobEnded]:
        """Job ends, as they happen."""
        while True:
            yield await self._job_events.get()

    def _job_dir(self, worker: str, token: str) -> str:
        return os.path.join(self._dir(worker), _JOBS_DIR, token)

    def _job_ended(self, token: str) -> None:
        """The job's process exited: stop what it left running, then report its end."""
        job = self._jobs.get(token)
        if job is None or not job.running or token in self._job_endings:
            return
        task = asyncio.get_running_loop().create_task(self._finish_job(job))
        self._job_endings[token] = task
        task.add_done_callback(lambda _: self._job_endings.pop(token, None))

    async def _finish_job(self, job: JobHandle) -> None:
        # Only while its leader is our unreaped child is the group id surely still the job's;
        # after a restart the job's token still finds what it left.
        group = job.pid if job.pid in self._children else 0
        await self._stop_leftovers(job.token, group, grace_s=job.grace_s)
        self._reap(job.pid)
        if self._jobs.get(job.token) is job and job.running:  # else its worker was deleted meanwhile
            self._report_job_end(job)

    def _report_job_end(self, job: JobHandle) -> None:
        try:
            with open(
                os.path.join(self._job_dir(job.worker, job.token), local_marks.EXIT_FILE), encoding="utf-8"
            ) as fh:
                job.exit_code = int(fh.read().strip())
        except (OSError, ValueError):
            job.exit_code = None  # killed with its wrapper: no code
        job.running = False
        self._save_job(job)
        ended = f"exited with code {job.exit_code}" if job.exit_code is not None else "was killed"
        self._job_events.put_nowait(
            backend.JobEnded(job.token, job.worker, job.exit_code, self._clock(), f"the job's process {ended}")
        )

    async def _stop_leftovers(self, token: str, pgid: int, *, grace_s: float) -> None:
        """SIGTERM group `pgid` (0: none) and every process carrying job `token`, SIGKILL after
        `grace_s`; returns once none is left (bounded)."""

        async def left() -> tuple[list[int], bool]:
            table = await self._scanner.env_table()
            pids = [pid for pid, env in table.items() if env.get(local_marks.JOB_ENV) == token]
            return pids, bool(pgid) and await self._scanner.group_alive(pgid)

        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
            pids, grouped = await left()
            if not pids and not grouped:
                return
            if grouped:
                procs.signal_group(pgid, sig)
            procs.signal_pids(pids, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                pids, grouped = await left()
                if not pids and not grouped:
                    return
                await asyncio.sleep(0.02)

    async def _close_jobs(self) -> None:
        """Stop stopping leftovers; a restart finds the jobs again and finishes them."""
        endings = list(self._job_endings.values())
        for task in endings:
            task.cancel()
        await asyncio.gather(*endings, return_exceptions=True)

    def _load_jobs(self, worker: str) -> None:
        """Re-find a worker's jobs after a restart: watch the running ones, report the ended ones."""
        root = os.path.join(self._dir(worker), _JOBS_DIR)
        with contextlib.suppress(FileNotFoundError):
            for token in sorted(os.listdir(root)):
                try:
                    with open(os.path.join(root, token, _JOB_FILE), encoding="utf-8") as fh:
                        job = JobHandle(**json.load(fh))
                except (OSError, ValueError, TypeError):
                    log.warning("ignoring an unreadable job handle of worker %s", worker)
                    continue
                if not job.pid:
                    # Never started (or its process was not recorded, and is killed as a stray):
                    # forgotten, so the provisioner's resume starts it now.
                    shutil.rmtree(os.path.join(root, token), ignore_errors=True)
                    continue
                self._jobs[job.token] = job
                if job.running and not (
                    procs.leader_alive(job.pid, job.start_ticks)
                    and self._watcher.watch(job.pid, functools.partial(self._job_ended, job.token))
                ):
                    self._job_ended(job.token)

    def _save_job(self, job: JobHandle) -> None:
        jdir = self._job_dir(job.worker, job.token)
        os.makedirs(jdir, mode=0o700, exist_ok=True)
        path = os.path.join(jdir, _JOB_FILE)
        with open(f"{path}.tmp", "w", encoding="utf-8") as fh:
            json.dump(dataclasses.asdict(job), fh)
        os.replace(f"{path}.tmp", path)

    @staticmethod
    def _describe_job(job: JobHandle) -> backend.BackendJob:
        return backend.BackendJob(
            token=job.token,
            worker=job.worker,
            running=job.running,
            exit_code=None if job.running else job.exit_code,
            start_time=job.start_time,
        )

"""Jobs on pool workers of the `kubernetes` backend: each job is exec'd into its worker's Pod.

Why exec: the worker Pod already holds the setup's result (files, installed packages) and the
worker's environment, and exec starts a process there at once, with nothing in the Pod polling
for work (a sidecar or a queue file would need one) and nothing to install in the image.

One exec session (the pods/exec subresource over a websocket, through the official client) per
job runs `JOB_SCRIPT` with `sh`:

- Started for the first time (an atomic `mkdir` of `<jobs dir>/<token>/started`), it runs the
  job in the background in a session and process group of its own (`setsid`), with its output
  to a file in the Pod (`out`) and its exit code to another (`exit`), and says `started` on
  stderr. A second session for the same token (a retry, a provisioner restart) finds the marker
  and says `attached`: a job is never started twice.
- It streams `out` on stdout (`tail -f` from the byte the provisioner has) into the job's log,
  waits for the job (`wait` on its child; a re-attached session looks for `exit` once a second,
  or for the job's process to be gone, a zombie counting as gone), stops what the job left
  running (as a cancel does, with the provisioner's kill grace), and ends with `exit <code>`,
  or `killed` when the job ended without writing a code.

The job's output and code live in files, not in the session: a cut stream (a provisioner
restart, an API server hiccup) loses neither, and the job goes on. When a session ends without
its last word, the job is attached to again (with backoff) as long as its worker's Pod runs;
once the Pod is gone, the job ended with it. Whatever a session's `tail` had not copied when the
job ended is fetched with one more exec, so the log is complete.

Cancel is an exec too (`CANCEL_SCRIPT`): SIGTERM to the job's process group, to every live
process of its tree and to every process carrying its token (`TOKEN_ENV`), SIGKILL after the
grace, and it returns once none is left. The scripts are
portable sh: they run alike under dash (Debian's /bin/sh), bash and busybox ash.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from services.provisioner import backend, kube_objects

log = logging.getLogger(__name__)

SAY = "[replicaplane-job] "
TOKEN_ENV = "REPLICAPLANE_JOB_TOKEN"
"""Carried by every process of a job (as on the local backend): found by it, a process that left
the job's process group and tree is still the job's."""
_DIR = f'"${{{kube_objects.JOBS_DIR_ENV}:-{kube_objects.JOBS_DIR_PATH}}}/$token"'
# Shell functions of both scripts, on `$pid` (the job's first process; with setsid its process
# group's id too) and `$mark` (the job's TOKEN_ENV pair). The job is its process group, every
# live process under `$pid` and every live process carrying `$mark`, found in /proc (zombies are
# dead already). The tree is followed from every process seen so far, so a child whose parent
# died to the SIGTERM still gets the SIGKILL; the mark finds what a parent that ended before
# left behind (its orphans are no longer under `$pid`). `stop` returns once none is left
# (bounded). `running` is `kill -0` that counts a zombie as dead (an unreaped job whose parent
# session went is one), `kill -0` itself only where there is no /proc.
_STOP_FUNCTIONS = (
    "marked() {\n"
    '  while IFS= read -r var || [ -n "$var" ]; do\n'
    '    case "$var" in *"$mark"*) return 0 ;; esac\n'
    '  done < "/proc/$1/environ"\n'
    "  return 1\n"
    "}\n"
    "table() {\n"
    "  for s in /proc/[0-9]*/stat; do\n"
    '    { read -r line < "$s"; } 2>/dev/null || continue\n'
    "    p=${line%% *}\n"
    "    set -- ${line##*') '}\n"
    '    case "$1" in Z | X) continue ;; esac\n'
    '    if marked "$p" 2>/dev/null; then echo "$p $2 $3 m"; else echo "$p $2 $3 -"; fi\n'
    "  done\n"
    "}\n"
    "members() {\n"
    '  rows=$(table); found=" $seen "; grew=1\n'
    '  while [ -n "$grew" ]; do\n'
    "    grew=\n"
    "    while read -r p pp pg m; do\n"
    '      case "$found" in *" $p "*) continue ;; esac\n'
    '      case "$found" in *" $pp "*) found="$found$p "; grew=1; continue ;; esac\n'
    '      if [ "$pg" = "$pid" ] || [ "$m" = m ]; then found="$found$p "; grew=1; fi\n'
    "    done <<EOF\n"
    "$rows\n"
    "EOF\n"
    "  done\n"
    "  while read -r p pp pg m; do\n"
    '    case "$found" in *" $p "*) printf "%s " "$p" ;; esac\n'
    "  done <<EOF\n"
    "$rows\n"
    "EOF\n"
    "}\n"
    'alive() { live=$(members); seen="$pid $live"; [ -n "$live" ]; }\n'
    'signal() { kill -"$1" -"$pid" 2>/dev/null; alive && for p in $live; do kill -"$1" "$p" 2>/dev/null; done; }\n'
    "stop() {\n"
    "  seen=$pid\n"
    "  signal TERM\n"
    '  i=0; while [ "$i" -lt "$1" ] && alive; do sleep 0.1; i=$((i + 1)); done\n'
    "  signal KILL\n"
    '  i=0; while [ "$i" -lt 50 ] && alive; do sleep 0.1; i=$((i + 1)); done\n'
    "}\n"
    "running() {\n"
    "  if [ -d /proc/self ]; then\n"
    '    { read -r line < "/proc/$1/stat"; } 2>/dev/null || return 1\n'
    "    set -- ${line##*') '}\n"
    '    case "$1" in Z | X) return 1 ;; esac\n'
    "    return 0\n"
    "  fi\n"
    '  kill -0 "$1" 2>/dev/null\n'
    "}\n"
)
# $1 token, $2 first byte of `out` to stream, $3 the command, $4 the grace (tenths of a second)
# of what the job leaves running when it ends; then the job's VAR=value pairs (`job_command`).
# Portable sh (dash, bash, busybox ash): no `set -m` (dash ignores it without a terminal, so the
# job would share the session's process group), no `kill --` (dash's kill refuses it). The job
# gets a session and process group of its own from `setsid` (util-linux, busybox); the `&`
# child is never a group leader, so setsid needs no fork and `$!` is the group's id. Without
# setsid the job stays in the session's group and is found by its tree and its mark instead.
# The exit-code writer runs inside the job's group: a job killed there says `killed`. Once the
# job's first process ended, whatever it left running is stopped as a cancel stops it, before
# the session says how it ended: the worker is clean for the next job.
JOB_SCRIPT = (
    "token=$1; from=$2; run=$3; grace=$4; shift 4\n"
    f"d={_DIR}\n"
    f'mark="{TOKEN_ENV}=$token"\n'
    f"say() {{ printf '{SAY}%s\\n' \"$*\" >&2; }}\n"
    f"{_STOP_FUNCTIONS}"
    "if command -v bash >/dev/null 2>&1; then RP_SH=bash; else RP_SH=sh; fi\n"
    "if command -v setsid >/dev/null 2>&1; then RP_NEW=setsid; else RP_NEW=; fi\n"
    'mkdir -p "$d" || { say "failed cannot create $d"; exit 111; }\n'
    'if mkdir "$d/started" 2>/dev/null; then\n'
    '  $RP_NEW sh -c \'"$@"; echo "$?" > "$0/exit.tmp"; mv -f "$0/exit.tmp" "$0/exit"\' '
    '"$d" env "$@" "$mark" "$RP_SH" -c "$run" > "$d/out" 2>&1 < /dev/null &\n'
    "  pid=$!\n"
    '  echo "$pid" > "$d/pid"\n'
    '  say "started $pid"\n'
    '  tail -c "+$from" -f "$d/out" & follower=$!\n'
    '  wait "$pid"\n'
    "else\n"
    '  pid=$(cat "$d/pid" 2>/dev/null)\n'
    '  say "attached $pid"\n'
    '  tail -c "+$from" -f "$d/out" & follower=$!\n'
    '  while [ ! -f "$d/exit" ] && [ -n "$pid" ] && running "$pid"; do sleep 1; done\n'
    "fi\n"
    '[ -z "$pid" ] || stop "$grace"\n'
    'kill "$follower" 2>/dev/null\n'
    'if [ -f "$d/exit" ]; then say "exit $(cat "$d/exit")"; else say "killed"; fi\n'
)
# $1 token, $2 grace in tenths of a second. It returns once none of the job is left (bounded),
# so the worker is free.
CANCEL_SCRIPT = (
    "token=$1; grace=$2\n"
    f"d={_DIR}\n"
    f'mark="{TOKEN_ENV}=$token"\n'
    'pid=$(cat "$d/pid" 2>/dev/null); [ -n "$pid" ] || exit 0\n'
    f"{_STOP_FUNCTIONS}"
    'stop "$grace"\n'
    "exit 0\n"
)


def job_command(token: str, offset: int, run: str, grace_s: float, pairs: list[str]) -> list[str]:
    """The exec command of one session of a job: `JOB_SCRIPT` with its arguments."""
    return ["/bin/sh", "-c", JOB_SCRIPT, "replicaplane-job", token, str(offset), run, _tenths(grace_s), *pairs]


def cancel_command(token: str, grace_s: float) -> list[str]:
    """The exec command that cancels a job: `CANCEL_SCRIPT` with its arguments."""
    return ["/bin/sh", "-c", CANCEL_SCRIPT, "replicaplane-cancel", token, _tenths(grace_s)]


def _tenths(seconds: float) -> str:
    return str(max(0, round(seconds * 10)))


# $1 token, $2 first byte: what the job wrote from there.
REST_SCRIPT = f'token=$1\ntail -c "+$2" {_DIR}/out\n'

STDOUT, STDERR, STATUS = 1, 2, 3
REATTACH_MAX_S = 10.0


class ExecError(Exception):
    """An exec session could not be opened (`opened` False: nothing ran) or broke."""

    def __init__(self, message: str, *, opened: bool) -> None:
        super().__init__(message)
        self.opened = opened


class Exec(Protocol):
    """Runs a command in a Pod's replica container and yields (channel, bytes) as they come."""

    def __call__(self, pod: str, command: list[str]) -> AsyncIterator[tuple[int, bytes]]: ...


@dataclasses.dataclass
class _Job:
    token: str
    job_id: str
    worker: str
    pod: str
    log: str
    running: bool = False
    exit_code: int | None = None
    start_time: float = 0.0
    ended: bool = False
    session: asyncio.Task[None] | None = None
    started: asyncio.Future[bool] | None = None  # True: runs; False: it had ended already


class KubeJobs:
    """The jobs of one kubernetes backend; see the module docstring.

    Args:
        exec_: opens an exec session (kube_client.py's Api.exec).
        worker_alive: whether a worker's Pod still runs (the backend's Pod watch knows).
        clock: wall-clock time.
    """

    def __init__(
        self,
        exec_: Exec,
        *,
        worker_alive: Callable[[str], bool],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._exec = exec_
        self._worker_alive = worker_alive
        self._clock = clock
        self._jobs: dict[str, _Job] = {}
        self._events: asyncio.Queue[backend.JobEnded] = asyncio.Queue()

    async def run(self, start: backend.JobStart, pod: str) -> backend.BackendJob:
        """Start (or attach to) the job in Pod `pod`; returns once it runs (or is known ended).

        Raises:
            backend.JobStartError: the exec failed, or the worker's Pod is gone.
        """
        job = self._jobs.get(start.token)
        if job is None:
            job = _Job(start.token, start.job.job_id, start.job.replica, pod, start.log)
            self._jobs[start.token] = job
        if job.started is None or (job.started.done() and job.started.exception() is not None):
            job.started = asyncio.get_running_loop().create_future()
            job.session = asyncio.get_running_loop().create_task(self._follow(job, start))
        try:
            await asyncio.shield(job.started)
        except ExecError as exc:
            raise backend.JobStartError(f"could not exec the job into Pod {pod}: {exc}") from None
        return self.describe(job)

    def get(self, token: str) -> backend.BackendJob | None:
        """Job `token`, if this backend runs or ran it since it started."""
        job = self._jobs.get(token)
        return self.describe(job) if job else None

    async def cancel(self, token: str, *, grace_s: float) -> None:
        """SIGTERM the job's processes, SIGKILL after `grace_s`; returns once they are gone (the
        script bounds its wait), and its session then ends."""
        job = self._jobs.get(token)
        if job is None or job.ended or not self._worker_alive(job.worker):
            return
        try:
            async for _ in self._exec(job.pod, cancel_command(token, grace_s)):
                pass
        except ExecError as exc:
            log.warning("could not cancel job %s in Pod %s: %s", job.job_id, job.pod, exc)
        if job.session is not None and not job.session.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(job.session), 5.0)

    def forget_worker(self, worker: str) -> None:
        """The worker is deleted: stop following its jobs (they died with its Pod)."""
        for job in [j for j in self._jobs.values() if j.worker == worker]:
            if job.session is not None:
                job.session.cancel()
            if not job.ended:
                self._end(job, None, "its worker was deleted", worker_gone=True)
            del self._jobs[job.token]

    async def ended(self) -> AsyncIterator[backend.JobEnded]:
        """Job ends, as they happen."""
        while True:
            yield await self._events.get()

    async def close(self) -> None:
        """Stop following jobs; they run on in their Pods and are attached to again after a restart."""
        sessions = [j.session for j in self._jobs.values() if j.session is not None]
        for task in sessions:
            task.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)

    @staticmethod
    def describe(job: _Job) -> backend.BackendJob:
        """The backend's view of a job."""
        return backend.BackendJob(
            token=job.token,
            worker=job.worker,
            running=not job.ended,
            exit_code=job.exit_code if job.ended else None,
            start_time=job.start_time,
        )

    # ---- the session ----------------------------------------------------------------------

    async def _follow(self, job: _Job, start: backend.JobStart) -> None:
        """Run or attach to the job and copy its output until it ends; attach again after a cut."""
        pairs = [f"{k}={v}" for k, v in {**start.job.envs, **backend.job_environment(start.job.job_id)}.items()]
        delay = 0.2
        while not job.ended:
            try:
                outcome = await self._session(job, start.job.run, start.grace_s, pairs)
            except ExecError:
                return  # no session could be opened before it started: it never ran (run() says why)
            if outcome is not None:
                code, message = outcome
                await self._copy_rest(job)
                self._end(job, code, message)
                return
            if not self._worker_alive(job.worker):
                self._end(job, None, "its worker's Pod is gone", worker_gone=True)
                return
            await asyncio.sleep(delay)  # cut without its last word: attach again
            delay = min(REATTACH_MAX_S, delay * 2)

    async def _session(self, job: _Job, run: str, grace_s: float, pairs: list[str]) -> tuple[int | None, str] | None:
        """One exec session; returns (exit code or None, message) once the job ended, None when
        the session was cut first."""
        command = job_command(job.token, _size(job.log) + 1, run, grace_s, pairs)
        said = b""
        try:
            with open(job.log, "ab") as out:  # noqa: ASYNC230 - local file, appends
                async for channel, data in self._exec(job.pod, command):
                    if channel == STDOUT:
                        out.write(data)
                        out.flush()
                    elif channel == STDERR:
                        said += data
                        *lines, said = said.split(b"\n")
                        for line in lines:
                            ended = self._heard(job, line.decode(errors="replace"))
                            if ended is not None:
                                return ended
        except ExecError as exc:
            if not exc.opened and job.started is not None and not job.started.done():
                # Refused before anything ran in the Pod (it is not running, the API refused).
                job.started.set_exception(exc)
                job.started.exception()  # retrieved here; run() re-raises it
                raise
            # Cut after it opened: the job may run; only attaching again can tell.
            log.debug("exec session of job %s ended: %s", job.job_id, exc)
        except OSError as exc:
            log.warning("could not write the log of job %s: %s", job.job_id, exc)
        return None

    def _heard(self, job: _Job, line: str) -> tuple[int | None, str] | None:
        """Apply one line the job script said on stderr; the job's end when it says so."""
        if not line.startswith(SAY):
            if line.strip():
                log.info("job %s in Pod %s: %s", job.job_id, job.pod, line.strip()[:300])
            return None
        word, _, rest = line[len(SAY) :].partition(" ")
        if word in ("started", "attached"):
            job.running = True
            job.start_time = job.start_time or self._clock()
            if job.started is not None and not job.started.done():
                job.started.set_result(True)
        elif word == "exit":
            with contextlib.suppress(ValueError):
                return int(rest.strip()), f"the job's process exited with code {rest.strip()}"
            return None, "the job ended with an unreadable exit code"
        elif word == "killed":
            return None, "the job's process was killed"
        elif word == "failed":
            if job.started is not None and not job.started.done():
                job.started.set_exception(ExecError(rest, opened=False))
                job.started.exception()
            return None, f"the job could not start: {rest}"
        return None

    async def _copy_rest(self, job: _Job) -> None:
        """Fetch what the session's follower had not copied when the job ended."""
        command = ["/bin/sh", "-c", REST_SCRIPT, "replicaplane-rest", job.token, str(_size(job.log) + 1)]
        try:
            with open(job.log, "ab") as out:  # noqa: ASYNC230 - local file, appends
                async for channel, data in self._exec(job.pod, command):
                    if channel == STDOUT:
                        out.write(data)
        except (ExecError, OSError) as exc:
            log.warning("the end of job %s's output could not be copied: %s", job.job_id, exc)

    def _end(self, job: _Job, code: int | None, message: str, *, worker_gone: bool = False) -> None:
        if job.ended:
            return
        job.ended, job.running, job.exit_code = True, False, code
        if job.started is not None and not job.started.done():
            job.started.set_result(False)
        self._events.put_nowait(
            backend.JobEnded(job.token, job.worker, code, self._clock(), message, worker_gone=worker_gone)
        )


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def frames(message: Any) -> tuple[int, bytes] | None:
    """A websocket message of the v4.channel.k8s.io protocol as (channel, data); None for others."""
    data = message.data
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, bytes | bytearray) or not data:
        return None
    return data[0], bytes(data[1:])

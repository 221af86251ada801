"""The kubernetes backend's job scripts (kube_jobs.py), run for real under dash and bash.

What a worker Pod runs for a job is shell text: it must work under whatever `/bin/sh` the image
has. Debian's is dash, which ignores `set -m` without a terminal (no process group for the job)
and whose `kill` takes no `--`. These tests run the scripts as an exec session does (a session of
its own, no terminal, the jobs directory from the environment) in a stand-in for each kind of
image (dash with bash, bash, busybox), with and without `setsid`, and check that neither a cancel
nor the job's end leaves a process of the job behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from services.provisioner import kube_jobs, kube_objects, procs

MARK = "RP_JOB_SHELL_TEST"
# What the scripts call besides shell builtins (the job itself calls `sleep`).
TOOLS = ("mkdir", "cat", "mv", "tail", "sleep", "env")
# The images the scripts must work in: which `sh` (and /bin/sh: what the exec runs) and whether
# bash is there. debian: dash as sh, with bash (python:3.11-slim); busybox: all of it busybox
# (alpine). Each with and without `setsid`.
IMAGES = {"debian": ("dash", True), "bash": ("bash", True), "busybox": ("busybox", False)}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing (CI installs it: .ci/run)")
        pytest.skip(f"{name} is not installed")
    return path


class Pod:
    """A stand-in for a worker Pod's container: a working directory, a jobs directory and a PATH
    with only what the image has, and the scripts run there as pods/exec runs them (`sh -c`, a
    session of their own, stdin closed)."""

    def __init__(self, tmp: str, image: str, *, setsid: bool) -> None:
        sh, with_bash = IMAGES[image]
        self.jobs = os.path.join(tmp, "jobs")
        self.home = os.path.join(tmp, "home")  # the container's working directory
        os.mkdir(self.home)
        bin_dir = os.path.join(tmp, "bin")
        os.mkdir(bin_dir)
        tools = {"sh": _tool(sh), **{t: _tool(t) for t in TOOLS}}
        if sh == "busybox":  # busybox runs the applet its link is named after
            tools = dict.fromkeys(tools, tools["sh"])
        if setsid:
            tools["setsid"] = tools["sh"] if sh == "busybox" else _tool("setsid")
        if with_bash:
            tools["bash"] = _tool("bash")
        for name, target in tools.items():
            os.symlink(target, os.path.join(bin_dir, name))
        self.shell = os.path.join(bin_dir, "sh")
        self.env = {**os.environ, "PATH": bin_dir, kube_objects.JOBS_DIR_ENV: self.jobs}
        self.sessions: list[subprocess.Popen[bytes]] = []
        self.mark = uuid.uuid4().hex
        self.pair = f"{MARK}={self.mark}"  # one of the job's VAR=value pairs

    def start(self, token: str, run: str, name: str = "session", grace_s: float = 1.0) -> str:
        """Open a job session; returns the path of what it says on stderr."""
        said = os.path.join(os.path.dirname(self.jobs), f"{token}-{name}.err")
        _, *args = kube_jobs.job_command(token, 1, run, grace_s, [self.pair])
        with open(said, "wb") as err:
            self.sessions.append(
                subprocess.Popen(
                    [self.shell, *args],
                    env=self.env,
                    cwd=self.home,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,
                )
            )
        return said

    def cancel(self, token: str, grace_tenths: int) -> None:
        _, *args = kube_jobs.cancel_command(token, grace_tenths / 10)
        subprocess.run(
            [self.shell, *args],
            env=self.env,
            stdin=subprocess.DEVNULL,
            check=True,
            timeout=60,
            start_new_session=True,
        )

    def job_pids(self) -> list[int]:
        """The job's live processes (all of them carry the marker the job's `env` set)."""
        return procs.pids_with_env(MARK, self.mark)

    def close(self) -> None:
        procs.signal_pids(self.job_pids(), signal.SIGKILL)
        for session in self.sessions:
            if session.poll() is None:
                os.killpg(session.pid, signal.SIGKILL)
            session.wait(10)


@pytest.fixture(
    params=[(image, setsid) for image in IMAGES for setsid in (True, False)],
    ids=lambda p: f"{p[0]}-{'setsid' if p[1] else 'no-setsid'}",
)
def pod(request: pytest.FixtureRequest, tmp_path) -> Iterator[Pod]:
    image, setsid = request.param
    p = Pod(str(tmp_path), image, setsid=setsid)
    try:
        yield p
    finally:
        p.close()


def _until(check, timeout: float = 10.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what or check}")
        time.sleep(0.02)


def _said(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return [line[len(kube_jobs.SAY) :] for line in fh.read().splitlines() if line.startswith(kube_jobs.SAY)]


def _words(path: str) -> list[str]:
    return [line.split(" ")[0] for line in _said(path)]


def _out(pod: Pod, token: str) -> str:
    try:
        with open(os.path.join(pod.jobs, token, "out"), encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return ""


def test_a_job_runs_and_its_session_says_its_exit_code(pod: Pod) -> None:
    said = pod.start("t1", 'echo "working in $PWD"; exit 4')
    _until(lambda: _words(said)[-1:] == ["exit"], what="the session's last word")
    assert _said(said)[0].startswith("started ") and _said(said)[-1] == "exit 4"
    assert _out(pod, "t1").startswith("working in ")
    pod.sessions[-1].wait(10)


def test_cancel_stops_every_process_of_the_job_and_its_session_ends(pod: Pod) -> None:
    # A foreground and a background child: a cancel must reach both, and their children.
    # (`; :` keeps each shell from exec'ing its last command: four processes.)
    said = pod.start("t1", "echo working; sleep 300 & sh -c 'sleep 300; :'; :")
    _until(lambda: len(pod.job_pids()) == 4 and "working" in _out(pod, "t1"), what="the job's processes")
    pod.cancel("t1", 50)
    _until(lambda: not pod.job_pids(), what="the job's processes to be gone")
    _until(lambda: _words(said)[-1:] in (["killed"], ["exit"]), what="the session's last word")
    pod.sessions[-1].wait(10)


def test_a_job_that_ignores_sigterm_is_killed_after_the_grace(pod: Pod) -> None:
    said = pod.start("t1", "trap '' TERM; echo stubborn; sleep 300; sleep 300")
    _until(lambda: "stubborn" in _out(pod, "t1") and len(pod.job_pids()) >= 2, what="the job's processes")
    pod.cancel("t1", 3)
    _until(lambda: not pod.job_pids(), what="the job's processes to be gone")
    _until(lambda: _words(said)[-1:] == ["killed"], what="the session's last word")


def test_a_second_session_attaches_and_a_cancel_ends_both(pod: Pod) -> None:
    first = pod.start("t1", "echo once >> runs; sleep 300", name="first")
    _until(lambda: _words(first)[:1] == ["started"] and pod.job_pids(), what="the job to start")
    second = pod.start("t1", "echo once >> runs; sleep 300", name="second")
    _until(lambda: _words(second)[:1] == ["attached"], what="the second session to attach")
    pod.cancel("t1", 10)
    _until(lambda: not pod.job_pids(), what="the job's processes to be gone")
    for said in (first, second):
        _until(lambda said=said: _words(said)[-1:] == ["killed"], what="each session's last word")
    with open(os.path.join(pod.home, "runs"), encoding="utf-8") as fh:
        assert fh.read() == "once\n"  # never started twice


def test_a_cancel_of_a_job_that_ended_or_never_started_does_nothing(pod: Pod) -> None:
    pod.cancel("never", 5)  # no directory at all
    said = pod.start("t1", "true")
    _until(lambda: _words(said)[-1:] == ["exit"], what="the job's end")
    pod.cancel("t1", 5)
    assert _said(said)[-1] == "exit 0"


def _job_file(pod: Pod, token: str, name: str) -> str:
    with open(os.path.join(pod.jobs, token, name), encoding="utf-8") as fh:
        return fh.read().strip()


def test_what_a_job_leaves_running_is_stopped_before_its_session_says_its_end(pod: Pod) -> None:
    # A background child; an orphan whose parent ended first (no longer under the job's process);
    # where the image has setsid, one that left the job's process group too.
    run = (
        "echo working; sleep 300 & sh -c 'sleep 300 & :'; "
        "if command -v setsid >/dev/null; then setsid sleep 300 & fi; exit 3"
    )
    said = pod.start("t1", run)
    _until(lambda: _words(said)[-1:] == ["exit"], what="the session's last word")
    assert _said(said)[-1] == "exit 3" and "working" in _out(pod, "t1")
    assert pod.job_pids() == []  # gone before the session said the job ended
    pod.sessions[-1].wait(10)


def test_what_a_job_leaves_running_gets_sigterm_then_sigkill_after_the_grace(pod: Pod) -> None:
    stubborn = "trap 'echo termed >> termed' TERM; : > ready; while :; do sleep 0.1; done"
    run = f'sh -c "{stubborn}" & while [ ! -f ready ]; do sleep 0.05; done; exit 0'
    said = pod.start("t1", run, grace_s=0.3)
    _until(lambda: _words(said)[-1:] == ["exit"], what="the session's last word")
    assert _said(said)[-1] == "exit 0"
    assert pod.job_pids() == []
    with open(os.path.join(pod.home, "termed"), encoding="utf-8") as fh:
        assert fh.read().startswith("termed")  # asked first, killed after the grace
    pod.sessions[-1].wait(10)


def test_an_attached_session_takes_a_zombie_job_for_ended(pod: Pod) -> None:
    first = pod.start("t1", "sleep 300", name="first")
    _until(lambda: _words(first)[:1] == ["started"] and pod.job_pids(), what="the job to start")
    os.kill(pod.sessions[0].pid, signal.SIGSTOP)  # its first session can no longer reap it
    pid = int(_job_file(pod, "t1", "pid"))
    os.kill(pid, signal.SIGKILL)  # no exit code written
    _until(lambda: (procs.read_stat(pid) or procs.ProcInfo(pid, 0, 0, 0, "?", 0)).state == "Z", what="a zombie")
    second = pod.start("t1", "sleep 300", name="second")
    _until(lambda: _words(second)[-1:] == ["killed"], what="the second session's last word")
    assert pod.job_pids() == []  # and what the job left running is gone

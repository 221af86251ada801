"""A throwaway PostgreSQL server for tests: a fresh cluster in a temporary directory, listening
on 127.0.0.1 and a free port, with trust authentication and no fsync (tests need no durability
from it), stopped and deleted at the end.

It runs Debian's `postgresql` package binaries (found on PATH or under /usr/lib/postgresql);
PostgreSQL refuses to run as root, so as root it runs as the `postgres` user. `unavailable()`
says why it cannot run here; in CI (CI=true) the tests that need it fail instead of skipping.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

USER = "replicaplane"
START_TIMEOUT_S = 30.0


def binary(name: str) -> str | None:
    """A PostgreSQL server program: the newest under /usr/lib/postgresql, else on PATH."""

    def version(path: str) -> int:
        major = path.split("/")[4]
        return int(major) if major.isdigit() else 0

    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=version)
    return found[-1] if found else shutil.which(name)


def _run_as() -> list[str]:
    """The command prefix that runs the server as a user PostgreSQL accepts."""
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


def unavailable() -> str:
    """Why a test server cannot run here ("" when it can)."""
    for name in ("initdb", "postgres"):
        if binary(name) is None:
            return f"PostgreSQL's {name} is not installed (apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no postgres user to run the server as"
        if shutil.which("runuser") is None:
            return "running as root and runuser is missing"
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One PostgreSQL cluster; `database()` hands out a fresh empty database each call."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="replicaplane-pg-")
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._count = itertools.count(1)
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
        os.chmod(self.dir, 0o700)

    @property
    def log(self) -> str:
        """The server's log file."""
        return os.path.join(self.dir, "server.log")

    def start(self) -> None:
        """initdb, then start the server and wait until it takes connections."""
        data = os.path.join(self.dir, "data")
        subprocess.run(
            [
                *_run_as(),
                binary("initdb") or "initdb",
                "-D",
                data,
                "-U",
                USER,
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        for _ in range(5):  # a port picked free can be taken before the server binds it
            self.port = _free_port()
            self._proc = subprocess.Popen(
                [
                    *_run_as(),
                    binary("postgres") or "postgres",
                    "-D",
                    data,
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    "-k",
                    self.dir,
                    "-c",
                    "fsync=off",
                    "-c",
                    "full_page_writes=off",
                    "-c",
                    "max_connections=300",
                    "-c",
                    f"log_directory={self.dir}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=open(self.log, "ab"),  # noqa: SIM115 (the child keeps it)
                start_new_session=True,
            )
            if self._wait_ready():
                return
            self._kill()
        raise RuntimeError(f"PostgreSQL did not start; its log is {self.log}")

    def _wait_ready(self) -> bool:
        import psycopg

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            try:
                with psycopg.connect(self.url("postgres"), connect_timeout=2):
                    return True
            except psycopg.OperationalError:
                time.sleep(0.1)
        return False

    def url(self, dbname: str) -> str:
        """The URL of one database of this server."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{dbname}"

    def database(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = f"t{os.getpid()}_{next(self._count)}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name} TEMPLATE template0")
        return self.url(name)

    def drop(self, url: str) -> None:
        """Drop a database made by `database()`, ending its sessions first."""
        import psycopg

        name = url.rsplit("/", 1)[1]
        with contextlib.suppress(psycopg.Error), psycopg.connect(self.url("postgres"), autocommit=True) as db:
            db.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGQUIT)  # immediate shutdown
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(10)
        self._proc = None

    def stop(self) -> None:
        """Stop the server and delete its files."""
        self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running() -> Iterator[Server]:
    """A started server, stopped and removed afterwards."""
    server = Server()
    try:
        server.start()
        yield server
    finally:
        server.stop()

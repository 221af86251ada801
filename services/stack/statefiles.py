"""The stack's files under its private state dir: pid file, state (JSON), token, ports, logs and
the stopping stack's report."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
from typing import Any

from services.stack import api, plan, procs


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
        return pid if pid and pid != os.getpid() and procs.is_ours(pid, "services.stack") else None

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


def read_result(files: StateFiles) -> list[str] | None:
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

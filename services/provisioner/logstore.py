"""Replica logs on disk: the launch log (provisioner steps and setup output), the app log, and
the output of each job a pool worker ran.

Logs live under `<state_dir>/logs/<name>/` (a worker's jobs under its `jobs/`), apart from the
replica's working files, so they outlive its teardown when asked to (failed replicas), and go
with the replica's logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable

from services.provisioner import model

CHUNK_BYTES = 64 * 1024
FOLLOW_POLL_S = 0.1


class LogStore:
    """Paths, notes and streaming of replica logs."""

    def __init__(self, state_dir: str) -> None:
        self._root = os.path.join(os.path.abspath(os.path.expanduser(state_dir)), "logs")
        os.makedirs(self._root, mode=0o700, exist_ok=True)

    def _dir(self, name: str) -> str:
        # Callers check names; this guard keeps any path that slips through inside the root.
        if not name or name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name):
            raise ValueError("a replica log name must be one path component")
        return os.path.join(self._root, name)

    def path(self, name: str, kind: model.LogKind) -> str:
        """The file of log `kind` (LAUNCH or APP) of replica `name`."""
        return os.path.join(self._dir(name), f"{kind.value}.log")

    def job_path(self, name: str, job_id: str) -> str:
        """The file of the output of job `job_id` run on worker `name`."""
        # Job ids are checked like replica names; the same guard applies.
        self._dir(job_id)
        return os.path.join(self._dir(name), "jobs", f"{job_id}.log")

    def prepare_job(self, name: str, job_id: str) -> str:
        """Create the job log's directory and the (empty) log; returns its path."""
        path = self.job_path(name, job_id)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(path, "ab"):
            pass
        return path

    def delete_job(self, name: str, job_id: str) -> bool:
        """Remove the log of job `job_id` of worker `name`; True if there was one."""
        try:
            os.unlink(self.job_path(name, job_id))
        except FileNotFoundError:
            return False
        return True

    def prepare(self, name: str) -> None:
        """Create the log directory of replica `name`."""
        os.makedirs(self._dir(name), mode=0o700, exist_ok=True)

    def note(self, name: str, text: str) -> None:
        """Append a timestamped provisioner line to the launch log of replica `name`."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        with (
            contextlib.suppress(OSError),
            open(self.path(name, model.LogKind.LAUNCH), "a", encoding="utf-8") as fh,
        ):
            fh.write(f"[{stamp}Z provisioner] {text}\n")

    def exists(self, name: str, kind: model.LogKind) -> bool:
        """Whether log `kind` of replica `name` exists."""
        return os.path.exists(self.path(name, kind))

    def delete(self, name: str) -> None:
        """Remove every log of replica `name`."""
        shutil.rmtree(self._dir(name), ignore_errors=True)

    async def stream(
        self, name: str, kind: model.LogKind, *, live: Callable[[], bool] | None = None
    ) -> AsyncIterator[bytes]:
        """Yield the log's bytes; while `live()` is true, keep yielding what is appended.

        Following checks for new output every 100 ms and ends once `live()` turns false and
        everything written was sent (or when the file is removed).
        """
        async for chunk in self.stream_file(self.path(name, kind), live=live):
            yield chunk

    async def stream_file(self, path: str, *, live: Callable[[], bool] | None = None) -> AsyncIterator[bytes]:
        """Yield a log file's bytes, following it while `live()` is true (see stream())."""
        try:
            fh = open(path, "rb")  # noqa: SIM115, ASYNC230 - local file, closed below
        except FileNotFoundError:
            return
        try:
            while True:
                chunk = fh.read(CHUNK_BYTES)
                if chunk:
                    yield chunk
                    continue
                if live is None or not live():
                    # One last read: output written just before the replica stopped.
                    rest = fh.read()
                    if rest:
                        yield rest
                    return
                await asyncio.sleep(FOLLOW_POLL_S)
        finally:
            fh.close()

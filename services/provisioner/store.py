"""Durable provisioner records: one JSON file per replica under `<state_dir>/replicas/` (and one
per job of a pool worker under `<state_dir>/jobs/`).

A record holds what a restarted provisioner needs to re-attach to a replica: the launch
request, the replica's last known state, its backend token and its launch and teardown event
logs. Files are replaced atomically (write, then rename). They may hold secret environment
values, so the directory is private to the user (0700) and files are 0600.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


class RecordStore:
    """Records as JSON files: replicas by default, or another `kind` (the jobs of pool workers)."""

    def __init__(self, state_dir: str, kind: str = "replicas") -> None:
        self._state_dir = os.path.abspath(os.path.expanduser(state_dir))
        self._root = os.path.join(self._state_dir, kind)
        os.makedirs(self._root, mode=0o700, exist_ok=True)

    def sibling(self, kind: str) -> RecordStore:
        """A store of another kind of record in the same state dir."""
        return RecordStore(self._state_dir, kind)

    def _path(self, name: str) -> str:
        return os.path.join(self._root, f"{name}.json")

    def save(self, name: str, record: dict[str, Any]) -> None:
        """Write the record of replica `name`, replacing the previous one atomically."""
        path = self._path(name)
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(record, fh, separators=(",", ":"))
        os.replace(tmp, path)

    def delete(self, name: str) -> None:
        """Remove the record of replica `name`, if any."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(name))

    def load_all(self) -> list[dict[str, Any]]:
        """Every stored record, by name; unreadable files are skipped with a warning."""
        records = []
        for entry in sorted(os.listdir(self._root)):
            if not entry.endswith(".json"):
                continue
            path = os.path.join(self._root, entry)
            try:
                with open(path, encoding="utf-8") as fh:
                    records.append(json.load(fh))
            except (OSError, ValueError):
                log.warning("ignoring unreadable replica record %s", path)
        return records

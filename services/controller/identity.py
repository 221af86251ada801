"""The controller's id, kept where a lost or replaced store cannot take it.

The id is the `owner` of every replica the controller launches, and a controller reaps (tears
down) only replicas it owns and has no record of. If the id lived only in the store, a lost
store would take it along: the restarted controller would get a new id and leave the lost
services' replicas running for good. So the id is also kept in a small file next to the store,
`<state_dir>/controller_id`, written once, atomically and fsynced, and read before the store.

Which id a controller starts with: the `controller_id` setting when set (for ids kept outside
the state directory, in a config file or the environment); else the id file; else the id in
the store's `meta` table (a controller from before the file existed); else a new one. The id
chosen is then written to whichever of the file and the store lack it.
"""

from __future__ import annotations

import logging
import os
import secrets

log = logging.getLogger(__name__)

ID_FILE = "controller_id"
MAX_ID = 128


def problem(controller_id: str) -> str:
    """What is wrong with `controller_id` as an id ("" when nothing is)."""
    if not controller_id or len(controller_id) > MAX_ID:
        return f"must be 1 to {MAX_ID} characters"
    if not controller_id.isprintable() or any(c.isspace() for c in controller_id):
        return "must be printable, without spaces"
    return ""


def read_file(state_dir: str) -> str:
    """The id in the state directory's id file; "" when there is none (or it is unusable)."""
    path = os.path.join(os.path.expanduser(state_dir), ID_FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read().strip()
    except FileNotFoundError:
        return ""
    except (OSError, UnicodeDecodeError) as exc:
        log.error("cannot read the controller id file %s: %s", path, exc)
        return ""
    if problem(text):
        log.error("ignoring the controller id file %s: it does not hold an id", path)
        return ""
    return text


def write_file(state_dir: str, controller_id: str) -> None:
    """Write the id file atomically: a new file, fsynced, renamed over the old, directory fsynced.

    Raises:
        OSError: the file could not be written.
    """
    directory = os.path.expanduser(state_dir)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, ID_FILE)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{controller_id}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def resolve(state_dir: str, *, setting: str, stored: str) -> str:
    """The id this controller runs with (see the module docstring), written to the id file.

    Args:
        state_dir: the controller's state directory.
        setting: the `controller_id` setting ("" when unset); already checked with `problem`.
        stored: the id in the store ("" when it has none).

    Returns:
        The id.

    Raises:
        OSError: the id file was missing and could not be written. Starting anyway would risk
            the very loss this file exists to prevent.
    """
    from_file = read_file(state_dir)
    chosen = setting or from_file or stored or secrets.token_hex(16)
    for where, other in (("the id file", from_file), ("the store", stored)):
        if other and other != chosen:
            # Replicas launched under the other id are no longer reaped by this controller:
            # say so, with the id an operator needs to reap them (replicactl orphans --owner).
            log.warning(
                "controller id %s replaces %s from %s; replicas launched under %s are left to "
                "`replicactl orphans --owner %s`",
                chosen,
                other,
                where,
                other,
                other,
            )
    if from_file != chosen:
        write_file(state_dir, chosen)
    return chosen

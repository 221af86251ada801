"""Local paths in a spec (`workdir`, `file_mounts` sources): the rules clients and servers share.

A relative path means "relative to where the user stands", which only the client knows: clients
resolve it (specfile.py) and the API refuses one that arrives relative, instead of resolving it
against a server's own working directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from services.common import errors


def is_local_source(source: str) -> bool:
    """Whether a `file_mounts` source names a path on a local disk (not a URI, not a storage mapping)."""
    text = source.strip()
    return bool(text) and not text.startswith("{") and "://" not in text


def is_relative(path: str) -> bool:
    """Whether `path` is relative; `~` and `~/x` count as absolute (the home directory)."""
    return not os.path.isabs(os.path.expanduser(path))


def relative_problems(workdir: str, file_mounts: Mapping[str, str]) -> list[errors.FieldViolation]:
    """A violation for a relative `workdir` and for each relative local `file_mounts` source."""
    why = (
        "must be an absolute path: the API has no current directory to resolve {what} against "
        "(replicactl resolves it against the directory it runs in, as sky does)"
    )
    problems = []
    if workdir and is_relative(workdir):
        problems.append(errors.FieldViolation("workdir", why.format(what="a relative workdir")))
    for destination, source in sorted(file_mounts.items()):
        if is_local_source(source) and is_relative(source):
            problems.append(
                errors.FieldViolation(f"file_mounts.{destination}", why.format(what="a relative source path"))
            )
    return problems

"""Reading a service YAML file the way every client should: relative local paths made absolute.

The rule is SkyPilot's: a relative `workdir` or `file_mounts` source is relative to the current
directory (its examples say "run from the repo root: `sky serve up examples/serve/...`"). A path
that does not exist there but does next to the YAML file is taken from there, so YAMLs written
for that older rule still work; when it exists in both places, the current directory wins and a
note says so. One that exists in neither is an error naming both paths tried.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any, TypeGuard

import yaml

from services.common import localpaths

_TOP_LEVEL_WORKDIR = re.compile(r"^workdir:[^\n]*$", re.MULTILINE)


class PathError(ValueError):
    """A relative `workdir` or `file_mounts` source that exists neither here nor next to the YAML."""


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A spec's text with its local paths made absolute.

    Attributes:
        text: the YAML to send; comments and layout are kept where the paths could be
            rewritten in place.
        notes: what a user should know about the resolution (a path taken from next to the
            YAML, or found in both places); empty in the usual case.
    """

    text: str
    notes: tuple[str, ...] = ()


def resolve_paths(yaml_text: str, *, cwd: str, yaml_dir: str) -> Resolved:
    """Make a relative `workdir` and relative local `file_mounts` sources absolute.

    Values holding `$` are left alone: the server fills env references in, and refuses the
    result if it is still relative.

    Args:
        yaml_text: the task YAML.
        cwd: the directory the user runs the command in.
        yaml_dir: the directory of the YAML file.

    Returns:
        The text to send and any notes for the user.

    Raises:
        PathError: a relative path that exists in neither directory (both are named).
    """
    doc = yaml.safe_load(yaml_text)
    if not isinstance(doc, dict):
        return Resolved(yaml_text)
    notes: list[str] = []
    workdir = doc.get("workdir")
    new_workdir = None
    if _resolvable(workdir):
        new_workdir = _resolve("workdir", workdir, os.path.isdir, cwd, yaml_dir, notes)
    mounts = doc.get("file_mounts")
    new_mounts: dict[str, str] = {}
    if isinstance(mounts, dict):
        for destination, source in mounts.items():
            if _resolvable(source) and localpaths.is_local_source(source):
                label = f"file_mounts {destination}"
                new_mounts[destination] = _resolve(label, source, os.path.exists, cwd, yaml_dir, notes)
    if new_workdir is None and not new_mounts:
        return Resolved(yaml_text, tuple(notes))
    expected = dict(doc)
    if new_workdir is not None:
        expected["workdir"] = new_workdir
    if new_mounts:
        expected["file_mounts"] = {**mounts, **new_mounts}  # type: ignore[dict-item]
    return Resolved(_rewrite(yaml_text, expected, new_workdir, new_mounts, mounts), tuple(notes))


def load(yaml_path: str, *, cwd: str | None = None) -> Resolved:
    """Read a service YAML file with its relative paths resolved (see resolve_paths).

    Raises:
        OSError: the file cannot be read.
        yaml.YAMLError: it is not YAML.
        PathError: a relative path exists in neither place.
    """
    with open(yaml_path, encoding="utf-8") as fh:
        text = fh.read()
    return resolve_paths(text, cwd=cwd or os.getcwd(), yaml_dir=os.path.dirname(os.path.abspath(yaml_path)))


def read_spec(yaml_path: str) -> str:
    """The text of load(yaml_path), for callers that show no notes."""
    return load(yaml_path).text


def spec_name(yaml_path: str) -> str:
    """The `name:` of a service YAML file, or "" if it has none."""
    with open(yaml_path, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    return str(doc.get("name") or "") if isinstance(doc, dict) else ""


def _resolvable(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and bool(value.strip()) and "$" not in value and localpaths.is_relative(value)


def _resolve(label: str, value: str, exists: Any, cwd: str, yaml_dir: str, notes: list[str]) -> str:
    here = os.path.normpath(os.path.join(os.path.abspath(cwd), value))
    beside = os.path.normpath(os.path.join(os.path.abspath(yaml_dir), value))
    if exists(here):
        if beside != here and exists(beside):
            notes.append(
                f"{label} {value!r} is {here} (relative to the current directory, as sky resolves it); "
                f"{beside} next to the YAML is not used"
            )
        return here
    if exists(beside):
        notes.append(f"{label} {value!r} is not in the current directory; using {beside} next to the YAML")
        return beside
    tried = here if beside == here else f"{here} (current directory) and {beside} (next to the YAML)"
    raise PathError(f"{label} {value!r}: no such path; tried {tried}")


def _rewrite(
    text: str,
    expected: dict[str, Any],
    workdir: str | None,
    new_mounts: dict[str, str],
    mounts: Any,
) -> str:
    """The YAML with the new paths, edited line by line when that provably gives `expected`."""
    edited = text
    if workdir is not None:
        # A JSON string is a YAML scalar, so the quoting is always right.
        line = f"workdir: {json.dumps(workdir)}"
        edited, count = _TOP_LEVEL_WORKDIR.subn(lambda _m: line, edited)
        if count != 1:
            edited = ""
    for destination, absolute in new_mounts.items():
        if not edited:
            break
        source = mounts[destination]
        pattern = re.compile(
            rf"^(\s+['\"]?{re.escape(str(destination))}['\"]?\s*:\s*)(['\"]?){re.escape(source)}\2(\s*(#.*)?)$",
            re.MULTILINE,
        )
        edited, count = pattern.subn(_replacer(json.dumps(absolute)), edited)
        if count != 1:
            edited = ""
    if edited and _loads(edited) == expected:
        return edited
    return yaml.safe_dump(expected, sort_keys=False)


def _replacer(value: str) -> Callable[[re.Match[str]], str]:
    return lambda m: f"{m.group(1)}{value}{m.group(3)}"


def _loads(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None

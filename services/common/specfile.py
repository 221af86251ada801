"""Reading a service YAML file the way every client should: relative `workdir` made absolute."""

from __future__ import annotations

import json
import os
import re

import yaml

_TOP_LEVEL_WORKDIR = re.compile(r"^workdir:[^\n]*$", re.MULTILINE)


def resolve_workdir(yaml_text: str, base_dir: str) -> str:
    """Return the YAML with a relative `workdir` made absolute against `base_dir`.

    The provisioner copies `workdir` into each replica's working directory, and its own working
    directory is no guide to where the YAML came from, so a client resolves the path (as
    SkyPilot's CLI does) before sending it. Comments and layout are kept.

    Args:
        yaml_text: the task YAML.
        base_dir: directory relative paths are resolved against (the YAML file's directory).

    Returns:
        The YAML text, unchanged when there is no relative workdir.
    """
    doc = yaml.safe_load(yaml_text)
    workdir = doc.get("workdir") if isinstance(doc, dict) else None
    if not isinstance(workdir, str) or not workdir or os.path.isabs(os.path.expanduser(workdir)):
        return yaml_text
    absolute = os.path.normpath(os.path.join(os.path.abspath(base_dir), workdir))
    # A JSON string is a YAML scalar, so the quoting is always right.
    line = f"workdir: {json.dumps(absolute)}"
    replaced, count = _TOP_LEVEL_WORKDIR.subn(lambda _m: line, yaml_text)
    if count == 1 and yaml.safe_load(replaced).get("workdir") == absolute:
        return replaced
    doc["workdir"] = absolute
    return yaml.safe_dump(doc, sort_keys=False)


def read_spec(yaml_path: str) -> str:
    """Read a service YAML file, with a relative `workdir` resolved against its directory."""
    with open(yaml_path, encoding="utf-8") as fh:
        return resolve_workdir(fh.read(), os.path.dirname(os.path.abspath(yaml_path)))


def spec_name(yaml_path: str) -> str:
    """The `name:` of a service YAML file, or "" if it has none."""
    with open(yaml_path, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    return str(doc.get("name") or "") if isinstance(doc, dict) else ""

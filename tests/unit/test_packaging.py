"""`pip install -e '.[dev]'` installs what `make setup` installs from requirements-dev.txt."""

from __future__ import annotations

import os
import tomllib

from packaging import requirements, utils

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pinned(path: str) -> dict[str, requirements.Requirement]:
    """Every requirement of a requirements file and the files it includes with -r, by name."""
    found: dict[str, requirements.Requirement] = {}
    with open(path, encoding="utf-8") as fh:
        for raw in fh:
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if line.startswith("-r "):
                found |= pinned(os.path.join(os.path.dirname(path), line[3:].strip()))
                continue
            req = requirements.Requirement(line)
            found[utils.canonicalize_name(req.name)] = req
    return found


def project() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)["project"]


def extra(name: str) -> list[requirements.Requirement]:
    """The requirements of one extra, with self-references (replicaplane[x]) expanded."""
    extras = project().get("optional-dependencies", {})
    assert name in extras, f"pyproject.toml has no {name!r} extra"
    out = []
    for line in extras[name]:
        req = requirements.Requirement(line)
        if utils.canonicalize_name(req.name) == "replicaplane":
            for included in sorted(req.extras):
                out += extra(included)
        else:
            out.append(req)
    return out


def test_dev_extra_installs_every_pin_of_requirements_dev_at_the_same_version() -> None:
    pins = pinned(os.path.join(REPO, "requirements-dev.txt"))
    runtime = {utils.canonicalize_name(r.name): r for r in map(requirements.Requirement, project()["dependencies"])}
    dev = {utils.canonicalize_name(r.name): r for r in extra("dev")}
    missing = sorted(set(pins) - set(dev) - set(runtime))
    assert not missing, f"in requirements-dev.txt but not installed by .[dev]: {missing}"
    for name, req in dev.items():
        assert name in pins, f"{name} is in the dev extra but not pinned in requirements-dev.txt"
        assert str(req.specifier) == str(pins[name].specifier), f"{name}: dev extra {req}, requirements {pins[name]}"
    for name, req in runtime.items():
        # The runtime dependencies stay ranges for users; the pins CI tests must fall inside them.
        version = next(iter(pins[name].specifier)).version
        assert req.specifier.contains(version), f"{name}: requirements pin {version}, pyproject allows {req.specifier}"

"""What a backend can run: accelerators it offers and local paths it can copy.

A spec this provisioner cannot run is refused when the service is created, naming the field,
rather than launched, failed and retried (and its `setup` run on the wrong host).
"""

from __future__ import annotations

import dataclasses
import os
import re

from services.common import errors

_ITEM = re.compile(r"([A-Za-z][\w.-]*)(?::(\d+(?:\.\d+)?))?")


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a spec asks of the backend.

    Attributes:
        accelerators: (field path, "NAME:COUNT[,NAME:COUNT...]") per place the spec names
            accelerators; a comma list is a set of alternatives, any one will do.
        alternatives: whether the spec lists any_of/ordered resources, of which any one will do.
        workdir: the local directory to copy; empty for none.
        file_mounts: destination -> source.
    """

    accelerators: tuple[tuple[str, str], ...] = ()
    alternatives: bool = False
    workdir: str = ""
    file_mounts: tuple[tuple[str, str], ...] = ()


def parse_offered(text: str) -> dict[str, float]:
    """Parses an `accelerators` setting such as "A100:8,H100:8" (a bare name offers one).

    Raises:
        ValueError: an item is not NAME or NAME:COUNT.
    """
    offered: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _ITEM.fullmatch(item)
        if match is None:
            raise ValueError(f"{item!r} is not NAME or NAME:COUNT")
        offered[match.group(1).lower()] = float(match.group(2) or 1)
    return offered


def _wanted(text: str) -> list[tuple[str, float]]:
    wanted = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _ITEM.fullmatch(item)
        if match is not None:
            wanted.append((match.group(1).lower(), float(match.group(2) or 1)))
    return wanted


def _satisfied(text: str, offered: dict[str, float]) -> bool:
    return any(offered.get(name, 0.0) >= count for name, count in _wanted(text))


def accelerator_problems(needs: Needs, offered: dict[str, float] | None) -> list[errors.FieldViolation]:
    """Violations when no acceptable accelerator choice is offered; `offered` None is no limit."""
    if offered is None or not needs.accelerators:
        return []
    runnable = [_satisfied(text, offered) for _, text in needs.accelerators]
    if any(runnable) if needs.alternatives else all(runnable):
        return []
    have = ", ".join(f"{name.upper()}:{count:g}" for name, count in sorted(offered.items())) or "none"
    return [
        errors.FieldViolation(path, f"this provisioner's backend does not offer {text} (it offers: {have})")
        for (path, text), ok in zip(needs.accelerators, runnable, strict=True)
        if not ok
    ]


def path_problems(needs: Needs) -> list[errors.FieldViolation]:
    """Violations for a workdir or local file mount source this machine does not have."""
    problems = []
    if needs.workdir and not os.path.isdir(os.path.expanduser(needs.workdir)):
        problems.append(errors.FieldViolation("workdir", "no such directory on the provisioner's host"))
    for destination, source in needs.file_mounts:
        if source.lstrip().startswith("{") or "://" in source:
            continue  # storage mappings and URIs are not local paths
        if not os.path.exists(os.path.expanduser(source)):
            problems.append(
                errors.FieldViolation(f"file_mounts.{destination}", "no such source path on the provisioner's host")
            )
    return problems

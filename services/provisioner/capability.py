"""What a backend can run: accelerators it offers and local paths it can copy.

A spec this provisioner cannot run is refused when the service is created, naming the field,
rather than launched, failed and retried (and its `setup` run on the wrong host).
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from collections.abc import Callable

from services.common import errors, localpaths
from services.provisioner import copies

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


def accelerator_problems(
    needs: Needs, offered: dict[str, float] | None, *, hint: Callable[[str], str] | None = None
) -> list[errors.FieldViolation]:
    """Violations when no acceptable accelerator choice is offered; `offered` None is no limit.

    Args:
        needs: what the spec asks for.
        offered: accelerator name (lowercase) -> count a replica may have; None: no limit.
        hint: turns one asked-for choice ("A100:1") into a sentence on how to run it here anyway.
    """
    if offered is None or not needs.accelerators:
        return []
    runnable = [_satisfied(text, offered) for _, text in needs.accelerators]
    if any(runnable) if needs.alternatives else all(runnable):
        return []
    have = ", ".join(f"{name.upper()}:{count:g}" for name, count in sorted(offered.items())) or "none"
    out = []
    for (path, text), ok in zip(needs.accelerators, runnable, strict=True):
        if ok:
            continue
        description = f"this provisioner's backend does not offer {text} (it offers: {have})"
        first = _wanted(text)
        if hint is not None and first:
            name, count = first[0]
            description += f"; {hint(f'{name.upper()}:{count:g}')}"
        out.append(errors.FieldViolation(path, description))
    return out


def relative_problems(needs: Needs) -> list[errors.FieldViolation]:
    """Violations for a relative workdir or local file mount source (the API takes absolute paths only)."""
    return localpaths.relative_problems(needs.workdir, dict(needs.file_mounts))


def path_problems(
    needs: Needs,
    *,
    state_dir: str = "",
    limits: copies.Limits | None = None,
    budget_s: float = 2.0,
    cancel: threading.Event | None = None,
) -> list[errors.FieldViolation]:
    """Violations for local paths this machine cannot copy into a replica.

    A workdir or local file mount source that is missing, holds the state dir or lies inside it,
    or (with `limits`) is too large to copy. Relative paths are left to relative_problems. The
    size is only counted for `budget_s` seconds; a launch enforces it anyway.

    Args:
        needs: what the spec asks for.
        state_dir: the provisioner's state dir; "" skips that check.
        limits: what one replica's copies may take; None skips the size check.
        budget_s: how long counting sizes may take.
        cancel: set to stop counting early.
    """
    problems = []
    sources: list[tuple[str, str]] = []
    if needs.workdir and not localpaths.is_relative(needs.workdir):
        path = os.path.expanduser(needs.workdir)
        if not os.path.isdir(path):
            problems.append(errors.FieldViolation("workdir", f"no such directory on the provisioner's host: {path}"))
        else:
            sources.append(("workdir", path))
    for destination, source in needs.file_mounts:
        if not localpaths.is_local_source(source) or localpaths.is_relative(source):
            continue  # storage mappings and URIs are not local paths; relative ones are refused elsewhere
        path = os.path.expanduser(source)
        field = f"file_mounts.{destination}"
        if not os.path.exists(path):
            problems.append(errors.FieldViolation(field, f"no such source path on the provisioner's host: {path}"))
        else:
            sources.append((field, path))
    if state_dir:
        for field, path in sources:
            if why := copies.overlap(path, state_dir):
                problems.append(errors.FieldViolation(field, why))
    if limits is not None and sources and not problems:
        budget = copies.Budget(limits, cancel or threading.Event())
        deadline = time.monotonic() + budget_s
        try:
            for field, path in sources:
                if not copies.measure(field, path, budget, deadline=deadline):
                    break
        except copies.TooLargeError as exc:
            problems.append(errors.FieldViolation(exc.label, exc.reason))
        except (copies.CancelledCopyError, OSError):
            pass  # the launch finds out for itself
    return problems

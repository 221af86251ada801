"""Extension points of the controller core: small lists of callbacks other parts attach to.

Observers (metrics, events) are called on the event loop and must not block or raise; an
exception is logged and the others still run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Hooks:
    """Callbacks the core calls.

    Attributes:
        on_pass: (service, seconds) after each pass of a service's loop.
        on_commit: (service, rows written, seconds from submit to stored) after each stored batch.
        on_launch: (service, replica id) when a new replica is scheduled.
        on_teardown: (service, replica id, reason) when a teardown is decided.
        on_failure: (service, replica id, failures.Failure) when a replica fails.
    """

    on_pass: list[Callable[[str, float], None]] = dataclasses.field(default_factory=list)
    on_commit: list[Callable[[str, int, float], None]] = dataclasses.field(default_factory=list)
    on_launch: list[Callable[[str, int], None]] = dataclasses.field(default_factory=list)
    on_teardown: list[Callable[[str, int, str], None]] = dataclasses.field(default_factory=list)
    on_failure: list[Callable[[str, int, Any], None]] = dataclasses.field(default_factory=list)

    def call(self, name: str, *args: Any) -> None:
        for fn in getattr(self, name):
            try:
                fn(*args)
            except Exception:
                log.exception("a %s hook failed", name)

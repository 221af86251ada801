"""The controller's replica budget (`max_replicas_total`): what each service holds, with the
sum kept in step as services change (every create checks it against all the others), and the
reservations of creates and updates still being stored."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Protocol

from replicaplane.common.v1 import spec_pb2
from services.controller import admission


class Holder(Protocol):
    def most_replicas(self) -> int: ...

    def reserved_replicas(self) -> int: ...


class Budget:
    """What the services hold of `limit`, summed.

    A service tells `touched(name)` whenever what it holds may have changed (a record added or
    torn down, a new version, a delete, the service gone); the sum is brought up to date for
    those services only, when next read. A create or an update reserves what its spec may run
    from its check until its call ends (stored or failed): calls checked while another is being
    stored see its reservation, so two cannot both take the last replicas.
    """

    def __init__(self, services: Mapping[str, Holder], limit: int) -> None:
        self._services = services
        self.limit = limit
        self._held: dict[str, int] = {}
        self._total = 0
        self._changed: set[str] = set()
        self._pending: dict[object, tuple[str, int]] = {}

    def touched(self, name: str) -> None:
        self._changed.add(name)

    def held(self) -> int:
        """What the services hold now, summed."""
        changed, self._changed = self._changed, set()
        for name in changed:
            service = self._services.get(name)
            now = 0 if service is None else service.reserved_replicas()
            self._total += now - self._held.pop(name, 0)
            if service is not None:
                self._held[name] = now
        return self._total

    @contextlib.contextmanager
    def reserve(self, name: str, parsed: spec_pb2.ServiceSpec) -> Iterator[None]:
        """Check `parsed` for service `name` against the budget and hold what it may run until
        the block ends.

        Raises:
            errors.ResourceExhaustedError: `admission.check_budget`'s refusal.
        """
        current = self._services.get(name)
        others = self.held() - self._held.get(name, 0)
        others += sum(count for other, count in self._pending.values() if other != name)
        want = admission.check_budget(
            name,
            parsed,
            limit=self.limit,
            current_most=None if current is None else current.most_replicas(),
            others=others,
        )
        token = object()
        self._pending[token] = (name, want)
        try:
            yield
        finally:
            del self._pending[token]

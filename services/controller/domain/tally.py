"""Replica views by id with their counts kept as records change, so what a service shows (its
status, ready/total, active versions) and what a pass needs (the torn-down records, the records
still held) cost nothing per pass however many replicas the service has. Plain Python."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, ValuesView

from services.controller.domain import status as st


class Views:
    """`ReplicaView`s by replica id, and counts over them kept in step with every change."""

    def __init__(self, items: Iterable[tuple[int, st.ReplicaView, bool]] = ()) -> None:
        """Args:
        items: (replica id, view, torn down) of each record.
        """
        self._views: dict[int, st.ReplicaView] = {}
        self.statuses: collections.Counter[st.ReplicaStatus] = collections.Counter()
        """How many replicas are in each status."""
        self.ready_by_version: collections.Counter[int] = collections.Counter()
        """How many READY replicas each version has."""
        self.torn_down: dict[int, int] = {}
        """Replica id -> version of each record whose teardown finished."""
        for rid, view, torn_down in items:
            self.set(rid, view, torn_down=torn_down)

    def set(self, rid: int, view: st.ReplicaView, *, torn_down: bool = False) -> None:
        """Add or replace the view of `rid`; `torn_down`: its teardown finished."""
        self._uncount(rid)
        self._views[rid] = view
        self.statuses[view.status] += 1
        if view.status is st.ReplicaStatus.READY:
            self.ready_by_version[view.version] += 1
        if torn_down:
            self.torn_down[rid] = view.version

    def pop(self, rid: int) -> st.ReplicaView | None:
        """Remove `rid`; its view, or None if it had none."""
        self._uncount(rid)
        return self._views.pop(rid, None)

    def _uncount(self, rid: int) -> None:
        old = self._views.get(rid)
        if old is None:
            return
        self.statuses[old.status] -= 1
        if not self.statuses[old.status]:
            del self.statuses[old.status]
        if old.status is st.ReplicaStatus.READY:
            self.ready_by_version[old.version] -= 1
            if not self.ready_by_version[old.version]:
                del self.ready_by_version[old.version]
        self.torn_down.pop(rid, None)

    @property
    def held(self) -> int:
        """Records whose teardown has not finished (what the service still holds)."""
        return len(self._views) - len(self.torn_down)

    def get(self, rid: int) -> st.ReplicaView | None:
        return self._views.get(rid)

    def __getitem__(self, rid: int) -> st.ReplicaView:
        return self._views[rid]

    def __contains__(self, rid: object) -> bool:
        return rid in self._views

    def __len__(self) -> int:
        return len(self._views)

    def __iter__(self) -> Iterator[int]:
        return iter(self._views)

    def values(self) -> ValuesView[st.ReplicaView]:
        return self._views.values()

"""Fan-out of service changes to watchers, with sequence numbers for resumable streams."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2

_HISTORY = 1024
_QUEUE_LIMIT = 10_000


class _Closed(Exception):
    pass


class ServiceHub:
    """Per-service change log and subscribers.

    Sequences start at the creation time in microseconds, so a client resuming after a
    controller restart never mistakes new changes for old ones: its number is simply too old
    for the new history and it gets a fresh snapshot.
    """

    def __init__(self) -> None:
        self.sequence = int(time.time() * 1_000_000)
        self._history: collections.deque[api.WatchServiceResponse] = collections.deque(maxlen=_HISTORY)
        self._subscribers: set[asyncio.Queue[api.WatchServiceResponse | None]] = set()
        self.endpoints_version = self.sequence
        self.endpoints: list[resources_pb2.Endpoint] = []
        self._endpoint_subscribers: set[asyncio.Queue[api.WatchEndpointsResponse | None]] = set()
        self.deleted = False

    def publish(
        self,
        service: resources_pb2.Service,
        replicas: list[resources_pb2.Replica],
        removed_ids: list[int],
        *,
        deleted: bool = False,
    ) -> None:
        """Record a change and push it to every watcher."""
        self.sequence += 1
        msg = api.WatchServiceResponse(
            sequence=self.sequence,
            service=service,
            replicas=replicas,
            removed_replica_ids=removed_ids,
            deleted=deleted,
        )
        self._history.append(msg)
        for q in list(self._subscribers):
            self._offer(q, msg)
        if deleted:
            self.close()

    def set_endpoints(self, endpoints: list[resources_pb2.Endpoint]) -> None:
        """Push the endpoint set if it changed."""
        if endpoints == self.endpoints:
            return
        self.endpoints = endpoints
        self.endpoints_version += 1
        msg = api.WatchEndpointsResponse(version=self.endpoints_version, endpoints=endpoints)
        for q in list(self._endpoint_subscribers):
            self._offer(q, msg)

    def close(self) -> None:
        """The service is gone: end every stream after what was sent."""
        self.deleted = True
        msg = api.WatchEndpointsResponse(version=self.endpoints_version + 1, deleted=True)
        for eq in list(self._endpoint_subscribers):
            self._offer(eq, msg)
            eq.put_nowait(None)
        for sq in list(self._subscribers):
            sq.put_nowait(None)

    @staticmethod
    def _offer(q: asyncio.Queue[Any], msg: object) -> None:
        # A watcher that cannot keep up is cut off (it resumes with a snapshot) instead of
        # growing memory without bound.
        if q.qsize() >= _QUEUE_LIMIT:
            q.put_nowait(None)
        else:
            q.put_nowait(msg)

    async def watch(
        self, after_sequence: int, snapshot: Callable[[], api.WatchServiceResponse]
    ) -> AsyncIterator[api.WatchServiceResponse]:
        """Yield a snapshot (or the missed changes after `after_sequence`), then live changes."""
        q: asyncio.Queue[api.WatchServiceResponse | None] = asyncio.Queue()
        self._subscribers.add(q)
        try:
            oldest = self._history[0].sequence if self._history else self.sequence + 1
            if after_sequence and oldest - 1 <= after_sequence <= self.sequence:
                backlog = [m for m in self._history if m.sequence > after_sequence]
            else:
                first = snapshot()
                first.sequence = self.sequence
                first.snapshot = True
                first.deleted = self.deleted  # a watcher that arrives as the service goes
                backlog = [first]
            last = after_sequence
            for msg in backlog:
                last = msg.sequence
                yield msg
            while True:
                if self.deleted and q.empty():
                    return  # the end was in the snapshot, or already sent from the queue
                change = await q.get()
                if change is None:
                    return
                if change.sequence <= last:
                    continue
                last = change.sequence
                yield change
                if change.deleted:
                    return
        finally:
            self._subscribers.discard(q)

    async def watch_endpoints(self, after_version: int) -> AsyncIterator[api.WatchEndpointsResponse]:
        """Yield the endpoint set now (unless the client has it), then every change."""
        q: asyncio.Queue[api.WatchEndpointsResponse | None] = asyncio.Queue()
        self._endpoint_subscribers.add(q)
        try:
            if after_version != self.endpoints_version:
                yield api.WatchEndpointsResponse(version=self.endpoints_version, endpoints=self.endpoints)
            if self.deleted:
                yield api.WatchEndpointsResponse(version=self.endpoints_version + 1, deleted=True)
                return
            while True:
                msg = await q.get()
                if msg is None:
                    return
                yield msg
                if msg.deleted:
                    return
        finally:
            self._endpoint_subscribers.discard(q)

"""Fan-out of service changes to watchers, with sequence numbers for resumable streams."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Generic, TypeVar

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2
from services.common import errors

log = logging.getLogger(__name__)

_HISTORY = 1024
HISTORY_ITEMS = 200_000
"""Endpoints and replicas held by one service's change history at most (about 40 MB): each change
carries the whole `Service`, so at 10,000 READY replicas 1,024 changes held 10 million
endpoints. A watcher resuming from a change no longer held gets a snapshot, as after 1,024."""
QUEUE_LIMIT = 10_000
"""Messages queued for one watcher at most. A watcher that falls further behind (it stopped
reading, or reads slower than the service changes) is dropped and told where to resume."""

_Msg = TypeVar("_Msg")


class _Dropped(Exception):
    pass


class _Watcher(Generic[_Msg]):
    """The queue of one stream. Dropping it frees the queue at once, although the stream's
    generator may stay parked in a `yield` until its client reads again."""

    def __init__(self) -> None:
        self.items: collections.deque[_Msg] = collections.deque()
        self.wakeup = asyncio.Event()
        self.closed = False  # end after what is queued
        self.dropped = False

    def offer(self, msg: _Msg) -> bool:
        """Queue `msg`; False (and the watcher dropped) when it is QUEUE_LIMIT behind."""
        if len(self.items) >= QUEUE_LIMIT:
            self.items.clear()
            self.dropped = True
            self.wakeup.set()
            return False
        self.items.append(msg)
        self.wakeup.set()
        return True

    def close(self) -> None:
        self.closed = True
        self.wakeup.set()

    async def next(self) -> _Msg | None:
        """The next message; None once closed and drained.

        Raises:
            _Dropped: the watcher fell QUEUE_LIMIT messages behind.
        """
        while not self.items:
            if self.dropped:
                raise _Dropped
            if self.closed:
                return None
            self.wakeup.clear()
            await self.wakeup.wait()
        if self.dropped:
            raise _Dropped
        return self.items.popleft()


class ServiceHub:
    """Per-service change log and subscribers.

    Sequences start at the creation time in microseconds, so a client resuming after a
    controller restart never mistakes new changes for old ones: its number is simply too old
    for the new history and it gets a fresh snapshot.
    """

    def __init__(self) -> None:
        self.sequence = int(time.time() * 1_000_000)
        self._history: collections.deque[tuple[api.WatchServiceResponse, int]] = collections.deque()
        self._history_items = 0
        self._subscribers: set[_Watcher[api.WatchServiceResponse]] = set()
        self.endpoints_version = self.sequence
        self.endpoints: Sequence[resources_pb2.Endpoint] = []
        self._endpoints_key: int | None = None
        self._endpoints_template: api.WatchEndpointsResponse | None = None
        self.weights: dict[int, int] = {}
        self._endpoint_subscribers: set[_Watcher[api.WatchEndpointsResponse]] = set()
        self.deleted = False
        self._observers: list[Callable[[api.WatchServiceResponse], None]] = []

    def observe(self, observer: Callable[[api.WatchServiceResponse], None]) -> None:
        """Call `observer` with every change published from now on (metrics, traces). It runs
        inside `publish`, so it must be quick; what it raises is logged, never passed on."""
        self._observers.append(observer)

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
        self._keep(msg)
        for observer in self._observers:
            try:
                observer(msg)
            except Exception:
                log.exception("a hub observer failed on a change of %s", service.name)
        for w in list(self._subscribers):
            if not w.offer(msg):
                self._subscribers.discard(w)
                log.warning("dropped a WatchService stream of %s: %d changes behind", service.name, QUEUE_LIMIT)
        if deleted:
            self.close()

    def _keep(self, msg: api.WatchServiceResponse) -> None:
        items = 1 + len(msg.service.endpoints) + len(msg.replicas)
        self._history.append((msg, items))
        self._history_items += items
        while len(self._history) > 1 and (len(self._history) > _HISTORY or self._history_items > HISTORY_ITEMS):
            self._history_items -= self._history.popleft()[1]

    def set_endpoints(
        self,
        endpoints: Sequence[resources_pb2.Endpoint],
        weights: dict[int, int] | None = None,
        *,
        key: int | None = None,
        message: api.WatchEndpointsResponse | None = None,
    ) -> None:
        """Push the endpoint set (and the traffic split by version, during a canary) if it changed.

        Args:
            endpoints: the endpoints.
            weights: version -> weight during a canary.
            key: a number that changes whenever the endpoints do (then they are not compared).
            message: a `WatchEndpointsResponse` holding `endpoints` alone, copied into each
                message sent (one C-level copy, instead of one call per endpoint).
        """
        weights = weights or {}
        same = key == self._endpoints_key if key is not None else endpoints == self.endpoints
        if same and weights == self.weights:
            return
        self.endpoints = endpoints
        self._endpoints_key = key
        self._endpoints_template = message
        self.weights = weights
        self.endpoints_version += 1
        if not self._endpoint_subscribers:
            return
        msg = self._endpoints_message()
        for w in list(self._endpoint_subscribers):
            if not w.offer(msg):
                self._endpoint_subscribers.discard(w)
                log.warning("dropped a WatchEndpoints stream that fell %d versions behind", QUEUE_LIMIT)

    def _endpoints_message(self) -> api.WatchEndpointsResponse:
        msg = api.WatchEndpointsResponse()
        if self._endpoints_template is not None:
            msg.MergeFrom(self._endpoints_template)
        else:
            msg.endpoints.extend(self.endpoints)
        msg.version = self.endpoints_version
        msg.version_weights.extend(
            resources_pb2.VersionWeight(version=v, weight=w) for v, w in sorted(self.weights.items())
        )
        return msg

    def close(self) -> None:
        """The service is gone: end every stream after what was sent."""
        self.deleted = True
        msg = api.WatchEndpointsResponse(version=self.endpoints_version + 1, deleted=True)
        for ew in list(self._endpoint_subscribers):
            ew.offer(msg)
            ew.close()
        for sw in list(self._subscribers):
            sw.close()

    @property
    def watchers(self) -> int:
        """Live WatchService and WatchEndpoints streams."""
        return len(self._subscribers) + len(self._endpoint_subscribers)

    def queued(self) -> int:
        """Messages waiting in the queues of every live watcher."""
        return sum(len(w.items) for w in self._subscribers) + sum(len(w.items) for w in self._endpoint_subscribers)

    async def watch(
        self, after_sequence: int, snapshot: Callable[[], api.WatchServiceResponse]
    ) -> AsyncIterator[api.WatchServiceResponse]:
        """Yield a snapshot (or the missed changes after `after_sequence`), then live changes.

        Raises:
            errors.ResourceExhaustedError: the watcher fell QUEUE_LIMIT changes behind; the
                message and metadata name the `after_sequence` to resume from.
        """
        w: _Watcher[api.WatchServiceResponse] = _Watcher()
        self._subscribers.add(w)
        last = after_sequence
        try:
            oldest = self._history[0][0].sequence if self._history else self.sequence + 1
            if after_sequence and oldest - 1 <= after_sequence <= self.sequence:
                backlog = [m for m, _ in self._history if m.sequence > after_sequence]
            else:
                first = snapshot()
                first.sequence = self.sequence
                first.snapshot = True
                first.deleted = self.deleted  # a watcher that arrives as the service goes
                backlog = [first]
            for msg in backlog:
                yield msg
                last = msg.sequence
            while True:
                if self.deleted and not w.items and not w.dropped:
                    return  # the end was in the snapshot, or already sent from the queue
                change = await w.next()
                if change is None:
                    return
                if change.sequence <= last:
                    continue
                yield change
                last = change.sequence
                if change.deleted:
                    return
        except _Dropped:
            raise errors.ResourceExhaustedError(
                f"this watch fell more than {QUEUE_LIMIT} changes behind and was dropped; "
                f"call WatchService again with after_sequence={last} to resume",
                reason="WATCH_FELL_BEHIND",
                after_sequence=last,
                queue_limit=QUEUE_LIMIT,
            ) from None
        finally:
            self._subscribers.discard(w)
            w.items.clear()

    async def watch_endpoints(self, after_version: int) -> AsyncIterator[api.WatchEndpointsResponse]:
        """Yield the endpoint set now (unless the client has it), then every change.

        Raises:
            errors.ResourceExhaustedError: the watcher fell QUEUE_LIMIT versions behind; the
                message and metadata name the `after_version` to resume from.
        """
        w: _Watcher[api.WatchEndpointsResponse] = _Watcher()
        self._endpoint_subscribers.add(w)
        last = after_version
        try:
            if after_version != self.endpoints_version:
                current = self._endpoints_message()
                yield current
                last = current.version
            if self.deleted:
                yield api.WatchEndpointsResponse(version=self.endpoints_version + 1, deleted=True)
                return
            while True:
                msg = await w.next()
                if msg is None:
                    return
                yield msg
                last = msg.version
                if msg.deleted:
                    return
        except _Dropped:
            raise errors.ResourceExhaustedError(
                f"this watch fell more than {QUEUE_LIMIT} versions behind and was dropped; "
                f"call WatchEndpoints again with after_version={last} to resume",
                reason="WATCH_FELL_BEHIND",
                after_version=last,
                queue_limit=QUEUE_LIMIT,
            ) from None
        finally:
            self._endpoint_subscribers.discard(w)
            w.items.clear()

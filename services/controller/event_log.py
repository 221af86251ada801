"""Every service's event log: recorded from published changes and controller actions, kept in
the store, listed and streamed (ListEvents, WatchEvents).

The log in memory is the one served; the store keeps a copy for restarts. Writes go through a
thread with its own store connection, so the event loop never waits for the store's lock; a
crash may lose the last events written in the moment before it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors, pagetoken, pbtime
from services.controller import hub, store
from services.controller.domain import events as ev

log = logging.getLogger(__name__)

_MAX_PAGE = 1000
# How many writes wait for the writer thread at most; beyond, events are kept in memory only.
_WRITE_BACKLOG = 10_000
# How long the writer gathers events before it writes them, so a burst (a scale-up of a thousand
# replicas) takes a few transactions instead of one each.
_BATCH_S = 0.2

Draft = ev.Draft
NORMAL = ev.EventType.NORMAL
WARNING = ev.EventType.WARNING


def to_proto(service: str, entry: ev.Entry) -> res.Event:
    """An entry as the API's Event."""
    return res.Event(
        sequence=entry.sequence,
        service_name=service,
        type=int(entry.draft.type),  # type: ignore[arg-type]
        reason=entry.draft.reason,
        message=entry.draft.message,
        object=entry.draft.object,
        count=entry.count,
        first_time=pbtime.timestamp(entry.first_time),
        last_time=pbtime.timestamp(entry.last_time),
    )


def from_proto(event: res.Event) -> ev.Entry:
    """A stored Event as an entry."""
    draft = ev.Draft(ev.EventType(event.type or 1), event.reason, event.message, event.object)
    return ev.Entry(
        event.sequence,
        draft,
        event.count,
        pbtime.from_timestamp(event.first_time),
        pbtime.from_timestamp(event.last_time),
    )


class _Writer:
    """A thread that writes event batches through its own store connection."""

    def __init__(self, connect: Callable[[], store.Store]) -> None:
        self._connect = connect  # called on the writer thread, at its first batch
        self._queue: queue.Queue[tuple[str, res.Event, int | None] | None] = queue.Queue(_WRITE_BACKLOG)
        self._closing = threading.Event()  # ends a batch window at once: a stop writes what is left
        self._thread = threading.Thread(target=self._run, name="event writer", daemon=True)
        self._thread.start()

    def put(self, service: str, event: res.Event, replaced: int | None) -> None:
        try:
            self._queue.put_nowait((service, event, replaced))
        except queue.Full:
            log.warning("event writer is behind; an event of %s is kept in memory only", service)

    def close(self) -> None:
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        db: store.Store | None = None
        try:
            while True:
                item = self._queue.get()
                if item is not None:
                    self._closing.wait(_BATCH_S)  # gather what follows: one transaction for a burst
                batch = [item]
                while item is not None and not self._queue.empty() and len(batch) < 2000:
                    item = self._queue.get_nowait()
                    batch.append(item)
                by_service: dict[str, tuple[list[res.Event], list[int]]] = {}
                for entry in batch:
                    if entry is None:
                        continue
                    events, replaced = by_service.setdefault(entry[0], ([], []))
                    events.append(entry[1])
                    if entry[2] is not None:
                        replaced.append(entry[2])
                if by_service:
                    if db is None:
                        db = self._connect()
                    for service, (events, replaced) in by_service.items():
                        try:
                            db.put_events(service, events, replaced=replaced)
                        except errors.UnavailableError:
                            log.warning("could not keep %d events of %s in the store", len(events), service)
                if batch[-1] is None:
                    return
        except Exception:
            log.exception("the event writer stopped; events are kept in memory only")
        finally:
            if db is not None:
                db.close()


class Events:
    """The event logs of every service."""

    def __init__(self, *, db: store.Store, clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._clock = clock
        self._logs: dict[str, ev.EventLog] = {}
        self._watchers: dict[str, set[hub._Watcher[res.Event]]] = {}
        # What the last published change said, to tell what a new one changes.
        self._replicas: dict[str, dict[int, tuple[str, int]]] = {}
        self._service: dict[str, tuple[str, int, int]] = {}  # status message, target, status
        # Events need no fsync each; the connection checks the leader's lease epoch like every
        # other write, so a deposed leader's last events are not kept.
        self._writer = _Writer(lambda: db.reopen(synchronous="NORMAL"))

    def close(self) -> None:
        """Finish writing; end every stream."""
        self._writer.close()
        for name in list(self._watchers):
            self._close_watchers(name)

    def open(self, name: str, replicas: dict[int, res.Replica], service: res.Service | None = None) -> None:
        """Start a service's log from the store (after a restart) or empty (a new service).

        Args:
            name: the service.
            replicas: its replica records as they are now (changes from them are events).
            service: the service as it is now, after a restart.
        """
        stored = []
        if service is not None:  # a new service has none stored yet
            try:
                stored = [from_proto(e) for e in self._db.list_events(name)]
            except errors.UnavailableError:
                pass
        self._logs[name] = ev.EventLog(stored)
        self._watchers.setdefault(name, set())
        self._replicas[name] = {
            rid: (res.ReplicaStatus.Name(r.status).removeprefix("REPLICA_STATUS_"), r.version)
            for rid, r in replicas.items()
        }
        if service is not None:
            self._service[name] = (service.status_message, service.autoscaler.target_replicas, service.status)

    def forget(self, name: str) -> None:
        """The service is gone: drop its log and end its streams."""
        self._logs.pop(name, None)
        self._replicas.pop(name, None)
        self._service.pop(name, None)
        self._close_watchers(name)
        self._watchers.pop(name, None)

    def _close_watchers(self, name: str) -> None:
        for w in list(self._watchers.get(name, ())):
            w.close()

    def record(self, name: str, draft: ev.Draft) -> res.Event | None:
        """Add an occurrence to a service's log; None if the service has no log."""
        log_ = self._logs.get(name)
        if log_ is None:
            return None
        entry, replaced = log_.record(draft, self._clock())
        event = to_proto(name, entry)
        self._writer.put(name, event, replaced)
        for w in list(self._watchers.get(name, ())):
            if not w.offer(event):
                self._watchers[name].discard(w)
        return event

    def observe(self, change: api.WatchServiceResponse) -> None:
        """Record the events of one published change of a service (a hub observer)."""
        service, replicas, removed = change.service, change.replicas, change.removed_replica_ids
        name = service.name
        if name not in self._logs:
            return
        seen = self._replicas.setdefault(name, {})
        for r in replicas:
            status = res.ReplicaStatus.Name(r.status).removeprefix("REPLICA_STATUS_")
            before = seen.get(r.replica_id)
            seen[r.replica_id] = (status, r.version)
            draft = ev.replica_change(
                r.replica_id,
                r.version,
                None if before is None else before[0],
                status,
                failure_reason=r.failure_reason,
            )
            if draft is not None:
                self.record(name, draft)
        for rid in removed:
            gone = seen.pop(rid, None)
            if gone is not None:
                draft = ev.replica_change(rid, gone[1], gone[0], None)
                if draft is not None:
                    self.record(name, draft)
        target = service.autoscaler.target_replicas
        before_service = self._service.get(name)
        self._service[name] = (service.status_message, target, service.status)
        shutting = res.SERVICE_STATUS_SHUTTING_DOWN
        if service.status == shutting and (before_service is None or before_service[2] != shutting):
            self.record(name, ev.Draft(NORMAL, "DeleteRequested", "tearing down every replica"))
        for draft in ev.service_change(
            before_message="" if before_service is None else before_service[0],
            after_message=service.status_message,
            before_target=None if before_service is None else before_service[1],
            after_target=target,
            decision=service.autoscaler.last_decision_reason,
        ):
            self.record(name, draft)

    def list(self, name: str, page_size: int, page_token: str) -> tuple[list[res.Event], str]:
        """A page of a service's events, oldest first.

        Raises:
            errors.ValidationError: a negative `page_size` or a bad `page_token`.
            errors.NotFoundError: no such service.
        """
        if page_size < 0:
            raise errors.ValidationError([errors.FieldViolation("page_size", f"must be >= 0, got {page_size}")])
        after = int(pagetoken.decode(page_token, "events", name, position_type=int)) if page_token else 0
        entries = self._log(name).entries(after)
        size = min(page_size or 100, _MAX_PAGE)
        page = entries[:size]
        token = pagetoken.encode("events", name, page[-1].sequence) if len(entries) > size else ""
        return [to_proto(name, e) for e in page], token

    async def watch(self, name: str, after_sequence: int) -> AsyncIterator[res.Event]:
        """Events after `after_sequence` still in the log, then each new one.

        Raises:
            errors.NotFoundError: no such service.
            errors.ResourceExhaustedError: the stream fell too far behind; resume from the
                sequence in its metadata.
        """
        log_ = self._log(name)
        w: hub._Watcher[res.Event] = hub._Watcher()
        self._watchers[name].add(w)
        last = after_sequence
        try:
            for entry in log_.entries(after_sequence):
                event = to_proto(name, entry)
                yield event
                last = event.sequence
            while True:
                event_or_none = await w.next()
                if event_or_none is None:
                    return
                if event_or_none.sequence <= last:
                    continue
                yield event_or_none
                last = event_or_none.sequence
        except hub._Dropped:
            raise errors.ResourceExhaustedError(
                f"this watch fell more than {hub.QUEUE_LIMIT} events behind and was dropped; "
                f"call WatchEvents again with after_sequence={last} to resume",
                reason="WATCH_FELL_BEHIND",
                after_sequence=last,
                queue_limit=hub.QUEUE_LIMIT,
            ) from None
        finally:
            self._watchers.get(name, set()).discard(w)
            w.items.clear()

    def _log(self, name: str) -> ev.EventLog:
        log_ = self._logs.get(name)
        if log_ is None:
            raise errors.NotFoundError(f"service {name!r} not found", reason="SERVICE_NOT_FOUND", service=name)
        return log_


def watch_response(event: res.Event) -> api.WatchEventsResponse:
    """A streamed event."""
    return api.WatchEventsResponse(event=event)

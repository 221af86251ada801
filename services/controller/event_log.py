"""Every service's event log: recorded from published changes and controller actions, kept in
the store, listed and streamed (ListEvents, WatchEvents).

The log in memory is the one served; the store keeps a copy for restarts, written by the
controller's writer in batches; a crash may lose the events of the last moment before it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors, pagetoken, pbtime
from services.controller import hub, store, writer
from services.controller.domain import events as ev

log = logging.getLogger(__name__)

_MAX_PAGE = 1000
# How many events wait to be written at most; beyond, events are kept in memory only.
_WRITE_BACKLOG = 10_000
# How long events are gathered before they go to the writer, so a burst (a scale-up of a
# thousand replicas) takes a few units of work instead of one each.
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


class Events:
    """The event logs of every service."""

    def __init__(self, *, db: store.Store, db_writer: writer.Writer, clock: Callable[[], float] = time.time) -> None:
        self._db = db  # reads only
        self._writer = db_writer
        self._clock = clock
        self._logs: dict[str, ev.EventLog] = {}
        self._watchers: dict[str, set[hub._Watcher[res.Event]]] = {}
        # What the last published change said, to tell what a new one changes.
        self._replicas: dict[str, dict[int, tuple[str, int]]] = {}
        self._service: dict[str, tuple[str, int, int]] = {}  # status message, target, status
        # Recorded and not handed to the writer yet: gathered for _BATCH_S, so a burst takes one
        # unit of work. The writer's connection is the only one that writes: a second one made
        # every write wait for SQLite's lock (sleeping in steps of up to 100 ms).
        self._pending: dict[str, tuple[list[res.Event], list[int]]] = {}
        self._pending_count = 0
        self._flush_at: asyncio.TimerHandle | None = None

    def close(self) -> None:
        """Hand what is pending to the writer now (it finishes it before it closes); end every stream."""
        self._flush()
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
        self._keep(name, event, replaced)
        for w in list(self._watchers.get(name, ())):
            if not w.offer(event):
                self._watchers[name].discard(w)
        return event

    def _keep(self, name: str, event: res.Event, replaced: int | None) -> None:
        if self._pending_count >= _WRITE_BACKLOG:
            log.warning("the store is behind on events; an event of %s is kept in memory only", name)
            return
        events, gone = self._pending.setdefault(name, ([], []))
        events.append(event)
        if replaced is not None:
            gone.append(replaced)
        self._pending_count += 1
        if self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(_BATCH_S, self._flush)

    def _flush(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        batch, count = self._pending, self._pending_count
        if not batch:
            return
        self._pending, self._pending_count = {}, 0

        def written(fut: asyncio.Future[None]) -> None:
            if not fut.cancelled() and fut.exception() is not None:
                log.warning("could not keep %d events in the store (%s)", count, type(fut.exception()).__name__)

        self._writer.submit(lambda db: db.put_events_of(batch)).add_done_callback(written)

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

"""Bridges the controller's watch streams to the pages.

A bridge follows the whole fleet for one API token: ListServices every second finds new
services, and one WatchService stream per service (resumed from its last sequence number when
cut) brings every change the moment it happens. Pages that present the same token share one
bridge, so ten open pages cost the controller one set of streams, not ten. The controller
decides what a token may see: a bridge whose token it refuses tells its pages so and stops.
The token is held in memory only, to be sent to the controller; it is never logged.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from services.common import waits
from services.dashboard import convert, fleet

log = logging.getLogger(__name__)

STARTING, LIVE, UNREACHABLE, DENIED = "starting", "live", "unreachable", "denied"

_DENIED_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
_RECONNECT_MAX_S = 2.0


class Subscriber:
    """One page's queue of messages. A page too slow to keep up loses its queue and gets a
    fresh snapshot instead (`resync`), so memory stays bounded and the page stays right."""

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self.resync = False
        self.ended = False
        self._items: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()
        self._wake = asyncio.Event()

    def push(self, kind: str, data: dict[str, Any]) -> None:
        """Queue a message (dropped after end())."""
        if self.ended:
            return
        if len(self._items) >= self.limit:
            self._items.clear()
            self.resync = True
        else:
            self._items.append((kind, data))
        self._wake.set()

    def end(self, kind: str, data: dict[str, Any]) -> None:
        """Queue a last message; the page's stream closes after it."""
        if not self.ended:
            self._items.append((kind, data))
            self.ended = True
            self._wake.set()

    async def take(self, timeout: float) -> list[tuple[str, dict[str, Any]]]:
        """The queued messages, waiting up to `timeout` seconds for one; [] if none came."""
        if not self._items and not self.resync:
            await waits.wait_event(self._wake, timeout)
        self._wake.clear()
        items = list(self._items)
        self._items.clear()
        return items


class Bridge:
    """The fleet as one token sees it, kept current from the controller's watch streams."""

    def __init__(
        self,
        stub: api_grpc.ControllerServiceStub,
        token: str,
        *,
        discover_interval_s: float = 1.0,
        call_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.stub = stub
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.discover_interval_s = discover_interval_s
        self.call_timeout_s = call_timeout_s
        self.fleet = fleet.Fleet()
        self.state = STARTING
        self.message = "connecting to the controller"
        self.subscribers: set[Subscriber] = set()
        self.open_streams = 0
        """WatchService streams open to the controller now."""
        self._clock = clock
        self._answered = asyncio.Event()
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._discover: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start following the controller."""
        self._discover = asyncio.create_task(self._discover_loop(), name="dashboard discovery")

    async def close(self) -> None:
        """Stop every stream."""
        tasks = [t for t in (self._discover, *self._watches.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def first_answer(self, timeout: float) -> str:
        """The state once the controller answered the first listing (or `timeout` passed)."""
        await waits.wait_event(self._answered, timeout)
        return self.state

    def now_ms(self) -> int:
        """The dashboard's clock in milliseconds."""
        return int(self._clock() * 1000)

    def snapshot(self) -> dict[str, Any]:
        """Everything a page needs to start: the fleet, recent events and the connection."""
        now = self.now_ms()
        return {"now": now, "connection": self.connection(now), **self.fleet.snapshot(now)}

    def connection(self, now: int) -> dict[str, Any]:
        """Where the link to the controller stands."""
        return {"now": now, "state": self.state, "message": self.message}

    def subscribe(self, limit: int = 1000) -> Subscriber:
        """A new page's queue; send it snapshot() first."""
        sub = Subscriber(limit)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        """The page went away."""
        self.subscribers.discard(sub)

    # ---- following the controller ---------------------------------------------------------

    def _broadcast(self, kind: str, data: dict[str, Any]) -> None:
        data["now"] = self.now_ms()
        for sub in self.subscribers:
            sub.push(kind, data)

    def _set_state(self, state: str, message: str) -> None:
        changed = (state, message) != (self.state, self.message)
        self.state, self.message = state, message
        self._answered.set()
        if changed:
            self._broadcast("connection", self.connection(self.now_ms()))

    def _deny(self, exc: grpc.aio.AioRpcError) -> None:
        message = (
            "the controller did not accept this API token" if self._metadata else "the controller requires an API token"
        )
        self.state, self.message = DENIED, message
        self._answered.set()
        for sub in self.subscribers:
            sub.end("denied", {"now": self.now_ms(), "message": message, "code": exc.code().name})
        current = asyncio.current_task()
        for task in (self._discover, *self._watches.values()):
            if task is not None and task is not current:
                task.cancel()

    async def _list_names(self) -> list[str]:
        names: list[str] = []
        token = ""
        for _ in range(10_000):  # bounded: 1,000 a page
            resp = await self.stub.ListServices(
                api.ListServicesRequest(page_size=1000, page_token=token),
                timeout=self.call_timeout_s,
                metadata=self._metadata,
            )
            names += [s.name for s in resp.services]
            token = resp.next_page_token
            if not token:
                break
        return names

    async def _discover_loop(self) -> None:
        delay = 0.1
        while True:
            try:
                names = await self._list_names()
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _DENIED_CODES:
                    self._deny(exc)
                    return
                if self.state != UNREACHABLE:
                    log.warning("cannot list services at the controller (%s); retrying", exc.code().name)
                self._set_state(UNREACHABLE, f"cannot reach the controller ({exc.code().name}); retrying")
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.discover_interval_s)
                continue
            delay = 0.1
            if self.state == UNREACHABLE:
                log.info("the controller answers again")
            self._set_state(LIVE, "")
            for name in names:
                task = self._watches.get(name)
                if task is None or task.done():
                    self._watches[name] = asyncio.create_task(self._watch(name), name=f"dashboard watch {name}")
            await asyncio.sleep(self.discover_interval_s)

    async def _watch(self, name: str) -> None:
        after = 0
        delay = 0.1
        while True:
            try:
                call = self.stub.WatchService(
                    api.WatchServiceRequest(service_name=name, after_sequence=after), metadata=self._metadata
                )
                self.open_streams += 1
                try:
                    async for msg in call:
                        delay = 0.1
                        after = msg.sequence
                        self._broadcast("change", self.fleet.apply(convert.change(msg), self.now_ms()))
                        if msg.deleted:
                            return
                finally:
                    self.open_streams -= 1
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.NOT_FOUND:
                    if (update := self.fleet.forget(name, self.now_ms())) is not None:
                        self._broadcast("change", update)
                    return
                if code in _DENIED_CODES:
                    self._deny(exc)
                    return
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    continue  # fell behind: resume at once from the last change received
                log.debug("watch of %s cut (%s); resuming after %d", name, code.name, after)
            # A stream that ended without `deleted` was cut (a restart, max_connection_age).
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RECONNECT_MAX_S)


class Full(Exception):
    """As many pages are open as allowed."""


class Bridges:
    """One bridge per token, shared by the pages that present it, kept a while after the last
    page closes (a reload finds it warm, with its history)."""

    def __init__(
        self,
        stub: api_grpc.ControllerServiceStub,
        *,
        discover_interval_s: float,
        call_timeout_s: float,
        linger_s: float,
        max_clients: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.stub = stub
        self.discover_interval_s = discover_interval_s
        self.call_timeout_s = call_timeout_s
        self.linger_s = linger_s
        self.max_clients = max_clients
        self._clock = clock
        self._bridges: dict[bytes, Bridge] = {}
        self._expiry: dict[bytes, asyncio.Task[None]] = {}

    @property
    def clients(self) -> int:
        """Pages connected now."""
        return sum(len(b.subscribers) for b in self._bridges.values())

    @property
    def streams(self) -> int:
        """WatchService streams open to the controller now, over every bridge."""
        return sum(b.open_streams for b in self._bridges.values())

    def states(self) -> dict[str, int]:
        """Bridges (followed tokens) by the state of their link to the controller."""
        return dict(collections.Counter(b.state for b in self._bridges.values()))

    async def join(self, token: str, *, timeout: float) -> tuple[Bridge, Subscriber | None]:
        """The bridge for `token` and a new subscriber, or None if the controller refused the token.

        Raises:
            Full: max_clients pages are connected.
        """
        if self.clients >= self.max_clients:
            raise Full
        key = hashlib.sha256(token.encode()).digest()
        bridge = self._bridges.get(key)
        if bridge is None or bridge.state == DENIED:
            if bridge is not None:
                await self._drop(key)
            bridge = Bridge(
                self.stub,
                token,
                discover_interval_s=self.discover_interval_s,
                call_timeout_s=self.call_timeout_s,
                clock=self._clock,
            )
            self._bridges[key] = bridge
            bridge.start()
        if (expiry := self._expiry.pop(key, None)) is not None:
            expiry.cancel()
        if await bridge.first_answer(timeout) == DENIED:
            if not bridge.subscribers and self._bridges.get(key) is bridge:
                await self._drop(key)
            return bridge, None
        return bridge, bridge.subscribe()

    def leave(self, bridge: Bridge, sub: Subscriber) -> None:
        """A page closed; its bridge stops `linger_s` after the last one."""
        bridge.unsubscribe(sub)
        key = next((k for k, b in self._bridges.items() if b is bridge), None)
        if key is None or bridge.subscribers or key in self._expiry:
            return
        self._expiry[key] = asyncio.create_task(self._expire(key, bridge), name="dashboard bridge expiry")

    async def _expire(self, key: bytes, bridge: Bridge) -> None:
        await asyncio.sleep(0 if bridge.state == DENIED else self.linger_s)
        self._expiry.pop(key, None)
        if self._bridges.get(key) is bridge and not bridge.subscribers:
            await self._drop(key)

    async def _drop(self, key: bytes) -> None:
        bridge = self._bridges.pop(key, None)
        if bridge is not None:
            await bridge.close()

    async def close(self) -> None:
        """End every page's stream and stop every bridge."""
        for task in self._expiry.values():
            task.cancel()
        self._expiry.clear()
        for bridge in self._bridges.values():
            for sub in bridge.subscribers:
                sub.end("closing", {"now": bridge.now_ms(), "message": "the dashboard is shutting down"})
        for key in list(self._bridges):
            await self._drop(key)

"""Many provisioner streams followed over one: the replicas' launches on `LaunchBatches` and their
teardowns on `TerminateBatches`, instead of a `Launch` or `Terminate` stream each. At 10,000
replicas the per-replica streams, then a message per event, were the largest cost left in the
controller (docs/scaling.md). What is queued when the stream writes goes in one message, both
ways. The stream opens with the first request and is shared by every service; when it breaks,
every follower on it breaks too and its driver follows again. A provisioner without the RPC
(UNIMPLEMENTED) is remembered: its followers then use a stream of their own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from typing import Any, Generic, Protocol, TypeVar

import grpc

log = logging.getLogger(__name__)

_BATCH_MAX = 500  # requests in one message at most
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class Broke(Exception):
    """A stream ended or broke before its last event: open it again."""


class Superseded(Exception):
    """The same replica is followed again elsewhere: this follower ends."""


class Refused(Exception):
    """The provisioner refused a request on the shared stream (as its own call would have failed)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Response(Protocol):
    """`LaunchManyResponse` and `TerminateManyResponse`: one event of one replica, or its end."""

    name: str
    done: bool
    error_code: int
    error_message: str

    @property
    def event(self) -> Any: ...


class Named(Protocol):
    """`LaunchRequest` and `TerminateRequest`: a request about one replica."""

    name: str


Req = TypeVar("Req", bound=Named)  # LaunchRequest / TerminateRequest
Item = TypeVar("Item")  # LaunchManyRequest / TerminateManyRequest
Event = TypeVar("Event")  # LaunchEvent / TerminateEvent


class Mux(Generic[Req, Item, Event]):
    """One shared stream of one batched RPC, and the followers of each replica on it."""

    def __init__(
        self,
        call: Callable[[AsyncIterator[Any]], AsyncIterable[Any]],
        batch_type: Callable[..., Any],
        item_type: Callable[..., Item],
        field: str,
    ) -> None:
        """
        Args:
            call: the RPC (`LaunchBatches` or `TerminateBatches` of a stub).
            batch_type: its request message, holding several items in `requests`.
            item_type: one item, whose oneof is `field` (a request, to start following it) or
                `stop` (a replica name, to stop).
            field: the name of the request in an item (`launch`, `terminate`).
        """
        self._call = call
        self._batch_type = batch_type
        self._item_type = item_type
        self._field = field
        self._what = batch_type.__name__.removesuffix("Request")
        self.supported = True
        self._outbox: asyncio.Queue[Item] | None = None
        self._followers: dict[str, asyncio.Queue[Response | BaseException]] = {}
        self._reader: asyncio.Task[None] | None = None

    def _open(self) -> asyncio.Queue[Item]:
        if self._outbox is None:
            outbox: asyncio.Queue[Item] = asyncio.Queue()
            self._outbox = outbox
            self._reader = asyncio.create_task(self._read(outbox), name=f"{self._what} stream")
        return self._outbox

    async def _read(self, outbox: asyncio.Queue[Item]) -> None:
        async def requests() -> AsyncIterator[Any]:
            while True:
                batch = [await outbox.get()]
                while not outbox.empty() and len(batch) < _BATCH_MAX:
                    batch.append(outbox.get_nowait())
                yield self._batch_type(requests=batch)

        error: BaseException = Broke(f"the {self._what} stream ended")
        try:
            async for message in self._call(requests()):
                for response in message.responses:
                    q = self._followers.get(response.name)
                    if q is not None:
                        q.put_nowait(response)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                log.info("the provisioner has no %s: a stream per replica", self._what)
            error = Broke(f"the {self._what} stream broke ({exc.code().name})")
        except asyncio.CancelledError:
            error = Broke(f"the {self._what} stream was closed")
            raise
        except Exception:
            log.exception("the %s stream failed", self._what)
            error = Broke(f"the {self._what} stream failed")
        finally:
            if self._outbox is outbox:
                self._outbox = None
            followers, self._followers = self._followers, {}
            for q in followers.values():
                q.put_nowait(error)  # each of its replicas is followed again by its driver

    async def follow(self, request: Req) -> AsyncGenerator[Event, None]:
        """The events of one replica's request, until its events end.

        Raises:
            Refused: the provisioner refused the request.
            Broke: the stream ended or broke first.
            Superseded: the same replica is followed again from another request.
        """
        name = request.name
        q: asyncio.Queue[Response | BaseException] = asyncio.Queue()
        old = self._followers.get(name)
        if old is not None:
            old.put_nowait(Superseded())
        self._followers[name] = q
        outbox = self._open()
        outbox.put_nowait(self._item_type(**{self._field: request}))
        ended = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                if item.done:
                    ended = True
                    if item.error_code:
                        raise Refused(_CODES.get(item.error_code, grpc.StatusCode.UNKNOWN), item.error_message)
                    return
                yield item.event
        finally:
            if self._followers.get(name) is q:
                del self._followers[name]
                if not ended and self._outbox is outbox:
                    outbox.put_nowait(self._item_type(stop=name))  # the provisioner's side goes on

    async def close(self) -> None:
        """Close the stream (what it followed goes on at the provisioner)."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

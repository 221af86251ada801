"""Launch driver: follows each replica's launch at the provisioner, re-attaching by name when its
stream breaks, and hands every event back. Launches go over one shared `LaunchBatches` stream
(`Mux`); a launch carrying a trace context, or any launch when the provisioner has no
`LaunchBatches`, gets a `Launch` stream of its own. Launches of the whole controller share a slot
pool (`max_launches_in_flight`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc

from replicaplane.provisioner.v1 import provisioner_service_pb2 as prov_pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from replicaplane.provisioner.v1 import resources_pb2 as prov_res
from services.controller import retries
from services.controller.drivers import tasks

log = logging.getLogger(__name__)

# Provisioner answers that retrying the same launch cannot fix.
PERMANENT_CODES = frozenset(
    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}
)
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_BATCH_MAX = 500  # launch requests in one message at most


class Broke(Exception):
    """A stream ended or broke before its last event: open it again."""


class Superseded(Exception):
    """The same launch is followed again elsewhere: this follower ends."""


class Refused(Exception):
    """The provisioner refused a launch on the shared stream (as `Launch` would have failed)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Mux:
    """Launches followed on one `LaunchBatches` stream of the provisioner instead of one `Launch`
    stream each: at 10,000 replicas the per-replica streams, then a message per launch event,
    were the largest cost left in the controller (docs/scaling.md). What is queued when the
    stream writes goes in one message, both ways. The stream opens with the first launch and is
    shared by every service; when it breaks, every launch on it breaks too and its driver
    re-attaches. A provisioner without `LaunchBatches` (UNIMPLEMENTED) is remembered: launches
    then go on streams of their own."""

    def __init__(self, provisioner: prov_grpc.ProvisionerServiceStub) -> None:
        self._prov = provisioner
        self.supported = True
        self._outbox: asyncio.Queue[prov_pb.LaunchManyRequest] | None = None
        self._followers: dict[str, asyncio.Queue[prov_pb.LaunchManyResponse | BaseException]] = {}
        self._reader: asyncio.Task[None] | None = None

    def _open(self) -> asyncio.Queue[prov_pb.LaunchManyRequest]:
        if self._outbox is None:
            outbox: asyncio.Queue[prov_pb.LaunchManyRequest] = asyncio.Queue()
            self._outbox = outbox
            self._reader = asyncio.create_task(self._read(outbox), name="launch stream")
        return self._outbox

    async def _read(self, outbox: asyncio.Queue[prov_pb.LaunchManyRequest]) -> None:
        async def requests() -> AsyncIterator[prov_pb.LaunchBatchesRequest]:
            while True:
                batch = [await outbox.get()]
                while not outbox.empty() and len(batch) < _BATCH_MAX:
                    batch.append(outbox.get_nowait())
                yield prov_pb.LaunchBatchesRequest(requests=batch)

        error: BaseException = Broke("the launch stream ended")
        try:
            async for message in self._prov.LaunchBatches(requests()):
                for response in message.responses:
                    q = self._followers.get(response.name)
                    if q is not None:
                        q.put_nowait(response)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                log.info("the provisioner has no LaunchBatches: one Launch stream per replica")
            error = Broke(f"the launch stream broke ({exc.code().name})")
        except asyncio.CancelledError:
            error = Broke("the launch stream was closed")
            raise
        except Exception:
            log.exception("the launch stream failed")
            error = Broke("the launch stream failed")
        finally:
            if self._outbox is outbox:
                self._outbox = None
            followers, self._followers = self._followers, {}
            for q in followers.values():
                q.put_nowait(error)  # each of its launches re-attaches

    async def follow(self, request: prov_pb.LaunchRequest) -> AsyncGenerator[prov_res.LaunchEvent, None]:
        """The events of one launch, until its events end.

        Raises:
            Refused: the provisioner refused the request.
            Broke: the stream ended or broke first.
        """
        name = request.name
        q: asyncio.Queue[prov_pb.LaunchManyResponse | BaseException] = asyncio.Queue()
        old = self._followers.get(name)
        if old is not None:
            old.put_nowait(Superseded())
        self._followers[name] = q
        outbox = self._open()
        outbox.put_nowait(prov_pb.LaunchManyRequest(launch=request))
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
                    outbox.put_nowait(prov_pb.LaunchManyRequest(stop=name))  # the launch goes on

    async def close(self) -> None:
        """Close the stream (the launches go on at the provisioner)."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


class Launches:
    """The launches of one service."""

    def __init__(
        self,
        provisioner: prov_grpc.ProvisionerServiceStub,
        slots: asyncio.Semaphore,
        *,
        policy: retries.Policy = retries.STREAM,
        mux: Mux | None = None,
    ) -> None:
        self._prov = provisioner
        self._slots = slots
        self._policy = policy
        self._mux = mux
        self.tasks = tasks.Tasks()

    def start(
        self,
        rid: int,
        request: Callable[[], prov_pb.LaunchRequest | None],
        on_event: Callable[[prov_res.LaunchEvent], bool],
        on_refused: Callable[[str], None],
        metadata: Callable[[prov_pb.LaunchRequest], tuple[tuple[str, str], ...]] = lambda _: (),
    ) -> None:
        """Follow the launch of `rid` unless already followed.

        Args:
            rid: the replica id.
            request: the request to send now, or None when the launch is no longer wanted.
            on_event: applies one event; True when the launch is over.
            on_refused: the provisioner refused the request itself (a permanent error).
            metadata: gRPC metadata for the call (the trace context): a launch with some goes
                on a stream of its own, so the provisioner's span of it has the right parent.
        """
        if rid not in self.tasks:
            self.tasks.start(rid, self._follow(rid, request, on_event, on_refused, metadata), f"launch {rid}")

    def _events(
        self, wanted: prov_pb.LaunchRequest, metadata: tuple[tuple[str, str], ...]
    ) -> AsyncGenerator[prov_res.LaunchEvent, None]:
        if self._mux is not None and self._mux.supported and not metadata:
            return self._mux.follow(wanted)
        return self._own_stream(wanted, metadata)

    async def _own_stream(
        self, wanted: prov_pb.LaunchRequest, metadata: tuple[tuple[str, str], ...]
    ) -> AsyncGenerator[prov_res.LaunchEvent, None]:
        async for response in self._prov.Launch(wanted, metadata=metadata):
            yield response.event

    async def _follow(
        self,
        rid: int,
        request: Callable[[], prov_pb.LaunchRequest | None],
        on_event: Callable[[prov_res.LaunchEvent], bool],
        on_refused: Callable[[str], None],
        metadata: Callable[[prov_pb.LaunchRequest], tuple[tuple[str, str], ...]],
    ) -> None:
        # The retries of `policy`, without tenacity's machinery around the first attempt, which
        # nearly always ends the launch: thousands of launches start at once at scale.
        async with self._slots:
            tries = 0
            while True:
                try:
                    await self._attempt(request, on_event, on_refused, metadata)
                    return
                except Broke:
                    tries += 1
                    if self._policy.attempts and tries >= self._policy.attempts:
                        raise
                await asyncio.sleep(self._policy.delay(tries))

    async def _attempt(
        self,
        request: Callable[[], prov_pb.LaunchRequest | None],
        on_event: Callable[[prov_res.LaunchEvent], bool],
        on_refused: Callable[[str], None],
        metadata: Callable[[prov_pb.LaunchRequest], tuple[tuple[str, str], ...]],
    ) -> None:
        """Follow the launch once, until it ends.

        Raises:
            Broke: the stream broke first: follow it again.
        """
        wanted = request()
        if wanted is None:
            return
        try:
            async with contextlib.aclosing(self._events(wanted, metadata(wanted))) as events:
                async for event in events:
                    if on_event(event):
                        return
        except Refused as exc:
            if exc.code in PERMANENT_CODES:
                on_refused(exc.details or exc.code.name)
                return
            log.info("launch of %s broke (%s); re-attaching", wanted.name, exc.code.name)
            raise Broke from exc
        except grpc.aio.AioRpcError as exc:
            if exc.code() in PERMANENT_CODES:
                on_refused(exc.details() or exc.code().name)
                return
            log.info("launch of %s broke (%s); re-attaching", wanted.name, exc.code().name)
            raise Broke from exc
        except Superseded:
            return
        except Broke:
            raise
        except Exception as exc:
            log.exception("following the launch of %s failed; re-attaching", wanted.name)
            raise Broke from exc
        raise Broke  # the stream ended without saying how the launch ended

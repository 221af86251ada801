"""Many server-streaming calls served over one bidirectional stream (the provisioner's
`LaunchMany`, `LaunchBatches` and `TerminateBatches`): each request starts one inner stream (or stops one), each
response carries one item of one of them, tagged with its key, and a last response says how it
ended; `LaunchBatches` carries several of each per message. The scripted provisioner of the
tests serves both with the same code."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import TypeVar

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import resources_pb2
from services.common import grpc_errors

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Item = TypeVar("Item")
Out = TypeVar("Out")


class Ended:
    """How one inner stream ended: `code` 0 (its items ran out) or a google.rpc.Code with its
    message, as the call on its own would have ended."""

    def __init__(self, code: int = 0, message: str = "") -> None:
        self.code = code
        self.message = message


# Responses one batch carries at most (`serve_batches`): about 100 KB of launch events.
BATCH_MAX = 500


async def serve(
    requests: AsyncIterable[tuple[str, Req | None]],
    start: Callable[[Req], AsyncIterator[Item]],
    wrap: Callable[[str, Item | Ended], Out],
    *,
    domain: str,
) -> AsyncIterator[Out]:
    """Serve inner streams over one stream, one response per message (see `serve_batches`)."""
    async for batch in serve_batches(requests, start, wrap, domain=domain):
        for response in batch:
            yield response


async def serve_batches(
    requests: AsyncIterable[tuple[str, Req | None]],
    start: Callable[[Req], AsyncIterator[Item]],
    wrap: Callable[[str, Item | Ended], Out],
    *,
    domain: str,
) -> AsyncIterator[list[Out]]:
    """Serve inner streams over one stream: yields the responses ready at each write, at most
    BATCH_MAX together (none waits for a batch to fill).

    Args:
        requests: (key, request) to start following `start(request)` under `key` (again: the old
            one stops), or (key, None) to stop following it.
        start: the inner stream of a request.
        wrap: the response carrying an item, or how the stream of `key` ended.
        domain: the error domain, for the statuses of inner streams that fail.
    """
    out: asyncio.Queue[Out | None] = asyncio.Queue()
    inner: dict[str, asyncio.Task[None]] = {}

    async def follow(key: str, request: Req) -> None:
        try:
            async for item in start(request):
                out.put_nowait(wrap(key, item))
            ended = Ended()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            status = grpc_errors.to_status(exc, domain=domain)
            ended = Ended(status.code, status.message)
        out.put_nowait(wrap(key, ended))

    def forget(key: str, task: asyncio.Task[None]) -> None:
        if inner.get(key) is task:
            del inner[key]

    async def read() -> None:
        try:
            async for key, request in requests:
                old = inner.pop(key, None)
                if old is not None:
                    old.cancel()
                if request is not None:
                    task = asyncio.create_task(follow(key, request), name=f"inner stream {key}")
                    inner[key] = task
                    task.add_done_callback(functools.partial(forget, key))
            # The client sent its last request: end once every inner stream has.
            await asyncio.gather(*inner.values(), return_exceptions=True)
        finally:
            out.put_nowait(None)

    reader = asyncio.create_task(read(), name="multiplexed requests")
    try:
        ended = False
        while not ended:
            item = await out.get()
            batch: list[Out] = []
            while item is not None:
                batch.append(item)
                if len(batch) >= BATCH_MAX or out.empty():
                    break
                item = out.get_nowait()
            ended = item is None
            if batch:
                yield batch
        await asyncio.wait([reader])
        failure = None if reader.cancelled() else reader.exception()
        if failure is not None:
            raise failure
    finally:
        reader.cancel()
        for task in list(inner.values()):
            task.cancel()


# ---- LaunchMany and LaunchBatches ---------------------------------------------------------------


def _launch_request(msg: pb.LaunchManyRequest) -> tuple[str, pb.LaunchRequest | None] | None:
    which = msg.WhichOneof("request")
    if which == "launch":
        return msg.launch.name, msg.launch
    if which == "stop":
        return msg.stop, None
    return None  # neither: nothing to do


async def launch_requests(
    requests: AsyncIterable[pb.LaunchManyRequest],
) -> AsyncIterator[tuple[str, pb.LaunchRequest | None]]:
    """LaunchMany's requests as (name, launch request), or (name, None) to stop following."""
    async for msg in requests:
        if (one := _launch_request(msg)) is not None:
            yield one


async def launch_batch_requests(
    requests: AsyncIterable[pb.LaunchBatchesRequest],
) -> AsyncIterator[tuple[str, pb.LaunchRequest | None]]:
    """LaunchBatches' requests, one by one, as `launch_requests` gives LaunchMany's."""
    async for msg in requests:
        for each in msg.requests:
            if (one := _launch_request(each)) is not None:
                yield one


def launch_response(name: str, item: resources_pb2.LaunchEvent | Ended) -> pb.LaunchManyResponse:
    """One event of the launch of `name`, or how its events ended."""
    if isinstance(item, Ended):
        return pb.LaunchManyResponse(name=name, done=True, error_code=item.code, error_message=item.message)
    return pb.LaunchManyResponse(name=name, event=item)


# ---- TerminateBatches -----------------------------------------------------------------------------


async def terminate_batch_requests(
    requests: AsyncIterable[pb.TerminateBatchesRequest],
) -> AsyncIterator[tuple[str, pb.TerminateRequest | None]]:
    """TerminateBatches' requests, one by one: (name, teardown request), or (name, None) to stop
    following it."""
    async for msg in requests:
        for each in msg.requests:
            which = each.WhichOneof("request")
            if which == "terminate":
                yield each.terminate.name, each.terminate
            elif which == "stop":
                yield each.stop, None


def terminate_response(name: str, item: resources_pb2.TerminateEvent | Ended) -> pb.TerminateManyResponse:
    """One event of the teardown of `name`, or how its events ended."""
    if isinstance(item, Ended):
        return pb.TerminateManyResponse(name=name, done=True, error_code=item.code, error_message=item.message)
    return pb.TerminateManyResponse(name=name, event=item)

"""Many server-streaming calls served over one bidirectional stream (the provisioner's
`LaunchMany`): each request starts one inner stream (or stops one), each response carries one
item of one of them, tagged with its key, and a last response says how it ended. The scripted
provisioner of the tests serves `LaunchMany` with the same code."""

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


async def serve(
    requests: AsyncIterable[tuple[str, Req | None]],
    start: Callable[[Req], AsyncIterator[Item]],
    wrap: Callable[[str, Item | Ended], Out],
    *,
    domain: str,
) -> AsyncIterator[Out]:
    """Serve inner streams over one stream.

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
        while (item := await out.get()) is not None:
            yield item
        await asyncio.wait([reader])
        failure = None if reader.cancelled() else reader.exception()
        if failure is not None:
            raise failure
    finally:
        reader.cancel()
        for task in list(inner.values()):
            task.cancel()


# ---- LaunchMany ---------------------------------------------------------------------------------


async def launch_requests(
    requests: AsyncIterable[pb.LaunchManyRequest],
) -> AsyncIterator[tuple[str, pb.LaunchRequest | None]]:
    """LaunchMany's requests as (name, launch request), or (name, None) to stop following."""
    async for msg in requests:
        which = msg.WhichOneof("request")
        if which == "launch":
            yield msg.launch.name, msg.launch
        elif which == "stop":
            yield msg.stop, None


def launch_response(name: str, item: resources_pb2.LaunchEvent | Ended) -> pb.LaunchManyResponse:
    """One event of the launch of `name`, or how its events ended."""
    if isinstance(item, Ended):
        return pb.LaunchManyResponse(name=name, done=True, error_code=item.code, error_message=item.message)
    return pb.LaunchManyResponse(name=name, event=item)

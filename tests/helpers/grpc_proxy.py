"""A byte-level gRPC proxy that sits between two real services and injects faults on chosen calls.

Messages pass through unparsed. A test queues faults per method: `slow` lets the call reach the
upstream, then holds the answer back for a while (the caller's deadline expires although the
call was applied); `refuse` answers with a status without forwarding the call. Every call that
passes is counted per method.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import grpc


@dataclasses.dataclass(frozen=True)
class Fault:
    """What to do with one call: hold its answer back `delay_s` after the upstream answered, or
    answer `code` without forwarding it."""

    delay_s: float = 0.0
    code: grpc.StatusCode | None = None
    message: str = ""


class Proxy(grpc.GenericRpcHandler):
    """Forwards every unary and server-streaming call to `upstream`."""

    def __init__(self, channel: grpc.aio.Channel, streaming: set[str]) -> None:
        self._channel = channel
        self._streaming = streaming
        self.faults: dict[str, collections.deque[Fault]] = collections.defaultdict(collections.deque)
        self.forwarded: collections.Counter[str] = collections.Counter()
        self.answered: collections.Counter[str] = collections.Counter()

    def slow(self, method: str, delay_s: float) -> None:
        """The next call of `method` is applied upstream, then answered `delay_s` late."""
        self.faults[method].append(Fault(delay_s=delay_s))

    def refuse(self, method: str, code: grpc.StatusCode, message: str) -> None:
        """The next call of `method` is answered `code` and never reaches the upstream."""
        self.faults[method].append(Fault(code=code, message=message))

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        name = method.rsplit("/", 1)[-1]
        if name in self._streaming:
            return grpc.unary_stream_rpc_method_handler(self._stream(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    def _metadata(self, context: grpc.aio.ServicerContext) -> list[tuple[str, Any]]:
        return [(k, v) for k, v in context.invocation_metadata() or () if not k.startswith(":")]

    def _unary(self, method: str) -> Any:
        name = method.rsplit("/", 1)[-1]

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            fault = self.faults[name].popleft() if self.faults[name] else Fault()
            if fault.code is not None:
                await context.abort(fault.code, fault.message)
            call = self._channel.unary_unary(method)
            try:
                answer: bytes = await call(request, metadata=self._metadata(context), timeout=30)
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "", exc.trailing_metadata())
            self.forwarded[name] += 1
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            self.answered[name] += 1
            return answer

        return handle

    def _stream(self, method: str) -> Any:
        name = method.rsplit("/", 1)[-1]

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            call = self._channel.unary_stream(method)(request, metadata=self._metadata(context))
            self.forwarded[name] += 1
            try:
                async for message in call:
                    yield message
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "", exc.trailing_metadata())

        return handle


@contextlib.asynccontextmanager
async def serving(upstream: str, *, streaming: set[str]) -> AsyncIterator[tuple[Proxy, str]]:
    """A proxy to `upstream` on 127.0.0.1, port 0; yields it and its address.

    Args:
        upstream: host:port of the real service.
        streaming: names of the server-streaming methods (every other method is unary).
    """
    channel = grpc.aio.insecure_channel(upstream)
    proxy = Proxy(channel, streaming)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((proxy,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield proxy, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
        await channel.close()

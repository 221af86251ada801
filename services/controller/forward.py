"""A standby controller's API: every call forwarded to the leader, as it is.

The controller registers `Switch` for its service. While this controller stands by, the switch
forwards each call (bytes in, bytes out: nothing is parsed) with its metadata (the token among
it) and deadline to the leader the lease names, and passes the leader's answer or error back.
Once this controller leads, the switch hands calls to the real servicer's handlers. A call
already forwarded once is never forwarded again (no loops between standbys with a stale view);
with no leader known it is UNAVAILABLE (reason NO_LEADER), which clients retry.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import descriptor

from services.common import errors

log = logging.getLogger(__name__)

FORWARDED = "x-replicaplane-forwarded"
"""Metadata key a forwarding standby adds; a call that carries it is not forwarded again."""

# Metadata that belongs to one hop, never passed on.
_HOP = ("user-agent", "grpc-", ":", "content-type", "te")


class _Recorder:
    """Stands in for a server in `add_XServicer_to_server`, to capture the method handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers.update(handlers)


def method_handlers(add_to_server: Callable[[Any, Any], None], servicer: object) -> dict[str, grpc.RpcMethodHandler]:
    """The handler of each method of `servicer`, by method name, as the generated code makes them."""
    recorder = _Recorder()
    add_to_server(servicer, recorder)
    return recorder.handlers


class Switch(grpc.GenericRpcHandler):
    """Forwards the service's calls to the leader until `lead()`; then serves them here."""

    def __init__(
        self,
        service: descriptor.ServiceDescriptor,
        *,
        leader_address: Callable[[], str],
        make_channel: Callable[[str], grpc.aio.Channel],
    ) -> None:
        """Set up forwarding.

        Args:
            service: the service whose calls are switched.
            leader_address: where the leader is now ("" when unknown).
            make_channel: a channel to an address (the leader's), kept while the address leads.
        """
        self._service = service.full_name
        self._streams = {m.name: m.server_streaming for m in service.methods}
        if any(m.client_streaming for m in service.methods):
            raise ValueError(f"{self._service} has client streams: forwarding does not carry them")
        self._leader_address = leader_address
        self._make_channel = make_channel
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._handlers: dict[str, grpc.RpcMethodHandler] | None = None

    def lead(self, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        """From now on, calls go to these handlers (this controller leads)."""
        self._handlers = handlers

    async def close(self) -> None:
        """Close the channels to leaders."""
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        """The handler of one call: here when leading, else forwarding."""
        prefix = f"/{self._service}/"
        method: str = handler_call_details.method
        if not method.startswith(prefix):
            return None
        name = method[len(prefix) :]
        if self._handlers is not None:
            return self._handlers.get(name)
        if name not in self._streams:
            return None
        if self._streams[name]:
            return grpc.unary_stream_rpc_method_handler(self._forward_stream(method))
        return grpc.unary_unary_rpc_method_handler(self._forward_unary(method))

    def _target(self, context: grpc.aio.ServicerContext) -> tuple[grpc.aio.Channel, list[tuple[str, str]]]:
        metadata = [(k, v) for k, v in (context.invocation_metadata() or ()) if not k.startswith(_HOP)]
        if any(k == FORWARDED for k, _ in metadata):
            raise _no_leader("the controller it was forwarded to does not lead either")
        address = self._leader_address()
        if not address:
            raise _no_leader("an election is under way")
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._make_channel(address)
        return channel, [*metadata, (FORWARDED, "1")]

    def _forward_unary(self, method: str) -> Callable[[bytes, grpc.aio.ServicerContext], Any]:
        async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            channel, metadata = self._target(context)
            try:
                response: bytes = await channel.unary_unary(method)(
                    request, metadata=metadata, timeout=context.time_remaining()
                )
            except grpc.aio.AioRpcError as err:
                await _pass_on(context, err)
                raise  # not reached: abort raises
            return response

        return call

    def _forward_stream(self, method: str) -> Callable[[bytes, grpc.aio.ServicerContext], AsyncIterator[bytes]]:
        async def call(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            channel, metadata = self._target(context)
            stream = channel.unary_stream(method)(request, metadata=metadata, timeout=context.time_remaining())
            try:
                async for message in stream:
                    yield message
            except grpc.aio.AioRpcError as err:
                await _pass_on(context, err)
            finally:
                stream.cancel()

        return call


def _no_leader(why: str) -> errors.UnavailableError:
    return errors.UnavailableError(
        f"no controller leads right now ({why}); try again in a few seconds", reason="NO_LEADER"
    )


async def _pass_on(context: grpc.aio.ServicerContext, err: grpc.aio.AioRpcError) -> None:
    """End the call with the leader's status, details and trailers (its ErrorInfo among them)."""
    trailers = tuple((k, v) for k, v in (err.trailing_metadata() or ()) if not k.startswith(":"))
    await context.abort(err.code(), err.details() or "", trailers)

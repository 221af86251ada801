"""gRPC server metrics for every service: one interceptor, per method and status code.

The names are the ones grpc-ecosystem's go-grpc-prometheus made common (`grpc_server_started_total`,
`grpc_server_handled_total`, `grpc_server_handling_seconds`, `grpc_server_msg_*_total`), so
existing gRPC dashboards and alerts work unchanged; `grpc_server_in_flight_rpcs` is ours.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import prometheus_client

from services.common import grpc_errors

# Unary calls take milliseconds; a stream's handling time is its whole life (minutes to days).
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)

_METHOD_LABELS = ["grpc_type", "grpc_service", "grpc_method"]


def _split_method(full: str) -> tuple[str, str]:
    """`/pkg.Service/Method` -> (`pkg.Service`, `Method`)."""
    service, _, method = full.lstrip("/").rpartition("/")
    return service or "unknown", method or "unknown"


def _grpc_type(handler: grpc.RpcMethodHandler) -> str:
    if handler.unary_unary:
        return "unary"
    if handler.unary_stream:
        return "server_stream"
    if handler.stream_unary:
        return "client_stream"
    return "bidi_stream"


class _Method:
    """The metric children of one method, resolved once (labels() takes a lock and a lookup)."""

    def __init__(self, families: GrpcServerMetrics, labels: tuple[str, str, str]) -> None:
        self._families = families
        self._labels = labels
        self.started = families.started.labels(*labels)
        self.in_flight = families.in_flight.labels(*labels)
        self.received = families.received.labels(*labels)
        self.sent = families.sent.labels(*labels)
        self._by_code: dict[str, tuple[Any, Any]] = {}

    def finished(self, code: str, seconds: float) -> None:
        pair = self._by_code.get(code)
        if pair is None:
            pair = self._by_code[code] = (
                self._families.handled.labels(*self._labels, code),
                self._families.handling.labels(*self._labels, code),
            )
        pair[0].inc()
        pair[1].observe(seconds)


class GrpcServerMetrics:
    """The gRPC server metric families, registered in `registry`."""

    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        self.started = prometheus_client.Counter(
            "grpc_server_started_total", "RPCs started on the server.", _METHOD_LABELS, registry=registry
        )
        self.handled = prometheus_client.Counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, by status code.",
            [*_METHOD_LABELS, "grpc_code"],
            registry=registry,
        )
        self.handling = prometheus_client.Histogram(
            "grpc_server_handling_seconds",
            "Time from the start of an RPC to its status (a stream's whole life), by status code.",
            [*_METHOD_LABELS, "grpc_code"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.in_flight = prometheus_client.Gauge(
            "grpc_server_in_flight_rpcs",
            "RPCs being handled now; for streaming types, the streams open now.",
            _METHOD_LABELS,
            registry=registry,
        )
        self.received = prometheus_client.Counter(
            "grpc_server_msg_received_total",
            "Request messages received (one per unary call, each message of a stream).",
            _METHOD_LABELS,
            registry=registry,
        )
        self.sent = prometheus_client.Counter(
            "grpc_server_msg_sent_total",
            "Response messages sent (one per unary call, each message of a stream).",
            _METHOD_LABELS,
            registry=registry,
        )
        self._methods: dict[tuple[str, str, str], _Method] = {}

    def method(self, grpc_type: str, full_method: str) -> _Method:
        """The children of one method (created on its first call)."""
        key = (grpc_type, *_split_method(full_method))
        found = self._methods.get(key)
        if found is None:
            # Unknown methods are answered UNIMPLEMENTED before interceptors see a handler, so
            # only registered methods get here: the label set is bounded by the API.
            found = self._methods[key] = _Method(self, key)
        return found


def _code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    """The status code an RPC ended with, as grpc names it (OK, NOT_FOUND, ...)."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        # The client went away or its deadline passed (the server sees both as cancellation).
        remaining = context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # set_code with a raw number
        found = next((c for c in grpc.StatusCode if c.value[0] == code), None)
        return found.name if found else "UNKNOWN"
    return "UNKNOWN" if exc is not None else "OK"


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts, times and tracks every RPC. Put it outermost, so refused calls count too."""

    def __init__(self, families: GrpcServerMetrics) -> None:
        self._families = families

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = self._families.method(_grpc_type(handler), handler_call_details.method)
        streams_in = bool(handler.stream_unary or handler.stream_stream)

        def wrap(behavior: grpc_errors.Behavior, streams_out: bool) -> grpc_errors.Behavior:
            if streams_out:
                return _stream(behavior, method, streams_in)
            return _unary(behavior, method, streams_in)

        return grpc_errors.rewrap(handler, wrap)


async def _counted(requests: AsyncIterator[Any], method: _Method) -> AsyncIterator[Any]:
    async for request in requests:
        method.received.inc()
        yield request


def _unary(behavior: grpc_errors.Behavior, method: _Method, streams_in: bool) -> grpc_errors.Behavior:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        method.started.inc()
        method.in_flight.inc()
        if streams_in:
            request = _counted(request, method)
        else:
            method.received.inc()
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            response = await behavior(request, context)
            method.sent.inc()
            return response
        except BaseException as exc:
            error = exc
            raise
        finally:
            method.in_flight.dec()
            method.finished(_code(context, error), time.perf_counter() - start)

    return handler


def _stream(behavior: grpc_errors.Behavior, method: _Method, streams_in: bool) -> grpc_errors.Behavior:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        method.started.inc()
        method.in_flight.inc()
        if streams_in:
            request = _counted(request, method)
        else:
            method.received.inc()
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            result = behavior(request, context)
            if inspect.isawaitable(result):
                await result  # a servicer that streams with context.write(), as health's Watch does
            else:
                async for response in result:
                    method.sent.inc()
                    yield response
        except BaseException as exc:
            error = exc
            raise
        finally:
            method.in_flight.dec()
            method.finished(_code(context, error), time.perf_counter() - start)

    return handler

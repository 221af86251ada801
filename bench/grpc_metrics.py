"""What the gRPC metrics and tracing interceptors cost per call, in-process and without the
network: the interceptor chain called as grpc.aio calls it (intercept_service, then the wrapped
handler), for a unary and a server-streaming method, beside a pass-through interceptor and the
error interceptor every service already has. The tracing interceptor with traces on is timed for
a call without a trace context (most calls: passed through) and one with a `traceparent` (a
server span, batched to an exporter that drops it). CPU time, so other work on the machine
weighs little.

Run from the repo root: `python bench/grpc_metrics.py`. Prints `figure:` lines.
"""

from __future__ import annotations

import asyncio
import collections
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
sys.path.insert(1, os.path.join(sys.path[0], "gen", "python"))

import grpc  # noqa: E402
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult  # noqa: E402

from services.common import grpc_errors, grpc_metrics, tracing  # noqa: E402
from services.common import metrics as metrics_mod  # noqa: E402

CALLS = 50_000
ROUNDS = 5
Details = collections.namedtuple("Details", "method invocation_metadata")


class Drop(SpanExporter):
    """Takes spans and keeps none: the export path's cost without a collector."""

    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class Context:
    """The two things the interceptors ask of a servicer context."""

    def code(self) -> None:
        return None

    def time_remaining(self) -> float:
        return 10.0


async def unary(request: Any, context: Any) -> Any:
    return request


async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
    for _ in range(3):
        yield request


class PassThrough(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        return await continuation(details)


async def per_call_us(
    interceptor: grpc.aio.ServerInterceptor, *, streaming: bool, metadata: tuple[tuple[str, str], ...] = ()
) -> float:
    """CPU microseconds per call through `interceptor`, the median of ROUNDS."""
    handler = grpc.unary_stream_rpc_method_handler(stream) if streaming else grpc.unary_unary_rpc_method_handler(unary)

    async def continuation(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return handler

    details = Details("/bench.v1.Bench/Call", metadata)
    context = Context()
    rounds = []
    for _ in range(ROUNDS):
        start = time.process_time()
        for _ in range(CALLS):
            wrapped = await interceptor.intercept_service(continuation, details)
            if streaming:
                async for _item in wrapped.unary_stream(1, context):
                    pass
            else:
                await wrapped.unary_unary(1, context)
        rounds.append((time.process_time() - start) / CALLS * 1e6)
    return statistics.median(rounds)


async def main() -> None:
    families = grpc_metrics.GrpcServerMetrics(metrics_mod.Metrics("bench").registry)
    interceptors = {
        "pass_through": PassThrough(),
        "error_interceptor": grpc_errors.ErrorInterceptor(domain="bench"),
        "metrics_interceptor": grpc_metrics.MetricsInterceptor(families),
    }
    for kind, streaming in (("unary", False), ("stream3", True)):
        for name, interceptor in interceptors.items():
            print(f"figure: {name}_{kind}_us_per_call {await per_call_us(interceptor, streaming=streaming):.2f} us")
    traces = tracing.with_exporter(Drop(), "bench", batch=True)
    with tracing.use(traces):
        parent = traces.start("caller")
        traced = tracing.metadata(parent)
        interceptor = tracing.TracingInterceptor("bench")
        for kind, streaming in (("unary", False), ("stream3", True)):
            plain = await per_call_us(interceptor, streaming=streaming)
            print(f"figure: tracing_interceptor_{kind}_us_per_call {plain:.2f} us")
            spanned = await per_call_us(interceptor, streaming=streaming, metadata=traced)
            print(f"figure: tracing_interceptor_traced_{kind}_us_per_call {spanned:.2f} us")
    traces.shutdown()


if __name__ == "__main__":
    asyncio.run(main())

"""What the gRPC metrics interceptor costs per call, in-process and without the network: the
interceptor chain called as grpc.aio calls it (intercept_service, then the wrapped handler), for
a unary and a server-streaming method, beside a pass-through interceptor and the error
interceptor every service already has. CPU time, so other work on the machine weighs little.

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

from services.common import grpc_errors, grpc_metrics  # noqa: E402
from services.common import metrics as metrics_mod  # noqa: E402

CALLS = 50_000
ROUNDS = 5
Details = collections.namedtuple("Details", "method invocation_metadata")


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


async def per_call_us(interceptor: grpc.aio.ServerInterceptor, *, streaming: bool) -> float:
    """CPU microseconds per call through `interceptor`, the median of ROUNDS."""
    handler = grpc.unary_stream_rpc_method_handler(stream) if streaming else grpc.unary_unary_rpc_method_handler(unary)

    async def continuation(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return handler

    details = Details("/bench.v1.Bench/Call", ())
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


if __name__ == "__main__":
    asyncio.run(main())

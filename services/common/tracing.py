"""Traces: OpenTelemetry spans across the gRPC hops, exported by OTLP when configured.

Off by default. `OTEL_TRACES_EXPORTER=otlp` turns them on for a process, which then sends its
spans over OTLP/gRPC to `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (or `OTEL_EXPORTER_OTLP_ENDPOINT`,
default `http://localhost:4317`); the exporter reads its other standard `OTEL_EXPORTER_OTLP_*`
settings itself. `OTEL_SERVICE_NAME` names the process (default `replicaplane-<component>`).

A trace context travels as a W3C `traceparent`: in gRPC metadata between services, and in the
probe target's `traceparent` field to the prober. Each process keeps one `Tracing` (set by its
main, or swapped in by a test with `use`); while it is off, every call here returns at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.common import errors, grpc_errors

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
EXPORTER_ENV = "OTEL_TRACES_EXPORTER"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_PROTOCOL"
TRACES_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"

_PROPAGATOR = TraceContextTextMapPropagator()
SERVICE = "replicaplane.service"
REPLICA = "replicaplane.replica_id"
VERSION = "replicaplane.version"


class Tracing:
    """One process's tracer; `enabled` is False (and nothing is recorded) when traces are off.

    Args:
        provider: the SDK provider spans go to; None for off.
    """

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self.provider = provider
        self.enabled = provider is not None
        self.tracer = provider.get_tracer("replicaplane") if provider is not None else trace.NoOpTracer()

    def start(
        self,
        name: str,
        *,
        parent: otel_context.Context | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        start_time_s: float | None = None,
    ) -> trace.Span:
        """A new span (a non-recording one while off); `parent` None starts a new trace."""
        if not self.enabled:
            return trace.INVALID_SPAN
        return self.tracer.start_span(
            name,
            context=parent if parent is not None else otel_context.Context(),
            kind=kind,
            attributes=dict(attributes or {}),
            start_time=None if start_time_s is None else int(start_time_s * 1e9),
        )

    def shutdown(self) -> None:
        """Send what is buffered and stop (at process exit)."""
        if self.provider is not None:
            self.provider.shutdown()


OFF = Tracing()
_current = OFF


def current() -> Tracing:
    """The process's tracing."""
    return _current


@contextlib.contextmanager
def use(tracing: Tracing) -> Iterator[Tracing]:
    """Make `tracing` the process's for the block (tests run several services in one process)."""
    global _current
    before, _current = _current, tracing
    try:
        yield tracing
    finally:
        _current = before


def with_exporter(exporter: SpanExporter, component: str = "test", *, batch: bool = False) -> Tracing:
    """Tracing on, sending spans to `exporter` (tests pass an in-memory one)."""
    provider = TracerProvider(resource=Resource.create({"service.name": f"replicaplane-{component}"}))
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return Tracing(provider)


def from_env(component: str, env: Mapping[str, str] | None = None) -> Tracing:
    """The tracing the standard OTEL_* environment variables ask for: off unless
    `OTEL_TRACES_EXPORTER=otlp`.

    Raises:
        errors.ValidationError: an exporter or protocol this build does not ship (naming the variable).
    """
    env = os.environ if env is None else env
    exporters = [e.strip().lower() for e in env.get(EXPORTER_ENV, "").split(",") if e.strip()]
    if not exporters or exporters == ["none"]:
        return OFF
    violations = []
    if exporters != ["otlp"]:
        violations.append(errors.FieldViolation(EXPORTER_ENV, f"must be otlp or none, got {','.join(exporters)}"))
    protocol = env.get(TRACES_PROTOCOL_ENV) or env.get(PROTOCOL_ENV) or "grpc"
    if protocol.strip().lower() != "grpc":
        name = TRACES_PROTOCOL_ENV if env.get(TRACES_PROTOCOL_ENV) else PROTOCOL_ENV
        violations.append(errors.FieldViolation(name, f"only grpc is supported, got {protocol}"))
    errors.require(violations, subject="trace settings")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or f"replicaplane-{component}"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return Tracing(provider)


def setup(component: str) -> Tracing:
    """Read the environment and make the result the process's tracing (a service's main)."""
    global _current
    _current = from_env(component)
    if _current.enabled:
        log.info("traces on: OTLP to %s", _endpoint())
    return _current


def _endpoint() -> str:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317"
    )


# ---- context propagation -------------------------------------------------------------------


def traceparent(span: trace.Span) -> str:
    """The W3C traceparent of `span`; "" for a non-recording one."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def parent_of(value: str) -> otel_context.Context | None:
    """The context a traceparent names; None when it is empty or malformed (a new trace)."""
    if not value:
        return None
    ctx = _PROPAGATOR.extract({TRACEPARENT: value})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def metadata(span: trace.Span) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `span` as the parent of the server's span; empty while off."""
    value = traceparent(span)
    return ((TRACEPARENT, value),) if value else ()


# ---- gRPC server spans -----------------------------------------------------------------------


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span for each call that carries a traceparent, and for the `roots` methods
    (calls that start work worth following) without one. Other calls pass through untouched.
    For unary calls the span is current while the servicer runs, so it can add attributes."""

    def __init__(self, component: str, roots: Sequence[str] = ()) -> None:
        self._component = component
        self._roots = frozenset(roots)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        tracing = current()
        if handler is None or not tracing.enabled:
            return handler
        method = handler_call_details.method
        value = next((str(v) for k, v in handler_call_details.invocation_metadata or () if k == TRACEPARENT), "")
        parent = parent_of(value)
        if parent is None and method not in self._roots:
            return handler
        service, _, name = method.lstrip("/").rpartition("/")
        attributes = {
            "rpc.system": "grpc",
            "rpc.service": service,
            "rpc.method": name,
            "replicaplane.component": self._component,
        }

        def wrap(behavior: grpc_errors.Behavior, streams_out: bool) -> grpc_errors.Behavior:
            if streams_out:
                return _stream_span(behavior, tracing, name, parent, attributes)
            return _unary_span(behavior, tracing, name, parent, attributes)

        return grpc_errors.rewrap(handler, wrap)


def _finish(span: trace.Span, context: grpc.aio.ServicerContext, exc: BaseException | None) -> None:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        name = code.name
    elif exc is None:
        name = "OK"
    elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
        name = "CANCELLED"
    else:
        name = "UNKNOWN"
    span.set_attribute("rpc.grpc.status_code", name)
    if name != "OK":
        span.set_status(trace.Status(trace.StatusCode.ERROR, name))
    span.end()


def _unary_span(
    behavior: grpc_errors.Behavior,
    tracing: Tracing,
    name: str,
    parent: otel_context.Context | None,
    attributes: dict[str, str],
) -> grpc_errors.Behavior:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        span = tracing.start(name, parent=parent, kind=trace.SpanKind.SERVER, attributes=attributes)
        token = otel_context.attach(trace.set_span_in_context(span))
        error: BaseException | None = None
        try:
            return await behavior(request, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            otel_context.detach(token)
            _finish(span, context, error)

    return handler


def _stream_span(
    behavior: grpc_errors.Behavior,
    tracing: Tracing,
    name: str,
    parent: otel_context.Context | None,
    attributes: dict[str, str],
) -> grpc_errors.Behavior:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        # Not made current: the generator yields, and the context must not leak across yields.
        span = tracing.start(name, parent=parent, kind=trace.SpanKind.SERVER, attributes=attributes)
        error: BaseException | None = None
        sent = 0
        try:
            result = behavior(request, context)
            if inspect.isawaitable(result):
                await result  # a servicer that streams with context.write()
            else:
                async for response in result:
                    sent += 1
                    _event(span, response)
                    yield response
        except BaseException as exc:
            error = exc
            raise
        finally:
            span.set_attribute("rpc.messages_sent", sent)
            _finish(span, context, error)

    return handler


def _event(span: trace.Span, response: Any) -> None:
    """A stream of events (Launch, Terminate) adds each event's type to the span."""
    event = getattr(response, "event", None)
    field = getattr(event, "DESCRIPTOR", None) and event.DESCRIPTOR.fields_by_name.get("type")  # type: ignore[union-attr]
    if field and field.enum_type is not None:
        span.add_event(str(field.enum_type.values_by_number[event.type].name))  # type: ignore[union-attr]


def current_span() -> trace.Span:
    """The span current in this task (a server span while a traced unary call runs)."""
    return trace.get_current_span()

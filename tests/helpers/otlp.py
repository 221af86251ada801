"""A tiny OTLP/gRPC trace receiver: what an OpenTelemetry Collector would get from our processes."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclasses.dataclass(frozen=True)
class Span:
    """One received span, flattened."""

    process: str  # the resource's service.name
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, object]
    events: list[str]
    error: bool


def _value(v: object) -> object:
    kind = v.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span (thread-safe; serves on its own threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self.requests = 0

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for rs in request.resource_spans:
            process = next((str(_value(a.value)) for a in rs.resource.attributes if a.key == "service.name"), "unknown")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    received.append(
                        Span(
                            process=process,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=[e.name for e in s.events],
                            error=s.status.code == s.status.STATUS_CODE_ERROR,
                        )
                    )
        with self._lock:
            self._spans += received
            self.requests += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[Span]:
        """Every span received so far."""
        with self._lock:
            return list(self._spans)

    def until(self, pred: Callable[[list[Span]], bool], timeout: float = 30.0) -> list[Span]:
        """Wait until `pred(spans)` holds; AssertionError with what arrived otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if pred(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans never got there; received: {[(s.process, s.name) for s in spans]}")
            time.sleep(0.1)


@dataclasses.dataclass
class Serving:
    receiver: Receiver
    port: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a process needs to send its spans here, quickly."""
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }


def serving() -> Iterator[Serving]:
    """A receiver on 127.0.0.1 (port 0), for a `with contextlib.contextmanager(serving)()` or a fixture."""
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield Serving(receiver, port)
    finally:
        server.stop(None)

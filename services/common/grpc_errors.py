"""Maps domain errors to gRPC statuses with google.rpc details, and decodes them on clients."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from services.common import errors

log = logging.getLogger(__name__)

_CODES: list[tuple[type[errors.ReplicaplaneError], grpc.StatusCode]] = [
    (errors.ValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.AbortedError, grpc.StatusCode.ABORTED),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
]


# Errors may quote input: quote at most this much of any one text, so a 1 MB field never
# comes back in a status (and a lone surrogate never breaks its encoding).
_MAX_TEXT = 240


def _clip(text: str) -> str:
    text = text.encode("utf-8", "replace").decode("utf-8")
    if len(text) <= _MAX_TEXT:
        return text
    return f"{text[: _MAX_TEXT - 50]} ... {text[-40:]}"


# Bytes of field violations listed in one status (at least one is always listed): with the message
# and ErrorInfo, the status stays far below the 8 KB trailer limit of gRPC clients.
_MAX_VIOLATION_BYTES = 2048


def _listed_violations(violations: list[errors.FieldViolation]) -> list[error_details_pb2.BadRequest.FieldViolation]:
    out: list[error_details_pb2.BadRequest.FieldViolation] = []
    size = 0
    for v in violations[: errors.MAX_LISTED_VIOLATIONS]:
        item = error_details_pb2.BadRequest.FieldViolation(field=_clip(v.field), description=_clip(v.description))
        size += item.ByteSize()
        if out and size > _MAX_VIOLATION_BYTES:
            break
        out.append(item)
    return out


def _pack(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def to_status(exc: BaseException, *, domain: str) -> status_pb2.Status:
    """Build the google.rpc.Status for an exception; unknown exceptions become INTERNAL."""
    if isinstance(exc, NotImplementedError):
        return status_pb2.Status(code=code_pb2.UNIMPLEMENTED, message="method not implemented")
    if not isinstance(exc, errors.ReplicaplaneError):
        return status_pb2.Status(code=code_pb2.INTERNAL, message="internal error")
    code = next((c for cls, c in _CODES if isinstance(exc, cls)), grpc.StatusCode.INTERNAL)
    metadata = {_clip(k): _clip(v) for k, v in exc.metadata.items()}
    if isinstance(exc, errors.ValidationError):
        metadata["violation_count"] = str(len(exc.violations))
    details = [_pack(error_details_pb2.ErrorInfo(reason=exc.reason, domain=domain, metadata=metadata))]
    if isinstance(exc, errors.ValidationError):
        details.append(_pack(error_details_pb2.BadRequest(field_violations=_listed_violations(exc.violations))))
    elif isinstance(exc, errors.FailedPreconditionError):
        details.append(
            _pack(
                error_details_pb2.PreconditionFailure(
                    violations=[
                        error_details_pb2.PreconditionFailure.Violation(
                            type=exc.type_, subject=_clip(exc.subject), description=_clip(exc.message)
                        )
                    ]
                )
            )
        )
    elif isinstance(exc, errors.ResourceExhaustedError) and exc.limit_name:
        details.append(
            _pack(
                error_details_pb2.QuotaFailure(
                    violations=[
                        error_details_pb2.QuotaFailure.Violation(
                            subject=_clip(exc.subject),
                            description=_clip(exc.message),
                            quota_id=exc.limit_name,
                            quota_value=exc.limit,
                        )
                    ]
                )
            )
        )
    return status_pb2.Status(code=code.value[0], message=_clip(exc.message), details=details)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, domain: str) -> None:
    if not isinstance(exc, errors.ReplicaplaneError | NotImplementedError):
        log.exception("unhandled error in RPC")
    status = rpc_status.to_status(to_status(exc, domain=domain))
    await context.abort(status.code, status.details, status.trailing_metadata)


Behavior = Callable[..., Any]
"""A servicer method as grpc hands it to interceptors: (request or iterator, context) -> result."""


def rewrap(handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior, bool], Behavior]) -> grpc.RpcMethodHandler:
    """A copy of `handler` whose behavior is `wrap(behavior, streams_out)`."""
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, True), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, False), **kwargs)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True), **kwargs)
    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns domain exceptions raised by servicers into statuses with details (AIP-193)."""

    def __init__(self, domain: str) -> None:
        self._domain = domain

    def _wrap_unary(self, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(request, context)
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await _abort(context, exc, self._domain)

        return handler

    def _wrap_stream(self, behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    await result  # it streams with context.write(), as health's Watch does
                else:
                    async for item in result:
                        yield item
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await _abort(context, exc, self._domain)

        return handler

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return rewrap(
            handler, lambda behavior, streams_out: (self._wrap_stream if streams_out else self._wrap_unary)(behavior)
        )


class RpcError(Exception):
    """A decoded error from a Replicaplane service, with its google.rpc details."""

    def __init__(self, err: grpc.aio.AioRpcError | grpc.RpcError) -> None:
        self.code: grpc.StatusCode = err.code()
        self.message: str = err.details() or ""
        self.reason = ""
        self.metadata: dict[str, str] = {}
        self.field_violations: list[tuple[str, str]] = []
        status = rpc_status.from_call(err)
        if status is not None:
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    self.reason = info.reason
                    self.metadata = dict(info.metadata)
                elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    bad = error_details_pb2.BadRequest()
                    detail.Unpack(bad)
                    self.field_violations = [(v.field, v.description) for v in bad.field_violations]
        super().__init__(f"{self.code.name}: {self.message}")

"""Audit log of API mutations: who asked for what, when, and how it ended.

One JSON object per line, on the `replicaplane.audit` logger and, if a file is set, appended to
it. A record names the caller (the token's name, or "anonymous" without auth), the peer
address, the method, the service and replica it targets and the resulting status code. It never
holds the request's YAML or anything else that can carry secrets.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from services.common import grpc_errors, security

log = logging.getLogger("replicaplane.audit")

# Request fields copied into a record when the request has them.
_FIELDS = ("service_name", "replica_id", "request_id", "purge", "dry_run", "mode")


class FileSink:
    """Appends lines to a file (0600), one write per line so concurrent lines never interleave."""

    def __init__(self, path: str) -> None:
        self._path = os.path.abspath(os.path.expanduser(path))
        os.makedirs(os.path.dirname(self._path), exist_ok=True)
        self._lock = threading.Lock()
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._fh = os.fdopen(fd, "a", encoding="utf-8")

    def __call__(self, line: str) -> None:
        """Write one line and flush it."""
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._fh.close()


def record(method: str, request: Any, response: Any, code: grpc.StatusCode, peer: str) -> dict[str, Any]:
    """The audit record of one call."""
    out: dict[str, Any] = {
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
        "principal": security.principal.get(),
        "peer": peer,
        "method": method.rsplit("/", 1)[-1],
    }
    for field in _FIELDS:
        if hasattr(request, field):
            value = getattr(request, field)
            if value or field == "service_name":
                out[field] = value
    # A create may name the service only inside its YAML: take the name from the answer.
    service = getattr(response, "service", None)
    name = str(getattr(service, "name", "") or "")
    if not out.get("service_name") and name:
        out["service_name"] = name
    out["code"] = code.name
    return out


class AuditInterceptor(grpc.aio.ServerInterceptor):
    """Writes an audit record for every call to one of `methods` (full names, /pkg.Svc/Method)."""

    def __init__(self, methods: Iterable[str], *, sink: Callable[[str], None] | None = None) -> None:
        self._methods = frozenset(methods)
        self._sink = sink

    def _emit(self, method: str, request: Any, response: Any, code: grpc.StatusCode, peer: str) -> None:
        line = json.dumps(record(method, request, response, code, peer), sort_keys=True)
        log.info("%s", line)
        if self._sink is not None:
            try:
                self._sink(line)
            except Exception:
                log.exception("could not write the audit file")

    def _wrap(self, method: str) -> Callable[[Any, bool], Any]:
        def wrap(behavior: Any, streams_out: bool) -> Any:
            if streams_out:

                async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                    code = grpc.StatusCode.OK
                    try:
                        async for item in behavior(request, context):
                            yield item
                    except BaseException:
                        code = _code(context)
                        raise
                    finally:
                        self._emit(method, request, None, code, context.peer())

                return stream

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    response = await behavior(request, context)
                except BaseException:
                    self._emit(method, request, None, _code(context), context.peer())
                    raise
                self._emit(method, request, response, grpc.StatusCode.OK, context.peer())
                return response

            return unary

        return wrap

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self._methods:
            return handler
        return grpc_errors.rewrap(handler, self._wrap(method))


def _code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK:
        return code
    if isinstance(code, int) and code:
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    return grpc.StatusCode.CANCELLED

"""Bearer tokens on the public API and mutual TLS between the services.

A service started by hand has neither unless configured; the local stack always runs with a
token (docs/security.md). Tokens are compared in constant time and never logged or echoed; a
request without a valid token is answered UNAUTHENTICATED before any servicer code runs.
Health checking and reflection stay open, so load balancers and grpcurl's listing keep working.
With mTLS, a server requires a client certificate signed by the shared CA, and the provisioner
and probers accept calls only from the names they are told (the controller's certificate).
"""

from __future__ import annotations

import contextvars
import dataclasses
import hmac
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc

from services.common import errors, grpc_errors

# Services that never need a token or an allowed client name.
OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)

# Environment a client (the stack, tests, scripts) reads its token from.
CLIENT_TOKEN_ENV = "REPLICAPLANE_API_TOKEN"
CLIENT_TOKEN_FILE_ENV = "REPLICAPLANE_API_TOKEN_FILE"

# The state dir of the local stack `make up` runs from the checkout, relative to it.
STACK_STATE_DIR = ".state"

ANONYMOUS = "anonymous"

# Who made the current call: set by the token interceptor, read by the audit log.
principal: contextvars.ContextVar[str] = contextvars.ContextVar("principal", default=ANONYMOUS)


def read_tokens(token: str, token_file: str) -> dict[str, str]:
    """The accepted tokens, each mapped to the name the audit log records for it.

    Args:
        token: one token (from the setting or its environment variable); its name is "token".
        token_file: a file with one token per line, either `TOKEN` or `NAME:TOKEN`; blank lines
            and lines starting with `#` are skipped.

    Raises:
        errors.ValidationError: the file is unreadable or a token is too short (the token
            itself is never part of the message).
    """
    found: dict[str, str] = {}
    violations: list[errors.FieldViolation] = []
    if token:
        found[token.strip()] = "token"
    if token_file:
        try:
            with open(os.path.expanduser(token_file), encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except OSError as exc:
            raise errors.ValidationError(
                [errors.FieldViolation("auth_token_file", f"cannot read: {exc.strerror}")], subject="settings"
            ) from None
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            name, sep, value = text.partition(":")
            if not sep:
                name, value = f"line{number}", text
            found[value.strip()] = name.strip() or f"line{number}"
    for value, name in found.items():
        if len(value) < 16:
            violations.append(errors.FieldViolation("auth_token", f"token {name!r} is shorter than 16 characters"))
    errors.require(violations, subject="settings")
    return found


def check_token(header: str, tokens: Mapping[str, str]) -> str | None:
    """The name of the token in an `authorization` header value, or None.

    Every known token is compared, in constant time each, so the time taken does not tell
    which token nearly matched or how much of it.
    """
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        presented = ""
    got = presented.strip().encode()
    match = None
    for value, name in tokens.items():
        if hmac.compare_digest(got, value.encode()) and got:
            match = name
    return match


def _denied(code: grpc.StatusCode, message: str) -> Callable[[grpc_errors.Behavior, bool], grpc_errors.Behavior]:
    def wrap(behavior: grpc_errors.Behavior, streams_out: bool) -> grpc_errors.Behavior:
        if streams_out:

            async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await context.abort(code, message)
                yield  # pragma: no cover - abort raises

            return deny_stream

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, message)

        return deny

    return wrap


def _as(name: str) -> Callable[[grpc_errors.Behavior, bool], grpc_errors.Behavior]:
    def wrap(behavior: grpc_errors.Behavior, streams_out: bool) -> grpc_errors.Behavior:
        if streams_out:

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                principal.set(name)
                async for item in behavior(request, context):
                    yield item

            return stream

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            principal.set(name)
            return await behavior(request, context)

        return unary

    return wrap


def _service_of(method: str) -> str:
    return method.lstrip("/").split("/", 1)[0]


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call except health and reflection."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._tokens = dict(tokens)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or _service_of(handler_call_details.method) in OPEN_SERVICES:
            return handler
        header = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):
                header = value
        name = check_token(header, self._tokens)
        if name is None:
            message = "missing or invalid bearer token" if header else "this API requires a bearer token"
            return grpc_errors.rewrap(handler, _denied(grpc.StatusCode.UNAUTHENTICATED, message))
        return grpc_errors.rewrap(handler, _as(name))


def _peer_names(context: grpc.aio.ServicerContext) -> set[str]:
    auth = context.auth_context() or {}
    names: set[str] = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names.update(v.decode(errors="replace") for v in auth.get(key, ()))
    return names


class ClientNameInterceptor(grpc.aio.ServerInterceptor):
    """With mTLS, admits only clients whose certificate names one of `allowed` (CN or SAN)."""

    def __init__(self, allowed: Iterable[str]) -> None:
        self._allowed = frozenset(allowed)

    def _check(self, behavior: grpc_errors.Behavior, streams_out: bool) -> grpc_errors.Behavior:
        allowed = self._allowed
        message = "client certificate is not allowed to call this service"
        if streams_out:

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if not _peer_names(context) & allowed:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
                async for item in behavior(request, context):
                    yield item

            return stream

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if not _peer_names(context) & allowed:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
            return await behavior(request, context)

        return unary

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or _service_of(handler_call_details.method) in OPEN_SERVICES:
            return handler
        return grpc_errors.rewrap(handler, self._check)


@dataclasses.dataclass(frozen=True)
class Tls:
    """PEM files of one service's TLS identity and the CA it trusts."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""

    @property
    def enabled(self) -> bool:
        """True when any file is set (then all three must be)."""
        return bool(self.cert_file or self.key_file or self.ca_file)

    def _read(self, section: str) -> tuple[bytes, bytes, bytes]:
        violations = []
        contents = []
        for field in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, field)
            if not path:
                violations.append(errors.FieldViolation(f"{section}.tls_{field}", "required when TLS is on"))
                contents.append(b"")
                continue
            try:
                with open(os.path.expanduser(path), "rb") as fh:
                    contents.append(fh.read())
            except OSError as exc:
                violations.append(errors.FieldViolation(f"{section}.tls_{field}", f"cannot read: {exc.strerror}"))
                contents.append(b"")
        errors.require(violations, subject=f"{section} settings")
        return contents[0], contents[1], contents[2]

    def server_credentials(self, section: str) -> grpc.ServerCredentials:
        """Server credentials that require a client certificate signed by the CA.

        Raises:
            errors.ValidationError: a file is missing or unreadable.
        """
        cert, key, ca = self._read(section)
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self, section: str) -> grpc.ChannelCredentials:
        """Client credentials: this identity's certificate, and the CA that signs the servers'.

        Raises:
            errors.ValidationError: a file is missing or unreadable.
        """
        cert, key, ca = self._read(section)
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def allowed_names(text: str) -> list[str]:
    """A comma-separated list of client names, cleaned."""
    return [n.strip() for n in text.split(",") if n.strip()]


def _first_token(path: str) -> str:
    with open(os.path.expanduser(path), encoding="utf-8") as fh:
        for line in fh:
            text = line.strip()
            if text and not text.startswith("#"):
                return text.partition(":")[2].strip() if ":" in text else text
    return ""


def client_token(
    environ: Mapping[str, str] | None = None, *, target: str = "", state_dir: str = STACK_STATE_DIR
) -> str:
    """The token a client sends, or "": $REPLICAPLANE_API_TOKEN, the first token of the file
    named by $REPLICAPLANE_API_TOKEN_FILE, else the controller's own token settings (so a
    local stack started with them talks to its controller), else the token of the local stack
    in `state_dir` (./.state) when `target` is that stack's controller (stack_token())."""
    env = os.environ if environ is None else environ
    for var, var_file in (
        (CLIENT_TOKEN_ENV, CLIENT_TOKEN_FILE_ENV),
        ("REPLICAPLANE_CONTROLLER_AUTH_TOKEN", "REPLICAPLANE_CONTROLLER_AUTH_TOKEN_FILE"),
    ):
        if env.get(var):
            return env[var].strip()
        if env.get(var_file):
            return _first_token(env[var_file])
    return stack_token(target, state_dir) if target else ""


def stack_token(target: str, state_dir: str = STACK_STATE_DIR) -> str:
    """The token the local stack in `state_dir` generated, if `target` is its controller.

    Only that controller ever gets it: a client pointed elsewhere sends nothing, so the token
    never reaches another server. "" when there is no such stack or the file is unreadable.
    """
    try:
        with open(os.path.join(state_dir, "stack.json"), encoding="utf-8") as fh:
            state = json.load(fh)
        if not isinstance(state, dict) or state.get("controller") != target or not state.get("token_file"):
            return ""
        return _first_token(str(state["token_file"]))
    except (OSError, ValueError):
        return ""


def client_tls(environ: Mapping[str, str] | None = None) -> grpc.ChannelCredentials | None:
    """Client TLS credentials from the first of the controller's, provisioner's or prober's
    REPLICAPLANE_<SECTION>_TLS_* files set in the environment, or None. Used for health checks of
    mTLS servers (health is open to any certificate the CA signed, if it allows client auth)."""
    env = os.environ if environ is None else environ
    for section in ("controller", "provisioner", "prober"):
        prefix = f"REPLICAPLANE_{section.upper()}_TLS_"
        tls = Tls(env.get(f"{prefix}CERT_FILE", ""), env.get(f"{prefix}KEY_FILE", ""), env.get(f"{prefix}CA_FILE", ""))
        if tls.enabled:
            return tls.channel_credentials(section)
    return None


def _with_token(details: grpc.aio.ClientCallDetails, header: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    metadata = [*(details.metadata or ()), header]
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, grpc.aio.Metadata(*metadata), details.credentials, details.wait_for_ready
    )


# grpc.aio files an interceptor under its first matching kind, so each kind is its own class.
class _UnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._header), request)


class _StreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._header), request)


def token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that send `token` on every call (none when it is empty)."""
    return [_UnaryToken(token), _StreamToken(token)] if token else []


def internal_server(section: str, tls: Tls, allowed_clients: str) -> tuple[list[grpc.aio.ServerInterceptor], Any]:
    """Interceptors and credentials of an internal server (provisioner, prober).

    Without TLS files: plaintext and no checks. With them: mTLS, and only clients whose
    certificate carries one of `allowed_clients` may call anything but health and reflection.

    Raises:
        errors.ValidationError: a TLS file is missing or unreadable, or no client is allowed.
    """
    if not tls.enabled:
        return [], None
    names = allowed_names(allowed_clients)
    if not names:
        raise errors.ValidationError(
            [errors.FieldViolation(f"{section}.tls_allowed_clients", "must name at least one client")],
            subject=f"{section} settings",
        )
    return [ClientNameInterceptor(names)], tls.server_credentials(section)

"""Probe targets, their validation, and one HTTP probe: plain Python, no gRPC."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import errno
import json
import re
import ssl
import time
from collections.abc import Mapping

import aiohttp
import yarl

from services.common import errors
from services.prober import fasthttp

# RFC 9110 token characters: what a header name may contain.
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_BAD_VALUE_CHARS = ("\r", "\n", "\x00")


class FailureKind(enum.Enum):
    """Why a probe failed, in a few bounded words (the metrics' `kind` label)."""

    HTTP_STATUS = "http_status"
    TIMEOUT = "timeout"
    CONNECTION_REFUSED = "connection_refused"
    CONNECTION_FAILED = "connection_failed"
    DNS = "dns"
    TLS = "tls"
    DISCONNECTED = "disconnected"
    BAD_RESPONSE = "bad_response"
    INVALID_TARGET = "invalid_target"
    OTHER = "other"


class Outcome(enum.Enum):
    """How a probe ended. Mirrors the proto's ProbeOutcome; unavailable is the fleet client's."""

    READY = "ready"
    REPLICA_FAILURE = "replica_failure"
    INVALID_TARGET = "invalid_target"


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """A probe target as a caller sent it, before validation; None means "use the default"."""

    target_id: str
    url: str
    path: str = "/"
    method: str = "GET"
    post_data_json: str = ""
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)
    timeout_s: float | None = None
    interval_s: float | None = None
    fast_interval_s: float | None = None
    starting: bool = False
    traceparent: str = ""


@dataclasses.dataclass(frozen=True)
class Defaults:
    """Values used where a target leaves a field unset."""

    timeout_s: float = 15.0
    interval_s: float = 10.0
    fast_interval_s: float = 0.1
    min_interval_s: float = 0.001


@dataclasses.dataclass(frozen=True, eq=True)
class Target:
    """A validated probe target. Headers and body stay out of repr: they may be secrets."""

    target_id: str
    url: yarl.URL = dataclasses.field(repr=False)
    method: str
    body: bytes | None = dataclasses.field(repr=False)
    headers: tuple[tuple[str, str], ...] = dataclasses.field(repr=False)
    timeout_s: float
    interval_s: float
    fast_interval_s: float
    starting: bool
    traceparent: str = ""  # the replica's start, while traced: outcome changes become spans

    def header_dict(self) -> dict[str, str]:
        """Headers as a dict for the HTTP client (a copy; the caller may change it)."""
        return dict(self.headers)


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    """The outcome of one probe.

    Attributes:
        target_id: the target probed.
        outcome: READY, REPLICA_FAILURE or INVALID_TARGET.
        http_code: the HTTP status, 0 when no response came.
        latency_s: seconds from sending the request to the response or the failure.
        error: why it failed; empty on success; never contains header values.
        probe_time: wall-clock time (epoch seconds) the probe was sent.
        failure: why it failed, in bounded words; None on success.
    """

    target_id: str
    outcome: Outcome
    http_code: int
    latency_s: float
    error: str
    probe_time: float
    failure: FailureKind | None = None

    @property
    def ready(self) -> bool:
        """True if and only if the replica answered HTTP 200."""
        return self.outcome is Outcome.READY


def _seconds(value: float | None, default: float, field: str, out: list[errors.FieldViolation]) -> float:
    if value is None or value == 0:
        return default
    if value < 0:
        out.append(errors.FieldViolation(field, "must be positive"))
        return default
    return float(value)


_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def make_target(spec: TargetSpec, defaults: Defaults) -> Target:
    """Validate `spec` and build the target to probe.

    Args:
        spec: the caller's target.
        defaults: values for unset timeouts and intervals.

    Returns:
        The target, with the URL and path joined and the body encoded.

    Raises:
        errors.ValidationError: every problem found, each naming its field. Messages never
            quote header values or the URL (which may carry credentials).
    """
    violations: list[errors.FieldViolation] = []
    if not spec.target_id:
        violations.append(errors.FieldViolation("target_id", "must be set"))
    path = spec.path or "/"
    if not path.startswith("/"):
        violations.append(errors.FieldViolation("path", "must start with '/'"))
    url = None
    try:
        url = yarl.URL(spec.url.rstrip("/") + path)
    except (ValueError, TypeError):
        violations.append(errors.FieldViolation("url", "not a valid URL"))
    if url is not None:
        if url.scheme not in ("http", "https"):
            violations.append(errors.FieldViolation("url", "must be an http or https URL"))
        elif not url.host:
            violations.append(errors.FieldViolation("url", "has no host"))
    method = spec.method.upper()
    if method not in ("GET", "POST"):
        violations.append(errors.FieldViolation("method", "must be GET or POST"))
    body = None
    headers = dict(spec.headers)
    if method == "POST":
        text = spec.post_data_json or "{}"
        try:
            json.loads(text)
        except ValueError:
            violations.append(errors.FieldViolation("post_data_json", "not valid JSON"))
        body = text.encode()
        if not any(name.lower() == "content-type" for name in headers):
            headers["Content-Type"] = "application/json"
    for name, value in spec.headers.items():
        if not _TOKEN.match(name):
            violations.append(errors.FieldViolation("headers", "a header name is not a valid token"))
        elif any(c in value for c in _BAD_VALUE_CHARS):
            # The name is not secret; the value is, so it is never quoted.
            violations.append(errors.FieldViolation(f"headers[{name}]", "value contains a line break"))
    timeout_s = _seconds(spec.timeout_s, defaults.timeout_s, "timeout", violations)
    interval_s = _seconds(spec.interval_s, defaults.interval_s, "interval", violations)
    fast_s = _seconds(spec.fast_interval_s, defaults.fast_interval_s, "fast_interval", violations)
    if spec.traceparent and not _TRACEPARENT.match(spec.traceparent):
        violations.append(
            errors.FieldViolation("traceparent", "must be a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)")
        )
    errors.require(violations, subject="probe target")
    assert url is not None
    return Target(
        target_id=spec.target_id,
        url=url,
        method=method,
        body=body,
        headers=tuple(headers.items()),
        timeout_s=timeout_s,
        interval_s=max(interval_s, defaults.min_interval_s),
        fast_interval_s=max(fast_s, defaults.min_interval_s),
        starting=spec.starting,
        traceparent=spec.traceparent,
    )


def scrub(text: str, target: Target) -> str:
    """Remove every header value (and any URL password) of `target` from `text`."""
    for _, value in target.headers:
        if len(value) >= 3 and value in text:
            text = text.replace(value, "<redacted>")
    if target.url.password and target.url.password in text:
        text = text.replace(target.url.password, "<redacted>")
    return text


def describe_error(exc: BaseException, target: Target) -> str:
    """A short reason for a failed probe, without header values or the URL."""
    return classify_error(exc, target)[1]


def classify_error(exc: BaseException, target: Target) -> tuple[FailureKind, str]:
    """The kind of a failed probe and a short reason, without header values or the URL."""
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return FailureKind.TIMEOUT, f"timeout after {target.timeout_s:g}s"
    if isinstance(exc, aiohttp.ClientConnectorCertificateError | aiohttp.ClientSSLError | ssl.SSLError):
        return FailureKind.TLS, scrub(f"TLS error: {exc.__class__.__name__}", target)
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return FailureKind.DNS, "name resolution failed"
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionError | OSError):
        os_error = getattr(exc, "os_error", exc)
        code = getattr(os_error, "errno", None)
        if code == errno.ECONNREFUSED:
            return FailureKind.CONNECTION_REFUSED, "connection refused"
        if code is not None and code in errno.errorcode:
            return FailureKind.CONNECTION_FAILED, f"connection failed: {errno.errorcode[code]}"
        return FailureKind.CONNECTION_FAILED, "connection failed"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return FailureKind.DISCONNECTED, "server disconnected"
    if isinstance(exc, aiohttp.TooManyRedirects):
        return FailureKind.BAD_RESPONSE, "too many redirects"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return FailureKind.BAD_RESPONSE, "bad response body"
    if isinstance(exc, aiohttp.ClientResponseError):
        return FailureKind.BAD_RESPONSE, f"bad response: {exc.__class__.__name__}"
    return FailureKind.OTHER, f"probe error: {exc.__class__.__name__}"


class HttpProber:
    """Makes probes over one pooled, keep-alive HTTP client session.

    Args:
        max_concurrent: probes in flight at once, over every stream; the rest wait their turn
            (the wait does not count toward a probe's timeout).
        keepalive_s: how long an idle connection to a replica is kept for reuse.
        verify_tls: verify replicas' TLS certificates.
        fast: make GETs over plain http on bare connections (`fasthttp`); else every probe
            goes through the general client.
    """

    def __init__(
        self, *, max_concurrent: int = 1000, keepalive_s: float = 30.0, verify_tls: bool = True, fast: bool = True
    ) -> None:
        # No connector limit: the semaphore bounds concurrency instead, because a request
        # waiting for a connector slot would spend its own timeout waiting.
        self._connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=keepalive_s, ssl=verify_tls)
        self._session = aiohttp.ClientSession(
            connector=self._connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            headers={"User-Agent": "replicaplane-prober"},
        )
        self._slots = asyncio.Semaphore(max_concurrent)
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}
        # GETs over plain http skip the general client (fasthttp.py); None: every probe uses it.
        self._fast = fasthttp.Client(keepalive_s=keepalive_s, user_agent="replicaplane-prober") if fast else None

    async def close(self) -> None:
        """Close every pooled connection."""
        if self._fast is not None:
            self._fast.close()
        await self._session.close()

    def _timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        found = self._timeouts.get(seconds)
        if found is None:
            if len(self._timeouts) > 1000:
                self._timeouts.clear()
            found = self._timeouts[seconds] = aiohttp.ClientTimeout(total=seconds)
        return found

    async def probe(self, target: Target) -> Result:
        """Probe `target` once. Never raises for replica problems: they are failure results.

        Returns:
            READY for HTTP 200 exactly, REPLICA_FAILURE with a reason for anything else.
        """
        async with self._slots:
            probe_time = time.time()
            start = time.perf_counter()
            code: int | Result | None = None
            if self._fast is not None and fasthttp.Client.handles(target.url, target.method):
                try:
                    async with asyncio.timeout(target.timeout_s):
                        code = await self._fast.get(target.url, target.headers)
                except fasthttp.Unhandled:
                    pass  # made again below by the general client, in the time left
                except (TimeoutError, ConnectionRefusedError) as exc:
                    return self._failure(target, probe_time, start, *classify_error(exc, target))
            if code is None:
                code = await self._general(target, probe_time, start)
            if isinstance(code, Result):
                return code
            latency = time.perf_counter() - start
        if code == 200:
            return Result(target.target_id, Outcome.READY, code, latency, "", probe_time)
        return Result(
            target.target_id,
            Outcome.REPLICA_FAILURE,
            code,
            latency,
            f"HTTP {code}",
            probe_time,
            FailureKind.HTTP_STATUS,
        )

    async def _general(self, target: Target, probe_time: float, start: float) -> int | Result:
        """The probe through the general client: its HTTP status, or the failure."""
        # A POST is not retried by the client when a pooled connection turns out closed
        # by the replica; retry once ourselves, so keep-alive never causes a failure.
        retries = 1 if target.method == "POST" else 0
        remaining = target.timeout_s - (time.perf_counter() - start)
        if remaining <= 0:
            return self._failure(target, probe_time, start, *classify_error(TimeoutError(), target))
        timeout = self._timeout(remaining) if remaining == target.timeout_s else aiohttp.ClientTimeout(total=remaining)
        while True:
            try:
                return await self._request(target, timeout)
            except aiohttp.ServerDisconnectedError as exc:
                remaining = target.timeout_s - (time.perf_counter() - start)
                if retries > 0 and remaining > 0:
                    retries -= 1
                    timeout = aiohttp.ClientTimeout(total=remaining)
                    continue
                return self._failure(target, probe_time, start, *classify_error(exc, target))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                return self._failure(target, probe_time, start, *classify_error(exc, target))

    async def _request(self, target: Target, timeout: aiohttp.ClientTimeout) -> int:
        async with self._session.request(
            target.method,
            target.url,
            headers=target.header_dict() if target.headers else None,
            data=target.body,
            timeout=timeout,
        ) as resp:
            # Read the body so the connection goes back to the pool.
            await resp.read()
            return resp.status

    @staticmethod
    def _failure(target: Target, probe_time: float, start: float, kind: FailureKind, error: str) -> Result:
        latency = time.perf_counter() - start
        return Result(target.target_id, Outcome.REPLICA_FAILURE, 0, latency, error, probe_time, kind)

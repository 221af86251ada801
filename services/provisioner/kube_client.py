"""The kubernetes backend's API client: the few calls it makes, with dict bodies and dict answers.

Calls are retried here, and only here, when the failure is transient (no answer, 429, 5xx): a
few tries with backoff or the server's Retry-After. Failures become `ApiError`s, which
`describe` puts in words for launch and teardown messages. The official client's asyncio
flavour (`kubernetes.aio`) is imported when the client opens, so the local backend never pays
for it. kube.py is the backend that uses it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import tenacity
from tenacity import wait as tenacity_wait

from services.provisioner import kube_jobs, kube_objects, retries

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
TRANSIENT = frozenset({0, 429, 500, 502, 503, 504})
"""HTTP statuses worth another try of the same call (0: no answer at all)."""


@dataclasses.dataclass(frozen=True)
class Options:
    """Settings of the kubernetes backend (see settings.Settings, `kubernetes_*`, for each)."""

    pods: kube_objects.PodConfig = dataclasses.field(default_factory=kube_objects.PodConfig)
    kubeconfig: str = ""
    context: str = ""
    in_cluster: bool = False
    create_namespace: bool = False
    endpoint: str = "pod"
    cluster_domain: str = "cluster.local"
    port_annotation: str = ""
    schedule_timeout_s: float = 600.0
    alternative_timeout_s: float = 45.0
    alternative_retry_s: float = 300.0
    start_timeout_s: float = 900.0
    delete_timeout_s: float = 60.0
    watch_timeout_s: float = 300.0
    watch_idle_s: float = 330.0
    request_timeout_s: float = 30.0
    follow_logs: bool = True
    node_address: str = ""
    load_balancer_timeout_s: float = 600.0
    log_reconnect_margin_s: float = 10.0
    api_attempts: int = 5
    api_backoff_s: float = 0.5
    api_backoff_max_s: float = 10.0


class ApiError(Exception):
    """A Kubernetes API call failed.

    Attributes:
        status: the HTTP status (0 when there was no answer).
        message: the API server's message (or the connection error).
        reason: the Status reason (`Forbidden`, `AlreadyExists`, ...), else the HTTP reason.
        retry_after: the server's Retry-After in seconds, if it sent one.
        tries: how many times the call was made.
    """

    def __init__(self, status: int, message: str, *, reason: str = "", retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.retry_after = retry_after
        self.tries = 1
        self.counted = False  # already reported to the metrics' on_error

    @property
    def transient(self) -> bool:
        """Whether trying the same call again may succeed."""
        return self.status in TRANSIENT


def describe(exc: ApiError) -> str:
    """An API failure in words, for launch and teardown messages: what, the status, the message."""
    code = f"{exc.status} {exc.reason}".strip()
    tries = f", {exc.tries} tries" if exc.tries > 1 else ""
    text = exc.message or "no message"
    if exc.status == 0:
        return f"the API server could not be reached ({exc.tries} {'tries' if exc.tries > 1 else 'try'}): {text}"
    if exc.status in (401, 403):
        return f"no access ({code}): {text}"
    if exc.status == 404:
        return f"not found ({code}): {text}"
    if exc.status == 409:
        return f"conflict ({code}): {text}"
    if exc.status in (400, 422):
        return f"rejected by the API server ({code}): {text}"
    if exc.status == 429:
        return f"the API server is throttling requests ({code}{tries}): {text}"
    if exc.status >= 500:
        return f"the API server failed ({code}{tries}): {text}"
    return f"the API server answered {code}{tries}: {text}"


class ServerWait(tenacity_wait.wait_base):
    """Wait before another try: the server's Retry-After when it sent one, else jittered exponential
    backoff; never longer than the backoff's maximum."""

    def __init__(self, backoff: retries.wait_jittered_exponential) -> None:
        self.backoff = backoff

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        """The gap before the next try."""
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if isinstance(exc, ApiError) and exc.retry_after is not None:
            return min(max(0.0, exc.retry_after), self.backoff.maximum)
        return self.backoff(retry_state)


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None  # the HTTP-date form: fall back to our own backoff


def _error(status: int, http_reason: str, body: bytes, headers: Any) -> ApiError:
    """An ApiError from an error answer (a Status object when the API server sent one)."""
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    message = str(data.get("message") or body[:300].decode(errors="replace") or f"HTTP {status}")
    reason = str(data.get("reason") or http_reason or "")
    return ApiError(status, message, reason=reason, retry_after=_retry_after(headers.get("Retry-After")))


class Gone(Exception):
    """The watch's resourceVersion is too old (410): relist."""


class Api:
    """The few calls the backend makes, with dict bodies and dict answers."""

    def __init__(self, opts: Options) -> None:
        self._opts = opts
        self._client: Any = None
        self._core: Any = None
        self._ws_client: Any = None
        self._ws_core: Any = None
        self._errors: tuple[type[BaseException], ...] = ()
        self.on_error: Callable[[int], None] = lambda status: None
        """Called with the status of each failed try (0: no answer), for the metrics."""
        self._wait = ServerWait(retries.wait_jittered_exponential(opts.api_backoff_s, 2.0, opts.api_backoff_max_s))

    async def open(self) -> None:
        from kubernetes.aio import client, config

        cfg = client.Configuration()
        try:
            if self._opts.in_cluster:
                config.load_incluster_config(client_configuration=cfg)
            else:
                await config.load_kube_config(
                    config_file=self._opts.kubeconfig or None,
                    context=self._opts.context or None,
                    client_configuration=cfg,
                )
        except Exception as exc:  # ConfigException, a missing or malformed file
            where = (
                "in-cluster config" if self._opts.in_cluster else (self._opts.kubeconfig or "the default kubeconfig")
            )
            raise ApiError(0, f"cannot load {where}: {exc}") from None
        self._client = client.ApiClient(cfg)
        self._core = client.CoreV1Api(self._client)
        from kubernetes.aio.stream import WsApiClient

        self._ws_client = WsApiClient(cfg)  # pods/exec, for the jobs of pool workers
        self._ws_core = client.CoreV1Api(self._ws_client)
        import aiohttp

        self._errors = (aiohttp.ClientError, OSError, TimeoutError, client.exceptions.ApiException)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
        if self._ws_client is not None:
            await self._ws_client.close()

    async def exec(self, namespace: str, pod: str, command: builtins.list[str]) -> AsyncIterator[tuple[int, bytes]]:
        """Run `command` in the Pod's replica container (pods/exec over a websocket) and yield
        (channel, data) frames: 1 stdout, 2 stderr, 3 the final status.

        Not retried here: a job's session decides what a failure means (kube_jobs.py).

        Raises:
            kube_jobs.ExecError: the session could not be opened (`opened` False) or broke.
        """
        import aiohttp

        try:
            ctx = await self._ws_core.connect_get_namespaced_pod_exec_without_preload_content(
                pod,
                namespace,
                command=command,
                container=kube_objects.CONTAINER,
                stdout=True,
                stderr=True,
                stdin=False,
                tty=False,
            )
            ws = await ctx.__aenter__()
        except aiohttp.WSServerHandshakeError as exc:
            self.on_error(exc.status)
            raise kube_jobs.ExecError(f"exec refused ({exc.status} {exc.message})", opened=False) from None
        except self._errors as exc:
            self.on_error(int(getattr(exc, "status", 0) or 0))
            raise kube_jobs.ExecError(f"exec failed: {type(exc).__name__}: {exc}", opened=False) from None
        try:
            async for message in ws:
                if message.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                    frame = kube_jobs.frames(message)
                    if frame is not None:
                        yield frame
                elif message.type == aiohttp.WSMsgType.ERROR:
                    raise kube_jobs.ExecError(f"exec stream broke: {ws.exception()}", opened=True)
        except self._errors as exc:
            raise kube_jobs.ExecError(f"exec stream broke: {type(exc).__name__}", opened=True) from None
        finally:
            await ctx.__aexit__(None, None, None)

    async def _call(self, method: str, *args: Any, retry: bool = True, **kwargs: Any) -> dict[str, Any]:
        """Call `method` and return the answer's JSON as a dict; transient failures are tried
        again (`api_attempts` in all) unless `retry` is False.

        Raises:
            ApiError: the last try's failure, with `tries` set.
        """
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(max(1, self._opts.api_attempts) if retry else 1),
            wait=self._wait,
            retry=tenacity.retry_if_exception(lambda exc: isinstance(exc, ApiError) and exc.transient),
            before_sleep=lambda state: log.warning(
                "kubernetes API %s failed (%s); try %d of %d",
                method,
                describe(state.outcome.exception()) if state.outcome else "?",  # type: ignore[arg-type]
                state.attempt_number + 1,
                self._opts.api_attempts,
            ),
            reraise=True,
        )
        tries = 0
        try:
            async for attempt in retrying:
                with attempt:
                    tries += 1
                    try:
                        return await self._call_once(method, *args, **kwargs)
                    except ApiError as exc:
                        self.on_error(exc.status)
                        exc.counted = True
                        raise
        except ApiError as exc:
            exc.tries = tries
            raise
        raise AssertionError("unreachable: tenacity either returns or raises")

    async def _call_once(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """One call. The raw (`_without_preload_content`) variants are used: the client's
        generated models reject objects that lack fields they think required, and plain dicts
        are all we need."""
        kwargs.setdefault("_request_timeout", self._opts.request_timeout_s)
        try:
            resp = await getattr(self._core, f"{method}_without_preload_content")(*args, **kwargs)
            try:
                body = await resp.read()
            finally:
                resp.release()
        except self._errors as exc:  # no answer (the client's own ApiException included)
            status = int(getattr(exc, "status", 0) or 0)
            raise ApiError(status, f"{type(exc).__name__}: {exc}".strip().rstrip(":")) from None
        if resp.status >= 400:
            raise _error(resp.status, str(resp.reason or ""), body, resp.headers)
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            data = {}
        return data if isinstance(data, dict) else {}

    async def create(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        ns = body["metadata"]["namespace"]
        return await self._call(f"create_namespaced_{kind}", ns, body)

    async def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        """The object, or None when there is none."""
        try:
            return await self._call(f"read_namespaced_{kind}", name, namespace)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self, kind: str, namespace: str, labels: str, *, retry: bool = True
    ) -> tuple[builtins.list[dict[str, Any]], str]:
        """The objects with `labels`, and the list's resourceVersion."""
        data = await self._call(f"list_namespaced_{kind}", namespace, label_selector=labels, retry=retry)
        return builtins.list(data.get("items") or []), str((data.get("metadata") or {}).get("resourceVersion") or "")

    async def patch(self, kind: str, name: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (the client would send a strategic merge patch for a dict)."""
        return await self._call(f"patch_namespaced_{kind}", name, namespace, body, _content_type=MERGE_PATCH)

    async def delete(
        self, kind: str, name: str, namespace: str, *, grace_s: float | None = None, uid: str = ""
    ) -> bool:
        """Delete one object (only if its uid is `uid`, when given); False when it was not there."""
        kwargs: dict[str, Any] = {}
        if grace_s is not None:
            kwargs["grace_period_seconds"] = max(0, round(grace_s))
        if uid:
            kwargs["body"] = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        try:
            await self._call(f"delete_namespaced_{kind}", name, namespace, **kwargs)
        except ApiError as exc:
            if exc.status == 404 or (uid and exc.status == 409):  # gone, or another object by now
                return False
            raise
        return True

    async def ensure_namespace(self, namespace: str) -> None:
        try:
            await self._call("read_namespace", namespace)
        except ApiError as exc:
            if exc.status != 404:
                raise
            body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
            with contextlib.suppress(ApiError):  # a racing creator is fine
                await self._call("create_namespace", body)

    async def pod_log(self, namespace: str, name: str, *, since_s: int | None) -> AsyncIterator[bytes]:
        """The replica container's log lines, each `<time> <text>`, followed until the container
        ends or `watch_timeout_s` passes (then the caller reads again from where it was).

        Raises:
            ApiError: the log could not be opened or the stream broke (400 while the container
                has not started, 404 once the Pod is gone).
            TimeoutError: the stream's time was up.
        """
        kwargs: dict[str, Any] = {
            "container": kube_objects.CONTAINER,
            "follow": True,
            "timestamps": True,
            "_request_timeout": self._opts.watch_timeout_s,
        }
        if since_s is not None:
            kwargs["since_seconds"] = max(1, since_s)
        try:
            resp = await self._core.read_namespaced_pod_log_without_preload_content(name, namespace, **kwargs)
        except self._errors as exc:
            if isinstance(exc, TimeoutError):
                raise
            raise ApiError(int(getattr(exc, "status", 0) or 0), f"{type(exc).__name__}: {exc}".rstrip(": ")) from None
        try:
            if resp.status >= 400:
                raise _error(resp.status, str(resp.reason or ""), await resp.read(), resp.headers)
            pending = b""
            while True:
                try:
                    chunk = await resp.content.readany()
                except self._errors as exc:
                    if isinstance(exc, TimeoutError):
                        raise
                    raise ApiError(0, f"log stream broke: {type(exc).__name__}") from None
                if not chunk:
                    break
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    yield line + b"\n"
            if pending:
                yield pending
        finally:
            resp.release()

    async def watch_pods(
        self, namespace: str, labels: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Pod events (BOOKMARKs included) until the server ends the watch.

        Raises:
            Gone: the resourceVersion is too old.
            TimeoutError: nothing arrived for `watch_idle_s`.
            ApiError: the watch could not be opened or broke.
        """
        kwargs: dict[str, Any] = {
            "label_selector": labels,
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": max(1, round(self._opts.watch_timeout_s)),
            # The server ends the watch; the idle timer below catches a dead connection. This
            # bound only keeps the client's own default (5 min in all) from cutting it first.
            "_request_timeout": self._opts.watch_timeout_s + self._opts.watch_idle_s + self._opts.request_timeout_s,
        }
        if resource_version:
            kwargs["resource_version"] = resource_version
        try:
            resp = await self._core.list_namespaced_pod_without_preload_content(namespace, **kwargs)
        except self._errors as exc:
            raise ApiError(0, f"{type(exc).__name__}: {exc}".rstrip(": ")) from None
        try:
            if resp.status == 410:
                raise Gone()
            if resp.status >= 400:
                raise _error(resp.status, str(resp.reason or ""), await resp.read(), resp.headers)
            while True:
                try:
                    # Not wait_for: on 3.11 it swallows a cancel that comes with a line (waits.py).
                    async with asyncio.timeout(self._opts.watch_idle_s):
                        line = await resp.content.readline()
                except self._errors as exc:
                    if isinstance(exc, TimeoutError):
                        raise
                    raise ApiError(0, f"watch broke: {type(exc).__name__}") from None
                if not line:
                    return
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                kind, obj = event.get("type", ""), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise ApiError(
                        int(obj.get("code") or 0),
                        str(obj.get("message") or "watch error"),
                        reason=obj.get("reason", ""),
                    )
                yield kind, obj
        finally:
            resp.release()

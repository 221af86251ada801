"""An in-memory Kubernetes API server for tests: the parts of the real one a backend meets.

It serves the core/v1 paths the official client calls (aiohttp, on 127.0.0.1) and keeps the
real server's protocol where a client can get it wrong:

- One resourceVersion counter, bumped by every write. Objects carry `uid`, `resourceVersion`
  and `creationTimestamp`; lists carry the collection's `resourceVersion`. A write that
  changes nothing changes no version and sends no event.
- Label selectors (`k=v`, `k==v`, `k!=v`, `k`, `!k`) filter lists and watches. A change that
  moves an object out of (into) a watch's selector reaches it as DELETED (ADDED).
- Watches: with no resourceVersion (or "0") a watch starts with an ADDED event per object;
  from a resourceVersion it sends only later changes, from a bounded history. A version older
  than the history gets one ERROR event carrying a 410 Expired Status, then the stream ends.
  `timeoutSeconds` ends a watch (default `watch_timeout_s`); with `allowWatchBookmarks` a
  BOOKMARK with the current version is sent whenever `bookmark_interval_s` passes in silence.
- Deletion: a Pod bound to a node is deleted gracefully (`deletionTimestamp` and
  `deletionGracePeriodSeconds` set) and stays until it is deleted with grace 0, as the kubelet
  does once its containers are dead; an unbound Pod goes at once. Finalizers keep any object
  until they are removed. Soon after an object goes, every object whose ownerReferences all
  name gone owners is deleted (the garbage collector); so is one created with such references.
- Errors are Status objects: 404 NotFound (also for a namespace that does not exist), 409
  AlreadyExists, 409 Conflict (a stale resourceVersion or uid precondition), 422 Invalid (a
  name that is not DNS-1123, a changed Pod spec), 415 for patch types not served here.
- `pods/{name}/log` serves a container's output as the kubelet keeps it (`LogSource`, set by
  the fake kubelet): 400 while the container has not started, `timestamps`, `sinceSeconds`,
  `tailLines`, and `follow`, which streams until the container's output ends. Gone with the Pod.
- `pods/{name}/exec` (GET with a websocket upgrade, subprotocol `v4.channel.k8s.io`, as the
  official client opens it) runs `command` in the Pod's container through the kubelet's
  `exec_source`: stdout and stderr come as channel 1 and 2 frames and the end as a channel 3
  Status (`Success`, or `NonZeroExitCode` with the code). 400 when the container is not running.
  A client that goes away closes the session's pipes, and the process runs on (as with a CRI).
- Services of type NodePort and LoadBalancer get a `nodePort` per port; a LoadBalancer's
  `status.loadBalancer.ingress` gets `load_balancer_ip` after `load_balancer_delay_s`.
- PATCH takes JSON merge patches. The `status` subresource changes only `status`; the object
  itself everything else. `pods/{name}/binding` binds a Pod to a node (the scheduler's call).
- Pod admission, as the LimitRanger and ResourceQuota plugins do it: a container's missing
  requests default to its limits; a container over a namespace's LimitRange maximum
  (`set_limit_range`) or a Pod that would take a ResourceQuota (`set_quota`) past its hard
  limits is refused with 403 Forbidden and the real server's message.

Not here: strategic-merge and JSON patches, PUT, field and set-based selectors, pagination,
RBAC, controllers other than the garbage collector.

Scripted faults, for the client's error handling (requests whose User-Agent starts with one of
`exempt_agents`, the fake kubelet's, are never faulted):
- `fail(verb, resource, status, times=...)`: the next matching requests answer `status`
  (429 with Retry-After); `after_commit=True` applies a write first, as when an answer is lost.
- `stall(times=...)`: the next watches send nothing at all until their timeout.
- `compact()`: forget the history, so every resume from an earlier version gets 410.
- `end_watches()`: end every open watch now, as an API server restart does.
- `set_limit_range(namespace, maximum)` and `set_quota(namespace, name, hard)`: the
  namespace's LimitRange maximum per container and a ResourceQuota (see Pod admission).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import copy
import dataclasses
import datetime
import itertools
import json
import os
import re
import secrets
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

KINDS = {
    "pods": "Pod",
    "services": "Service",
    "secrets": "Secret",
    "configmaps": "ConfigMap",
    "namespaces": "Namespace",
}
MERGE_PATCH = "application/merge-patch+json"
_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_END = object()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(frozen=True)
class LogSource:
    """A container's log as the kubelet keeps it: lines `<RFC 3339 time> <text>` in `path`;
    `done()` once nothing more will be written."""

    path: str
    done: Callable[[], bool]


class StatusError(Exception):
    """An error answer: a Status object with `code`."""

    def __init__(self, code: int, message: str, *, reason: str = "", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or _REASONS.get(code, "Unknown")
        self.headers = headers or {}

    def status(self) -> dict[str, Any]:
        """The Status object the real API server sends."""
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


def _not_found(resource: str, name: str) -> StatusError:
    return StatusError(404, f'{resource} "{name}" not found')


def log_time_ns(text: str) -> int:
    """An RFC 3339 time (fractional seconds optional) in nanoseconds since the epoch."""
    whole, _, frac = text.rstrip("Z").partition(".")
    seconds = datetime.datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.UTC).timestamp()
    return int(seconds) * 1_000_000_000 + int((frac + "000000000")[:9])


_QUANTITY_UNITS = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}


def quantity(text: str) -> float:
    """A Kubernetes quantity (`500m`, `2`, `16Gi`) as a number (enough of the grammar for tests)."""
    for unit in sorted(_QUANTITY_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * _QUANTITY_UNITS[unit]
    return float(text)


def pod_requests(pod: dict[str, Any]) -> dict[str, float]:
    """What a Pod asks of a node: its containers' requests summed (limits where a request is unset)."""
    total: dict[str, float] = collections.defaultdict(float)
    for container in (pod.get("spec") or {}).get("containers") or []:
        res = container.get("resources") or {}
        for name, text in {**(res.get("limits") or {}), **(res.get("requests") or {})}.items():
            total[name] += quantity(str(text))
    return dict(total)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: dicts merge, None deletes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def parse_selector(text: str) -> list[tuple[str, str, str]]:
    """A label selector as (key, op, value) terms; op is =, !=, exists or !exists.

    Raises:
        StatusError: 400 for syntax this server does not take (set-based terms).
    """
    terms = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if " in " in part or " notin " in part or "(" in part:
            raise StatusError(400, f"unable to parse requirement: set-based selectors are not served here: {part}")
        if "!=" in part:
            key, _, value = part.partition("!=")
            terms.append((key.strip(), "!=", value.strip()))
        elif "=" in part:
            key, _, value = part.partition("==" if "==" in part else "=")
            terms.append((key.strip(), "=", value.strip()))
        elif part.startswith("!"):
            terms.append((part[1:].strip(), "!exists", ""))
        else:
            terms.append((part, "exists", ""))
    return terms


def selects(terms: list[tuple[str, str, str]], obj: dict[str, Any] | None) -> bool:
    """Whether `obj`'s labels satisfy every term."""
    if obj is None:
        return False
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for key, op, value in terms:
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "exists" and key not in labels:
            return False
        if op == "!exists" and key in labels:
            return False
    return True


@dataclasses.dataclass
class Fault:
    """A scripted failure; see `KubeApi.fail`."""

    verb: str
    resource: str
    status: int
    times: int
    name: str = ""
    message: str = ""
    retry_after: int | None = None
    after_commit: bool = False
    hits: int = 0


@dataclasses.dataclass
class Event:
    """One change, as kept in the history."""

    rv: int
    resource: str
    namespace: str
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclasses.dataclass
class Logged:
    """One request as received: method, path, query, answer status, User-Agent."""

    method: str
    path: str
    query: dict[str, str]
    status: int = 0
    agent: str = ""


@dataclasses.dataclass(eq=False)
class _Watcher:
    resource: str
    namespace: str
    terms: list[tuple[str, str, str]]
    queue: asyncio.Queue[Any] = dataclasses.field(default_factory=asyncio.Queue)

    def translate(self, event: Event) -> tuple[str, dict[str, Any]] | None:
        """What this watch sees of `event` (selector moves become ADDED or DELETED)."""
        if event.resource != self.resource or (self.namespace and event.namespace != self.namespace):
            return None
        now, before = selects(self.terms, event.obj), selects(self.terms, event.old)
        if event.type == "MODIFIED":
            if now and before:
                return "MODIFIED", event.obj
            if now:
                return "ADDED", event.obj
            if before:
                return "DELETED", event.obj
            return None
        return (event.type, event.obj) if now else None


class KubeApi:
    """The in-memory API server; see the module docstring. Runs on one asyncio loop."""

    def __init__(
        self,
        *,
        history: int = 1000,
        bookmark_interval_s: float = 1.0,
        watch_timeout_s: float = 1800.0,
        gc_delay_s: float = 0.05,
        exempt_agents: tuple[str, ...] = ("fake-kubelet",),
    ) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.history: collections.deque[Event] = collections.deque()
        self.history_limit = history
        self.bookmark_interval_s = bookmark_interval_s
        self.watch_timeout_s = watch_timeout_s
        self.gc_delay_s = gc_delay_s
        self.exempt_agents = exempt_agents
        self.faults: list[Fault] = []
        self.stalls = 0
        self.log: list[Logged] = []
        self.compacted = 0
        self._rv = itertools.count(1001)
        self.rv = 1000
        self._watchers: set[_Watcher] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""
        # Where a Pod's container log is read (the kubelet's side); None: no logs anywhere.
        self.log_source: Callable[[str, str], LogSource | None] | None = None
        # Starts a command in a Pod's running container (the kubelet's side); None: no exec.
        self.exec_source: Callable[[str, str, list[str]], Awaitable[asyncio.subprocess.Process | None]] | None = None
        self.log_poll_s = 0.05
        # NodePort and LoadBalancer Services: node ports from 30000, the ingress address a
        # cloud's controller would publish after a while.
        self._node_ports = itertools.count()
        self.load_balancer_ip = "127.0.0.1"
        self.load_balancer_delay_s = 0.05
        # Pod admission: per namespace, a LimitRange's maximum per container and ResourceQuotas.
        self.limit_ranges: dict[str, dict[str, str]] = {}
        self.quotas: dict[str, dict[str, dict[str, str]]] = {}
        self.add_namespace("default")

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1") -> str:
        """Serve on a free port of `host`; returns the base URL."""
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # A client that goes away cancels its handler, so stalled watches end with it.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        """End every watch and stop serving."""
        self.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- scripting -------------------------------------------------------------------------

    def add_namespace(self, name: str) -> None:
        """Make namespace `name` exist."""
        if ("namespaces", "", name) not in self.objects:
            self._create("namespaces", "", {"metadata": {"name": name}})

    def fail(
        self,
        verb: str,
        resource: str,
        status: int,
        *,
        times: int = 1,
        name: str = "",
        message: str = "",
        retry_after: int | None = None,
        after_commit: bool = False,
    ) -> Fault:
        """Make the next `times` requests of `verb` (create, get, list, watch, patch, delete,
        or * for any) on `resource` (and object `name`, if given) answer `status`.

        A 429 carries `Retry-After` (`retry_after`, default 1 s). With `after_commit` a write is
        applied before the error is returned. Returns the fault; its `hits` counts matches.
        """
        if status == 429 and retry_after is None:
            retry_after = 1
        fault = Fault(verb, resource, status, times, name, message, retry_after, after_commit)
        self.faults.append(fault)
        return fault

    def set_limit_range(self, namespace: str, maximum: dict[str, str]) -> None:
        """A LimitRange in `namespace`: no container may ask for more than `maximum` (resource ->
        quantity) as its limit (or its request, without a limit). Empty: none."""
        self.limit_ranges[namespace] = dict(maximum)

    def set_quota(self, namespace: str, name: str, hard: dict[str, str]) -> None:
        """A ResourceQuota `name` in `namespace`: `pods`, `requests.<resource>` (`cpu` and `memory`
        alone mean their requests) and `limits.<resource>`, summed over the namespace's Pods
        that have not ended. Empty `hard` removes it."""
        quotas = self.quotas.setdefault(namespace, {})
        if hard:
            quotas[name] = dict(hard)
        else:
            quotas.pop(name, None)

    def stall(self, times: int = 1) -> None:
        """The next `times` watches are accepted and then send nothing until their timeout."""
        self.stalls += times

    def compact(self) -> None:
        """Forget every change so far: a watch resumed from an earlier version gets 410."""
        self.history.clear()
        self.compacted = self.rv

    def end_watches(self) -> None:
        """End every open watch (their clients see the stream end)."""
        for watcher in self._watchers:
            watcher.queue.put_nowait(_END)

    @property
    def open_watches(self) -> int:
        """How many watches are open."""
        return len(self._watchers)

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object, or None (a copy)."""
        obj = self.objects.get((resource, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def names(self, resource: str, namespace: str) -> list[str]:
        """Names of the stored objects of `resource` in `namespace`."""
        return sorted(n for r, ns, n in self.objects if r == resource and ns == namespace)

    # ---- HTTP ------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        entry = Logged(request.method, request.path, dict(request.query), agent=request.headers.get("User-Agent", ""))
        self.log.append(entry)
        try:
            response = await self._route(request, entry)
        except StatusError as exc:
            response = web.json_response(exc.status(), status=exc.code, headers=exc.headers)
        entry.status = response.status
        return response

    async def _route(self, request: web.Request, entry: Logged) -> web.StreamResponse:
        path = request.path.rstrip("/")
        if path in ("/version", "/livez", "/readyz"):
            return web.json_response({"major": "1", "minor": "33", "gitVersion": "v1.33.0-emulated"})
        parts = path.split("/")[1:]
        if parts[:2] != ["api", "v1"] or len(parts) < 3:
            raise StatusError(404, "the server could not find the requested resource")
        rest = parts[2:]
        # /api/v1/namespaces[/{name}] is cluster-scoped; /api/v1/namespaces/{ns}/{resource}... is not.
        if rest[0] == "namespaces" and len(rest) <= 2:
            resource, namespace, name, sub = "namespaces", "", (rest[1] if len(rest) == 2 else ""), ""
        elif rest[0] == "namespaces":
            namespace, resource = rest[1], rest[2]
            name = rest[3] if len(rest) > 3 else ""
            sub = rest[4] if len(rest) > 4 else ""
        else:
            resource, namespace, name, sub = rest[0], "", "", ""  # all namespaces: list and watch only
        if resource not in KINDS or len(rest) > 5:
            raise StatusError(404, "the server could not find the requested resource")
        query = dict(request.query)
        method = request.method
        watching = query.get("watch") in ("true", "1")
        verb = {
            ("GET", True): "get",
            ("GET", False): "watch" if watching else "list",
            ("POST", False): "create",
            ("POST", True): "create",
            ("PATCH", True): "patch",
            ("DELETE", True): "delete",
        }.get((method, bool(name)))
        if verb is None:
            raise StatusError(405, f"{method} is not served here for this path")
        body: Any = None
        if method in ("POST", "PATCH", "DELETE"):
            raw = await request.read()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                raise StatusError(400, "the request body is not JSON") from None
        if sub == "log" and resource == "pods" and method == "GET":
            verb = "log"
        if sub == "exec" and resource == "pods" and method in ("GET", "POST"):
            verb = "exec"
        fault = self._fault(verb, resource, name or str((body or {}).get("metadata", {}).get("name", "")), request)
        if fault is not None and not fault.after_commit:
            raise self._fault_error(fault, resource, name)
        if verb == "log":
            return await self._pod_log(request, namespace, name, query)
        if verb == "exec":
            return await self._exec(request, namespace, name)
        if verb == "watch":
            return await self._watch(request, resource, namespace, query)
        result, status = self._apply(verb, resource, namespace, name, sub, query, body, request.content_type)
        if fault is not None:
            raise self._fault_error(fault, resource, name)
        return web.json_response(result, status=status)

    def _fault(self, verb: str, resource: str, name: str, request: web.Request) -> Fault | None:
        if request.headers.get("User-Agent", "").startswith(self.exempt_agents):
            return None
        for fault in self.faults:
            if fault.times <= 0 or fault.verb not in (verb, "*") or fault.resource != resource:
                continue
            if fault.name and fault.name != name:
                continue
            fault.times -= 1
            fault.hits += 1
            return fault
        return None

    @staticmethod
    def _fault_error(fault: Fault, resource: str, name: str) -> StatusError:
        headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
        default = {
            403: f'{resource} "{name}" is forbidden: User "system:serviceaccount:replicas:x" cannot do that',
            409: "Operation cannot be fulfilled: the object has been modified; please apply your changes "
            "to the latest version and try again",
            429: "Too many requests, please try again later.",
        }.get(fault.status, f"scripted failure {fault.status}")
        return StatusError(fault.status, fault.message or default, headers=headers)

    def _apply(
        self,
        verb: str,
        resource: str,
        namespace: str,
        name: str,
        sub: str,
        query: dict[str, str],
        body: Any,
        content_type: str,
    ) -> tuple[dict[str, Any], int]:
        if verb == "list":
            return self._list(resource, namespace, query), 200
        if verb == "create" and name:
            if sub != "binding":
                raise StatusError(405, "POST to an object is not served here")
            return self._bind(namespace, name, body or {}), 201
        if sub and (sub != "status" or verb not in ("get", "patch")):
            raise StatusError(404, "the server could not find the requested resource")
        if verb == "create":
            return self._create(resource, namespace, body or {}), 201
        if verb == "get":
            obj = self.objects.get((resource, namespace, name))
            if obj is None:
                raise _not_found(resource, name)
            return obj, 200
        if verb == "patch":
            if content_type != MERGE_PATCH:
                raise StatusError(
                    415, f"the body of the request was in an unknown format; this server takes {MERGE_PATCH}"
                )
            return self._patch(resource, namespace, name, body or {}, status_only=sub == "status"), 200
        options = body or {}
        grace_text = query.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
        grace = int(grace_text) if grace_text not in (None, "") else None
        return self._delete(resource, namespace, name, grace, options.get("preconditions") or {}), 200

    # ---- reads -----------------------------------------------------------------------------

    async def _pod_log(
        self, request: web.Request, namespace: str, name: str, query: dict[str, str]
    ) -> web.StreamResponse:
        """A Pod's container log, as the API server relays it from the kubelet."""
        pod = self.objects.get(("pods", namespace, name))
        if pod is None:
            raise _not_found("pods", name)
        containers = [c.get("name", "") for c in (pod.get("spec") or {}).get("containers") or []]
        container = query.get("container") or (containers[0] if len(containers) == 1 else "")
        if container not in containers:
            raise StatusError(400, f"container {container} is not valid for pod {name}", reason="BadRequest")
        source = self.log_source(namespace, name) if self.log_source is not None else None
        if source is None or not os.path.exists(source.path):  # noqa: ASYNC240 - a local file, tests only
            raise StatusError(
                400,
                f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating',
                reason="BadRequest",
            )
        follow = query.get("follow") in ("true", "True", "1")
        timestamps = query.get("timestamps") in ("true", "True", "1")
        since_ns = 0
        if query.get("sinceSeconds"):
            since_ns = (datetime.datetime.now(datetime.UTC).timestamp() - int(query["sinceSeconds"])) * 1e9
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/plain"})
        await response.prepare(request)

        def render(line: bytes) -> bytes | None:
            stamp, _, text = line.partition(b" ")
            if since_ns and log_time_ns(stamp.decode(errors="replace")) < since_ns:
                return None
            return line if timestamps else text

        with open(source.path, "rb") as fh:  # noqa: ASYNC230 - a local file, tests only
            *whole, pending = fh.read().split(b"\n")
            lines = [line + b"\n" for line in whole]
            if query.get("tailLines"):
                lines = lines[-int(query["tailLines"]) :] if int(query["tailLines"]) > 0 else []
            out = [r for r in (render(line) for line in lines) if r is not None]
            if out:
                await response.write(b"".join(out))
            while follow:
                done = source.done()  # read before the last look, so nothing written is missed
                chunk = fh.read()
                if chunk:
                    pending += chunk
                    *whole, pending = pending.split(b"\n")
                    out = [r for r in (render(line + b"\n") for line in whole) if r is not None]
                    if out:
                        await response.write(b"".join(out))
                    continue
                if done or ("pods", namespace, name) not in self.objects:
                    break
                await asyncio.sleep(self.log_poll_s)
            if pending and (rest := render(pending)) is not None:
                await response.write(rest)
        await response.write_eof()
        return response

    async def _exec(self, request: web.Request, namespace: str, name: str) -> web.StreamResponse:
        command = request.query.getall("command", [])
        if ("pods", namespace, name) not in self.objects:
            raise _not_found("pods", name)
        if not command:
            raise StatusError(400, "you must specify at least one command for the container")
        proc = await self.exec_source(namespace, name, command) if self.exec_source else None
        if proc is None:
            raise StatusError(400, f'container not found ("{name}"): the container is not running')
        ws = web.WebSocketResponse(protocols=("v4.channel.k8s.io",))
        await ws.prepare(request)

        async def pump(stream: asyncio.StreamReader | None, channel: int) -> None:
            while stream is not None and (chunk := await stream.read(65536)):
                await ws.send_bytes(bytes([channel]) + chunk)

        async def client_gone() -> None:
            async for _ in ws:  # nothing comes (stdin is off) until the client closes
                pass

        pumps = asyncio.gather(pump(proc.stdout, 1), pump(proc.stderr, 2))
        watcher = asyncio.ensure_future(client_gone())
        try:
            done, _ = await asyncio.wait({pumps, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if pumps in done:
                code = await proc.wait()
                if code == 0:
                    status: dict[str, Any] = {"metadata": {}, "status": "Success"}
                else:
                    status = {
                        "metadata": {},
                        "status": "Failure",
                        "message": f"command terminated with non-zero exit code: {code}",
                        "reason": "NonZeroExitCode",
                        "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
                    }
                await ws.send_bytes(b"\x03" + json.dumps(status).encode())
                await ws.close()
        except (ConnectionError, RuntimeError):
            pass  # the client went away
        finally:
            watcher.cancel()
            pumps.cancel()
            # As a CRI does when the client is gone: the session's pipes close, its process runs on.
            transport = getattr(proc, "_transport", None)
            for fd in (1, 2):
                pipe = transport.get_pipe_transport(fd) if transport is not None else None
                if pipe is not None:
                    pipe.close()
        return ws

    def _list(self, resource: str, namespace: str, query: dict[str, str]) -> dict[str, Any]:
        if query.get("fieldSelector"):
            raise StatusError(400, "field selectors are not served here")
        terms = parse_selector(query.get("labelSelector", ""))
        items = [
            obj
            for (r, ns, _), obj in sorted(self.objects.items())
            if r == resource and (not namespace or ns == namespace) and selects(terms, obj)
        ]
        return {
            "kind": f"{KINDS[resource]}List",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self.rv)},
            "items": items,
        }

    async def _watch(
        self, request: web.Request, resource: str, namespace: str, query: dict[str, str]
    ) -> web.StreamResponse:
        terms = parse_selector(query.get("labelSelector", ""))
        since = query.get("resourceVersion", "")
        if since not in ("", "0") and not since.isdigit():
            raise StatusError(400, f"invalid resource version {since!r}")
        timeout = float(query.get("timeoutSeconds") or self.watch_timeout_s)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        if self.stalls > 0 and not request.headers.get("User-Agent", "").startswith(self.exempt_agents):
            self.stalls -= 1
            await asyncio.sleep(timeout)
            return response
        watcher = _Watcher(resource, namespace, terms)
        if since in ("", "0"):
            first = [
                ("ADDED", obj)
                for (r, ns, _), obj in sorted(self.objects.items())
                if watcher.translate(Event(0, r, ns, "ADDED", obj, None))
            ]
        elif int(since) < self.compacted:
            expired = StatusError(410, f"too old resource version: {since} ({self.compacted + 1})", reason="Expired")
            await send("ERROR", expired.status())
            return response
        else:
            first = [seen for e in self.history if e.rv > int(since) and (seen := watcher.translate(e))]
        self._watchers.add(watcher)
        try:
            for kind, obj in first:
                await send(kind, obj)
            quiet_since = loop.time()
            while (left := deadline - loop.time()) > 0:
                wait = min(left, max(0.0, quiet_since + self.bookmark_interval_s - loop.time())) if bookmarks else left
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), wait)
                except TimeoutError:
                    if bookmarks and loop.time() >= quiet_since + self.bookmark_interval_s:
                        await send(
                            "BOOKMARK",
                            {
                                "kind": KINDS[resource],
                                "apiVersion": "v1",
                                "metadata": {"resourceVersion": str(self.rv)},
                            },
                        )
                        quiet_since = loop.time()
                    continue
                if item is _END:
                    break
                await send(*item)
                quiet_since = loop.time()
        except (ConnectionError, RuntimeError):
            pass  # the client went away
        finally:
            self._watchers.discard(watcher)
        return response

    # ---- writes ----------------------------------------------------------------------------

    def _next_rv(self) -> str:
        self.rv = next(self._rv)
        return str(self.rv)

    def _record(
        self, resource: str, namespace: str, kind: str, obj: dict[str, Any], old: dict[str, Any] | None
    ) -> None:
        event = Event(self.rv, resource, namespace, kind, copy.deepcopy(obj), old)
        self.history.append(event)
        while len(self.history) > self.history_limit:
            self.compacted = self.history.popleft().rv
        for watcher in self._watchers:
            seen = watcher.translate(event)
            if seen is not None:
                watcher.queue.put_nowait(seen)

    def _create(self, resource: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = dict(body.get("metadata") or {})
        if namespace and ("namespaces", "", namespace) not in self.objects:
            raise StatusError(404, f'namespaces "{namespace}" not found')
        if meta.get("namespace") and meta["namespace"] != namespace:
            raise StatusError(
                400, "the namespace of the provided object does not match the namespace sent on the request"
            )
        name = meta.get("name") or ""
        if not name and meta.get("generateName"):
            name = f"{meta['generateName']}{secrets.token_hex(3)[:5]}"
        kind = KINDS[resource]
        if not name:
            raise StatusError(
                422, f"{kind} is invalid: metadata.name: Required value: name or generateName is required"
            )
        label_only = resource in ("services", "namespaces")
        valid = _DNS_LABEL if label_only else _DNS_SUBDOMAIN
        if len(name) > (63 if label_only else 253) or not valid.match(name):
            raise StatusError(
                422,
                f'{kind} "{name}" is invalid: metadata.name: Invalid value: "{name}": must be a lowercase '
                "RFC 1123 " + ("label" if label_only else "subdomain"),
            )
        key = (resource, namespace, name)
        if key in self.objects:
            raise StatusError(409, f'{resource} "{name}" already exists', reason="AlreadyExists")
        obj = copy.deepcopy(body)
        obj.update(kind=kind, apiVersion="v1")
        meta.update(name=name, uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion=self._next_rv())
        for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "generateName"):
            meta.pop(field, None)
        if namespace:
            meta["namespace"] = namespace
        obj["metadata"] = meta
        self._default(resource, obj)
        if resource == "pods":
            self._admit(namespace, name, obj)
        self.objects[key] = obj
        self._record(resource, namespace, "ADDED", obj, None)
        if meta.get("ownerReferences"):
            self._collect_soon(namespace)
        if resource == "services" and obj["spec"]["type"] == "LoadBalancer":
            where = (namespace, obj["metadata"]["name"], obj["metadata"]["uid"])
            asyncio.get_running_loop().call_later(self.load_balancer_delay_s, self._publish_load_balancer, *where)
        return obj

    def _default(self, resource: str, obj: dict[str, Any]) -> None:
        """What the API server fills in on create."""
        if resource == "pods":
            spec = obj.setdefault("spec", {})
            spec.setdefault("terminationGracePeriodSeconds", 30)
            spec.setdefault("restartPolicy", "Always")
            for container in spec.get("containers") or []:
                res = container.get("resources") or {}
                if res.get("limits"):  # a request left out is the limit
                    res["requests"] = {**res["limits"], **(res.get("requests") or {})}
            obj["status"] = {"phase": "Pending"}
        elif resource == "secrets":
            data = dict(obj.get("data") or {})
            for key, value in (obj.pop("stringData", None) or {}).items():
                data[key] = base64.b64encode(str(value).encode()).decode()
            obj["data"] = data
            obj.setdefault("type", "Opaque")
        elif resource == "services":
            spec = obj.setdefault("spec", {})
            if not spec.get("type"):
                spec["type"] = "ClusterIP"
            spec.setdefault("clusterIP", f"10.96.{self.rv // 250 % 250}.{self.rv % 250 + 1}")
            if spec["type"] in ("NodePort", "LoadBalancer"):
                for port in spec.get("ports") or []:
                    port.setdefault("nodePort", 30000 + next(self._node_ports) % 2768)
            obj["status"] = {"loadBalancer": {}}
        elif resource == "namespaces":
            obj["status"] = {"phase": "Active"}

    def _admit(self, namespace: str, name: str, pod: dict[str, Any]) -> None:
        """The LimitRanger and ResourceQuota admission plugins, with their messages.

        Raises:
            StatusError: 403 Forbidden when the Pod breaks a LimitRange or a quota.
        """
        forbidden = f'pods "{name}" is forbidden'
        maximum = self.limit_ranges.get(namespace) or {}
        for container in pod["spec"].get("containers") or []:
            res = container.get("resources") or {}
            for resource, most in sorted(maximum.items()):
                limit = (res.get("limits") or {}).get(resource)
                asked, what = (
                    (limit, "limit") if limit is not None else ((res.get("requests") or {}).get(resource), "request")
                )
                if asked is not None and quantity(str(asked)) > quantity(most):
                    raise StatusError(
                        403, f"{forbidden}: maximum {resource} usage per Container is {most}, but {what} is {asked}"
                    )
        for quota, hard in sorted((self.quotas.get(namespace) or {}).items()):
            used = collections.Counter[str]()
            for (kind, ns, _), other in self.objects.items():
                if kind == "pods" and ns == namespace and other["status"].get("phase") not in ("Succeeded", "Failed"):
                    used.update(self._quota_usage(other))
            wanted = self._quota_usage(pod)
            over = sorted(k for k in hard if wanted.get(k, 0.0) and used[k] + wanted[k] > quantity(hard[k]))
            if over:
                requested = ",".join(f"{k}={wanted[k]:g}" for k in over)
                taken = ",".join(f"{k}={used[k]:g}" for k in over)
                limited = ",".join(f"{k}={hard[k]}" for k in over)
                raise StatusError(
                    403,
                    f"{forbidden}: exceeded quota: {quota}, requested: {requested}, used: {taken}, limited: {limited}",
                )

    @staticmethod
    def _quota_usage(pod: dict[str, Any]) -> dict[str, float]:
        """What a Pod counts against a quota: `pods`, `requests.*` (and bare cpu, memory), `limits.*`."""
        usage: dict[str, float] = collections.defaultdict(float)
        usage["pods"] = 1.0
        for container in pod["spec"].get("containers") or []:
            res = container.get("resources") or {}
            for kind in ("requests", "limits"):
                for resource, text in (res.get(kind) or {}).items():
                    usage[f"{kind}.{resource}"] += quantity(str(text))
                    if kind == "requests" and resource in ("cpu", "memory"):
                        usage[resource] += quantity(str(text))
        return dict(usage)

    def _publish_load_balancer(self, namespace: str, name: str, uid: str) -> None:
        """What a cloud's load-balancer controller does: write the ingress address to the status."""
        svc = self.objects.get(("services", namespace, name))
        if svc is None or svc["metadata"]["uid"] != uid:
            return
        old = copy.deepcopy(svc)
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": self.load_balancer_ip}]}}
        svc["metadata"]["resourceVersion"] = self._next_rv()
        self._record("services", namespace, "MODIFIED", svc, old)

    def _bind(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        node = ((body.get("target") or {}).get("name")) or ""
        pod = self.objects.get(("pods", namespace, name))
        if pod is None:
            raise _not_found("pods", name)
        bound = pod.get("spec", {}).get("nodeName")
        if bound:
            raise StatusError(
                409, f'Operation cannot be fulfilled on pods/binding "{name}": already assigned to {bound}'
            )
        old = copy.deepcopy(pod)
        pod["spec"]["nodeName"] = node
        pod["metadata"]["resourceVersion"] = self._next_rv()
        self._record("pods", namespace, "MODIFIED", pod, old)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _patch(
        self, resource: str, namespace: str, name: str, patch: dict[str, Any], *, status_only: bool
    ) -> dict[str, Any]:
        obj = self.objects.get((resource, namespace, name))
        if obj is None:
            raise _not_found(resource, name)
        wanted = str((patch.get("metadata") or {}).get("resourceVersion") or "")
        if wanted and wanted != obj["metadata"]["resourceVersion"]:
            raise StatusError(
                409,
                f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
            )
        if status_only:
            merged = copy.deepcopy(obj)
            merged["status"] = merge_patch(obj.get("status") or {}, patch.get("status") or {})
        else:
            merged = merge_patch(obj, {k: v for k, v in patch.items() if k != "status"})
            meta = merged.setdefault("metadata", {})
            for field in (
                "name",
                "namespace",
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "resourceVersion",
            ):
                if field in obj["metadata"]:
                    meta[field] = obj["metadata"][field]
                else:
                    meta.pop(field, None)
            if resource == "pods" and merged.get("spec") != obj.get("spec"):
                raise StatusError(
                    422,
                    f'Pod "{name}" is invalid: spec: Forbidden: pod updates may not change fields other '
                    "than the image, activeDeadlineSeconds, tolerations and terminationGracePeriodSeconds",
                )
        if merged == obj:
            return obj
        merged["metadata"]["resourceVersion"] = self._next_rv()
        old, self.objects[(resource, namespace, name)] = obj, merged
        self._record(resource, namespace, "MODIFIED", merged, old)
        meta = merged["metadata"]
        done = resource != "pods" or meta.get("deletionGracePeriodSeconds") == 0
        if meta.get("deletionTimestamp") and done and not meta.get("finalizers"):
            self._remove(resource, namespace, name)
        elif meta.get("ownerReferences") != old["metadata"].get("ownerReferences"):
            self._collect_soon(namespace)
        return merged

    def _delete(
        self, resource: str, namespace: str, name: str, grace: int | None, preconditions: dict[str, Any]
    ) -> dict[str, Any]:
        key = (resource, namespace, name)
        obj = self.objects.get(key)
        if obj is None:
            raise _not_found(resource, name)
        meta = obj["metadata"]
        if preconditions.get("uid") and preconditions["uid"] != meta["uid"]:
            raise StatusError(
                409,
                f"Precondition failed: UID in precondition: {preconditions['uid']}, UID in object meta: {meta['uid']}",
            )
        if resource == "namespaces":
            for other in [k for k in self.objects if k[1] == name]:
                self._remove(*other)
            return self._remove(*key)
        if resource == "pods":
            if grace is None:
                grace = int(obj.get("spec", {}).get("terminationGracePeriodSeconds", 30))
            if not obj.get("spec", {}).get("nodeName"):
                grace = 0  # never ran anywhere: nothing to stop
            current = meta.get("deletionGracePeriodSeconds")
            if current is not None and grace >= current:
                return obj  # already terminating with a grace period at least as short
        else:
            grace = 0
        if grace == 0 and not meta.get("finalizers"):
            return self._remove(*key)
        old = copy.deepcopy(obj)
        meta.setdefault("deletionTimestamp", _now())
        meta["deletionGracePeriodSeconds"] = grace
        meta["resourceVersion"] = self._next_rv()
        self._record(resource, namespace, "MODIFIED", obj, old)
        return obj

    def _remove(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        obj = self.objects.pop((resource, namespace, name))
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._record(resource, namespace, "DELETED", obj, None)
        self._collect_soon(namespace)
        return obj

    # ---- the garbage collector -------------------------------------------------------------

    def _collect_soon(self, namespace: str) -> None:
        try:
            asyncio.get_running_loop().call_later(self.gc_delay_s, self._collect, namespace)
        except RuntimeError:
            pass  # not serving yet (namespaces made before start)

    def _collect(self, namespace: str) -> None:
        """Delete every object whose owners are all gone (background propagation)."""
        uids = {obj["metadata"]["uid"] for (_, ns, _), obj in self.objects.items() if ns == namespace}
        for (resource, ns, name), obj in list(self.objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if ns != namespace or not refs or obj["metadata"].get("deletionTimestamp"):
                continue
            if all(ref.get("uid") not in uids for ref in refs) and (resource, ns, name) in self.objects:
                self._delete(resource, ns, name, None, {})

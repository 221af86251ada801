"""The spans of replicas starting, for traces that follow a create or an update to READY.

One trace per `CreateService` (or `UpdateService`): its server span is the root; each replica
of the new version gets a `replica.start` span under it, from its launch to READY (or to its
failure). That span's context goes to the provisioner with the `Launch` call (gRPC metadata)
and to the prober in the probe target, so their spans join the same trace:

    CreateService (controller)
    └── replica.start  service=web replica_id=1 version=1
        ├── Launch (provisioner; an event per launch event: QUEUED, PROVISIONING, RUNNING)
        ├── probe (prober; the first probe and each change of outcome)
        └── replica.ready

Spans end when the service's hub publishes the replica READY, failed or removed, so nothing
here depends on how the reconciler is built. While traces are off every call returns at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

import yaml
from opentelemetry import context as otel_context
from opentelemetry import trace

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import tracing

ORIGIN_TTL_S = 600.0
"""Replicas launched this long after a create or update start traces of their own."""
MAX_OPEN = 10_000
"""Replica spans open at most (each is a few hundred bytes); more start no span."""

LP = res.LaunchPhase
_ENDED = frozenset(
    {
        res.REPLICA_STATUS_FAILED,
        res.REPLICA_STATUS_FAILED_INITIAL_DELAY,
        res.REPLICA_STATUS_FAILED_PROBING,
        res.REPLICA_STATUS_FAILED_PROVISION,
        res.REPLICA_STATUS_FAILED_CLEANUP,
        res.REPLICA_STATUS_PREEMPTED,
        res.REPLICA_STATUS_SHUTTING_DOWN,
    }
)


@dataclasses.dataclass(frozen=True)
class _Origin:
    parent: otel_context.Context
    first_version: int
    at: float


@dataclasses.dataclass
class _Open:
    span: trace.Span
    status: int


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's when present: 5x faster


def service_name_of(yaml_text: str) -> str:
    """The `name:` of a service YAML, or "" (the controller's own parse reports what is wrong)."""
    try:
        doc = yaml.load(yaml_text, Loader=_LOADER)  # a safe loader (no object tags)
    except yaml.YAMLError:
        return ""
    name = doc.get("name") if isinstance(doc, dict) else None
    return name if isinstance(name, str) else ""


class ReplicaTraces:
    """Replica spans of one controller: a hub observer, plus what the Launch call and the probe
    target carry."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._origins: dict[str, _Origin] = {}
        self._open: dict[tuple[str, int], _Open] = {}
        self._since = time.time()

    @contextlib.contextmanager
    def origin(self, service: Callable[[], str], first_version: Callable[[], int]) -> Iterator[None]:
        """Around a create or update: replicas of `service` from `first_version` on start under
        the current span (the RPC's server span). The callables run only while traces are on."""
        if not tracing.current().enabled:
            yield
            return
        span = trace.get_current_span()
        try:
            name = service() if span.get_span_context().is_valid else ""
            first = first_version() if name else 0
        except Exception:  # an unknown service, a bad spec: the call itself says so
            name = ""
        if not name:
            yield
            return
        span.set_attribute(tracing.SERVICE, name)
        self._origins[name] = _Origin(trace.set_span_in_context(span), first, self._now())
        try:
            yield
        except BaseException:
            self._origins.pop(name, None)  # nothing was created or updated
            raise

    def launch_metadata(self, service: str, replica_id: int, version: int) -> tuple[tuple[str, str], ...]:
        """gRPC metadata for the replica's Launch call: its start span as the parent."""
        if not tracing.current().enabled:
            return ()
        span = self._span(service, replica_id, version)
        return tracing.metadata(span) if span is not None else ()

    def traceparent(self, r: res.Replica) -> str:
        """The probe target's traceparent while the replica has not been READY yet."""
        if not tracing.current().enabled or r.facts.HasField("first_ready_time"):
            return ""
        found = self._open.get((r.service, r.replica_id))
        return tracing.traceparent(found.span) if found is not None else ""

    def published(self, msg: api.WatchServiceResponse) -> None:
        """A hub observer: open spans of replicas that start launching, end them at READY, at a
        failure or when they go."""
        if not tracing.current().enabled:
            return
        name = msg.service.name
        for r in msg.replicas:
            key = (name, r.replica_id)
            found = self._open.get(key)
            if found is None:
                launching = r.facts.launch_phase == LP.LAUNCH_PHASE_SCHEDULED and r.status == res.REPLICA_STATUS_PENDING
                if not launching or r.create_time.ToSeconds() < self._since:
                    continue  # not starting, or known from before this process
                self._span(name, r.replica_id, r.version)
                found = self._open.get(key)
                if found is None:
                    continue
            self._moved(key, found, r)
        for rid in msg.removed_replica_ids:
            self._end((name, rid), "removed", ok=False)
        if msg.deleted:
            for key in [k for k in self._open if k[0] == name]:
                self._end(key, "service deleted", ok=False)
            self._origins.pop(name, None)

    def _span(self, service: str, replica_id: int, version: int) -> trace.Span | None:
        key = (service, replica_id)
        found = self._open.get(key)
        if found is not None:
            return found.span
        if len(self._open) >= MAX_OPEN:
            return None
        origin = self._origins.get(service)
        parent = None
        if origin is not None and version >= origin.first_version and self._now() - origin.at <= ORIGIN_TTL_S:
            parent = origin.parent
        span = tracing.current().start(
            "replica.start",
            parent=parent,
            attributes={tracing.SERVICE: service, tracing.REPLICA: replica_id, tracing.VERSION: version},
        )
        self._open[key] = _Open(span, res.REPLICA_STATUS_PENDING)
        return span

    def _moved(self, key: tuple[str, int], found: _Open, r: res.Replica) -> None:
        if r.status == found.status:
            return
        found.status = r.status
        status = str(res.ReplicaStatus.Name(r.status)).removeprefix("REPLICA_STATUS_")
        found.span.add_event(status)
        if r.status == res.REPLICA_STATUS_READY:
            ready = tracing.current().start(
                "replica.ready",
                parent=trace.set_span_in_context(found.span),
                attributes={tracing.SERVICE: r.service, tracing.REPLICA: r.replica_id, tracing.VERSION: r.version},
            )
            ready.end()
            self._end(key, "", ok=True)
        elif r.status in _ENDED:
            self._end(key, status, ok=False)

    def _end(self, key: tuple[str, int], why: str, *, ok: bool) -> None:
        found = self._open.pop(key, None)
        if found is None:
            return
        if not ok:
            found.span.set_status(trace.Status(trace.StatusCode.ERROR, why))
        found.span.end()

"""What a service loop is built from: its settings, the stored service it starts from, what
every loop shares, and a checkpoint of memory for API calls."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2 as res
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as prov_grpc
from services.common import errors
from services.controller import book, convert, facts, hooks, store, writer
from services.controller import traces as replica_traces
from services.controller.domain import autoscaler
from services.controller.drivers import launches, probes, teardowns


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Controller knobs a service loop needs."""

    drain_s: float = 120.0
    probe_fast_interval_s: float = 0.1
    reconnect_initial_s: float = 0.1
    reconnect_max_s: float = 2.0
    sweep_interval_s: float = 5.0
    max_replicas_per_service: int = 1000
    max_replicas_total: int = 5000
    max_launches_in_flight: int = 128
    decision_interval_s: float = autoscaler.DECISION_INTERVAL_S
    zero_decision_interval_s: float = autoscaler.ZERO_DECISION_INTERVAL_S
    qps_window_s: float = autoscaler.QPS_WINDOW_S
    balancer_ttl_s: float = 15.0
    """A balancer's URL is shown until it has not reported for this long."""


@dataclasses.dataclass
class Loaded:
    """A service as stored."""

    row: store.ServiceRow
    specs: dict[int, spec_pb2.ServiceSpec]
    state: bytes | None
    replicas: list[res.Replica]

    @classmethod
    def read(cls, db: store.Store, name: str) -> Loaded:
        row = db.get_service(name)
        if row is None:
            raise errors.NotFoundError(f"service {name!r} not found", service=name)
        specs = {v: s for v in db.list_versions(name) if (s := db.get_version(name, v)) is not None}
        return cls(row, specs, db.get_autoscaler_state(name), db.list_replicas(name))


@dataclasses.dataclass
class Deps:
    """What every service loop shares."""

    writer: writer.Writer
    reader: store.Store
    provisioner: prov_grpc.ProvisionerServiceStub
    probes: probes.ProbeSink
    tuning: Tuning
    on_gone: Callable[[str], None]
    hooks: hooks.Hooks = dataclasses.field(default_factory=hooks.Hooks)
    watch_generation: Callable[[], int] = lambda: 0
    zones: Callable[[], list[tuple[str, float]]] = list
    owner: str = ""
    launch_slots: asyncio.Semaphore | None = None
    launch_mux: launches.LaunchMux | None = None
    teardown_mux: teardowns.TeardownMux | None = None
    traces: replica_traces.ReplicaTraces = dataclasses.field(default_factory=lambda: replica_traces.ReplicaTraces())
    # Called with the service's name whenever what it holds of the replica budget may have changed.
    held_changed: Callable[[str], None] = lambda _name: None


@dataclasses.dataclass
class Checkpoint:
    """Memory before an API call changed it."""

    row: store.ServiceRow
    state: bytes
    specs: dict[int, spec_pb2.ServiceSpec]
    next_id: int
    replicas: dict[int, bytes]
    book: book.Book
    logs_kept: set[int]


def copy(r: res.Replica) -> res.Replica:
    out = res.Replica()
    out.CopyFrom(r)
    return out


def parse(data: bytes) -> res.Replica:
    out = res.Replica()
    out.ParseFromString(data)
    return out


def create(db: store.Store, name: str, parsed: spec_pb2.ServiceSpec, *, request_id: str) -> Loaded:
    """Store a new service (the writer runs it in one transaction): the row, version 1 and the
    autoscaler's first state (its target the policy's minimum) commit together."""

    state = facts.ScalerState(target=convert.policy_of(parsed).min_replicas).dump()
    row = db.create_service(name, parsed, now=time.time(), request_id=request_id)
    db.put_autoscaler_state(name, state)
    return Loaded(row, {1: parsed}, state, [])

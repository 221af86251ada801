"""Traces across the gRPC hops: one CreateService yields one connected trace (controller,
provisioner and prober spans, in-memory exporter), the trace context travels in gRPC metadata
and in the probe target; with traces off nothing is recorded or sent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors, tracing
from services.controller import server as controller_server
from services.prober import server as prober_server
from tests.helpers import cluster as cl
from tests.helpers import fake_provisioner

READY = res.REPLICA_STATUS_READY
YAML = """
name: web
service:
  readiness_probe:
    path: /health
    initial_delay_seconds: 5
  replicas: 2
resources:
  ports: 8080
run: serve
"""


@contextlib.asynccontextmanager
async def stack(tmp_path) -> AsyncIterator[tuple[api_grpc.ControllerServiceStub, fake_provisioner.FakeProvisioner]]:
    """Controller, prober and the scripted provisioner, built while the test's tracing is current."""
    async with fake_provisioner.serving() as (fake, provisioner_addr):
        prober = await prober_server.build_server(prober_server.load_settings(listen_addr="127.0.0.1:0"))
        await prober.start()
        running = await controller_server.start(
            controller_server.Settings(
                listen_addr="127.0.0.1:0",
                metrics_addr="",
                state_dir=str(tmp_path / "ctl"),
                provisioner_addr=provisioner_addr,
                prober_addrs=f"127.0.0.1:{prober.port}",
            )
        )
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
        try:
            yield api_grpc.ControllerServiceStub(channel), fake
        finally:
            await channel.close()
            await running.stop(None)
            await prober.stop(None)


async def until(pred, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def by_name(spans: list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_one_create_yields_one_connected_trace(tmp_path) -> None:
    exporter = InMemorySpanExporter()
    with tracing.use(tracing.with_exporter(exporter)):
        async with stack(tmp_path) as (stub, _):
            await stub.CreateService(api.CreateServiceRequest(yaml=YAML))
            w = cl.Watch(stub, "web")
            await w.until(lambda w: w.count(READY) == 2)
            await until(lambda: len(by_name(list(exporter.get_finished_spans())).get("replica.ready", [])) == 2)
            w.cancel()
    spans = list(exporter.get_finished_spans())
    named = by_name(spans)
    (create,) = named["CreateService"]
    assert create.parent is None
    assert create.kind == trace.SpanKind.SERVER
    assert create.attributes["replicaplane.service"] == "web"
    assert create.attributes["rpc.grpc.status_code"] == "OK"
    trace_id = create.context.trace_id
    starts = named["replica.start"]
    assert sorted(s.attributes["replicaplane.replica_id"] for s in starts) == [1, 2]
    assert {s.attributes["replicaplane.service"] for s in starts} == {"web"}
    assert {s.attributes["replicaplane.version"] for s in starts} == {1}
    assert {parent_id(s) for s in starts} == {create.context.span_id}
    start_ids = {s.context.span_id for s in starts}
    for s in starts:
        assert s.status.is_ok
        assert [e.name for e in s.events][-1] == "READY"

    launches = named["Launch"]
    assert len(launches) == 2
    assert {parent_id(s) for s in launches} == start_ids
    for launch in launches:
        assert launch.kind == trace.SpanKind.SERVER
        assert [e.name for e in launch.events] == [
            "LAUNCH_EVENT_TYPE_QUEUED",
            "LAUNCH_EVENT_TYPE_PROVISIONING",
            "LAUNCH_EVENT_TYPE_RUNNING",
        ]
    probes = named["probe"]
    assert {parent_id(s) for s in probes} == start_ids
    assert any(p.attributes["replicaplane.probe.outcome"] == "ready" for p in probes)
    assert {parent_id(s) for s in named["replica.ready"]} == start_ids

    # One trace: every span of the create is in it, and nothing else was traced (reads, watches,
    # the provisioner watch and probe streams carry no trace context).
    assert {s.context.trace_id for s in spans} == {trace_id}
    assert set(named) == {"CreateService", "replica.start", "Launch", "probe", "replica.ready"}


async def test_a_callers_trace_context_is_continued(tmp_path) -> None:
    exporter = InMemorySpanExporter()
    with tracing.use(tracing.with_exporter(exporter)) as tracer:
        caller = tracer.start("deploy script")
        async with stack(tmp_path) as (stub, _):
            await stub.CreateService(api.CreateServiceRequest(yaml=YAML), metadata=tracing.metadata(caller))
            w = cl.Watch(stub, "web")
            await w.until(lambda w: w.count(READY) == 2)
            w.cancel()
        caller.end()
    (create,) = by_name(list(exporter.get_finished_spans()))["CreateService"]
    assert create.context.trace_id == caller.get_span_context().trace_id
    assert parent_id(create) == caller.get_span_context().span_id


async def test_an_update_traces_the_new_versions_replicas(tmp_path) -> None:
    exporter = InMemorySpanExporter()
    with tracing.use(tracing.with_exporter(exporter)):
        async with stack(tmp_path) as (stub, _):
            await stub.CreateService(api.CreateServiceRequest(yaml=YAML))
            w = cl.Watch(stub, "web")
            await w.until(lambda w: w.count(READY) == 2)
            exporter.clear()
            # A new run command: replicas are replaced, rolling.
            await stub.UpdateService(
                api.UpdateServiceRequest(service_name="web", yaml=YAML.replace("run: serve", "run: serve --v2"))
            )
            await w.until(lambda w: w.count(READY) == 2 and {r.version for r in w.replicas.values()} == {2})
            await until(lambda: len(by_name(list(exporter.get_finished_spans())).get("replica.ready", [])) == 2)
            w.cancel()
    named = by_name(list(exporter.get_finished_spans()))
    (update,) = named["UpdateService"]
    starts = [s for s in named["replica.start"] if s.attributes["replicaplane.version"] == 2]
    assert len(starts) == 2
    assert {parent_id(s) for s in starts} == {update.context.span_id}


async def test_traces_off_record_and_send_nothing(tmp_path) -> None:
    assert not tracing.current().enabled  # the default
    async with stack(tmp_path) as (stub, fake):
        await stub.CreateService(api.CreateServiceRequest(yaml=YAML))
        w = cl.Watch(stub, "web")
        await w.until(lambda w: w.count(READY) == 2)
        w.cancel()
    assert sum(fake.launches.values()) == 2
    assert fake.traceparents == ["", ""]


def test_settings_turn_traces_on_only_for_otlp_over_grpc() -> None:
    assert not tracing.from_env("controller", {}).enabled
    assert not tracing.from_env("controller", {"OTEL_TRACES_EXPORTER": "none"}).enabled
    on = tracing.from_env("controller", {"OTEL_TRACES_EXPORTER": "otlp"})
    try:
        assert on.enabled
        assert on.provider is not None
        assert on.provider.resource.attributes["service.name"] == "replicaplane-controller"
    finally:
        on.shutdown()
    named = tracing.from_env("prober", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SERVICE_NAME": "probers-eu"})
    named.shutdown()
    assert named.provider is not None and named.provider.resource.attributes["service.name"] == "probers-eu"
    with pytest.raises(errors.ValidationError) as err:
        tracing.from_env("controller", {"OTEL_TRACES_EXPORTER": "jaeger"})
    assert [v.field for v in err.value.violations] == ["OTEL_TRACES_EXPORTER"]
    with pytest.raises(errors.ValidationError) as err:
        tracing.from_env("controller", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert [v.field for v in err.value.violations] == ["OTEL_EXPORTER_OTLP_PROTOCOL"]

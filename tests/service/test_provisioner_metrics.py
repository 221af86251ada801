"""The provisioner's own metrics on real servers on port 0 (the local backend with real replica
processes, and the kubernetes backend against the test API server), scraped and parsed as
Prometheus does: each one moves when launches, teardowns and API errors happen."""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc
from services.common import grpc_server
from services.provisioner import server
from tests.helpers import kube_emulator, metrics, provisioner_procs
from tests.helpers import kube_provisioner as kp
from tests.helpers import provisioner_client as client

LOCAL = {"backend": "local"}


@pytest.fixture
async def local(tmp_path) -> AsyncIterator[tuple[pb_grpc.ProvisionerServiceStub, str]]:
    state_dir = str(tmp_path / "state")
    settings = server.Settings(
        listen_addr="127.0.0.1:0",
        metrics_addr="127.0.0.1:0",
        state_dir=state_dir,
        launch_backoff_initial_s=0.01,
        launch_backoff_max_s=0.02,
        kill_grace_s=1.0,
    )
    built = await server.build_server(settings)
    endpoint = await grpc_server.serve_metrics(built, "127.0.0.1:0")
    assert endpoint is not None
    await built.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{built.port}") as channel:
            yield pb_grpc.ProvisionerServiceStub(channel), endpoint.url
    finally:
        await built.stop(None)
        await endpoint.stop()
        provisioner_procs.kill_replicas(state_dir)


async def test_a_launch_and_a_teardown_are_timed_and_replicas_counted_by_state(local) -> None:
    stub, url = local
    before = await metrics.ascrape(url)
    assert before.value("replicaplane_provisioner_replicas", **LOCAL, state="running") == 0
    assert before.value("replicaplane_provisioner_launch_duration_seconds_count") == 0
    events = await client.collect(stub.Launch(client.launch_request(1)))
    assert client.types(events)[-1] == "RUNNING"
    scrape = await metrics.ascrape(url)
    launched = {**LOCAL, "outcome": "succeeded"}
    assert scrape.value("replicaplane_provisioner_launch_duration_seconds_count", **launched) == 1
    assert scrape.value("replicaplane_provisioner_launch_duration_seconds_sum", **launched) > 0
    assert scrape.value("replicaplane_provisioner_launch_attempts_total", **launched) == 1
    assert scrape.value("replicaplane_provisioner_replicas", **LOCAL, state="running") == 1
    assert scrape.value("replicaplane_provisioner_replicas", **LOCAL, state="failed") == 0

    await client.collect(stub.Terminate(pb.TerminateRequest(name="svc-1")))
    scrape = await metrics.ascrape(url)
    assert scrape.value("replicaplane_provisioner_teardown_duration_seconds_count", **launched) == 1
    assert scrape.value("replicaplane_provisioner_replicas", **LOCAL, state="running") == 0
    # The local backend has no remote API: nothing to count, and nothing counted.
    assert scrape.value("replicaplane_provisioner_backend_api_errors_total") == 0


async def test_a_failed_launch_counts_each_attempt_and_the_failure(local) -> None:
    stub, url = local
    request = client.launch_request(1, spec_=client.spec("true", setup="exit 7"))
    events = await client.collect(stub.Launch(request))
    assert client.types(events)[-1] == "FAILED"
    scrape = await metrics.ascrape(url)
    assert scrape.value("replicaplane_provisioner_launch_duration_seconds_count", **LOCAL, outcome="failed") == 1
    assert scrape.value("replicaplane_provisioner_launch_duration_seconds_count", **LOCAL, outcome="succeeded") == 0
    assert scrape.value("replicaplane_provisioner_launch_attempts_total", **LOCAL, outcome="failed") == 3
    assert scrape.value("replicaplane_provisioner_replicas", **LOCAL, state="failed") == 1


async def test_an_app_that_exits_is_counted_as_ended(local) -> None:
    stub, url = local
    events = await client.collect(stub.Launch(client.launch_request(1, spec_=client.spec(f"{sys.executable} -c ''"))))
    assert client.types(events)[-1] == "RUNNING"
    scrape = await metrics.until(
        url, lambda s: s.value("replicaplane_provisioner_replicas", **LOCAL, state="app_ended") == 1
    )
    assert scrape.value("replicaplane_provisioner_replicas", **LOCAL, state="running") == 0


@pytest.fixture
def emulator(tmp_path) -> Iterator[kube_emulator.Emulator]:
    emu = kube_emulator.Emulator(str(tmp_path / "emu"), bookmark_interval_s=0.2).start()
    try:
        yield emu
    finally:
        emu.stop()


async def test_kubernetes_api_errors_are_counted_by_status(tmp_path, emulator) -> None:
    settings = kp.settings(str(tmp_path), emulator, f"t-{uuid.uuid4().hex[:8]}", metrics_addr="127.0.0.1:0")
    running = await kp.start(settings)
    endpoint = await grpc_server.serve_metrics(running.server, "127.0.0.1:0")
    assert endpoint is not None
    try:
        emulator.run(emulator.api.fail, "create", "pods", 503, times=2)
        emulator.run(emulator.api.fail, "create", "secrets", 429, times=1, retry_after=0)
        spec = client.spec()
        spec.secrets["TOKEN"] = "s3cret"
        events = await client.collect(running.stub.Launch(client.launch_request(1, spec_=spec)))
        assert client.types(events)[-1] == "RUNNING"
        scrape = await metrics.ascrape(endpoint.url)
        kube = {"backend": "kubernetes"}
        assert scrape.value("replicaplane_provisioner_backend_api_errors_total", **kube, code="503") == 2
        assert scrape.value("replicaplane_provisioner_backend_api_errors_total", **kube, code="429") == 1
        assert scrape.value("replicaplane_provisioner_launch_duration_seconds_count", **kube, outcome="succeeded") == 1
        assert scrape.value("replicaplane_provisioner_replicas", **kube, state="running") == 1
        await client.collect(running.stub.Terminate(pb.TerminateRequest(name="svc-1")))
    finally:
        await running.stop()
        await endpoint.stop()

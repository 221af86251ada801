"""The kubernetes backend with several resources alternatives: `any_of`, `ordered`, a list of
accelerators. Each alternative is tried as a Pod, in order, until one can be placed.

The emulated cluster has one node with an H100 and one with an A100 (one GPU each) unless a
test says otherwise; the fake scheduler accounts for what bound Pods use, so a second GPU
replica finds the node full, as on a real cluster.
"""

from __future__ import annotations

import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from replicaplane.common.v1 import spec_pb2
from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import resources_pb2
from services.common import spec as spec_mod
from services.provisioner import server
from tests.helpers import kube_emulator
from tests.helpers import kube_provisioner as kp
from tests.helpers import provisioner_client as client

L = client.L
INFRASTRUCTURE = resources_pb2.FAILURE_CAUSE_INFRASTRUCTURE
USER = resources_pb2.FAILURE_CAUSE_USER


def _spec(resources: str) -> spec_pb2.ServiceSpec:
    """A one-replica spec of the test HTTP app with `resources` (YAML under `resources:`)."""
    text = (
        "service:\n  readiness_probe: /health\n  replicas: 1\n"
        f"resources:\n  ports: 8080\n{textwrap.indent(textwrap.dedent(resources), '  ')}"
        f"run: |\n  {client.HTTP_RUN}\n"
    )
    return spec_mod.parse(text, name="svc")


@pytest.fixture
def nodes() -> list[kube_emulator.Node]:
    return [kube_emulator.gpu_node("h100-node", "H100", 1), kube_emulator.gpu_node("a100-node", "A100", 1)]


@pytest.fixture
def emulator(tmp_path, nodes) -> Iterator[kube_emulator.Emulator]:
    emu = kube_emulator.Emulator(str(tmp_path / "emu"), nodes=nodes).start()
    try:
        yield emu
    finally:
        emu.stop()


@pytest.fixture
def values(tmp_path, emulator) -> server.Settings:
    # A long single-Pod schedule timeout: only the per-alternative one may move a launch on.
    return kp.settings(
        str(tmp_path),
        emulator,
        f"t-{uuid.uuid4().hex[:8]}",
        kubernetes_schedule_timeout_s=60,
        kubernetes_alternative_timeout_s=0.3,
    )


@pytest.fixture
async def prov(values) -> AsyncIterator[kp.Running]:
    running = await kp.start(values)
    try:
        yield running
    finally:
        await running.stop()


async def _launch(prov: kp.Running, replica_id: int, spec: spec_pb2.ServiceSpec) -> list:
    return await client.collect(prov.stub.Launch(client.launch_request(replica_id, spec_=spec)), timeout=60)


async def _launch_log(prov: kp.Running, name: str) -> str:
    kind = resources_pb2.LOG_KIND_LAUNCH
    chunks = await client.collect(prov.stub.StreamLogs(pb.StreamLogsRequest(name=name, kind=kind)))
    return b"".join(c.data for c in chunks).decode()


def _pod_creates(emulator: kube_emulator.Emulator) -> int:
    return len([path for path, _ in emulator.logged("POST") if path.endswith("/pods")])


async def test_any_of_runs_the_next_alternative_when_one_cannot_be_scheduled(prov, emulator, values) -> None:
    # No node has an L4: the first alternative stays unschedulable, the second fits.
    spec = _spec("any_of:\n  - accelerators: L4:1\n  - accelerators: H100:1\n    cpus: 2\n")
    events = await _launch(prov, 1, spec)
    assert client.types(events) == ["QUEUED", "PROVISIONING", "RUNNING"]
    running = events[-1]
    assert "resources.any_of[1]" in running.message and "H100:1" in running.message
    assert running.replica.accelerator == "H100:1"
    assert running.replica.resources_path == "resources.any_of[1]"
    await client.wait_http(running.endpoint + "/health")

    pod = await emulator.pod("svc-1")
    assert pod is not None
    assert pod["spec"]["nodeName"] == "h100-node"
    assert pod["spec"]["nodeSelector"] == {"replicaplane.dev/accelerator": "h100"}
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "2", "nvidia.com/gpu": "1"}
    assert pod["metadata"]["annotations"]["replicaplane.dev/resources"] == "resources.any_of[1]"
    assert _pod_creates(emulator) == 2  # the L4 Pod was made, then deleted
    assert await emulator.names("pod") == ["svc-1"]

    text = await _launch_log(prov, "svc-1")
    assert "trying resources.any_of[0] (accelerators L4:1)" in text
    assert "resources.any_of[0] (accelerators L4:1) could not be scheduled within 0.3 s" in text
    assert "Insufficient nvidia.com/gpu" in text or "didn't match Pod's node affinity/selector" in text
    assert "trying resources.any_of[1] (cpus 2, accelerators H100:1)" in text
    assert "running on resources.any_of[1]" in text

    # After a provisioner restart the adopted replica still says what it runs on.
    await prov.stop()
    again = await kp.start(values)
    try:
        replica = (await again.stub.GetReplica(pb.GetReplicaRequest(name="svc-1"))).replica
        assert (replica.accelerator, replica.resources_path) == ("H100:1", "resources.any_of[1]")
        await client.collect(again.stub.Terminate(pb.TerminateRequest(name="svc-1")))
    finally:
        await again.stop()


async def test_ordered_takes_the_first_alternative_that_fits_and_keeps_the_order(prov, emulator) -> None:
    spec = _spec("ordered:\n  - accelerators: A100:1\n  - accelerators: H100:1\n")
    first = await _launch(prov, 1, spec)
    assert first[-1].replica.accelerator == "A100:1"  # both fit: the first listed wins
    assert (await emulator.pod("svc-1"))["spec"]["nodeName"] == "a100-node"  # type: ignore[index]
    # The A100 node is full now: the second replica waits on it, then runs on the H100.
    second = await _launch(prov, 2, spec)
    assert second[-1].replica.accelerator == "H100:1"
    # The A100 frees up; `ordered` goes back to it first (where any_of would not wait on it again).
    await client.collect(prov.stub.Terminate(pb.TerminateRequest(name="svc-1")))
    creates = _pod_creates(emulator)
    third = await _launch(prov, 3, spec)
    assert third[-1].replica.accelerator == "A100:1"
    assert _pod_creates(emulator) == creates + 1


async def test_any_of_tries_an_alternative_that_just_found_no_capacity_last(prov, emulator) -> None:
    spec = _spec("any_of:\n  - accelerators: A100:1\n  - accelerators: H100:1\n  - cpus: 1\n")
    assert (await _launch(prov, 1, spec))[-1].replica.accelerator == "A100:1"
    second = await _launch(prov, 2, spec)  # the A100 node is full
    assert second[-1].replica.accelerator == "H100:1"
    # Both GPU nodes are full and the A100 just failed: the third replica tries the H100 (not
    # known to be full yet), then the CPU-only alternative; the A100 would have come last.
    creates = _pod_creates(emulator)
    third = await _launch(prov, 3, spec)
    assert (third[-1].replica.accelerator, third[-1].replica.resources_path) == ("", "resources.any_of[2]")
    assert _pod_creates(emulator) == creates + 2
    text = await _launch_log(prov, "svc-3")
    assert text.index("trying resources.any_of[1]") < text.index("trying resources.any_of[2]")
    assert "trying resources.any_of[0]" not in text


async def test_a_list_of_accelerators_is_tried_in_order(prov, emulator) -> None:
    events = await _launch(prov, 1, _spec("accelerators: [L4, H100]\n"))
    assert client.types(events)[-1] == "RUNNING"
    assert events[-1].replica.accelerator == "H100:1"
    assert events[-1].replica.resources_path == "resources"


async def test_when_no_alternative_can_be_placed_the_attempt_fails_naming_each(prov, emulator) -> None:
    spec = _spec("any_of:\n  - accelerators: L4:1\n  - accelerators: H100:4\n")
    events = await _launch(prov, 1, spec)
    failed = [e for e in events if e.type == L.LAUNCH_EVENT_TYPE_ATTEMPT_FAILED]
    assert len(failed) == 3  # retried per the launch policy: capacity may come
    for event in failed:
        assert event.cause == INFRASTRUCTURE
        assert event.capacity_unavailable and not event.permanent
        assert event.message.startswith("no resources alternative could be placed: ")
        assert "resources.any_of[0] (accelerators L4:1): Pod could not be scheduled within 0.3 s" in event.message
        assert "resources.any_of[1] (accelerators H100:4): Pod could not be scheduled within 0.3 s" in event.message
        assert "Insufficient nvidia.com/gpu" in event.message
    assert client.types(events)[-1] == "FAILED"
    assert events[-1].cause == INFRASTRUCTURE and events[-1].capacity_unavailable
    assert await emulator.names("pod") == []


async def test_a_limit_range_refusal_moves_on_and_alone_is_the_users_fault(prov, emulator) -> None:
    emulator.run(emulator.api.set_limit_range, emulator.namespace, {"cpu": "2"})
    # The first alternative is over the LimitRange: refused at create; the second runs.
    events = await _launch(prov, 1, _spec("ordered:\n  - cpus: 4\n  - cpus: 1\n"))
    assert client.types(events) == ["QUEUED", "PROVISIONING", "RUNNING"]
    assert events[-1].replica.resources_path == "resources.ordered[1]"
    text = await _launch_log(prov, "svc-1")
    assert "resources.ordered[0] (cpus 4) was refused" in text
    assert "maximum cpu usage per Container is 2, but limit is 4" in text

    # Every alternative refused by the LimitRange: the user's, permanent (no retry can help).
    events = await _launch(prov, 2, _spec("ordered:\n  - cpus: 4\n  - cpus: 3\n"))
    assert client.types(events) == ["QUEUED", "PROVISIONING", "ATTEMPT_FAILED", "FAILED"]
    assert events[-1].cause == USER and events[-1].permanent and not events[-1].capacity_unavailable
    assert "resources.ordered[0] (cpus 4): " in events[-1].message
    assert "resources.ordered[1] (cpus 3): " in events[-1].message
    assert "but limit is 3" in events[-1].message

    # A LimitRange refusal beside a capacity failure: the infrastructure's (capacity may come).
    events = await _launch(prov, 3, _spec("any_of:\n  - cpus: 4\n  - accelerators: L4:1\n"))
    assert client.types(events)[-1] == "FAILED"
    assert events[-1].cause == INFRASTRUCTURE and not events[-1].permanent


async def test_a_quota_refusal_moves_on_and_is_the_infrastructures(prov, emulator) -> None:
    emulator.run(emulator.api.set_quota, emulator.namespace, "gpus", {"requests.nvidia.com/gpu": "0"})
    events = await _launch(prov, 1, _spec("any_of:\n  - accelerators: H100:1\n  - cpus: 1\n"))
    assert client.types(events)[-1] == "RUNNING"
    assert events[-1].replica.resources_path == "resources.any_of[1]"
    text = await _launch_log(prov, "svc-1")
    assert "exceeded quota: gpus" in text

    events = await _launch(prov, 2, _spec("any_of:\n  - accelerators: H100:1\n  - accelerators: A100:1\n"))
    assert client.types(events)[-1] == "FAILED"
    assert events[-1].cause == INFRASTRUCTURE and events[-1].capacity_unavailable
    assert events[-1].message.count("quota exceeded") == 2


async def test_a_failure_after_scheduling_does_not_move_on(prov, emulator) -> None:
    # Setup failing on the first alternative's Pod fails the attempt: it says nothing about capacity.
    spec = _spec("any_of:\n  - accelerators: H100:1\n  - cpus: 1\n")
    spec.setup = "exit 3"
    events = await _launch(prov, 1, spec)
    failed = [e for e in events if e.type == L.LAUNCH_EVENT_TYPE_ATTEMPT_FAILED]
    assert failed and all(e.message == "setup exited with code 3" and e.cause == USER for e in failed)
    text = await _launch_log(prov, "svc-1")
    assert "trying resources.any_of[1]" not in text

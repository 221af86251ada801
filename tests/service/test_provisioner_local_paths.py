"""The local backend and a spec's local paths: relative ones, the state dir, size limits, teardown during a copy."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc
from services.provisioner import server
from tests.helpers import provisioner_client as client
from tests.helpers import provisioner_procs

L, T = client.L, client.T


def disk_usage(path: str) -> int:
    """Bytes allocated on disk under `path` (holes do not count)."""
    total = 0
    for here, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(here, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def write_file(path: str, size: int, *, holes: bool = True) -> None:
    """A file of `size` bytes: all holes (no disk used), or random data."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        if holes:
            fh.truncate(size)
        else:
            fh.write(os.urandom(size))


def exists(path: str) -> bool:
    return os.path.exists(path)


@pytest.fixture
def app_dir(tmp_path) -> str:
    """A project folder whose state dir (as `make up` makes it) is inside it."""
    root = tmp_path / "project"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.py").write_text("print('hello')\n")
    return str(root)


async def _serve(state_dir: str, **overrides: object) -> server.Server:
    values: dict[str, object] = {
        "listen_addr": "127.0.0.1:0",
        "state_dir": state_dir,
        "launch_backoff_initial_s": 0.05,
        "launch_backoff_max_s": 0.1,
        "kill_grace_s": 1.0,
        "cancel_timeout_s": 5.0,
        **overrides,
    }
    srv = await server.build_server(server.Settings(**values))  # type: ignore[arg-type]
    await srv.start()
    return srv


@pytest.fixture
async def prov(app_dir) -> AsyncIterator[pb_grpc.ProvisionerServiceStub]:
    state_dir = os.path.join(app_dir, ".state", "provisioner")
    srv = await _serve(state_dir, local_copy_max_mb=1)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            yield pb_grpc.ProvisionerServiceStub(channel)
    finally:
        await srv.stop(None)
        provisioner_procs.kill_replicas(state_dir)


def _problems(answer: pb.CheckSpecResponse) -> dict[str, str]:
    return {p.field: p.description for p in answer.problems}


async def test_check_spec_refuses_relative_paths_the_state_dir_and_copies_over_the_limit(prov, app_dir) -> None:
    relative = client.spec(workdir="src")
    relative.file_mounts["/data"] = "data/x.csv"
    relative.file_mounts["/remote"] = "s3://bucket/x"
    problems = _problems(await prov.CheckSpec(pb.CheckSpecRequest(spec=relative)))
    assert sorted(problems) == ["file_mounts./data", "workdir"]
    assert "must be an absolute path" in problems["workdir"]

    whole = _problems(await prov.CheckSpec(pb.CheckSpecRequest(spec=client.spec(workdir=app_dir))))
    assert list(whole) == ["workdir"]
    assert "contains the provisioner's state directory" in whole["workdir"]

    big = os.path.join(app_dir, "big")
    write_file(os.path.join(big, "weights.bin"), 2 << 20)  # 2 MB, over this provisioner's 1 MB
    over = _problems(await prov.CheckSpec(pb.CheckSpecRequest(spec=client.spec(workdir=big))))
    assert list(over) == ["workdir"]
    assert "more than 1 MB" in over["workdir"]
    assert "local_copy_max_mb" in over["workdir"]

    gone = _problems(await prov.CheckSpec(pb.CheckSpecRequest(spec=client.spec(workdir=app_dir + "/gone"))))
    assert gone == {"workdir": f"no such directory on the provisioner's host: {app_dir}/gone"}

    fine = await prov.CheckSpec(pb.CheckSpecRequest(spec=client.spec(workdir=os.path.join(app_dir, "src"))))
    assert list(fine.problems) == []


async def test_a_launch_never_copies_the_state_dir_into_a_replica(prov, app_dir) -> None:
    # A caller that skipped CheckSpec (or an older controller) still cannot make the copy copy itself.
    state_dir = os.path.join(app_dir, ".state", "provisioner")
    before = disk_usage(state_dir)
    for workdir, why in ((app_dir, "contains the provisioner's state directory"), ("src", "a relative path")):
        request = client.launch_request(1, "self", spec_=client.spec(workdir=workdir))
        events = await client.collect(prov.Launch(request))
        assert events[-1].type == L.LAUNCH_EVENT_TYPE_FAILED
        assert events[-1].permanent
        assert why in events[-1].message
        await client.collect(prov.Terminate(pb.TerminateRequest(name="self-1")))
    assert not exists(os.path.join(state_dir, "local", "self-1"))
    assert disk_usage(state_dir) < before + (1 << 20)  # records and logs only


async def test_a_launch_over_the_copy_limit_fails_before_copying_naming_the_setting(prov, app_dir) -> None:
    big = os.path.join(app_dir, "big")
    write_file(os.path.join(big, "weights.bin"), 2 << 20, holes=False)
    events = await client.collect(prov.Launch(client.launch_request(1, "big", spec_=client.spec(workdir=big))))
    assert events[-1].type == L.LAUNCH_EVENT_TYPE_FAILED
    assert events[-1].permanent
    assert "more than 1 MB to copy" in events[-1].message
    assert "REPLICAPLANE_PROVISIONER_LOCAL_COPY_MAX_MB" in events[-1].message


async def test_a_teardown_does_not_wait_behind_a_copy_in_progress(tmp_path) -> None:
    state_dir = str(tmp_path / "state")
    srv = await _serve(state_dir, local_copy_max_mb=1 << 30)
    workdir = tmp_path / "huge"
    write_file(str(workdir / "weights.bin"), 1 << 40)  # 1 TiB of holes: minutes to read, nothing to store
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = pb_grpc.ProvisionerServiceStub(channel)
            before = disk_usage(state_dir)
            request = client.launch_request(1, "huge", spec_=client.spec(workdir=str(workdir)))
            launch = asyncio.create_task(client.collect(stub.Launch(request), timeout=60))
            copied = os.path.join(state_dir, "local", "huge-1", "work", "weights.bin")
            async with asyncio.timeout(30):
                while not exists(copied):
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            assert not launch.done()  # still copying
            started = time.monotonic()
            events = await client.collect(stub.Terminate(pb.TerminateRequest(name="huge-1")), timeout=10)
            took = time.monotonic() - started
            assert events[-1].type == T.TERMINATE_EVENT_TYPE_TERMINATED
            assert took < 5, f"the teardown waited {took:.1f} s"
            assert (await launch)[-1].type == L.LAUNCH_EVENT_TYPE_CANCELLED
            assert not exists(os.path.join(state_dir, "local", "huge-1"))
            await asyncio.sleep(0.5)
            assert not exists(copied)  # nothing is still writing there
            assert disk_usage(state_dir) < before + (1 << 20)
    finally:
        await srv.stop(None)
        provisioner_procs.kill_replicas(state_dir)


async def test_check_spec_says_how_to_run_a_gpu_spec_on_this_machine(prov) -> None:
    gpu = client.spec()
    gpu.resources.accelerators = "A100:1"
    problems = _problems(await prov.CheckSpec(pb.CheckSpecRequest(spec=gpu)))
    assert list(problems) == ["resources.accelerators"]
    assert "local_accelerators setting" in problems["resources.accelerators"]
    assert "REPLICAPLANE_PROVISIONER_LOCAL_ACCELERATORS=A100:1" in problems["resources.accelerators"]

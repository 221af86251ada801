"""Regression: a relative workdir through the API once made the provisioner copy its own state dir
into a replica (12 GB in 8 minutes), and no service could be deleted meanwhile."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from services.common import grpc_errors
from tests.helpers import cluster as cl

pytestmark = pytest.mark.e2e


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


def sparse_file(path: str, size: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)


def copying(state_dir: str, prefix: str) -> list[str]:
    """Replica dirs of the service `prefix` in the provisioner's state dir."""
    root = os.path.join(state_dir, "local")
    return [n for n in os.listdir(root) if n.startswith(prefix)] if os.path.isdir(root) else []


def copy_started(state_dir: str, prefix: str, file: str) -> bool:
    return any(os.path.exists(os.path.join(state_dir, "local", n, "work", file)) for n in copying(state_dir, prefix))


async def _refused(c: cl.Cluster, yaml_text: str) -> dict[str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.CreateService(api.CreateServiceRequest(yaml=yaml_text), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return dict(grpc_errors.RpcError(info.value).field_violations)


async def test_relative_or_self_containing_workdirs_are_refused_and_a_delete_never_waits_behind_a_copy(
    tmp_path,
) -> None:
    c = cl.Cluster(str(tmp_path), provisioner_env={"REPLICAPLANE_PROVISIONER_LOCAL_COPY_MAX_MB": str(1 << 30)})
    try:
        state_dir = c.provisioner_state_dir
        before = disk_usage(state_dir)
        base = cl.app_yaml("paths", c.tag, replicas=1)

        # Relative paths mean nothing to a server: refused, naming each field, nothing stored.
        relative = base + "workdir: .\nfile_mounts:\n  /data: data\n"
        problems = await _refused(c, relative)
        assert sorted(problems) == ["file_mounts./data", "workdir"]
        assert "must be an absolute path" in problems["workdir"]

        # The folder that holds the provisioner's state dir (tmp_path here, the repo with `make up`).
        problems = await _refused(c, base + f"workdir: {tmp_path}\n")
        assert list(problems) == ["workdir"]
        assert "contains the provisioner's state directory" in problems["workdir"]
        assert not (await c.stub.ListServices(api.ListServicesRequest())).services

        # A copy that takes long (1 TiB of holes) holds up nothing: the delete completes at once.
        huge = tmp_path / "huge"
        sparse_file(str(huge / "weights.bin"), 1 << 40)
        await c.stub.CreateService(api.CreateServiceRequest(yaml=base + f"workdir: {huge}\n"), timeout=10)
        async with asyncio.timeout(60):
            while not copy_started(state_dir, "paths-", "weights.bin"):
                await asyncio.sleep(0.05)
        started = time.monotonic()
        await c.stub.DeleteService(api.DeleteServiceRequest(service_name="paths"), timeout=10)
        async with asyncio.timeout(5):
            while True:
                try:
                    await c.stub.GetService(api.GetServiceRequest(service_name="paths"), timeout=5)
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.NOT_FOUND
                    break
                await asyncio.sleep(0.05)
        assert time.monotonic() - started < 5
        assert copying(state_dir, "paths-") == []
        assert disk_usage(state_dir) < before + (4 << 20)  # records and logs, never a copy
    finally:
        await c.close()

"""The controller killed (-9) while writing to a failing disk, then its store lost: no
acknowledged write is lost, and no replica of a lost service is left running."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from services.common import grpc_errors
from services.controller import identity
from tests.e2e.test_replicactl import replicactl
from tests.e2e.test_store_errors import _file_size_signal_ignored, _largest_file, _limit_file_size
from tests.helpers import cluster as cl

pytestmark = [pytest.mark.e2e, pytest.mark.drill]

READY = cl.res.REPLICA_STATUS_READY
EMPTY = "name: {name}\nservice:\n  readiness_probe: /health\n  replicas: 0\nresources:\n  ports: 8080\nrun: sleep 60\n"
MAX_WRITES = 400


async def _ready(c: cl.Cluster, name: str, count: int) -> None:
    await c.stub.CreateService(api.CreateServiceRequest(yaml=cl.app_yaml(name, c.tag, replicas=count)), timeout=30)
    w = cl.Watch(c.stub, name)
    await w.until(lambda w: w.count(READY) == count, timeout=60)
    w.cancel()


async def _until_no_replica_runs(c: cl.Cluster, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while cl.replica_pids(c.tag):
            await asyncio.sleep(0.1)


class Writer:
    """Creates services one after another until stopped: the acknowledged creates, the refused
    ones (UNAVAILABLE, STORE_UNAVAILABLE: nothing was changed), and the one in flight at a
    kill (its outcome unknown)."""

    def __init__(self, c: cl.Cluster) -> None:
        self.c = c
        self.acked: list[str] = []
        self.refused: list[str] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        for i in range(MAX_WRITES):
            name = f"w-{i}"
            try:
                await self.c.stub.CreateService(api.CreateServiceRequest(yaml=EMPTY.format(name=name)), timeout=30)
            except grpc.aio.AioRpcError as exc:
                err = grpc_errors.RpcError(exc)
                if err.reason != "STORE_UNAVAILABLE":
                    return  # the controller was killed under this call: its outcome is unknown
                self.refused.append(name)
                continue
            self.acked.append(name)

    async def until(self, acked: int, refused: int) -> None:
        async with asyncio.timeout(60):
            while len(self.acked) < acked or len(self.refused) < refused:
                assert not self.task.done(), (self.acked, self.refused)
                await asyncio.sleep(0.01)


async def test_kill_9_on_a_failing_disk_keeps_acknowledged_writes_and_a_lost_store_leaves_no_orphan(
    tmp_path,
) -> None:
    with _file_size_signal_ignored():  # the controller gets EFBIG from its file size limit, not a signal
        c = cl.Cluster(str(tmp_path))
    state_dir = os.path.join(c.tmp, "ctl")
    try:
        await _ready(c, "web", 2)
        web_pids = set(cl.replica_pids(c.tag))
        me = (await c.stub.ListOrphans(api.ListOrphansRequest(), timeout=10)).controller_id
        assert me == identity.read_file(state_dir)

        # Writes go on while the disk fails (no controller file may grow more than 64 KiB past
        # the largest one now), and the controller is killed -9 in the middle of them.
        writer = Writer(c)
        await writer.until(acked=20, refused=0)
        _limit_file_size(c.controller.proc.pid, _largest_file(state_dir, c.controller.log_path) + 65536)
        await writer.until(acked=20, refused=5)
        with _file_size_signal_ignored():
            await c.restart_controller(kill=True)
        await writer.task
        acked, refused = writer.acked, writer.refused
        # What was acknowledged is there, what was refused is not, and the replicas kept
        # running through it.
        for name in acked:
            await c.stub.GetService(api.GetServiceRequest(service_name=name), timeout=10)
        for name in refused:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.stub.GetService(api.GetServiceRequest(service_name=name), timeout=10)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        w = cl.Watch(c.stub, "web")
        await w.until(lambda w: w.count(READY) == 2, timeout=30)
        w.cancel()
        assert set(cl.replica_pids(c.tag)) == web_pids

        # The store is lost (its files gone; the id file next to it stays): the restarted
        # controller keeps its id, so web's replicas are its own orphans and it reaps them.
        c.controller.kill()
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(state_dir, f"state.db{suffix}"))
        await c.restart_controller(kill=False)
        assert (await c.stub.ListOrphans(api.ListOrphansRequest(), timeout=10)).controller_id == me
        await _until_no_replica_runs(c)
        async with asyncio.timeout(15):
            while (await c.stub.ListOrphans(api.ListOrphansRequest(), timeout=10)).orphans:
                await asyncio.sleep(0.1)

        # The whole state directory is lost, id file included: the new controller has a new id
        # and leaves the old one's replicas alone, and `replicactl orphans --reap --owner` reaps them.
        await _ready(c, "api", 1)
        c.controller.kill()
        shutil.rmtree(state_dir)
        await c.restart_controller(kill=False)
        listed = replicactl(c.controller.addr, "orphans")
        assert listed.returncode == 0, listed.stderr
        assert "api-1-" in listed.stdout and me in listed.stdout, listed.stdout
        assert cl.replica_pids(c.tag), "a replica of another owner was reaped by default"
        reaped = replicactl(c.controller.addr, "orphans", "--reap", "--owner", me, "--wait", "--timeout", "30")
        assert reaped.returncode == 0, reaped.stderr
        assert "reaping api-1-" in reaped.stdout and "reaped 1 orphan" in reaped.stdout, reaped.stdout
        await _until_no_replica_runs(c)
    finally:
        await c.close()

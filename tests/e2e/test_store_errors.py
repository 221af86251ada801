"""A controller whose disk fails for real (the process's file size limit, so SQLite gets EFBIG
and reports a disk I/O error): the API says what failed, the detail is in the log only."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from collections.abc import Iterator

import grpc
import pytest

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from tests.helpers import fake_provisioner, procs
from tests.service.test_controller import spec
from tests.service.test_store_errors import unavailable


@contextlib.contextmanager
def _file_size_signal_ignored() -> Iterator[None]:
    # An ignored signal stays ignored across exec: the controller gets EFBIG, not SIGXFSZ.
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGXFSZ, previous)


def _largest_file(state_dir: str, log_path: str) -> int:
    files = [os.path.join(state_dir, f) for f in os.listdir(state_dir)] + [log_path]
    return max(os.path.getsize(f) for f in files)


def _limit_file_size(pid: int, limit: int) -> None:
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, hard))


async def test_a_disk_error_is_unavailable_in_the_users_words_and_the_detail_is_logged(tmp_path) -> None:
    state_dir = str(tmp_path / "ctl")
    async with fake_provisioner.serving() as (_, provisioner_addr):
        with _file_size_signal_ignored():
            controller = procs.start_service(
                "controller",
                env={
                    "REPLICAPLANE_CONTROLLER_STATE_DIR": state_dir,
                    "REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR": provisioner_addr,
                    "REPLICAPLANE_CONTROLLER_PROBER_ADDRS": "127.0.0.1:9",
                },
                workdir=str(tmp_path),
            )
        try:
            async with grpc.aio.insecure_channel(controller.addr) as channel:
                stub = api_grpc.ControllerServiceStub(channel)
                await stub.CreateService(api.CreateServiceRequest(yaml=spec(name="small")), timeout=30)
                # No file of the controller may grow past 64 KiB more than the largest is now;
                # a 700 KB spec is written (twice) into the WAL, so its write fails.
                _limit_file_size(controller.proc.pid, _largest_file(state_dir, controller.log_path) + 65536)
                big = spec(name="big") + "envs:\n  BLOB: " + "x" * 700_000 + "\n"
                err = await unavailable(stub.CreateService(api.CreateServiceRequest(yaml=big), timeout=30))
                assert err.message.startswith("the controller could not save the change"), err.message
                assert "disk" in err.message and "try again" in err.message
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.GetService(api.GetServiceRequest(service_name="big"), timeout=30)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND  # nothing was changed

                _limit_file_size(controller.proc.pid, resource.RLIM_INFINITY)
                created = await stub.CreateService(api.CreateServiceRequest(yaml=big), timeout=30)
                assert created.service.name == "big"
        finally:
            controller.stop()
    assert "disk I/O error" in controller.log()  # the detail, for the operator

"""Local replicas run in one Python venv per service version: pip installs there, never into the host."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator

import grpc
import pytest

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from replicaplane.provisioner.v1 import provisioner_service_pb2_grpc as pb_grpc
from services.provisioner import server
from tests.helpers import provisioner_client as client
from tests.helpers import provisioner_procs, wheels

L = client.L
PACKAGE = wheels.PACKAGE


def read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


async def wait_read(path: str, timeout: float = 30) -> str:
    """The contents of `path` once the replica has written it."""
    async with asyncio.timeout(timeout):
        while True:
            text = await asyncio.to_thread(_read_if_there, path)
            if text:
                return text
            await asyncio.sleep(0.05)


def _read_if_there(path: str) -> str:
    try:
        return read(path)
    except FileNotFoundError:
        return ""


def host_imports(package: str) -> bool:
    """Whether the host's python3 (what replicas ran before venvs) can import `package`."""
    return subprocess.run(["python3", "-c", f"import {package}"], capture_output=True, check=False).returncode == 0


async def _serve(state_dir: str, **overrides: object) -> server.Server:
    values: dict[str, object] = {
        "listen_addr": "127.0.0.1:0",
        "state_dir": state_dir,
        "launch_backoff_initial_s": 0.05,
        "launch_backoff_max_s": 0.1,
        "kill_grace_s": 1.0,
        **overrides,
    }
    srv = await server.build_server(server.Settings(**values))  # type: ignore[arg-type]
    await srv.start()
    return srv


@pytest.fixture
def state_dir(tmp_path) -> str:
    return str(tmp_path / "state")


@pytest.fixture
async def stub(state_dir) -> AsyncIterator[pb_grpc.ProvisionerServiceStub]:
    srv = await _serve(state_dir)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            yield pb_grpc.ProvisionerServiceStub(channel)
    finally:
        await srv.stop(None)
        provisioner_procs.kill_replicas(state_dir)


def _spec(tmp_path, wheel: str) -> object:
    # The app reports what its `python3` sees, then serves as usual.
    setup = (
        f"echo start >> {tmp_path}/setups; pip install --no-index --quiet {wheel}; "
        f"sleep 0.3; echo end >> {tmp_path}/setups"
    )
    run = (
        f'python3 -c \'import {PACKAGE}, os, sys; print("env", sys.prefix, os.environ["VIRTUAL_ENV"])\' '
        f"> seen.txt && exec {client.HTTP_RUN}"
    )
    return client.spec(run, setup=setup)


async def test_replicas_of_a_version_share_one_venv_that_setup_installs_into(stub, state_dir, tmp_path) -> None:
    wheel = wheels.make_wheel(str(tmp_path))
    spec = _spec(tmp_path, wheel)
    results = await asyncio.gather(
        *(client.collect(stub.Launch(client.launch_request(i, "pyapp", spec_=spec)), timeout=60) for i in (1, 2))
    )
    assert [events[-1].type for events in results] == [L.LAUNCH_EVENT_TYPE_RUNNING] * 2
    envs = os.listdir(os.path.join(state_dir, "envs"))
    assert len(envs) == 1 and envs[0].startswith("pyapp-v1-")
    env_dir = os.path.join(state_dir, "envs", envs[0])
    for i in (1, 2):
        seen = (await wait_read(os.path.join(state_dir, "local", f"pyapp-{i}", "work", "seen.txt"))).split()
        assert seen == ["env", env_dir, env_dir]
    # The first setup ran alone: two pip installs never wrote into the venv at once.
    assert read(os.path.join(tmp_path, "setups")).split() == ["start", "end", "start", "end"]
    assert not host_imports(PACKAGE)

    # Another version has its own venv; each goes with its last replica.
    other = client.launch_request(3, "pyapp", spec_=spec)
    other.version = 2
    assert (await client.collect(stub.Launch(other), timeout=60))[-1].type == L.LAUNCH_EVENT_TYPE_RUNNING
    assert len(os.listdir(os.path.join(state_dir, "envs"))) == 2
    await client.collect(stub.Terminate(pb.TerminateRequest(name="pyapp-1")))
    assert os.listdir(env_dir)  # replica 2 still uses it
    for name in ("pyapp-2", "pyapp-3"):
        await client.collect(stub.Terminate(pb.TerminateRequest(name=name)))
    assert os.listdir(os.path.join(state_dir, "envs")) == []


async def test_a_restarted_provisioner_keeps_the_venvs_its_replicas_use(state_dir, tmp_path) -> None:
    wheel = wheels.make_wheel(str(tmp_path))
    srv = await _serve(state_dir)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = pb_grpc.ProvisionerServiceStub(channel)
            launch = client.launch_request(1, "kept", spec_=_spec(tmp_path, wheel))
            assert (await client.collect(stub.Launch(launch), timeout=60))[-1].type == L.LAUNCH_EVENT_TYPE_RUNNING
        await srv.stop(None)
        os.makedirs(os.path.join(state_dir, "envs", "stale-v1-0000000000"))  # left by an old replica
        srv = await _serve(state_dir)
        assert [n.startswith("kept-v1-") for n in os.listdir(os.path.join(state_dir, "envs"))] == [True]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = pb_grpc.ProvisionerServiceStub(channel)
            await client.collect(stub.Terminate(pb.TerminateRequest(name="kept-1")))
        assert os.listdir(os.path.join(state_dir, "envs")) == []
    finally:
        await srv.stop(None)
        provisioner_procs.kill_replicas(state_dir)


async def test_venvs_can_be_turned_off(tmp_path) -> None:
    state_dir = str(tmp_path / "state")
    srv = await _serve(state_dir, local_venv=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = pb_grpc.ProvisionerServiceStub(channel)
            run = f'echo "[${{VIRTUAL_ENV:-none}}]" > seen.txt && exec {client.HTTP_RUN}'
            launch = client.launch_request(1, "plain", spec_=client.spec(run))
            assert (await client.collect(stub.Launch(launch), timeout=60))[-1].type == L.LAUNCH_EVENT_TYPE_RUNNING
            seen = await wait_read(os.path.join(state_dir, "local", "plain-1", "work", "seen.txt"))
            assert seen.strip() == "[none]"
            assert "envs" not in os.listdir(state_dir)
    finally:
        await srv.stop(None)
        provisioner_procs.kill_replicas(state_dir)


async def test_bare_venvs_borrow_the_provisioners_pip_instead_of_installing_one(tmp_path) -> None:
    # Without the system site-packages (or where the base interpreter has no pip), venvs get pip
    # through a link to the provisioner's own, not ensurepip's seconds-long install into each.
    state_dir = str(tmp_path / "state")
    wheel = wheels.make_wheel(str(tmp_path))
    srv = await _serve(state_dir, local_venv_system_site_packages=False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = pb_grpc.ProvisionerServiceStub(channel)
            launch = client.launch_request(1, "bare", spec_=_spec(tmp_path, wheel))
            assert (await client.collect(stub.Launch(launch), timeout=60))[-1].type == L.LAUNCH_EVENT_TYPE_RUNNING
            seen = (await wait_read(os.path.join(state_dir, "local", "bare-1", "work", "seen.txt"))).split()
            env_dir = seen[1]
            version = f"python{sys.version_info.major}.{sys.version_info.minor}"
            site = os.path.join(env_dir, "lib", version, "site-packages")
            assert sorted(os.listdir(site)) == sorted(
                ["_replicaplane_pip.pth", PACKAGE, f"{PACKAGE}-1.0.dist-info"]
            )  # no pip of its own
            assert read(os.path.join(env_dir, "pyvenv.cfg")).count("include-system-site-packages = false") == 1
    finally:
        await srv.stop(None)
        provisioner_procs.kill_replicas(state_dir)

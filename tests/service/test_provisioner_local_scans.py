"""The local backend's /proc scans (group liveness, stray processes) run off the event loop,
and callers that ask at the same time share one scan."""

from __future__ import annotations

import asyncio
import os
import threading

from services.provisioner import backend, local, model, procs


def _request(tmp_path, name: str, run: str) -> backend.CreateRequest:
    spec = model.ReplicaSpec(run=run)
    launch = model.LaunchRequest(name=name, service="svc", replica_id=int(name.split("-")[1]), version=1, spec=spec)
    return backend.CreateRequest(
        launch=launch, attempt=1, launch_log=str(tmp_path / f"{name}.launch"), app_log=str(tmp_path / f"{name}.app")
    )


async def test_the_local_backend_never_scans_proc_on_the_event_loop(tmp_path, monkeypatch) -> None:
    scans: list[int] = []
    real_all_pids = procs.all_pids

    def recorded() -> object:
        scans.append(threading.get_ident())
        return real_all_pids()

    monkeypatch.setattr(procs, "all_pids", recorded)
    loop_thread = threading.get_ident()
    state = str(tmp_path / "state")
    # A process of a replica this provisioner does not know: start() must find and kill it.
    stray = await asyncio.create_subprocess_exec(
        "sleep", "60", env={**os.environ, local.OWNER_ENV: state, local.TOKEN_ENV: "unknown"}
    )
    backend_ = local.LocalBackend(state, network="port")
    try:
        await backend_.start()
        assert await asyncio.wait_for(stray.wait(), 10) == -9
        # Ignores SIGTERM, so the teardown polls the group through its grace, then SIGKILLs.
        await backend_.create(_request(tmp_path, "svc-1-a", "trap '' TERM; while true; do sleep 0.05; done"))
        await backend_.create(_request(tmp_path, "svc-2-b", "sleep 60"))
        await asyncio.gather(backend_.delete("svc-1-a", grace_s=0.3), backend_.preempt("svc-2-b"))
        await backend_.delete("svc-2-b", grace_s=0)
    finally:
        if stray.returncode is None:
            stray.kill()
            await stray.wait()
        await backend_.close()
    assert scans, "nothing looked at /proc: the test did not exercise the scans"
    assert loop_thread not in scans


async def test_concurrent_scans_are_shared(tmp_path) -> None:
    calls = 0
    started = threading.Event()
    release = threading.Event()

    def scan() -> int:
        nonlocal calls
        calls += 1
        started.set()
        release.wait(10)
        return calls

    shared = procs.Coalesced(scan)
    first = asyncio.ensure_future(shared.get())
    await asyncio.to_thread(started.wait, 10)
    # Asked while scan 1 runs: they need a scan that starts after them, and share it.
    later = [asyncio.ensure_future(shared.get()) for _ in range(20)]
    await asyncio.sleep(0.05)
    release.set()
    assert await asyncio.wait_for(first, 10) == 1
    assert await asyncio.wait_for(asyncio.gather(*later), 10) == [2] * 20
    assert calls == 2

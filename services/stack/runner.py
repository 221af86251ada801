"""Runs the local stack: `up` (in the foreground or detached) and `down`.

`up` starts the service processes (supervisor.py), creates the example and cleans up on stop.

Children run in their own sessions, so Ctrl-C reaches only the stack, which then deletes every
service (so the provisioner tears every replica down) before it stops the children. The stack
finishes that cleanup whatever happened to its terminal: a pipe whose reader died with the same
Ctrl-C (`make up | tee`) or a closed terminal sends its lines to `stack.log` instead. Should the
stack itself be killed (SIGKILL), the kernel sends each child SIGTERM (PR_SET_PDEATHSIG), so no
service outlives it; `down` then deletes the services left behind.

The state dir is private (0700): it holds the internal services' sockets, the API token the
stack generates (0600), the stores, replica logs and specs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from services.common import config
from services.stack import api, output, plan, preflight, procs, statefiles, supervisor

FOLLOW_MAX = 100
"""Services the stack's terminal follows at most; the rest are named once (the dashboard and
`replicactl status` show every one)."""
DISCOVER_INTERVAL_S = 1.0
"""How often the stack looks for services created or deleted through the API."""


async def _run(stack: supervisor.Stack, example: str | None, ready_timeout: float, *, follow: bool = True) -> None:
    await stack.start(ready_timeout)
    await stack.wait_serving(ready_timeout)
    if not follow:  # a stack started only to clean up after a killed one
        stack.ready = True
        stack.save()
        return
    client = api.Controller(stack.controller_addr, token=stack.token)
    try:
        if example:
            # Recorded before the call, so a stop during an in-flight create still deletes it.
            if name := await asyncio.to_thread(api.spec_name, example):
                stack.created.append(name)
                stack.save()
            if (created := await client.create(example, stack.out)) not in stack.created:
                stack.created.append(created)
        stack.ready = True
        stack.save()
        stack.out(f"stack ready: controller at {stack.controller_addr}; Ctrl-C (or make down) stops it")
        # Every service, the ones created through the API later too, until the stack stops.
        await client.follow_all(stack.out, first=stack.created, interval=DISCOVER_INTERVAL_S, limit=FOLLOW_MAX)
    finally:
        await client.close()


async def up(
    specs: Sequence[plan.ProcessSpec],
    *,
    state_dir: str,
    example: str | None,
    ready_timeout: float = 30.0,
    delete_timeout: float = 90.0,
    out: api.Out = output.say,
    cleanup_only: bool = False,
) -> int:
    """Run the stack until SIGTERM, SIGINT or SIGHUP, then clean up.

    Before it starts anything, every fixed TCP port of `specs` must be free; a taken one is
    named in one line (with what holds it) and nothing starts.

    Args:
        specs: the processes, from plan.plan().
        state_dir: absolute state directory.
        example: a service YAML to create once the stack serves, or None.
        ready_timeout: seconds each process gets to serve.
        delete_timeout: seconds each created service gets to be deleted on stop.
        out: where progress lines go.
        cleanup_only: start the processes quietly, delete every service and stop (what `down`
            does after a killed stack).

    Returns:
        The exit code: 0 after a requested stop, 1 if anything failed.
    """
    files = statefiles.StateFiles(state_dir)
    if not statefiles.private_dir(state_dir, out):
        return 1
    if (other := files.running_pid()) is not None:
        out(f"a stack is already running from {state_dir} (pid {other}); stop it with `make down`")
        return 1
    if problem := await asyncio.to_thread(preflight.check_ports, specs):
        out(f"error: {problem}")
        return 1
    output.keep_output_in(os.path.join(state_dir, "stack.log"))
    files.write(files.pid_path, f"{os.getpid()}\n")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(files.result_path)  # a stale report of an earlier stack
    controller = next(s for s in specs if s.component == "controller")
    token = ""
    if controller.env.get("REPLICAPLANE_CONTROLLER_AUTH_TOKEN_FILE") == files.token_path:
        token = files.new_token()
        if not cleanup_only:
            out(f"API token (for grpcurl and scripts): {files.token_path}")
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(files.token_path)  # the user's own tokens guard the API
    stack = supervisor.Stack(specs, files, out, token=token, announce=not cleanup_only)
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():  # an impatient second Ctrl-C: the cleanup goes on, say what it waits for
            out(f"already stopping: deleting every service first (at most {delete_timeout:.0f} s each)")
        stop.set()

    loop = asyncio.get_running_loop()
    # SIGHUP: the terminal closed; clean up as for Ctrl-C (lines go to stack.log from then on).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)
    main = asyncio.create_task(_run(stack, example, ready_timeout, follow=not cleanup_only))
    exits = asyncio.create_task(stack.watch_exits())
    stopped = asyncio.create_task(stop.wait())
    rc = 0
    try:
        done, _ = await asyncio.wait({main, exits, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if main in done and main.exception() is not None:
            exc = main.exception()
            out(f"error: {exc}" if isinstance(exc, api.StackError) else f"error: {exc!r}")
            rc = 1
        elif exits in done:
            out(f"error: {exits.result()}")
            rc = 1
        elif not cleanup_only:
            out("stopping")
    finally:
        for task in (exits, stopped):
            task.cancel()
        if not stack.ready:  # still starting: cancel an in-flight create before deleting by name
            main.cancel()
            await asyncio.gather(main, return_exceptions=True)
        # While the deletes run, the watch (if running) keeps printing the teardown.
        services_left = await stack.delete_services(delete_timeout)
        if services_left:
            rc = 1
        files.write(files.result_path, json.dumps({"services_left": services_left}) + "\n")
        main.cancel()
        await asyncio.gather(main, exits, stopped, return_exceptions=True)
        await stack.stop_processes()
        files.remove()
    return rc


def detach(
    argv: Sequence[str],
    *,
    state_dir: str,
    timeout: float,
    out: api.Out = output.say,
    specs: Sequence[plan.ProcessSpec] = (),
) -> int:
    """Run `python -m services.stack <argv>` in the background and wait until it is ready.

    Args:
        argv: the `up` command line of the background stack.
        state_dir: its state dir.
        timeout: seconds it gets to be ready.
        out: where progress lines go.
        specs: its processes; their fixed ports are checked first, as `up` does.

    Returns:
        0 once the background stack is ready; 1 if it failed or took longer than `timeout` s.
    """
    files = statefiles.StateFiles(state_dir)
    if not statefiles.private_dir(state_dir, out):
        return 1
    if (other := files.running_pid()) is not None:
        out(f"a stack is already running from {state_dir} (pid {other}); stop it with `make down`")
        return 1
    if problem := preflight.check_ports(specs):
        out(f"error: {problem}")
        return 1
    log_path = os.path.join(state_dir, "stack.log")
    start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.stack", *argv],
            env=procs.child_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, encoding="utf-8", errors="replace") as fh:
                fh.seek(start)
                lines = fh.read().splitlines()
            # Its own one-line error says it all; otherwise show how it ended.
            if errors := [line.split(" ", 1)[-1] for line in lines if " error: " in f" {line}"]:
                for line in errors:
                    out(f"{line} (the stack's output: {log_path})")
                return 1
            out(f"the stack failed to start (exit code {proc.returncode}); last lines of {log_path}:")
            for line in lines[-20:]:
                print(f"  {line}", flush=True)
            return 1
        state = files.read_state()
        if state and state.get("pid") == proc.pid and state.get("ready"):
            out(f"stack running in the background (pid {proc.pid}); controller at {state['controller']}")
            for name, url in (state.get("metrics") or {}).items():
                out(f"{name} metrics: {url}")
            for process in state.get("processes", []):
                if process.get("name") == "dashboard" and process.get("url"):
                    out(output.dashboard_line(process["url"]))
            out(f"output: {log_path}; stop it with `make down` (python -m services.stack down)")
            return 0
        time.sleep(0.1)
    out(f"the stack was not ready after {timeout:.0f} s; stopping it (see {log_path})")
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout + 30)
    return 1


def down(*, state_dir: str, timeout: float, out: api.Out = output.say) -> int:
    """Stop the stack running from `state_dir`, the same way Ctrl-C does.

    Every service the controller has is deleted (not only the ones the stack created), and the
    services that could not be deleted are reported.

    If the stack process itself is gone without cleaning up (killed), its processes went with it
    (or are stopped now), but its services' replicas still run: the provisioner and controller
    are started again from the same state, quietly, to delete every service, then stopped.

    Returns:
        0 when nothing of the stack is left running and every service was deleted, 1 otherwise.
    """
    files = statefiles.StateFiles(state_dir)
    pid = files.running_pid()
    state = files.read_state() or {}
    if pid is None and not state:
        out(f"no stack is running from {state_dir}")
        files.remove()
        return 0
    failed = False
    crashed = pid is None
    if pid is not None:
        out(f"stopping the stack (pid {pid})")
        os.kill(pid, signal.SIGTERM)
        if not procs.wait_gone(pid, "services.stack", timeout):
            out(f"the stack did not stop in {timeout:.0f} s; killing it and cleaning up after it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            procs.wait_gone(pid, "services.stack", 2.0)
            crashed = True
        result = None if crashed else statefiles.read_result(files)
        if crashed:
            pass  # cleaned up below
        elif result is None:
            out("the stack did not say whether every service was deleted; see its log")
        elif result:
            out(f"services left: {', '.join(result)} (their replicas may still run)")
            failed = True
        else:
            out("services left: none")
    else:
        out(f"cleaning up after a stack that is gone (pid {state.get('pid', '?')})")
    left = [
        (p["name"], int(p["pid"]), f"services.{p['name'].split('-')[0]}")
        for p in state.get("processes", [])
        if procs.is_ours(int(p["pid"]), f"services.{p['name'].split('-')[0]}")
    ]
    if left:
        # A killed stack's processes got SIGTERM from the kernel already; wait for them (or end them).
        out("stopping what it left running: " + ", ".join(n for n, _, _ in left))
        procs.terminate_pids(sorted(left, key=lambda t: t[0] != "controller"), out)
        if still := [n for n, p, m in left if procs.is_ours(p, m)]:
            out("still running: " + ", ".join(still))
            return 1
    if crashed:
        return _clean_up_after_crash(state_dir, timeout, out)
    files.remove()
    out("stack stopped")
    return 1 if failed else 0


def cleanup_specs(state_dir: str, environ: dict[str, str] | None = None) -> list[plan.ProcessSpec]:
    """The processes that delete a killed stack's services: its provisioner, one prober and its
    controller on the same state, the controller's API on a port of its own choosing, no
    metrics, no balancer or dashboard (nothing for users to reach)."""
    env = dict(os.environ if environ is None else environ)
    env["REPLICAPLANE_CONTROLLER_LISTEN_ADDR"] = "127.0.0.1:0"
    env["REPLICAPLANE_LOADBALANCER_HTTP_ADDR"] = "127.0.0.1:0"
    env["REPLICAPLANE_DASHBOARD_HTTP_ADDR"] = "127.0.0.1:0"
    for section in ("controller", "provisioner", "prober", "loadbalancer", "dashboard"):
        env[config.env_name(section, "metrics_addr")] = ""
    specs = plan.plan(probers=1, state_dir=state_dir, environ=env)
    return [s for s in specs if s.component in ("provisioner", "prober", "controller")]


def _clean_up_after_crash(state_dir: str, timeout: float, out: api.Out) -> int:
    try:
        specs = cleanup_specs(state_dir)
    except ValueError as exc:
        out(f"error: cannot start the stack again to delete its services: {exc}")
        return 1
    out("starting its provisioner and controller again to delete every service")
    rc = asyncio.run(up(specs, state_dir=state_dir, example=None, delete_timeout=timeout, out=out, cleanup_only=True))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(statefiles.StateFiles(state_dir).result_path)
    return rc

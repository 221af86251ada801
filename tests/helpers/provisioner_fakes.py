"""A scriptable in-memory provisioner backend, for unit tests of the provisioner core."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator

from services.provisioner import backend, model


@dataclasses.dataclass
class Call:
    """One create() call the fake saw."""

    name: str
    attempt: int
    zone: str


class FakeBackend(backend.Backend):
    """Runs nothing; create() outcomes are scripted per replica name.

    `outcomes[name]` is a list consumed one per create(): an exception instance to raise, or
    None for success. `gates[name]`, when set, is an asyncio.Event create() waits on first
    (to hold a launch in flight). `delete_failures[name]` counts delete() calls that fail.
    `exit_during_create[name]` makes the app exit (with that code) before create() returns.
    Jobs: `job_gate`, when set, is an event run_job() waits on first; `job_starts` records every
    run_job() call, `job_cancels` every cancel_job(); end_job() reports a job's end.
    """

    name = "fake"

    def __init__(self) -> None:
        self.outcomes: dict[str, list[BaseException | None]] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.delete_failures: dict[str, int] = {}
        self.creates: list[Call] = []
        self.deletes: list[str] = []
        self.preempted: list[str] = []
        self.exit_during_create: dict[str, int] = {}
        self.running: dict[str, backend.BackendReplica] = {}
        self.started = asyncio.Event()  # set whenever a create() begins
        self._events: asyncio.Queue[backend.BackendEvent] = asyncio.Queue()
        self.job_gate: asyncio.Event | None = None
        self.job_starts: list[backend.JobStart] = []
        self.job_cancels: list[tuple[str, float]] = []
        self.jobs: dict[str, backend.BackendJob] = {}
        self._job_events: asyncio.Queue[backend.JobEnded] = asyncio.Queue()
        self._tokens = itertools.count(1)
        self._ports = itertools.count(20000)

    async def create(self, request: backend.CreateRequest) -> backend.BackendReplica:
        """Record the call, wait on the gate, then fail or succeed as scripted."""
        self.creates.append(Call(request.name, request.attempt, request.launch.zone))
        self.started.set()
        gate = self.gates.get(request.name)
        if gate is not None:
            await gate.wait()
        script = self.outcomes.get(request.name) or []
        outcome = script.pop(0) if script else None
        if outcome is not None:
            raise outcome
        replica = backend.BackendReplica(
            name=request.name,
            token=f"t{next(self._tokens)}",
            endpoint=f"http://127.0.0.1:{next(self._ports)}",
            zone=request.launch.zone or "zone-a",
            price_per_hour=1.0,
            is_spot=request.launch.use_spot,
            app_state=model.AppState.RUNNING,
            start_time=1.0,
        )
        self.running[request.name] = replica
        if request.name in self.exit_during_create:
            # The app dies before create() returns: its exit event is seen first.
            self.exit(request.name, self.exit_during_create[request.name])
            for _ in range(5):
                await asyncio.sleep(0)
        return replica

    async def delete(self, name: str, *, grace_s: float) -> None:
        """Forget `name`, or fail as scripted."""
        self.deletes.append(name)
        left = self.delete_failures.get(name, 0)
        if left:
            self.delete_failures[name] = left - 1
            raise backend.TeardownError("scripted teardown failure")
        self.running.pop(name, None)

    def get(self, name: str) -> backend.BackendReplica | None:
        """The running replica `name`."""
        return self.running.get(name)

    def list(self) -> list[backend.BackendReplica]:
        """Every running replica."""
        return [self.running[n] for n in sorted(self.running)]

    async def watch(self) -> AsyncIterator[backend.BackendEvent]:
        """Events pushed with exit() and vanish()."""
        while True:
            yield await self._events.get()

    def exit(self, name: str, code: int) -> None:
        """Report that the app of `name` exited with `code`."""
        token = self.running[name].token
        self._events.put_nowait(backend.BackendEvent(name, token, model.AppState.EXITED, code, 0.0, f"exit {code}"))

    def vanish(self, name: str) -> None:
        """Report that `name` vanished."""
        token = self.running[name].token
        self._events.put_nowait(backend.BackendEvent(name, token, model.AppState.VANISHED, 0, 0.0, "gone"))

    async def preempt(self, name: str) -> None:
        """Record the preemption."""
        self.preempted.append(name)

    async def run_job(self, start: backend.JobStart) -> backend.BackendJob:
        """Record the call, wait on the gate; a token started before is only described."""
        self.job_starts.append(start)
        if self.job_gate is not None:
            await self.job_gate.wait()
        if start.token not in self.jobs:
            self.jobs[start.token] = backend.BackendJob(start.token, start.job.replica, running=True, start_time=2.0)
        return self.jobs[start.token]

    async def cancel_job(self, token: str, *, grace_s: float) -> None:
        """Record the cancel; a running job ends killed."""
        self.job_cancels.append((token, grace_s))
        if token in self.jobs and self.jobs[token].running:
            self.end_job(token, None)

    def get_job(self, token: str) -> backend.BackendJob | None:
        """Job `token`."""
        return self.jobs.get(token)

    async def watch_jobs(self) -> AsyncIterator[backend.JobEnded]:
        """Ends pushed with end_job()."""
        while True:
            yield await self._job_events.get()

    def end_job(self, token: str, code: int | None, *, worker_gone: bool = False) -> None:
        """Report that job `token` ended with `code` (None: killed)."""
        job = self.jobs[token]
        self.jobs[token] = dataclasses.replace(job, running=False, exit_code=code)
        self._job_events.put_nowait(backend.JobEnded(token, job.worker, code, 3.0, "ended", worker_gone=worker_gone))

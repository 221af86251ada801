"""The provisioner's core: launch and teardown operations, retries, slots, watch and re-attach.

Plain Python (no gRPC). Every replica is keyed by its name. A launch or teardown runs as its
own task and appends events to the replica's event log; RPC streams only follow those logs,
so a client that goes away never stops the work, and a later call replays from any point.
Records are persisted after every step, so a restarted provisioner finds its replicas again:
running ones are watched, launches and teardowns that were in flight are resumed.

Pool workers launch like replicas but end their launch with SETUP_DONE (no endpoint). Mixed into
`Provisioner`: launches (`launches.Launches`, with `launches.validate`), running apps
(`app_events.AppEvents`), teardowns (`teardowns.Teardowns`) and the jobs that run on workers
(`worker_jobs.WorkerJobs`); what is kept of a replica is `entries.Entry`.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

import prometheus_client

from services.common import errors, pagetoken
from services.provisioner import (
    app_events,
    capability,
    entries,
    events,
    jobs,
    launches,
    logstore,
    metrics,
    model,
    retries,
    slots,
    store,
    teardowns,
    worker_jobs,
)
from services.provisioner import backend as backend_mod

log = logging.getLogger(__name__)

MAX_PAGE_SIZE = 10_000
_RESTARTED = "a provisioner restart"
DEFAULT_PAGE_SIZE = 1_000


@dataclasses.dataclass(frozen=True)
class Options:
    """Tuning of the provisioner core (see settings.Settings for each field's meaning)."""

    max_in_flight: float = 8
    launch_attempts: int = 3
    launch_backoff_initial_s: float = 60.0
    launch_backoff_multiplier: float = 1.6
    launch_backoff_max_s: float = 300.0
    teardown_attempts: int = 3
    teardown_backoff_initial_s: float = 5.0
    teardown_backoff_multiplier: float = 1.6
    teardown_backoff_max_s: float = 25.0
    backoff_jitter: float = retries.DEFAULT_JITTER
    cancel_timeout_s: float = 15.0
    kill_grace_s: float = 5.0
    watch_history: int = 10_000
    sweep_interval_s: float = 5.0
    # How long a job killed from outside waits for news of its worker (the Pod watch may lag
    # behind the exec session) before it is reported killed rather than "worker died".
    job_kill_settle_s: float = 1.0


class Provisioner(launches.Launches, app_events.AppEvents, teardowns.Teardowns, worker_jobs.WorkerJobs):
    """Launches and tears down replicas through a backend; see the module docstring."""

    def __init__(
        self,
        *,
        backend: backend_mod.Backend,
        records: store.RecordStore,
        logs: logstore.LogStore,
        options: Options | None = None,
        clock: Callable[[], float] = time.time,
        stats: metrics.ProvisionerMetrics | None = None,
        job_records: store.RecordStore | None = None,
    ) -> None:
        self._backend = backend
        self._stats = stats or metrics.ProvisionerMetrics(prometheus_client.CollectorRegistry(), backend.name)
        self._stats.watch(self._count_states)
        backend.report_api_errors(self._stats.api_error)
        self._records = records
        self._logs = logs
        self._opts = options or Options()
        self._clock = clock
        self._slots = slots.Slots(self._opts.max_in_flight)
        self._entries: dict[str, entries.Entry] = {}
        self._job_records = job_records or records.sibling("jobs")
        self._jobs: dict[str, jobs.Entry] = {}
        self._job_tokens: dict[str, str] = {}  # backend token -> job id
        self._job_tasks: set[asyncio.Task[None]] = set()
        self._hub = events.WatchHub(self._snapshot, history=self._opts.watch_history, clock=clock)
        self._consumer: asyncio.Task[None] | None = None
        self._job_consumer: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = False
        self._streams_ended = False

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load records, re-find replicas through the backend, resume interrupted operations."""
        await self._backend.start()
        for data in self._records.load_all():
            try:
                entry = entries.Entry.from_record(data)
            except (KeyError, TypeError, ValueError):
                log.warning("ignoring a malformed replica record")
                continue
            self._entries[entry.request.name] = entry
        for data in self._job_records.load_all():
            try:
                job = jobs.Entry.from_record(data)
            except (KeyError, TypeError, ValueError):
                log.warning("ignoring a malformed job record")
                continue
            self._jobs[job.job.job_id] = job
            self._job_tokens[job.token] = job.job.job_id
        # Which job a worker runs is the job records' fact (a replica record may be older).
        for entry in self._entries.values():
            entry.replica.job_id = ""
        for job in self._jobs.values():
            worker = self._entries.get(job.request.replica)
            if worker is not None and not job.job.ended:
                worker.replica.job_id = job.job.job_id
        for found in self._backend.list():
            if found.name not in self._entries:
                log.warning("tearing down replica %s: the backend runs it but no record exists", found.name)
                try:
                    await self._backend.delete(found.name, grace_s=self._opts.kill_grace_s)
                except backend_mod.TeardownError as exc:
                    log.warning("could not tear down unknown replica %s: %s", found.name, exc)
        self._consumer = asyncio.get_running_loop().create_task(self._consume())
        self._job_consumer = asyncio.get_running_loop().create_task(self._consume_jobs())
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        for entry in list(self._entries.values()):
            self._resume(entry)
        for job in list(self._jobs.values()):
            if not job.job.ended:
                # Started again through the backend, which never starts one twice: a job that
                # runs is re-attached, one that never started starts now.
                self._start_job(job)

    def _resume(self, entry: entries.Entry) -> None:
        replica = entry.replica
        if replica.state in (model.ReplicaState.QUEUED, model.ReplicaState.PROVISIONING):
            self._logs.note(replica.name, "provisioner restarted during the launch; starting it again")
            self._start_launch(entry, resumed=_RESTARTED)
        elif replica.state == model.ReplicaState.TERMINATING:
            last = entry.teardown.last
            if last is None or not last.terminal:
                self._start_teardown(entry, drain_s=0.0, keep_logs=entry.keep_logs)
        elif replica.state == model.ReplicaState.RUNNING and replica.app_state == model.AppState.RUNNING:
            found = self._backend.get(replica.name)
            if found is None or found.token != entry.token:
                self._app_changed(
                    entry, model.AppState.VANISHED, 0, "the replica was gone when the provisioner restarted"
                )

    def end_streams(self) -> None:
        """End every open stream (shutdown), so a graceful server stop does not wait on them.

        Clients see their stream end without a terminal event and re-attach with
        `after_sequence`, as after any cut stream; the work itself goes on.
        """
        self._streams_ended = True
        for entry in self._entries.values():
            entry.launch.close()
            entry.teardown.close()
        for job in self._jobs.values():
            job.log.close()
        self._hub.close()

    async def close(self) -> None:
        """Stop operations (they resume on the next start) and watchers; replicas keep running."""
        self._closing = True
        tasks = [t for e in self._entries.values() for t in (e.launch_task, e.teardown_task) if t and not t.done()]
        tasks += [t for t in (self._consumer, self._job_consumer, self._sweeper) if t is not None]
        tasks += list(self._job_tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        for entry in self._entries.values():
            entry.launch.close()
            entry.teardown.close()
        for job in self._jobs.values():
            job.log.close()
        self._hub.close()
        await self._backend.close()

    # ---- reads -----------------------------------------------------------------------------

    def _get_entry(self, name: str) -> entries.Entry:
        entry = self._entries.get(name)
        if entry is None:
            message = f"replica {name} not found"
            # A bare `{service}-{id}` (as older docs showed) names the replicas it could mean:
            # the controller's names end in the service's uid.
            service, _, rid = name.rpartition("-")
            if service and rid.isascii() and rid.isdigit() and len(rid) <= 18:
                meant = sorted(
                    n
                    for n, e in self._entries.items()
                    if e.replica.service == service and e.replica.replica_id == int(rid)
                )
                if meant:
                    message += (
                        f"; replica names are {{service}}-{{replica_id}}-{{uid}}: did you mean {', '.join(meant[:3])}?"
                    )
            raise errors.NotFoundError(message, reason="REPLICA_NOT_FOUND", replica=name)
        return entry

    def get(self, name: str) -> model.Replica:
        """The replica `name`.

        Raises:
            errors.NotFoundError: no such replica.
        """
        return self._get_entry(name).replica.copy()

    def list(self, *, service: str = "", page_size: int = 0, page_token: str = "") -> tuple[list[model.Replica], str]:
        """One page of replicas in name order, and the token of the next page ("" at the end).

        Raises:
            errors.ValidationError: a negative page size or a malformed page token.
        """
        if page_size < 0:
            raise errors.ValidationError([errors.FieldViolation("page_size", "must not be negative")])
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        start = str(pagetoken.decode(page_token, "replicas", service, position_type=str)) if page_token else ""
        names = sorted(
            n for n, e in self._entries.items() if (not service or e.replica.service == service) and n > start
        )
        page = names[:size]
        token = pagetoken.encode("replicas", service, page[-1]) if len(names) > size else ""
        return [self._entries[n].replica.copy() for n in page], token

    def _count_states(self) -> dict[str, int]:
        """Replicas by the metrics' state names (see metrics.STATES)."""
        counts: dict[str, int] = {}
        for entry in self._entries.values():
            replica = entry.replica
            state = replica.state.value.lower()
            if replica.state == model.ReplicaState.RUNNING and replica.app_state != model.AppState.RUNNING:
                state = "app_ended"
            counts[state] = counts.get(state, 0) + 1
        return counts

    def _snapshot(self) -> builtins.list[model.Replica]:
        return [self._entries[n].replica.copy() for n in sorted(self._entries)]

    def watch(self, after_sequence: int = 0) -> AsyncIterator[model.ReplicaEvent]:
        """Replica changes after `after_sequence`, a snapshot first when needed (see WatchHub)."""
        return self._hub.follow(after_sequence)

    def zones(self) -> builtins.list[model.Zone]:
        """The backend's zones, cheapest first."""
        return self._backend.zones()

    def set_zone_availability(self, zone: str, refuse_for_s: float) -> model.Zone:
        """Make `zone` refuse launches for `refuse_for_s` seconds; 0 accepts again."""
        return self._backend.set_zone_availability(zone, refuse_for_s)

    async def stream_logs(
        self, name: str, kind: model.LogKind, *, follow: bool, job_id: str = ""
    ) -> AsyncIterator[bytes]:
        """The bytes of a replica's log, or (kind JOB) of a job's output; with `follow`, new output
        while the replica (the job) lives.

        Raises:
            errors.ValidationError: `name` is not a replica name (never a path), or a JOB log
                without a valid `job_id`.
            errors.NotFoundError: no such log (never launched, or removed at teardown).
        """
        if kind == model.LogKind.JOB:
            async for chunk in self._stream_job_log(name, job_id, follow=follow):
                yield chunk
            return
        entries.check_name(name)
        if not self._logs.exists(name, kind):
            raise errors.NotFoundError(f"no {kind.value} log for replica {name}", reason="LOG_NOT_FOUND", replica=name)
        live = (lambda: self._live(name, kind)) if follow else None
        async for chunk in self._logs.stream(name, kind, live=live):
            yield chunk

    async def check_spec(self, needs: capability.Needs) -> builtins.list[errors.FieldViolation]:
        """What of a spec this provisioner's backend cannot run; empty if it can."""
        backend = self._backend
        problems = capability.accelerator_problems(needs, backend.offered_accelerators(), hint=backend.accelerator_hint)
        problems += capability.relative_problems(needs)
        return problems + await backend.path_problems(needs)

    def offered_accelerators(self) -> dict[str, float] | None:
        """The backend's accelerators; None when it places no limit."""
        return self._backend.offered_accelerators()

    def delete_logs(self, name: str, *, job_id: str = "") -> bool:
        """Delete the logs kept for replica `name`, which must be gone, with its jobs' logs and
        records; or, with `job_id`, one ended job's log and record. True if there were any.

        Raises:
            errors.ValidationError: `name` is not a replica name (`job_id` not a job id).
            errors.FailedPreconditionError: the replica still exists (tear it down first), or
                the job has not ended.
        """
        if job_id:
            return self._delete_job(job_id)
        entries.check_name(name)
        if name in self._entries:
            raise errors.FailedPreconditionError(
                f"replica {name} still exists; its logs go with its teardown", subject=name, replica=name
            )
        existed = any(self._logs.exists(name, kind) for kind in model.REPLICA_LOGS)
        self._logs.delete(name)
        existed = self._forget_jobs_of(name) or existed
        return existed

    def _live(self, name: str, kind: model.LogKind) -> bool:
        entry = self._entries.get(name)
        if entry is None or self._closing or self._streams_ended:
            return False
        if kind == model.LogKind.LAUNCH:
            return entry.launch.active or entry.teardown.active
        return entry.replica.state == model.ReplicaState.RUNNING and entry.replica.app_state == model.AppState.RUNNING

    def _save(self, entry: entries.Entry) -> None:
        # Memory is the truth while the provisioner runs; a record that could not be written
        # only matters after a restart, which re-finds replicas through the backend anyway.
        try:
            self._records.save(entry.request.name, entry.to_record())
        except Exception:
            log.exception("could not persist replica %s", entry.request.name)

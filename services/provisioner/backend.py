"""The backend interface: what a provisioner needs from whatever runs replicas.

Five operations (create, delete, get, list, watch) plus start/close, three optional
simulation hooks (zones, zone refusal, preemption) that backends without them leave to the
defaults here, which refuse with FAILED_PRECONDITION, and the jobs of pool workers (run_job,
cancel_job, get_job, watch_jobs), which a backend without them also refuses.

A pool worker is created like any replica, with `ReplicaSpec.worker` set: `create()` runs its
setup, then starts a holder instead of `run`, so the worker stays alive (and its end is noticed
like an app's) until it is deleted. Jobs run in the worker's working directory and environment.
"""

from __future__ import annotations

import abc
import asyncio
import builtins
import dataclasses
from collections.abc import AsyncIterator, Callable

from services.common import errors
from services.provisioner import capability, model


class LaunchError(Exception):
    """A launch attempt failed.

    Attributes:
        message: why, fit for users (no secrets).
        cause: whose fault it was (see causes.py): the user's (their spec, image or code) or
            the infrastructure's (capacity, quota, the API server, this host).
        permanent: retrying cannot help (bad spec, missing files, an image name that cannot
            be). Only user-caused failures can be permanent: the infrastructure's are retried.
        capacity_unavailable: the zone lacked capacity. Not retried when the launch asked for
            that zone: the controller places the replica again (another zone, after a backoff).
    """

    def __init__(
        self,
        message: str,
        *,
        cause: model.FailureCause = model.FailureCause.UNSPECIFIED,
        permanent: bool = False,
        capacity_unavailable: bool = False,
    ) -> None:
        if permanent and cause == model.FailureCause.INFRASTRUCTURE:
            raise ValueError("an infrastructure failure is retried, never permanent")
        super().__init__(message)
        self.message = message
        self.cause = cause
        self.permanent = permanent
        self.capacity_unavailable = capacity_unavailable


class TeardownError(Exception):
    """A teardown attempt failed; it may be retried."""


class JobStartError(Exception):
    """A job could not be started on its worker.

    Attributes:
        message: why, fit for users (no secrets).
        cause: whose fault it was: the infrastructure's (the worker is gone, a process could not
            be started, the API failed) unless the job itself cannot run as given.
    """

    def __init__(self, message: str, *, cause: model.FailureCause = model.FailureCause.INFRASTRUCTURE) -> None:
        super().__init__(message)
        self.message = message
        self.cause = cause


@dataclasses.dataclass(frozen=True)
class CreateRequest:
    """One launch attempt of a replica.

    Attributes:
        launch: the launch request.
        attempt: the attempt number, from 1.
        launch_log: file the backend appends setup output and its own steps to.
        app_log: file the backend appends the app's stdout and stderr to.
    """

    launch: model.LaunchRequest
    attempt: int
    launch_log: str
    app_log: str

    @property
    def name(self) -> str:
        """The replica name."""
        return self.launch.name


@dataclasses.dataclass(frozen=True)
class BackendReplica:
    """What a backend knows of one replica it runs.

    Attributes:
        name: replica name.
        token: identifies this incarnation (attempt) of the replica; events carry it.
        endpoint: base URL of the app.
        zone: where it runs.
        price_per_hour: the zone's price.
        is_spot: on spot capacity.
        app_state: RUNNING, EXITED or VANISHED.
        exit_code: the app's exit code once EXITED.
        start_time: when the app started (wall clock).
        accelerator: the accelerator it runs on as NAME:COUNT; "" for none or not known.
        resources_path: the spec's resources it runs on (`resources.any_of[1]`, `resources`);
            "" when the backend does not choose among them.
    """

    name: str
    token: str
    endpoint: str
    zone: str
    price_per_hour: float
    is_spot: bool
    app_state: model.AppState
    exit_code: int = 0
    start_time: float = 0.0
    accelerator: str = ""
    resources_path: str = ""


@dataclasses.dataclass(frozen=True)
class BackendEvent:
    """A replica's app exited (`app_state` EXITED, with `exit_code`) or vanished; `cause` says
    whose fault it was (UNSPECIFIED lets the provisioner core decide by `app_state`)."""

    name: str
    token: str
    app_state: model.AppState
    exit_code: int = 0
    time: float = 0.0
    message: str = ""
    cause: model.FailureCause = model.FailureCause.UNSPECIFIED


@dataclasses.dataclass(frozen=True)
class JobStart:
    """One job to start on a pool worker.

    Attributes:
        job: the job request (id, worker, command, extra envs).
        token: identifies this job's incarnation; the backend keys its state by it, so a job id
            used again after its job was forgotten is a new job.
        worker: the worker's launch request (its spec's envs, secrets, ...).
        worker_token: the worker's backend token (its incarnation).
        log: file the job's output is appended to.
        grace_s: seconds between SIGTERM and SIGKILL for what the job leaves running when its
            command ends (background processes are stopped then, so the worker is clean).
    """

    job: model.JobRequest
    token: str
    worker: model.LaunchRequest
    worker_token: str
    log: str
    grace_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class BackendJob:
    """What a backend knows of one job it started.

    Attributes:
        token: the job incarnation (`JobStart.token`).
        worker: the worker's name.
        running: its process runs.
        exit_code: once ended: its exit code, or None when its processes were killed without
            one (cancelled, or the worker died).
        start_time: when its process started (wall clock).
    """

    token: str
    worker: str
    running: bool
    exit_code: int | None = None
    start_time: float = 0.0


@dataclasses.dataclass(frozen=True)
class JobEnded:
    """A job's processes ended: with `exit_code`, or None when they were killed without one;
    `worker_gone` when the backend knows they died with their worker."""

    token: str
    worker: str
    exit_code: int | None
    time: float = 0.0
    message: str = ""
    worker_gone: bool = False


def job_environment(job_id: str) -> dict[str, str]:
    """The variables that name a job to its command: SkyPilot's (its task id, and the older job id
    name) and ours."""
    return {"SKYPILOT_TASK_ID": job_id, "SKYPILOT_JOB_ID": job_id, "REPLICAPLANE_JOB_ID": job_id}


class Backend(abc.ABC):
    """Runs replicas. Methods are called from one asyncio loop."""

    name = "backend"

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Re-find the replicas this backend started before (after a restart)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Stop watching; replicas keep running."""

    @abc.abstractmethod
    async def create(self, request: CreateRequest) -> BackendReplica:
        """Make one launch attempt: prepare, run setup, start the app.

        On cancellation it removes what it started before re-raising.

        Raises:
            LaunchError: the attempt failed (leftovers may remain; call delete()).
        """

    @abc.abstractmethod
    async def delete(self, name: str, *, grace_s: float) -> None:
        """Tear replica `name` down: SIGTERM-like stop, `grace_s`, then kill. A replica that
        is already gone (or was never created) counts as deleted.

        Raises:
            TeardownError: something is still running; retry later.
        """

    @abc.abstractmethod
    def get(self, name: str) -> BackendReplica | None:
        """The replica `name`, or None."""

    @abc.abstractmethod
    def list(self) -> list[BackendReplica]:
        """Every replica the backend runs, including ones whose app exited."""

    @abc.abstractmethod
    def watch(self) -> AsyncIterator[BackendEvent]:
        """App exits and disappearances, as they happen. One consumer."""

    def report_api_errors(self, hook: Callable[[int], None]) -> None:  # noqa: B027 - optional hook
        """Call `hook(status)` for each failed call to the backend's API: an HTTP status, 0 when
        no answer came. Backends without a remote API never call it."""

    def zones(self) -> builtins.list[model.Zone]:
        """Zones, cheapest first; none unless the backend simulates them."""
        return []

    def offered_accelerators(self) -> dict[str, float] | None:
        """Accelerator name (lowercase) -> how many a replica may ask for; None places no limit."""
        return None

    def accelerator_hint(self, wanted: str) -> str:
        """How to run a spec asking for accelerator `wanted` ("A100:1") here anyway; "" if there is no way."""
        return ""

    async def path_problems(self, needs: capability.Needs) -> builtins.list[errors.FieldViolation]:
        """What of the spec's local paths (workdir, file mounts) launches could not copy; none by default."""
        return []

    def set_zone_availability(self, zone: str, refuse_for_s: float) -> model.Zone:
        """Make `zone` refuse launches for `refuse_for_s` seconds (0: accept again)."""
        raise errors.FailedPreconditionError(f"backend {self.name} does not simulate zones", subject=zone)

    async def preempt(self, name: str) -> None:
        """Kill replica `name` abruptly, as a spot preemption does; no exit event follows."""
        raise errors.FailedPreconditionError(f"backend {self.name} does not simulate preemption", subject=name)

    # ---- jobs on pool workers ---------------------------------------------------------------

    async def run_job(self, start: JobStart) -> BackendJob:
        """Start a job's process on its worker and return once it runs.

        Idempotent by `start.token`: a job that was started already is described, never started
        again (so a retry after a lost answer, or a restart, cannot run it twice).

        Raises:
            JobStartError: it could not be started (the worker is gone, a process failed to start).
        """
        raise errors.FailedPreconditionError(f"backend {self.name} does not run jobs", subject=start.job.replica)

    async def cancel_job(self, token: str, *, grace_s: float) -> None:  # noqa: B027 - optional hook
        """Stop job `token`'s processes: SIGTERM-like, `grace_s`, then kill. Its end is still
        reported on watch_jobs(). A job that is gone counts as stopped."""

    def get_job(self, token: str) -> BackendJob | None:
        """Job `token`, or None when this backend never started it (or forgot it)."""
        return None

    async def watch_jobs(self) -> AsyncIterator[JobEnded]:
        """Job ends, as they happen (and, after start(), the ends of jobs that ended while the
        provisioner was down). One consumer."""
        await asyncio.Event().wait()  # a backend without jobs reports none
        yield JobEnded("", "", None)  # pragma: no cover - never reached

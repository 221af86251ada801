"""The backend interface: what a provisioner needs from whatever runs replicas.

Five operations (create, delete, get, list, watch) plus start/close, and three optional
simulation hooks (zones, zone refusal, preemption) that backends without them leave to the
defaults here, which refuse with FAILED_PRECONDITION.
"""

from __future__ import annotations

import abc
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

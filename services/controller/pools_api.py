"""The API edge of pool jobs: find the pool a request names, check the request, call its jobs.

The fleets are read through a callable (the controller's loops by name): a fleet's `pool` is its
pool side (None for a service), and `row.deleting` says it shuts down.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors, spec
from services.controller import pools


class _Row(Protocol):
    @property
    def deleting(self) -> bool: ...


class Fleet(Protocol):
    """What this edge reads of a fleet's loop."""

    @property
    def pool(self) -> pools.PoolSide | None: ...
    @property
    def row(self) -> _Row: ...


class Jobs:
    """SubmitJob, GetJob, ListJobs, CancelJob and WatchJob over the controller's pools."""

    def __init__(self, fleets: Callable[[], Mapping[str, Fleet]]) -> None:
        self._fleets = fleets

    def _find(self, name: str, *, job_id: int | None = None) -> pools.PoolSide:
        """The pool named `name`.

        Raises:
            errors.ValidationError: an empty or too long name, a job id below 1, or a service
                that is not a pool (field `pool`).
            errors.NotFoundError: no such pool (reason POOL_NOT_FOUND).
        """
        violations = []
        if not name:
            violations.append(errors.FieldViolation("pool", "the pool's name is required"))
        elif len(name) > spec.MAX_NAME_LEN:
            violations.append(errors.FieldViolation("pool", f"at most {spec.MAX_NAME_LEN} characters"))
        if job_id is not None and job_id < 1:
            violations.append(errors.FieldViolation("job_id", f"must be >= 1, got {job_id}"))
        errors.require(violations, subject="job request")
        fleet = self._fleets().get(name)
        if fleet is not None and fleet.pool is not None:
            return fleet.pool
        if fleet is not None:
            raise errors.ValidationError(
                [errors.FieldViolation("pool", f"{name!r} is a service, not a pool: jobs run only on pools")],
                subject="job request",
            )
        raise errors.NotFoundError(f"pool {name!r} not found", reason="POOL_NOT_FOUND", pool=name)

    def submit(self, request: api.SubmitJobRequest) -> res.Job:
        """Queue a job.

        Raises:
            errors.ValidationError: a malformed field, or a service named as `pool`.
            errors.NotFoundError: no such pool.
            errors.FailedPreconditionError: the pool is shutting down.
        """
        side = self._find(request.pool)
        fleet = self._fleets().get(request.pool)
        if fleet is not None and fleet.row.deleting:
            raise errors.FailedPreconditionError(
                f"pool {request.pool!r} is shutting down: it takes no new jobs",
                reason="POOL_SHUTTING_DOWN",
                subject=request.pool,
                type_="SHUTTING_DOWN",
            )
        return side.jobs.submit(request.run, dict(request.envs), request.name)

    def get(self, request: api.GetJobRequest) -> res.Job:
        """One job."""
        return self._find(request.pool, job_id=request.job_id).jobs.get(request.job_id)

    def list(self, request: api.ListJobsRequest) -> tuple[list[res.Job], str]:
        """A page of jobs."""
        return self._find(request.pool).jobs.page(request.page_size, request.page_token)

    async def cancel(self, request: api.CancelJobRequest) -> res.Job:
        """Cancel a job."""
        side = self._find(request.pool, job_id=request.job_id)
        return await side.jobs.cancel(request.job_id)

    async def watch(self, request: api.WatchJobRequest) -> AsyncIterator[api.WatchJobResponse]:
        """Follow a job."""
        side = self._find(request.pool, job_id=request.job_id)
        async for msg in side.jobs.watch(request.job_id, states_only=request.states_only):
            yield msg

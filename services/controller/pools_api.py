"""The API edge of pool jobs: find the pool a request names, check the request, call its jobs.

The fleet registry is asked through callables, so this module needs no reconciler: `exists`
answers whether a name is a fleet at all, `pool` the pool side of a pool (None for a service).

Until the controller core runs pools (worker readiness, sizing by the queue, no probes, no load
balancer), CreateService and UpdateService refuse a pool with FAILED_PRECONDITION
(`POOLS_NOT_AVAILABLE`), after the spec's own validation, changing nothing (`refuse_pool`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors, spec
from services.controller import pools


def refuse_pool(yaml_text: str) -> None:
    """Refuses a spec that is a pool. A spec that does not parse passes: the call's own
    validation reports why, as INVALID_ARGUMENT.

    Raises:
        errors.FailedPreconditionError: the spec is a pool.
    """
    try:
        # No replica cap here: the controller applies its own when it parses the spec again.
        parsed = spec.parse(yaml_text, replica_cap=2**31 - 1)
    except errors.ValidationError:
        return
    if spec.is_pool(parsed):
        raise errors.FailedPreconditionError(
            "pools are not available yet: the controller cannot run jobs or size a pool by its queue "
            "until its pool side lands (the spec is valid)",
            reason="POOLS_NOT_AVAILABLE",
            subject="pool",
            type_="NOT_AVAILABLE",
        )


class Jobs:
    """SubmitJob, GetJob, ListJobs, CancelJob and WatchJob over the controller's pools."""

    def __init__(
        self,
        *,
        exists: Callable[[str], bool],
        pool: Callable[[str], pools.PoolSide | None],
        deleting: Callable[[str], bool],
    ) -> None:
        self._exists = exists
        self._pool = pool
        self._deleting = deleting

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
        side = self._pool(name)
        if side is not None:
            return side
        if self._exists(name):
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
        if self._deleting(request.pool):
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

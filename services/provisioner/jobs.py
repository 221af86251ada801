"""Jobs on pool workers, the plain parts: request validation and the record of one job.

The provisioner core (manager.py) runs them: one job per worker at a time, keyed by job id, its
events in an event log that RunJob streams follow and replay, its record saved after every step
(`<state_dir>/jobs/<job_id>.json`), so a restarted provisioner, or a controller that re-attaches,
never starts a job twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import Any

from services.common import errors
from services.provisioner import events, model

_JOB_ID = re.compile(r"^[a-z0-9]([-a-z0-9]{0,126}[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_RUN_BYTES = 1 << 20
MAX_ENVS_BYTES = 1 << 20
_RESERVED_PREFIX = "REPLICAPLANE_"
_BAD_ID = "must be a job id: lowercase letters, digits and '-', at most 128 characters"


def check_id(job_id: str, *, field: str = "job_id") -> None:
    """Check that `job_id` is a job id (a safe file name, never a path).

    Raises:
        errors.ValidationError: it is not.
    """
    if not _JOB_ID.fullmatch(job_id):
        raise errors.ValidationError([errors.FieldViolation(field, _BAD_ID)], subject="job")


def validate(request: model.JobRequest) -> None:
    """Check a request to run a new job: every problem at once, each naming its field.

    Raises:
        errors.ValidationError: the request is malformed.
    """
    violations = []
    if not _JOB_ID.fullmatch(request.job_id):
        violations.append(errors.FieldViolation("job_id", _BAD_ID))
    if not request.replica:
        violations.append(errors.FieldViolation("replica", "the worker to run on is required"))
    elif not _JOB_ID.fullmatch(request.replica):
        violations.append(errors.FieldViolation("replica", "must be a replica name: lowercase letters, digits and '-'"))
    if not request.run.strip():
        violations.append(errors.FieldViolation("run", "a job needs a command"))
    elif "\x00" in request.run:
        violations.append(errors.FieldViolation("run", "must not contain a NUL character"))
    elif len(request.run.encode("utf-8", "surrogatepass")) > MAX_RUN_BYTES:
        violations.append(errors.FieldViolation("run", f"must be at most {MAX_RUN_BYTES} bytes"))
    size = 0
    for name, value in request.envs.items():
        size += len(name) + len(value.encode("utf-8", "surrogatepass"))
        shown = name if len(name) <= 64 else name[:61] + "..."
        if not _ENV_NAME.fullmatch(name):
            violations.append(errors.FieldViolation(f"envs.{shown}", "must be an environment variable name"))
        elif name.startswith(_RESERVED_PREFIX):
            violations.append(
                errors.FieldViolation(f"envs.{shown}", f"{_RESERVED_PREFIX}* variables are set by the provisioner")
            )
        elif "\x00" in value:
            violations.append(errors.FieldViolation(f"envs.{shown}", "must not contain a NUL character"))
    if size > MAX_ENVS_BYTES:
        violations.append(errors.FieldViolation("envs", f"must be at most {MAX_ENVS_BYTES} bytes together"))
    errors.require(violations, subject="job")


@dataclasses.dataclass
class Entry:
    """Everything known of one job: its request, state, events and the backend's token for it."""

    request: model.JobRequest
    job: model.Job
    log: events.EventLog[model.JobEvent]
    token: str
    task: asyncio.Task[None] | None = None
    # Set once the job is cancelled (its grace), and its processes' end is a cancel.
    cancel_grace_s: float | None = None
    # Set once its worker is known lost (why), so its processes' end is reported as that.
    lost: str = ""
    # An end the backend reported before its start was answered: (exit code or None,).
    early_end: tuple[int | None] | None = None

    def to_record(self) -> dict[str, Any]:
        return {
            "request": self.request.to_dict(),
            "job": self.job.to_dict(),
            "token": self.token,
            "events": [e.to_dict() for e in self.log.events],
        }

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> Entry:
        return cls(
            request=model.JobRequest.from_dict(data["request"]),
            job=model.Job.from_dict(data["job"]),
            log=events.EventLog(model.JobEvent.from_dict(e) for e in data.get("events", [])),
            token=str(data["token"]),
        )

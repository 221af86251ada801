"""Plain-Python domain types of the provisioner: replicas, launch requests, events, zones."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class ReplicaState(enum.Enum):
    """Where a replica's lifecycle stands (mirrors provisioner.v1.ReplicaState)."""

    QUEUED = "QUEUED"
    PROVISIONING = "PROVISIONING"
    RUNNING = "RUNNING"
    TERMINATING = "TERMINATING"
    TERMINATED = "TERMINATED"
    FAILED = "FAILED"


class AppState(enum.Enum):
    """Where a replica's app stands (mirrors provisioner.v1.AppState)."""

    UNSPECIFIED = "UNSPECIFIED"
    RUNNING = "RUNNING"
    EXITED = "EXITED"
    VANISHED = "VANISHED"
    PREEMPTED = "PREEMPTED"


class FailureCause(enum.Enum):
    """Whose fault a failure was (mirrors provisioner.v1.FailureCause)."""

    UNSPECIFIED = "UNSPECIFIED"
    USER = "USER"
    INFRASTRUCTURE = "INFRASTRUCTURE"


class LaunchEventType(enum.Enum):
    """What a launch step was (mirrors provisioner.v1.LaunchEventType)."""

    QUEUED = "QUEUED"
    PROVISIONING = "PROVISIONING"
    ATTEMPT_FAILED = "ATTEMPT_FAILED"
    RETRYING = "RETRYING"
    RUNNING = "RUNNING"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    # A pool worker's setup exited 0: it is ready for jobs (a worker's launch ends with it).
    SETUP_DONE = "SETUP_DONE"


LAUNCH_TERMINAL = frozenset(
    {LaunchEventType.RUNNING, LaunchEventType.FAILED, LaunchEventType.CANCELLED, LaunchEventType.SETUP_DONE}
)


class TerminateEventType(enum.Enum):
    """What a teardown step was (mirrors provisioner.v1.TerminateEventType)."""

    QUEUED = "QUEUED"
    DRAINING = "DRAINING"
    TERMINATING = "TERMINATING"
    RETRYING = "RETRYING"
    TERMINATED = "TERMINATED"
    FAILED = "FAILED"


TERMINATE_TERMINAL = frozenset({TerminateEventType.TERMINATED, TerminateEventType.FAILED})


class ReplicaEventType(enum.Enum):
    """What changed in a watched replica (mirrors provisioner.v1.ReplicaEventType)."""

    SNAPSHOT = "SNAPSHOT"
    APP_RUNNING = "APP_RUNNING"
    APP_EXITED = "APP_EXITED"
    VANISHED = "VANISHED"
    PREEMPTED = "PREEMPTED"
    TERMINATED = "TERMINATED"
    SNAPSHOT_END = "SNAPSHOT_END"


class LogKind(enum.Enum):
    """Which log: a replica's launch log or app output, or a job's output."""

    LAUNCH = "launch"
    APP = "app"
    JOB = "job"


REPLICA_LOGS = (LogKind.LAUNCH, LogKind.APP)
"""The logs every replica has (a worker's jobs have one each besides)."""


class JobState(enum.Enum):
    """Where a job stands (mirrors provisioner.v1.JobState)."""

    STARTING = "STARTING"
    RUNNING = "RUNNING"
    EXITED = "EXITED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


JOB_ENDED = frozenset({JobState.EXITED, JobState.FAILED, JobState.CANCELLED})


class JobEventType(enum.Enum):
    """What a job step was (mirrors provisioner.v1.JobEventType)."""

    STARTED = "STARTED"
    EXITED = "EXITED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What a replica runs: the parts of a service spec the provisioner needs.

    Attributes:
        setup: shell commands run once before `run`; empty for none.
        run: shell command that starts the app.
        envs: environment of `setup` and `run`.
        secrets: secret environment; never logged.
        workdir: local directory copied into the replica's working directory; empty for none.
        file_mounts: destination path -> local source path.
        ports: the ports the spec declares (`resources.ports`).
        serving_port: the port the replica serves on; 0 when the spec names none.
        use_spot: the spec's `resources.use_spot`.
        num_nodes: nodes per replica; only 1 can be launched.
        resources: hardware and placement fields (cloud, cpus, accelerators, ...) of the top
            level, as text.
        alternatives: the `any_of` or `ordered` entries, in the spec's order, each in the form
            of `resources` (with the top-level fields it did not set); empty without them.
        alternatives_kind: "any_of" or "ordered" ("" without alternatives).
        worker: a pool worker: `run` is not run; after setup a holder keeps it alive for jobs.
    """

    setup: str = ""
    run: str = ""
    envs: dict[str, str] = dataclasses.field(default_factory=dict)
    secrets: dict[str, str] = dataclasses.field(default_factory=dict)
    workdir: str = ""
    file_mounts: dict[str, str] = dataclasses.field(default_factory=dict)
    ports: tuple[int, ...] = ()
    serving_port: int = 0
    use_spot: bool = False
    num_nodes: int = 1
    resources: dict[str, str] = dataclasses.field(default_factory=dict)
    alternatives: tuple[dict[str, str], ...] = ()
    alternatives_kind: str = ""
    worker: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = dataclasses.asdict(self)
        data["ports"] = list(self.ports)
        data["alternatives"] = [dict(a) for a in self.alternatives]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaSpec:
        """The inverse of to_dict()."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["ports"] = tuple(values.get("ports", ()))
        values["alternatives"] = tuple(dict(a) for a in values.get("alternatives", ()))
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
    """A request to launch replica `name` (`{service}-{replica_id}`) of a service version."""

    name: str
    service: str
    replica_id: int
    version: int
    spec: ReplicaSpec
    use_spot: bool = False
    zone: str = ""
    # The launching controller's identity; empty for requests that carry none.
    owner: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = dataclasses.asdict(self)
        data["spec"] = self.spec.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchRequest:
        """The inverse of to_dict()."""
        return cls(**{**data, "spec": ReplicaSpec.from_dict(data["spec"])})


@dataclasses.dataclass
class Replica:
    """What the provisioner knows of one replica (mirrors provisioner.v1.ProvisionedReplica)."""

    name: str
    service: str
    replica_id: int
    version: int
    state: ReplicaState = ReplicaState.QUEUED
    app_state: AppState = AppState.UNSPECIFIED
    endpoint: str = ""
    zone: str = ""
    is_spot: bool = False
    exit_code: int = 0
    attempt: int = 0
    failure_reason: str = ""
    backend: str = ""
    create_time: float = 0.0
    start_time: float = 0.0
    price_per_hour: float = 0.0
    owner: str = ""
    # What it runs on, when the backend says: NAME:COUNT, and the spec's resources path.
    accelerator: str = ""
    resources_path: str = ""
    # A pool worker, and the job starting or running on it ("" when free).
    worker: bool = False
    job_id: str = ""

    def copy(self) -> Replica:
        """A snapshot that later changes do not affect."""
        return dataclasses.replace(self)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = dataclasses.asdict(self)
        data["state"] = self.state.value
        data["app_state"] = self.app_state.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Replica:
        """The inverse of to_dict()."""
        return cls(
            **{
                **data,
                "state": ReplicaState(data["state"]),
                "app_state": AppState(data["app_state"]),
            }
        )


@dataclasses.dataclass(frozen=True)
class LaunchEvent:
    """One step of a launch; `replica` is the replica after the step."""

    sequence: int
    time: float
    type: LaunchEventType
    replica: Replica
    attempt: int = 0
    message: str = ""
    retry_delay_s: float = 0.0
    endpoint: str = ""
    permanent: bool = False
    capacity_unavailable: bool = False
    # For ATTEMPT_FAILED and FAILED: whose fault the failure was.
    cause: FailureCause = FailureCause.UNSPECIFIED

    @property
    def terminal(self) -> bool:
        """Whether the launch stream ends after this event."""
        return self.type in LAUNCH_TERMINAL

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = dataclasses.asdict(self)
        data["type"] = self.type.value
        data["replica"] = self.replica.to_dict()
        data["cause"] = self.cause.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchEvent:
        """The inverse of to_dict(); records written before causes existed read as UNSPECIFIED."""
        return cls(
            **{
                **data,
                "type": LaunchEventType(data["type"]),
                "replica": Replica.from_dict(data["replica"]),
                "cause": FailureCause(data.get("cause", FailureCause.UNSPECIFIED.value)),
            }
        )


@dataclasses.dataclass(frozen=True)
class TerminateEvent:
    """One step of a teardown."""

    sequence: int
    time: float
    type: TerminateEventType
    message: str = ""
    delay_s: float = 0.0
    attempt: int = 0

    @property
    def terminal(self) -> bool:
        """Whether the teardown stream ends after this event."""
        return self.type in TERMINATE_TERMINAL

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = dataclasses.asdict(self)
        data["type"] = self.type.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TerminateEvent:
        """The inverse of to_dict()."""
        return cls(**{**data, "type": TerminateEventType(data["type"])})


@dataclasses.dataclass(frozen=True)
class ReplicaEvent:
    """A change of a managed replica, on the watch stream. `replica` is None for SNAPSHOT_END."""

    sequence: int
    time: float
    type: ReplicaEventType
    replica: Replica | None
    message: str = ""
    # For APP_EXITED, VANISHED and PREEMPTED: whose fault the change was.
    cause: FailureCause = FailureCause.UNSPECIFIED


@dataclasses.dataclass(frozen=True)
class JobRequest:
    """A request to run job `job_id` on pool worker `replica`."""

    job_id: str
    replica: str
    run: str
    envs: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobRequest:
        """The inverse of to_dict()."""
        return cls(**data)


@dataclasses.dataclass
class Job:
    """What the provisioner knows of one job (mirrors provisioner.v1.ProvisionedJob)."""

    job_id: str
    replica: str
    service: str
    state: JobState = JobState.STARTING
    exit_code: int = 0
    failure_reason: str = ""
    cause: FailureCause = FailureCause.UNSPECIFIED
    create_time: float = 0.0
    start_time: float = 0.0
    end_time: float = 0.0

    @property
    def ended(self) -> bool:
        """Whether the job will never run again."""
        return self.state in JOB_ENDED

    def copy(self) -> Job:
        """A snapshot that later changes do not affect."""
        return dataclasses.replace(self)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = dataclasses.asdict(self)
        data["state"] = self.state.value
        data["cause"] = self.cause.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Job:
        """The inverse of to_dict()."""
        return cls(**{**data, "state": JobState(data["state"]), "cause": FailureCause(data["cause"])})


@dataclasses.dataclass(frozen=True)
class JobEvent:
    """One step of a job; `job` is the job after the step."""

    sequence: int
    time: float
    type: JobEventType
    job: Job
    message: str = ""
    exit_code: int = 0
    cause: FailureCause = FailureCause.UNSPECIFIED

    @property
    def terminal(self) -> bool:
        """Whether the job's stream ends after this event."""
        return self.type != JobEventType.STARTED

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = dataclasses.asdict(self)
        data["type"] = self.type.value
        data["job"] = self.job.to_dict()
        data["cause"] = self.cause.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobEvent:
        """The inverse of to_dict()."""
        return cls(
            **{
                **data,
                "type": JobEventType(data["type"]),
                "job": Job.from_dict(data["job"]),
                "cause": FailureCause(data["cause"]),
            }
        )


@dataclasses.dataclass(frozen=True)
class Zone:
    """A placement zone; `refuse_until` is a wall-clock time, 0 when the zone accepts launches."""

    name: str
    price_per_hour: float
    refuse_until: float = 0.0

    def refusing(self, now: float) -> bool:
        """Whether the zone refuses launches at `now`."""
        return self.refuse_until > now

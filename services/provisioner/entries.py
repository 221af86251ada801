"""What the provisioner core keeps of one replica (`Entry`, persisted after every step), and the
check of a replica name."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import Any

from services.common import errors
from services.provisioner import backend as backend_mod
from services.provisioner import events, model

# A replica name as a single safe path component (it names log and work directories).
_REPLICA_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,126}[a-z0-9])?$")


@dataclasses.dataclass
class Entry:
    """Everything known of one replica."""

    request: model.LaunchRequest
    replica: model.Replica
    launch: events.EventLog[model.LaunchEvent]
    teardown: events.EventLog[model.TerminateEvent]
    token: str = ""
    teardown_start: int = 0
    drain_s: float = 0.0
    keep_logs: bool = True
    launch_task: asyncio.Task[None] | None = None
    teardown_task: asyncio.Task[None] | None = None
    # Set when a later Terminate asks for a shorter drain than the one in progress.
    drain_cut: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # App events that arrived before the launch recorded RUNNING, by backend token.
    pending: dict[str, backend_mod.BackendEvent] = dataclasses.field(default_factory=dict)
    # When the current launch and teardown started (monotonic), for their durations.
    launch_started: float = 0.0
    teardown_started: float = 0.0

    def to_record(self) -> dict[str, Any]:
        return {
            "request": self.request.to_dict(),
            "replica": self.replica.to_dict(),
            "token": self.token,
            "teardown_start": self.teardown_start,
            "drain_s": self.drain_s,
            "keep_logs": self.keep_logs,
            "launch_events": [e.to_dict() for e in self.launch.events],
            "teardown_events": [e.to_dict() for e in self.teardown.events],
        }

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> Entry:
        return cls(
            request=model.LaunchRequest.from_dict(data["request"]),
            replica=model.Replica.from_dict(data["replica"]),
            launch=events.EventLog(model.LaunchEvent.from_dict(e) for e in data.get("launch_events", [])),
            teardown=events.EventLog(model.TerminateEvent.from_dict(e) for e in data.get("teardown_events", [])),
            token=data.get("token", ""),
            teardown_start=data.get("teardown_start", 0),
            drain_s=data.get("drain_s", 0.0),
            keep_logs=data.get("keep_logs", True),
        )


def check_name(name: str) -> None:
    """Check that `name` is a replica name (a safe file name, never a path).

    Raises:
        errors.ValidationError: it is not.
    """
    if not _REPLICA_NAME.fullmatch(name):
        raise errors.ValidationError(
            [errors.FieldViolation("name", "must be a replica name: lowercase letters, digits and '-'")],
            subject="replica name",
        )

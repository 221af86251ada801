"""What the controller knows of a service beside its replica records, and how a replica record
maps to and from the domain's lifecycle facts (`lifecycle.Life`)."""

from __future__ import annotations

import dataclasses
import json

from replicaplane.controller.v1 import resources_pb2 as res
from services.common import pbtime
from services.controller import convert
from services.controller.domain import autoscaler, lifecycle


@dataclasses.dataclass
class ScalerState:
    """Autoscaler state, persisted so a restart resumes without churn (SkyPilot issue 8562)."""

    target: int = -1  # adopted target without overprovision; -1 until the first start
    ever_ready_versions: list[int] = dataclasses.field(default_factory=list)
    stopped: dict[str, str] = dataclasses.field(default_factory=dict)
    load: dict[str, int] = dataclasses.field(default_factory=dict)  # second -> request count
    # [balancer id, last sequence applied], oldest report first (a list: JSON keeps its order).
    reports: list[list[str | int]] = dataclasses.field(default_factory=list)
    upscale_since: float | None = None  # wall-clock time a higher candidate first held
    downscale_since: float | None = None
    reason: str = ""  # why the last decision changed something
    decided_at: float = 0.0
    zones: dict[str, str] = dataclasses.field(default_factory=dict)  # spot placer marks

    @property
    def hysteresis(self) -> autoscaler.Hysteresis:
        return autoscaler.Hysteresis(max(self.target, 0), self.upscale_since, self.downscale_since)

    def window(self) -> dict[int, int]:
        return {int(k): v for k, v in self.load.items()}

    def ledger(self) -> dict[str, int]:
        return {str(b): int(s) for b, s in self.reports}

    @classmethod
    def load_from(cls, data: bytes | None) -> ScalerState:
        if not data:
            return cls()
        raw = json.loads(data)
        return cls(**{k: v for k, v in raw.items() if k in {f.name for f in dataclasses.fields(cls)}})

    def dump(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()


@dataclasses.dataclass
class Extra:
    """Facts kept in memory only: an app exit seen before the launch said RUNNING."""

    pending_exit: lifecycle.AppExited | None = None


def life_of(r: res.Replica, extra: Extra | None = None) -> lifecycle.Life:
    """The lifecycle facts of a record, with the memory-only extras."""
    extra = extra or Extra()
    return convert.life_of(r, pending_exit=extra.pending_exit)


_FLAGS = (
    "user_app_failed",
    "ready_now",
    "initial_delay_exceeded",
    "is_scale_down",
    "preempted",
    "purged",
    "failed_spot_availability",
    "exit_code",
)
_TIMES = {
    "first_ready_time": "first_ready_time",
    "first_failure_time": "first_failure_time",
    "streak_start": "streak_start_time",
    "streak_last": "streak_last_time",
}


def write_life(r: res.Replica, old: lifecycle.Life, new: lifecycle.Life, extra: Extra) -> bool:
    """Copy what changed from `old` to `new` into the record (and the memory-only extras);
    True when the record changed (it must be stored)."""
    extra.pending_exit = new.pending_exit
    f = r.facts
    changed = False
    if new.launch != old.launch:
        f.launch_phase = int(new.launch)  # type: ignore[assignment]
        changed = True
    if new.teardown != old.teardown:
        f.teardown_phase = int(new.teardown)  # type: ignore[assignment]
        changed = True
    for name in _FLAGS:
        if getattr(new, name) != getattr(old, name):
            setattr(f, name, getattr(new, name))
            changed = True
    for name, field in _TIMES.items():
        value = getattr(new, name)
        if value != getattr(old, name):
            if value is None:
                f.ClearField(field)  # type: ignore[arg-type]
            else:
                getattr(f, field).CopyFrom(pbtime.timestamp(value))
            changed = True
    if new.drain_s != old.drain_s:
        f.drain.CopyFrom(pbtime.duration(new.drain_s))
        changed = True
    if new.failure_reason != old.failure_reason:
        r.failure_reason = new.failure_reason
        changed = True
    return changed


windows_of = convert.windows_of

"""What replicactl prints: status and orphan tables (drawn by tables.py), plans, error lines.

Pure functions of the API's messages, so they are unit-tested without a controller. Fields this
client does not know (added by a newer controller) are ignored here and kept in `--json`.
"""

from __future__ import annotations

import json
import re
import textwrap
import time
from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format, message

from replicaplane.common.v1 import spec_pb2
from replicaplane.controller.v1 import resources_pb2 as res
from services.cli import tables
from services.common import watchlines

SERVICE_HEADERS = ("NAME", "VERSION", "UPTIME", "STATUS", "REPLICAS", "ENDPOINT")
REPLICA_HEADERS = ("SERVICE", "ID", "VERSION", "ENDPOINT", "LAUNCHED", "STATUS", "REASON")
REPLICA_EXTRA_HEADERS = ("ZONE", "SPOT", "NAME")
VERBOSE_HEADERS = ("AUTOSCALING", "LB_POLICY", "RESOURCES")
ORPHAN_HEADERS = ("NAME", "SERVICE", "ID", "VERSION", "STATE", "AGE", "OWNER", "REASON")

# A balancer in front of the replicas may give the service one URL; the first of these string
# fields that a controller sends wins over the list of replica endpoints.
_SERVICE_URL_FIELDS = ("endpoint", "url", "load_balancer_url", "balancer_url", "load_balancer_endpoint")


def to_json(messages: dict[str, Any], indent: int | None = 2) -> str:
    """Messages (or lists of them) in protobuf's JSON mapping, field names as in the protos.

    `indent=None` gives one compact line (JSON lines for `watch --json`).
    """

    def conv(value: Any) -> Any:
        if isinstance(value, message.Message):
            return json_format.MessageToDict(value, preserving_proto_field_name=True)
        if isinstance(value, list | tuple):
            return [conv(v) for v in value]
        return value

    return json.dumps({k: conv(v) for k, v in messages.items()}, indent=indent)


def service_status(value: int) -> str:
    """READY for SERVICE_STATUS_READY."""
    return watchlines.enum_label(res.ServiceStatus, value, "SERVICE_STATUS_")


def replica_status(value: int) -> str:
    """READY for REPLICA_STATUS_READY."""
    return watchlines.enum_label(res.ReplicaStatus, value, "REPLICA_STATUS_")


def duration(seconds: float) -> str:
    """A short human duration: 45s, 12m 3s, 5h 2m, 3d 4h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def _has(msg: message.Message, field: str) -> bool:
    try:
        return msg.HasField(field)
    except ValueError:
        return False


def service_endpoint(svc: res.Service) -> str:
    """The service's URL if it has one, else its READY replicas' endpoints."""
    for field in _SERVICE_URL_FIELDS:
        desc = svc.DESCRIPTOR.fields_by_name.get(field)
        if desc is not None and isinstance(getattr(svc, field), str):
            value = getattr(svc, field)
            if value:
                return str(value)
    urls = [e.url for e in sorted(svc.endpoints, key=lambda e: e.replica_id) if e.url]
    if not urls:
        return "-"
    return urls[0] if len(urls) == 1 else f"{urls[0]} (+{len(urls) - 1})"


def service_row(svc: res.Service, now: float) -> tuple[str, ...]:
    """One row of the services table."""
    versions = ",".join(str(v) for v in svc.active_versions) or (str(svc.latest_version) if svc.latest_version else "-")
    uptime = "-"
    if _has(svc, "uptime_start_time"):
        uptime = duration(now - svc.uptime_start_time.ToSeconds())
    return (
        svc.name,
        versions,
        uptime,
        service_status(svc.status),
        f"{svc.ready_replicas}/{svc.total_replicas}",
        service_endpoint(svc),
    )


def kind(svc: res.Service) -> str:
    """POOL or SERVICE (a controller from before pools shows no kind: a service)."""
    return "POOL" if svc.kind == spec_pb2.FLEET_KIND_POOL else "SERVICE"


def worker_use(r: res.Replica) -> str:
    """Who uses a pool worker, shown where a replica shows its endpoint: its job, or idle."""
    if r.job_id:
        return f"job {r.job_id}"
    return "idle" if r.status == res.REPLICA_STATUS_READY else "-"


def replica_row(r: res.Replica, now: float, *, extra: bool = False, worker: bool = False) -> tuple[str, ...]:
    """One row of the replicas table; `extra` adds zone, spot and the replica name; a pool's
    `worker` shows the job it runs instead of an endpoint."""
    launched = "-"
    for field in ("launch_time", "create_time"):
        if _has(r, field):
            launched = duration(now - getattr(r, field).ToSeconds()) + " ago"
            break
    row: tuple[str, ...] = (
        r.service,
        str(r.replica_id),
        str(r.version),
        worker_use(r) if worker else (r.endpoint or "-"),
        launched,
        replica_status(r.status),
        r.failure_reason or "-",
    )
    if extra:
        row += (r.zone or "-", "yes" if r.is_spot else "no", r.replica_name or "-")
    return row


def orphan_row(o: res.Orphan, now: float) -> tuple[str, ...]:
    """One row of the orphans table; the owner reads `this controller` for this controller's own."""
    age = duration(now - o.create_time.ToSeconds()) if _has(o, "create_time") else "-"
    if o.owned_by_this_controller:
        owner = "this controller" if o.owner else "none (this controller's)"
    else:
        owner = o.owner
    row = (o.replica_name, o.service_name, str(o.replica_id), str(o.version), o.state, age, owner, o.reason)
    return tuple(cell or "-" for cell in row)


def orphans_text(orphans: Sequence[res.Orphan], controller_id: str, *, tty: bool, now: float | None = None) -> str:
    """The orphans table, under a line with this controller's id."""
    now = time.time() if now is None else now
    head = f"controller id: {controller_id}\n"
    if not orphans:
        return head + "No orphans.\n"
    rows = [orphan_row(o, now) for o in orphans]
    return head + tables.table("Orphans", ORPHAN_HEADERS, rows, tty=tty)


def autoscaler_line(svc: res.Service) -> str:
    """`hello: autoscaler request_rate: target 2 (1..3), 1.50 qps; <last decision>`, or "" when
    the controller sends no autoscaler status."""
    if "autoscaler" not in svc.DESCRIPTOR.fields_by_name or not _has(svc, "autoscaler"):
        return ""
    a = svc.autoscaler
    line = f"{svc.name}: autoscaler {a.kind or '-'}: target {a.target_replicas} ({a.min_replicas}..{a.max_replicas})"
    line += f", {a.qps:.2f} qps"
    if a.last_decision_reason:
        line += f"; {a.last_decision_reason}"
    return line


def verbose_cells(svc: res.Service) -> tuple[str, str, str]:
    """The `status -v` columns (as `sky serve status -v`): autoscaling, load balancing policy
    and the resources asked for."""
    if not _has(svc, "spec"):
        return ("-", "-", "-")
    policy = svc.spec.service.replica_policy
    if policy.max_replicas > policy.min_replicas:
        scaling = f"{policy.min_replicas}..{policy.max_replicas} replicas"
        if policy.target_qps_per_replica:
            scaling += f" at {policy.target_qps_per_replica:g} qps each"
        elif policy.target_qps_per_accelerator:
            scaling += " at qps per accelerator"
    else:
        scaling = f"fixed {policy.min_replicas} replicas"
    lb = svc.spec.service.load_balancing_policy or spec_pb2.LOAD_BALANCING_POLICY_LEAST_LOAD
    balancing = watchlines.enum_label(spec_pb2.LoadBalancingPolicy, lb, "LOAD_BALANCING_POLICY_").lower()
    r = svc.spec.resources
    parts = [f"cpus={r.cpus}" if r.cpus else "", f"mem={r.memory}" if r.memory else "", r.accelerators]
    parts += ["spot" if r.use_spot else "", "/".join(p for p in (r.cloud, r.region, r.zone) if p)]
    alternatives = len(r.any_of) or len(r.ordered)
    if alternatives:
        parts.append(f"{alternatives} alternatives")
    return (scaling, balancing, " ".join(p for p in parts if p) or "-")


# The optional columns of the status tables, left out in this order on a narrow terminal
# (tables.table).
SERVICE_OPTIONAL = ("RESOURCES", "LB_POLICY", "AUTOSCALING", "UPTIME", "VERSION")
REPLICA_OPTIONAL = ("NAME", "SPOT", "ZONE", "LAUNCHED", "VERSION")


# A READY service's message that only restates its counts; any other message is news.
_ROUTINE = re.compile(r"\d+/\d+ ready(, target \d+)?")


def _notes(svc: res.Service, show_all: bool) -> list[str]:
    """The lines under the services table for one service."""
    message = svc.status_message
    routine = svc.status == res.SERVICE_STATUS_READY and _ROUTINE.fullmatch(message) is not None
    lines = [f"{svc.name}: {message}"] if message and (show_all or not routine) else []
    if svc.kind == spec_pb2.FLEET_KIND_POOL:
        lines.append(f"{svc.name}: pool, {svc.queued_jobs} job(s) queued, {svc.running_jobs} running")
    if svc.probing_stale:
        lines.append(f"{svc.name}: probing is stale (no prober answered recently)")
    if show_all and (line := autoscaler_line(svc)):
        lines.append(line)
    if line := rollout_line(svc):
        lines.append(line)
    return lines


_ROLLOUT_STATES = {
    res.ROLLOUT_STATE_PROGRESSING: "canary",
    res.ROLLOUT_STATE_SUCCEEDED: "canary succeeded",
    res.ROLLOUT_STATE_ROLLED_BACK: "canary rolled back",
    res.ROLLOUT_STATE_FAILED: "canary failed",
}


def rollout_line(svc: res.Service) -> str:
    """`hello: canary version 2 from 1, step 1/2 at 10 %: <message>` while a canary rollout runs
    (or after it ended), else ""."""
    if "rollout" not in svc.DESCRIPTOR.fields_by_name or not _has(svc, "rollout"):
        return ""
    r = svc.rollout
    kind = _ROLLOUT_STATES.get(r.state, "canary")
    where = f", step {r.step}/{r.step_count} at {r.canary_weight} %" if r.state == res.ROLLOUT_STATE_PROGRESSING else ""
    return f"{svc.name}: {kind}: version {r.canary_version} from {r.stable_version}{where}: {r.message}"


def status_text(
    services: Sequence[res.Service],
    replicas: Sequence[res.Replica],
    *,
    tty: bool,
    show_all: bool = False,
    verbose: bool = False,
    now: float | None = None,
    width: int | None = None,
) -> str:
    """The `replicactl status` output: a services table, each service's notes, a replicas table.

    Args:
        services: the services to show.
        replicas: their replicas.
        tty: draw with rich (colours) instead of plain text.
        show_all: every status message, the autoscaler, and the replicas' zone, spot and name.
        verbose: the autoscaling, load balancing and resources columns.
        now: the time durations count to (default now).
        width: the width to fit; None for no limit.
    """
    now = time.time() if now is None else now
    headers = SERVICE_HEADERS + (VERBOSE_HEADERS if verbose else ())
    rows = [service_row(s, now) + (verbose_cells(s) if verbose else ()) for s in services]
    pools = {s.name for s in services if s.kind == spec_pb2.FLEET_KIND_POOL}
    if pools:  # a KIND column only when there is a pool to tell apart
        headers = (*headers[:1], "KIND", *headers[1:])
        rows = [(*row[:1], kind(s), *row[1:]) for s, row in zip(services, rows, strict=True)]
    out = tables.table("Services", headers, rows, tty=tty, width=width, optional=SERVICE_OPTIONAL)
    notes = [line for s in services for line in _notes(s, show_all)]
    if width is not None:  # prose: wrapped between words, a long word (a URL) kept whole
        notes = [
            part
            for note in notes
            for part in textwrap.wrap(
                note, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False
            )
        ]
    if notes:
        out += "\n" + "\n".join(notes) + "\n"
    headers = REPLICA_HEADERS + (REPLICA_EXTRA_HEADERS if show_all else ())
    rows = [replica_row(r, now, extra=show_all, worker=r.service in pools) for r in replicas]
    out += "\n" + tables.table("Service Replicas", headers, rows, tty=tty, width=width, optional=REPLICA_OPTIONAL)
    return out


def plan_text(name: str, plan: res.UpdatePlan, *, dry_run: bool) -> str:
    """What an update does (or would do, on a dry run), one line each."""

    def ids(values: Sequence[int]) -> str:
        return ", ".join(str(v) for v in values) or "none"

    verb = "would" if dry_run else "will"
    lines = [
        f"{name}: version {plan.new_version}" + (" (dry run, nothing changed)" if dry_run else ""),
        f"  kept in place: {ids(plan.kept_replica_ids)}"
        + (" (only the service section changed)" if plan.in_place else ""),
        f"  {verb} launch: {plan.launch_count} new replica(s)",
        f"  {verb} tear down: {ids(plan.teardown_replica_ids)}",
    ]
    if plan.replaced_replica_ids:
        lines.append(f"  {verb} replace: {ids(plan.replaced_replica_ids)}")
    return "\n".join(lines) + "\n"


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_line(code: str, message: str, violations: Sequence[tuple[str, str]] = ()) -> str:
    """One readable line: the fields and what is wrong with each, or the reason."""
    if violations:
        body = "; ".join(f"{field}: {desc}" for field, desc in violations)
        return "error: " + _clip(body, 600)
    return f"error: {_clip(message or code)}"

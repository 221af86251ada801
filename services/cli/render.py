"""What replicactl prints: tables (rich on a terminal, plain text otherwise), plans, error lines.

Pure functions of the API's messages, so they are unit-tested without a controller. Fields this
client does not know (added by a newer controller) are ignored here and kept in `--json`.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format, message

from replicaplane.controller.v1 import resources_pb2 as res
from services.common import watchlines

SERVICE_HEADERS = ("NAME", "VERSION", "UPTIME", "STATUS", "REPLICAS", "ENDPOINT")
REPLICA_HEADERS = ("SERVICE", "ID", "VERSION", "ENDPOINT", "LAUNCHED", "STATUS", "REASON")
REPLICA_EXTRA_HEADERS = ("ZONE", "SPOT", "NAME")
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


def replica_row(r: res.Replica, now: float, *, extra: bool = False) -> tuple[str, ...]:
    """One row of the replicas table; `extra` adds zone, spot and the replica name."""
    launched = "-"
    for field in ("launch_time", "create_time"):
        if _has(r, field):
            launched = duration(now - getattr(r, field).ToSeconds()) + " ago"
            break
    row: tuple[str, ...] = (
        r.service,
        str(r.replica_id),
        str(r.version),
        r.endpoint or "-",
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
    return head + table("Orphans", ORPHAN_HEADERS, rows, tty=tty)


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


def plain_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart; no trailing spaces."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]
    lines = []
    for row in (headers, *rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines) + "\n"


def rich_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], *, width: int = 160) -> str:
    """The same table drawn by rich (colours for statuses), as text for a terminal."""
    import rich.console
    import rich.table

    table = rich.table.Table(title=title, title_justify="left", show_edge=False, header_style="bold")
    for h in headers:
        table.add_column(h, overflow="fold")
    for row in rows:
        table.add_row(*(_colour(headers[i], cell) for i, cell in enumerate(row)))
    buf = io.StringIO()
    rich.console.Console(file=buf, force_terminal=True, width=width).print(table)
    return buf.getvalue()


_GOOD = {"READY"}
_BAD_PREFIX = ("FAILED", "UNKNOWN", "CONTROLLER_FAILED", "PREEMPTED")


def _colour(header: str, cell: str) -> str:
    if header != "STATUS":
        return cell.replace("[", "\\[")
    if cell in _GOOD:
        return f"[green]{cell}[/green]"
    if cell.startswith(_BAD_PREFIX):
        return f"[red]{cell}[/red]"
    return f"[yellow]{cell}[/yellow]"


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], *, tty: bool, width: int = 160) -> str:
    """A titled table: rich on a terminal, plain text otherwise (pipes, files, CI)."""
    if tty:
        return rich_table(title, headers, rows, width=width)
    return f"{title}\n" + plain_table(headers, rows)


def status_text(
    services: Sequence[res.Service],
    replicas: Sequence[res.Replica],
    *,
    tty: bool,
    show_all: bool = False,
    now: float | None = None,
    width: int = 160,
) -> str:
    """The `replicactl status` output: a services table, then a replicas table."""
    now = time.time() if now is None else now
    out = table("Services", SERVICE_HEADERS, [service_row(s, now) for s in services], tty=tty, width=width)
    # A READY service's message only repeats the counts; the others say why they are where they are.
    messages = [
        f"{s.name}: {s.status_message}"
        for s in services
        if s.status_message and (show_all or s.status != res.SERVICE_STATUS_READY)
    ]
    stale = [f"{s.name}: probing is stale (no prober answered recently)" for s in services if s.probing_stale]
    if show_all:
        messages += [line for s in services if (line := autoscaler_line(s))]
    if messages or stale:
        out += "\n" + "\n".join(messages + stale) + "\n"
    headers = REPLICA_HEADERS + (REPLICA_EXTRA_HEADERS if show_all else ())
    rows = [replica_row(r, now, extra=show_all) for r in replicas]
    out += "\n" + table("Service Replicas", headers, rows, tty=tty, width=width)
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

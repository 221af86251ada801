"""What a Pod's status says, in the kubernetes backend's terms, and where its log copy got to.

Plain functions, no client import, unit-tested directly: the reading of a Pod's phase,
conditions and container state (`read_status`), the words for its end (`exit_message`), the
position of the copy of its log (`LogPosition`), and the address a replica serves at.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from services.provisioner import kube_objects


@dataclasses.dataclass(frozen=True)
class PodStatus:
    """What a Pod's status says, in the backend's terms.

    Attributes:
        phase: Pending, Running, Succeeded, Failed, Unknown, or "" before the kubelet wrote any.
        deleting: `deletionTimestamp` is set (graceful deletion in progress).
        running: the container is running.
        started: the container passed its startup probe (setup finished), or has none.
        pod_ip: the Pod's IP, once assigned.
        host_ip: the IP of the node it runs on, once assigned.
        exit_code: the container's exit code once terminated, else None.
        exit_reason: the container's termination reason (Error, Completed, OOMKilled).
        termination_message: what the container wrote to its termination log (or its log tail).
        waiting_reason: why the container waits (ContainerCreating, ErrImagePull, ...).
        waiting_message: the kubelet's message for that.
        unschedulable: the scheduler's message while the Pod cannot be placed, else "".
        disruption: why the Pod was disrupted from outside (eviction, preemption), else "".
        node: the node it was scheduled to.
    """

    phase: str = ""
    deleting: bool = False
    running: bool = False
    started: bool = False
    pod_ip: str = ""
    host_ip: str = ""
    exit_code: int | None = None
    exit_reason: str = ""
    termination_message: str = ""
    waiting_reason: str = ""
    waiting_message: str = ""
    unschedulable: str = ""
    disruption: str = ""
    node: str = ""

    @property
    def finished(self) -> bool:
        """The Pod will never run again (Succeeded or Failed)."""
        return self.phase in ("Succeeded", "Failed")


def read_status(pod: dict[str, Any]) -> PodStatus:
    """Read the phase, container state and conditions of a Pod (as the API returns it)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    statuses = status.get("containerStatuses") or []
    container: dict[str, Any] = next(
        (c for c in statuses if c.get("name") == kube_objects.CONTAINER), statuses[0] if statuses else {}
    )
    state = container.get("state") or {}
    running = "running" in state and state["running"] is not None
    terminated = state.get("terminated") or {}
    waiting = state.get("waiting") or {}
    phase = status.get("phase") or ""
    exit_code: int | None = None
    if terminated:
        exit_code = int(terminated.get("exitCode", 0))
    elif phase == "Succeeded":
        exit_code = 0
    scheduled = conditions.get("PodScheduled") or {}
    unschedulable = ""
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "unschedulable"
    disruption = ""
    target = conditions.get("DisruptionTarget") or {}
    if status.get("reason") == "Evicted":
        disruption = f"evicted: {status.get('message') or 'by the kubelet'}"
    elif target.get("status") == "True":
        disruption = f"{target.get('reason') or 'disrupted'}: {target.get('message') or ''}".rstrip(": ")
    return PodStatus(
        phase=phase,
        deleting=bool(meta.get("deletionTimestamp")),
        running=running,
        started=running and bool(container.get("started", True)),
        pod_ip=status.get("podIP") or "",
        host_ip=status.get("hostIP") or "",
        exit_code=exit_code,
        exit_reason=terminated.get("reason") or "",
        termination_message=(terminated.get("message") or "").strip(),
        waiting_reason=waiting.get("reason") or "",
        waiting_message=waiting.get("message") or "",
        unschedulable=unschedulable,
        disruption=disruption,
        node=(pod.get("spec") or {}).get("nodeName") or "",
    )


def exit_message(status: PodStatus) -> str:
    """The event message of an app exit: as the local backend's, plus the kernel's reason."""
    text = f"app exited with code {status.exit_code}"
    return f"{text} ({status.exit_reason})" if status.exit_reason == "OOMKilled" else text


def log_time_ns(text: str) -> int | None:
    """An RFC 3339 time as the kubelet stamps log lines, in nanoseconds since the epoch; None if malformed."""
    whole, _, frac = text.rstrip("Z").partition(".")
    try:
        seconds = datetime.datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.UTC)
    except ValueError:
        return None
    if frac and not frac.isdigit():
        return None
    return int(seconds.timestamp()) * 1_000_000_000 + int((frac + "000000000")[:9])


@dataclasses.dataclass
class LogPosition:
    """How far a Pod's log was copied, so a read that starts again copies nothing twice.

    Attributes:
        token: the incarnation whose log this is.
        time_ns: the time of the last line copied.
        copied: how many lines of that time were copied (lines can share a time).
        setup_done: setup's part of the log is over (later lines are the app's).
        seen: lines of `time_ns` seen in the current read.
    """

    token: str = ""
    time_ns: int = 0
    copied: int = 0
    setup_done: bool = False
    seen: int = 0

    def take(self, line: bytes) -> bytes | None:
        """The text of a `<time> <text>` log line if it was not copied yet, else None; advances."""
        stamp, _, text = line.partition(b" ")
        at = log_time_ns(stamp.decode(errors="replace"))
        if at is None:
            return line  # not stamped: copy it rather than lose output
        if at < self.time_ns:
            return None
        if at == self.time_ns:
            self.seen += 1
            if self.seen <= self.copied:
                return None
            self.copied = self.seen
            return text
        self.time_ns, self.copied, self.seen = at, 1, 1
        return text

    def restart(self) -> None:
        """A new read of the log begins (from some time at or before `time_ns`)."""
        self.seen = 0

    def to_dict(self) -> dict[str, Any]:
        """What is kept across provisioner restarts."""
        return {"token": self.token, "time_ns": self.time_ns, "copied": self.copied, "setup_done": self.setup_done}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LogPosition:
        """The position `to_dict` wrote."""
        return cls(
            token=str(data.get("token", "")),
            time_ns=int(data.get("time_ns", 0)),
            copied=int(data.get("copied", 0)),
            setup_done=bool(data.get("setup_done", False)),
        )


def service_endpoint(service: dict[str, Any] | None, port: int, *, mode: str, node_host: str) -> str:
    """The endpoint a replica's Service gives it from outside the cluster ("" while it has none).

    `node_port`: `node_host` and the node port of the serving `port`. `load_balancer`: the
    first ingress address the cloud published (IP or host name) and `port`.
    """
    if service is None:
        return ""
    if mode == "node_port":
        node_port = next(
            (p.get("nodePort") for p in (service.get("spec") or {}).get("ports") or [] if p.get("port") == port), None
        )
        return endpoint(node_host, int(node_port)) if node_host and node_port else ""
    if mode == "load_balancer":
        ingress = (((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or [{}])[0]
        host = ingress.get("ip") or ingress.get("hostname") or ""
        return endpoint(host, port) if host else ""
    return ""


def endpoint(host: str, port: int) -> str:
    """`http://host:port`, with brackets around an IPv6 address."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

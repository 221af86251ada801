"""Names, labels, annotations and container conventions of the `kubernetes` backend's objects.

No client import here: object names, label selectors, the constants the Pods carry, and the
parsing of the backend's settings are plain functions, unit-tested directly. The Pod, Service
and Secret manifests built from a launch request are kube_manifests.py; reading a Pod's status
back is kube_status.py. `kube.py` sends the objects through the official client (kube_client.py).

A replica is one Pod (`restartPolicy: Never`: a replica that exits is replaced by the
controller with a new id, never restarted in place), plus an optional Service and, when the
spec has secrets, a Secret the Pod reads its secret environment from. The container runs a
small `sh` wrapper: `setup`, then a marker file, then `exec` of `run`. A startup probe that
waits for the marker makes the container `started` exactly when setup has finished, which is
when a launch counts as RUNNING (as with the local backend). A failed setup writes its exit
code to the termination message, so it is told apart from an app exit.

A pool worker's Pod opens no port and its container runs a holder after setup instead of `run`
(a shell that sleeps until SIGTERM), so the Pod lives until teardown and its end is reported as
an app's. Jobs are exec'd into it (kube_jobs.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any

MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "replicaplane"
LABEL_INSTANCE = "replicaplane.dev/instance"
LABEL_SERVICE = "replicaplane.dev/service"
LABEL_VERSION = "replicaplane.dev/version"
LABEL_REPLICA_ID = "replicaplane.dev/replica-id"
LABEL_POD = "replicaplane.dev/pod"
LABEL_SPOT = "replicaplane.dev/spot"
ANNOTATION_REPLICA = "replicaplane.dev/replica-name"
ANNOTATION_TOKEN = "replicaplane.dev/token"
ANNOTATION_ZONE = "replicaplane.dev/zone"
ANNOTATION_CREATED = "replicaplane.dev/created-at"
ANNOTATION_OWNER = "replicaplane.dev/owner"
# Which of the spec's resources alternatives the Pod runs (`resources.any_of[1]`), and its
# accelerator (`H100:1`): read back when a restarted provisioner adopts the Pod.
ANNOTATION_RESOURCES = "replicaplane.dev/resources"
ANNOTATION_ACCELERATOR = "replicaplane.dev/accelerator"
ANNOTATION_WORKER = "replicaplane.dev/worker"

ZONE_LABEL = "topology.kubernetes.io/zone"
CONTAINER = "replica"
DEFAULT_PORT = 8080
SETUP_DONE_ENV = "REPLICAPLANE_SETUP_DONE"
SETUP_DONE_PATH = "/tmp/.replicaplane-setup-done"
TERMINATION_LOG_ENV = "REPLICAPLANE_TERMINATION_LOG"
TERMINATION_LOG_PATH = "/dev/termination-log"
SETUP_FAILED_PREFIX = "setup exited with code"
# Printed between setup's output and the app's: the Pod log has both, the provisioner keeps
# them apart (the launch log and the app log), as the local backend does.
SETUP_FINISHED_LINE = "[replicaplane] setup finished; starting run"
# A pool worker's command after setup: it sleeps until it is killed; SIGTERM ends it at once.
HOLDER = "trap 'exit 0' TERM; while :; do sleep 86400 & wait $!; done"
JOBS_DIR_ENV = "REPLICAPLANE_JOBS_DIR"
JOBS_DIR_PATH = "/tmp/.replicaplane-jobs"

# $1 is setup, $2 is run. bash when the image has it (SkyPilot runs both with bash), else sh.
WRAPPER = (
    "if command -v bash >/dev/null 2>&1; then RP_SH=bash; else RP_SH=sh; fi\n"
    'if [ -n "$1" ]; then\n'
    '  "$RP_SH" -c "$1"; code=$?\n'
    '  if [ "$code" -ne 0 ]; then\n'
    f'    printf "{SETUP_FAILED_PREFIX} %s" "$code" > "${TERMINATION_LOG_ENV}" 2>/dev/null\n'
    '    exit "$code"\n'
    "  fi\n"
    "fi\n"
    f'touch "${SETUP_DONE_ENV}"\n'
    f'if [ -n "$1" ]; then echo "{SETUP_FINISHED_LINE}"; fi\n'
    'exec "$RP_SH" -c "$2"\n'
)

IMAGE_PULL_ERRORS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
CONTAINER_ERRORS = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
SERVICE_TYPES = ("", "ClusterIP", "NodePort", "LoadBalancer")
ENDPOINT_MODES = ("pod", "service", "node_port", "load_balancer")
# The Service types that give each endpoint mode its address.
ENDPOINT_SERVICE_TYPES = {
    "service": SERVICE_TYPES[1:],
    "node_port": ("NodePort", "LoadBalancer"),
    "load_balancer": ("LoadBalancer",),
}
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class ManifestError(Exception):
    """The launch request cannot be expressed as a Pod (a permanent launch failure)."""


@dataclasses.dataclass(frozen=True)
class Toleration:
    """A toleration put on spot Pods."""

    key: str
    value: str
    effect: str

    def to_dict(self) -> dict[str, str]:
        """The Pod spec form."""
        out = {"key": self.key, "operator": "Equal" if self.value else "Exists", "effect": self.effect}
        if self.value:
            out["value"] = self.value
        return out


@dataclasses.dataclass(frozen=True)
class PodConfig:
    """What the backend's settings say about every Pod it creates (see settings.Settings)."""

    namespace: str = "default"
    instance: str = "replicaplane"
    default_image: str = "python:3.11-slim"
    service_type: str = ""
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    annotations: dict[str, str] = dataclasses.field(default_factory=dict)
    spot_node_selector: dict[str, str] = dataclasses.field(default_factory=dict)
    spot_tolerations: tuple[Toleration, ...] = ()
    accelerator_label: str = "replicaplane.dev/accelerator"
    # Lowercased accelerator name -> the value of accelerator_label on its nodes, where that is
    # not the lowercased name (GKE: a100 -> nvidia-tesla-a100).
    accelerator_label_values: dict[str, str] = dataclasses.field(default_factory=dict)
    gpu_resource: str = "nvidia.com/gpu"
    setup_timeout_s: float = 3600.0
    setup_probe_period_s: int = 2


# ---- names ---------------------------------------------------------------------------------


def object_name(replica_name: str) -> str:
    """The Pod (and Service, Secret) name of a replica: a DNS-1035 label, deterministic.

    The replica name is lowercased and every other character becomes '-'. A name that is
    still not a valid label, or is longer than 63 characters, is cut and gets the first 8 hex
    characters of its SHA-256, so two long names that share a prefix stay distinct.
    """
    text = re.sub(r"[^a-z0-9-]", "-", replica_name.lower())
    if text == replica_name and len(text) <= 63 and _DNS_LABEL.match(text):
        return text
    digest = hashlib.sha256(replica_name.encode()).hexdigest()[:8]
    head = text[: 63 - 9].strip("-")
    if not head or not head[0].isalpha():
        head = ("r-" + head)[: 63 - 9].rstrip("-")
    return f"{head}-{digest}"


def is_dns_label(text: str) -> bool:
    """Whether `text` is a DNS-1123 label (lowercase alphanumerics and '-', at most 63)."""
    return len(text) <= 63 and re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", text) is not None


def is_label_value(text: str) -> bool:
    """Whether `text` is a valid label value."""
    return len(text) <= 63 and _LABEL_VALUE.match(text) is not None


def is_label_key(text: str) -> bool:
    """Whether `text` is a label key: an optional DNS subdomain prefix and '/', then a name of at
    most 63 characters."""
    prefix, _, name = text.rpartition("/")
    return _LABEL_KEY.match(text) is not None and len(name) <= 63 and len(prefix) <= 253


def is_resource_name(text: str) -> bool:
    """Whether `text` can name an extended resource: a label key with a domain prefix (`nvidia.com/gpu`)."""
    return "/" in text and is_label_key(text) and not text.startswith("kubernetes.io/")


def selector(instance: str) -> dict[str, str]:
    """The labels every Pod of this provisioner instance carries (and is listed by)."""
    return {MANAGED_BY: MANAGED_BY_VALUE, LABEL_INSTANCE: instance}


def selector_text(labels: dict[str, str]) -> str:
    """A label selector string for `labels`."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def matches(obj: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether `obj` carries every label of `labels` (servers that ignore selectors exist)."""
    have = (obj.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


def token_of(pod: dict[str, Any]) -> str:
    """The incarnation token `pod` (or a Service, a Secret) carries; "" when it has none."""
    return str(((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_TOKEN, ""))


# ---- settings parsing ------------------------------------------------------------------------


def parse_pairs(text: str, field: str) -> dict[str, str]:
    """`k=v,k2=v2` as a dict; label-key syntax is checked.

    Raises:
        ValueError: a malformed pair, naming `field`.
    """
    out: dict[str, str] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _LABEL_KEY.match(key) or len(key.rpartition("/")[2]) > 63:
            raise ValueError(f"{field}: {item!r} is not key=value with a valid key")
        out[key] = value
    return out


def check_label_values(labels: dict[str, str], field: str) -> None:
    """Label values are at most 63 characters of [A-Za-z0-9-_.], alphanumeric at both ends.

    Raises:
        ValueError: a bad value, naming `field`.
    """
    for key, value in labels.items():
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            raise ValueError(f"{field}: the value of {key} is not a valid label value")


def parse_tolerations(text: str, field: str) -> tuple[Toleration, ...]:
    """`key[=value]:Effect,...` as tolerations.

    Raises:
        ValueError: a malformed item, naming `field`.
    """
    out = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        head, sep, effect = item.rpartition(":")
        key, _, value = head.partition("=")
        if not sep or effect not in TOLERATION_EFFECTS or not _LABEL_KEY.match(key.strip()):
            raise ValueError(
                f"{field}: {item!r} is not key[=value]:Effect (Effect one of {', '.join(TOLERATION_EFFECTS)})"
            )
        out.append(Toleration(key.strip(), value.strip(), effect))
    return tuple(out)

"""Kubernetes objects of the `kubernetes` backend as plain dicts.

No client import here: object names, settings parsing, and the Pod, Service and Secret
manifests built from a launch request are plain functions, unit-tested directly (reading a
Pod's status back is kube_status.py). `kube.py` sends these dicts through the official client
(kube_client.py).

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
import math
import re
from typing import Any

from services.provisioner import alternatives, model, ports

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
_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)([KkMmGgTt])?[Bb]?(\+)?$")
_UNITS = {"k": "Ki", "m": "Mi", "g": "Gi", "t": "Ti"}


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
    """What the backend's settings say about every Pod it creates (see server.Settings)."""

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


# ---- manifests -----------------------------------------------------------------------------


def image_of(res: dict[str, str], default: str) -> str:
    """The container image: the resources' `image_id` (a `docker:` prefix dropped) or the default."""
    image = res.get("image_id", "").strip()
    return image.removeprefix("docker:") or default


def serving_port(spec: model.ReplicaSpec) -> int:
    """The port the app serves on inside its Pod; 0 for a pool worker, which serves none."""
    if spec.worker:
        return 0
    return spec.serving_port or (spec.ports[0] if spec.ports else DEFAULT_PORT)


def _cpu(text: str) -> tuple[str, bool]:
    value = text.strip()
    at_least = value.endswith("+")
    return value.rstrip("+"), at_least


def _memory(text: str) -> tuple[str, bool] | None:
    match = _MEMORY.match(text.strip())
    if match is None:
        return None  # for example '8x' (relative to cpus): not expressible as a quantity
    number, unit, plus = match.groups()
    return f"{number}{_UNITS[(unit or 'g').lower()]}", bool(plus)


def _accelerator(text: str) -> tuple[str, int]:
    first = text.split(",")[0]
    name, _, count_text = first.partition(":")
    count = float(count_text or 1)
    if count != math.floor(count) or count < 1:
        raise ManifestError(f"accelerators {first}: Kubernetes schedules whole devices only")
    return name.strip(), int(count)


def resources(res: dict[str, str], cfg: PodConfig) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Container resources, node selector and notes for the launch log, from one set of
    resources' cpus/memory/accelerators.

    An exact amount (`2`) is both request and limit; `2+` is a request only. Accelerators
    become a limit of `cfg.gpu_resource` (the API server makes the request equal) and, when
    `cfg.accelerator_label` is set, a node selector on that label: the accelerator's value in
    `cfg.accelerator_label_values`, else its lowercased name. Of several accelerator choices
    only the first is used (alternatives.of_spec makes each choice an alternative of its own).

    Raises:
        ManifestError: a fractional accelerator count.
    """
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    node_selector: dict[str, str] = {}
    notes = []
    if res.get("cpus"):
        value, at_least = _cpu(res["cpus"])
        requests["cpu"] = value
        if not at_least:
            limits["cpu"] = value
    if res.get("memory"):
        parsed = _memory(res["memory"])
        if parsed is None:
            notes.append(f"memory {res['memory']} is not an amount; no memory request set")
        else:
            requests["memory"] = parsed[0]
            if not parsed[1]:
                limits["memory"] = parsed[0]
    if res.get("accelerators"):
        name, count = _accelerator(res["accelerators"])
        if "," in res["accelerators"]:
            notes.append(f"accelerators {res['accelerators']}: using the first choice, {name}:{count}")
        limits[cfg.gpu_resource] = str(count)
        if cfg.accelerator_label:
            node_selector[cfg.accelerator_label] = cfg.accelerator_label_values.get(name.lower(), name.lower())
    for key in ("cloud", "region", "instance_type", "disk_size"):
        if res.get(key):
            notes.append(f"recorded, not used by the kubernetes backend: {key}={res[key]}")
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out, node_selector, notes


def replica_labels(launch: model.LaunchRequest, cfg: PodConfig, obj: str) -> dict[str, str]:
    """The labels of a replica's objects: the operator's, then ours (ours win)."""
    return {
        **cfg.labels,
        **selector(cfg.instance),
        LABEL_SERVICE: launch.service,
        LABEL_VERSION: str(launch.version),
        LABEL_REPLICA_ID: str(launch.replica_id),
        LABEL_POD: obj,
        LABEL_SPOT: "true" if launch.use_spot else "false",
    }


def environment(launch: model.LaunchRequest, port: int, *, has_secret: bool) -> list[dict[str, Any]]:
    """The container's env list: the spec's envs, then PORT (not for a worker), HOST and the replica ids."""
    env = dict(launch.spec.envs)
    if port:
        env["PORT"] = str(port)
    if launch.spec.worker:
        env[JOBS_DIR_ENV] = JOBS_DIR_PATH
    env.update(
        {
            "HOST": "0.0.0.0",
            "REPLICA_ID": str(launch.replica_id),
            "SKYPILOT_SERVE_REPLICA_ID": str(launch.replica_id),
            "PYTHONUNBUFFERED": "1",
            SETUP_DONE_ENV: SETUP_DONE_PATH,
            TERMINATION_LOG_ENV: TERMINATION_LOG_PATH,
        }
    )
    out: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in env.items()]
    if has_secret:
        # Secret values stay out of the Pod spec; the kubelet reads them from the Secret.
        out += [{"name": k, "valueFrom": {"secretKeyRef": {"name": "", "key": k}}} for k in sorted(launch.spec.secrets)]
    return out


@dataclasses.dataclass(frozen=True)
class Placement:
    """What decides where a Pod can be scheduled: container resources, node selector, tolerations."""

    resources: dict[str, Any]
    node_selector: dict[str, str]
    tolerations: list[dict[str, str]]
    notes: list[str]

    @property
    def key(self) -> str:
        """Equal for two Pods the scheduler would place alike (notes aside)."""
        return repr((_sorted_items(self.resources), sorted(self.node_selector.items()), self.tolerations))


def _sorted_items(value: Any) -> Any:
    """`value` with every dict turned into sorted (key, value) pairs, for comparing."""
    if isinstance(value, dict):
        return [(k, _sorted_items(v)) for k, v in sorted(value.items())]
    return value


def zone_of(launch: model.LaunchRequest, alternative: alternatives.Alternative) -> str:
    """The zone a launch runs in on one alternative: the launch's (the controller placed it),
    else the alternative's own, else "" (anywhere)."""
    return launch.zone or alternative.resources.get("zone", "")


def placement(launch: model.LaunchRequest, alternative: alternatives.Alternative, cfg: PodConfig) -> Placement:
    """Where one alternative of a launch may run: its resources, the launch's zone (else the
    alternative's own), and the spot node selector and tolerations of a spot launch.

    Raises:
        ManifestError: the alternative cannot be expressed as a Pod.
    """
    res = alternative.resources
    container_resources, node_selector, notes = resources(res, cfg)
    zone = zone_of(launch, alternative)
    if zone:
        node_selector[ZONE_LABEL] = zone
    tolerations = []
    if launch.use_spot:
        node_selector.update(cfg.spot_node_selector)
        tolerations = [t.to_dict() for t in cfg.spot_tolerations]
    return Placement(container_resources, node_selector, tolerations, notes)


def pod_manifest(
    launch: model.LaunchRequest,
    cfg: PodConfig,
    *,
    token: str,
    created_at: float,
    alternative: alternatives.Alternative | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The Pod of one launch attempt on one resources alternative (the first of the spec's when
    None), and notes for the launch log.

    Raises:
        ManifestError: the request cannot run as a Pod.
    """
    spec = launch.spec
    if spec.num_nodes > 1:
        raise ManifestError(f"num_nodes={spec.num_nodes}: the kubernetes backend runs single-node replicas")
    if alternative is None:
        alternative = alternatives.of_spec(spec)[0]
    obj = object_name(launch.name)
    port = serving_port(spec)
    where = placement(launch, alternative, cfg)
    notes = list(where.notes)
    if spec.workdir or spec.file_mounts:
        notes.append("workdir and file_mounts are not copied into Pods; bake them into the image")
    has_secret = bool(spec.secrets)
    env = environment(launch, port, has_secret=has_secret)
    for item in env:
        if "valueFrom" in item:
            item["valueFrom"]["secretKeyRef"]["name"] = obj
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image_of(alternative.resources, cfg.default_image),
        "command": ["/bin/sh", "-c", WRAPPER, "replicaplane-run", spec.setup, HOLDER if spec.worker else spec.run],
        "env": env,
        "ports": [
            {"containerPort": p, "protocol": "TCP", **({"name": "serve"} if p == port else {})}
            for p in ports.declared(spec.ports, port)
        ],
        "terminationMessagePath": TERMINATION_LOG_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if where.resources:
        container["resources"] = where.resources
    if spec.setup.strip():
        period = max(1, cfg.setup_probe_period_s)
        container["startupProbe"] = {
            "exec": {"command": ["/bin/sh", "-c", f'test -f "${SETUP_DONE_ENV}"']},
            "periodSeconds": period,
            "failureThreshold": max(1, math.ceil(cfg.setup_timeout_s / period)),
        }
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if where.tolerations:
        pod_spec["tolerations"] = where.tolerations
    if where.node_selector:
        pod_spec["nodeSelector"] = where.node_selector
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": obj,
            "namespace": cfg.namespace,
            "labels": replica_labels(launch, cfg, obj),
            "annotations": {
                **cfg.annotations,
                ANNOTATION_REPLICA: launch.name,
                ANNOTATION_TOKEN: token,
                ANNOTATION_ZONE: zone_of(launch, alternative),
                ANNOTATION_CREATED: repr(created_at),
                ANNOTATION_OWNER: launch.owner,
                ANNOTATION_RESOURCES: alternative.path,
                ANNOTATION_ACCELERATOR: alternative.accelerator,
                **({ANNOTATION_WORKER: "true"} if spec.worker else {}),
            },
        },
        "spec": pod_spec,
    }
    return pod, notes


def owner_reference(pod: dict[str, Any]) -> dict[str, str] | None:
    """An ownerReference to `pod` as the API server returned it (None without a uid).

    Objects carrying it are deleted by the cluster's garbage collector once the Pod is gone.
    """
    meta = pod.get("metadata") or {}
    if not meta.get("uid") or not meta.get("name"):
        return None
    return {"apiVersion": "v1", "kind": "Pod", "name": str(meta["name"]), "uid": str(meta["uid"])}


def service_manifest(
    launch: model.LaunchRequest, cfg: PodConfig, *, token: str, owner: dict[str, str] | None = None
) -> dict[str, Any]:
    """The Service in front of a replica's Pod (same name), selecting exactly that Pod and owned by it."""
    obj = object_name(launch.name)
    port = serving_port(launch.spec)
    metadata: dict[str, Any] = {
        "name": obj,
        "namespace": cfg.namespace,
        "labels": replica_labels(launch, cfg, obj),
        "annotations": {**cfg.annotations, ANNOTATION_REPLICA: launch.name, ANNOTATION_TOKEN: token},
    }
    if owner:
        metadata["ownerReferences"] = [owner]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": cfg.service_type,
            "selector": {**selector(cfg.instance), LABEL_POD: obj},
            "ports": [
                {"name": f"p{p}", "port": p, "targetPort": p, "protocol": "TCP"}
                for p in ports.declared(launch.spec.ports, port)
            ],
        },
    }


def secret_manifest(launch: model.LaunchRequest, cfg: PodConfig, *, token: str) -> dict[str, Any]:
    """The Secret holding a replica's secret environment (same name as the Pod).

    It is created before the Pod, so it cannot name the Pod as its owner yet; the backend adds
    that ownerReference once the Pod exists.
    """
    import base64  # only replicas with secrets need it

    obj = object_name(launch.name)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": obj,
            "namespace": cfg.namespace,
            "labels": replica_labels(launch, cfg, obj),
            "annotations": {ANNOTATION_REPLICA: launch.name, ANNOTATION_TOKEN: token},
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in launch.spec.secrets.items()},
    }

"""The Pod, Service and Secret manifests of the `kubernetes` backend, built from a launch request.

Plain functions over plain dicts, no client import, unit-tested directly. The names, labels,
annotations and container conventions they use are kube_objects.py's; `kube.py` sends the
manifests (kube_launch.py) through the official client (kube_client.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from services.provisioner import alternatives, kube_objects, model, ports

_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)([KkMmGgTt])?[Bb]?(\+)?$")
_UNITS = {"k": "Ki", "m": "Mi", "g": "Gi", "t": "Ti"}


def image_of(res: dict[str, str], default: str) -> str:
    """The container image: the resources' `image_id` (a `docker:` prefix dropped) or the default."""
    image = res.get("image_id", "").strip()
    return image.removeprefix("docker:") or default


def serving_port(spec: model.ReplicaSpec) -> int:
    """The port the app serves on inside its Pod; 0 for a pool worker, which serves none."""
    if spec.worker:
        return 0
    return spec.serving_port or (spec.ports[0] if spec.ports else kube_objects.DEFAULT_PORT)


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
        raise kube_objects.ManifestError(f"accelerators {first}: Kubernetes schedules whole devices only")
    return name.strip(), int(count)


def resources(res: dict[str, str], cfg: kube_objects.PodConfig) -> tuple[dict[str, Any], dict[str, str], list[str]]:
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


def replica_labels(launch: model.LaunchRequest, cfg: kube_objects.PodConfig, obj: str) -> dict[str, str]:
    """The labels of a replica's objects: the operator's, then ours (ours win)."""
    return {
        **cfg.labels,
        **kube_objects.selector(cfg.instance),
        kube_objects.LABEL_SERVICE: launch.service,
        kube_objects.LABEL_VERSION: str(launch.version),
        kube_objects.LABEL_REPLICA_ID: str(launch.replica_id),
        kube_objects.LABEL_POD: obj,
        kube_objects.LABEL_SPOT: "true" if launch.use_spot else "false",
    }


def environment(launch: model.LaunchRequest, port: int, *, has_secret: bool) -> list[dict[str, Any]]:
    """The container's env list: the spec's envs, then PORT (not for a worker), HOST and the replica ids."""
    env = dict(launch.spec.envs)
    if port:
        env["PORT"] = str(port)
    if launch.spec.worker:
        env[kube_objects.JOBS_DIR_ENV] = kube_objects.JOBS_DIR_PATH
    env.update(
        {
            "HOST": "0.0.0.0",
            "REPLICA_ID": str(launch.replica_id),
            "SKYPILOT_SERVE_REPLICA_ID": str(launch.replica_id),
            "PYTHONUNBUFFERED": "1",
            kube_objects.SETUP_DONE_ENV: kube_objects.SETUP_DONE_PATH,
            kube_objects.TERMINATION_LOG_ENV: kube_objects.TERMINATION_LOG_PATH,
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


def placement(
    launch: model.LaunchRequest, alternative: alternatives.Alternative, cfg: kube_objects.PodConfig
) -> Placement:
    """Where one alternative of a launch may run: its resources, the launch's zone (else the
    alternative's own), and the spot node selector and tolerations of a spot launch.

    Raises:
        ManifestError: the alternative cannot be expressed as a Pod.
    """
    res = alternative.resources
    container_resources, node_selector, notes = resources(res, cfg)
    zone = zone_of(launch, alternative)
    if zone:
        node_selector[kube_objects.ZONE_LABEL] = zone
    tolerations = []
    if launch.use_spot:
        node_selector.update(cfg.spot_node_selector)
        tolerations = [t.to_dict() for t in cfg.spot_tolerations]
    return Placement(container_resources, node_selector, tolerations, notes)


def pod_manifest(
    launch: model.LaunchRequest,
    cfg: kube_objects.PodConfig,
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
        raise kube_objects.ManifestError(
            f"num_nodes={spec.num_nodes}: the kubernetes backend runs single-node replicas"
        )
    if alternative is None:
        alternative = alternatives.of_spec(spec)[0]
    obj = kube_objects.object_name(launch.name)
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
        "name": kube_objects.CONTAINER,
        "image": image_of(alternative.resources, cfg.default_image),
        "command": [
            "/bin/sh",
            "-c",
            kube_objects.WRAPPER,
            "replicaplane-run",
            spec.setup,
            kube_objects.HOLDER if spec.worker else spec.run,
        ],
        "env": env,
        "ports": [
            {"containerPort": p, "protocol": "TCP", **({"name": "serve"} if p == port else {})}
            for p in ports.declared(spec.ports, port)
        ],
        "terminationMessagePath": kube_objects.TERMINATION_LOG_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if where.resources:
        container["resources"] = where.resources
    if spec.setup.strip():
        period = max(1, cfg.setup_probe_period_s)
        container["startupProbe"] = {
            "exec": {"command": ["/bin/sh", "-c", f'test -f "${kube_objects.SETUP_DONE_ENV}"']},
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
                kube_objects.ANNOTATION_REPLICA: launch.name,
                kube_objects.ANNOTATION_TOKEN: token,
                kube_objects.ANNOTATION_ZONE: zone_of(launch, alternative),
                kube_objects.ANNOTATION_CREATED: repr(created_at),
                kube_objects.ANNOTATION_OWNER: launch.owner,
                kube_objects.ANNOTATION_RESOURCES: alternative.path,
                kube_objects.ANNOTATION_ACCELERATOR: alternative.accelerator,
                **({kube_objects.ANNOTATION_WORKER: "true"} if spec.worker else {}),
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
    launch: model.LaunchRequest, cfg: kube_objects.PodConfig, *, token: str, owner: dict[str, str] | None = None
) -> dict[str, Any]:
    """The Service in front of a replica's Pod (same name), selecting exactly that Pod and owned by it."""
    obj = kube_objects.object_name(launch.name)
    port = serving_port(launch.spec)
    metadata: dict[str, Any] = {
        "name": obj,
        "namespace": cfg.namespace,
        "labels": replica_labels(launch, cfg, obj),
        "annotations": {
            **cfg.annotations,
            kube_objects.ANNOTATION_REPLICA: launch.name,
            kube_objects.ANNOTATION_TOKEN: token,
        },
    }
    if owner:
        metadata["ownerReferences"] = [owner]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": cfg.service_type,
            "selector": {**kube_objects.selector(cfg.instance), kube_objects.LABEL_POD: obj},
            "ports": [
                {"name": f"p{p}", "port": p, "targetPort": p, "protocol": "TCP"}
                for p in ports.declared(launch.spec.ports, port)
            ],
        },
    }


def secret_manifest(launch: model.LaunchRequest, cfg: kube_objects.PodConfig, *, token: str) -> dict[str, Any]:
    """The Secret holding a replica's secret environment (same name as the Pod).

    It is created before the Pod, so it cannot name the Pod as its owner yet; the backend adds
    that ownerReference once the Pod exists.
    """
    import base64  # only replicas with secrets need it

    obj = kube_objects.object_name(launch.name)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": obj,
            "namespace": cfg.namespace,
            "labels": replica_labels(launch, cfg, obj),
            "annotations": {kube_objects.ANNOTATION_REPLICA: launch.name, kube_objects.ANNOTATION_TOKEN: token},
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in launch.spec.secrets.items()},
    }

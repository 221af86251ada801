"""The provisioner's settings: defaults, the config file and the environment, checked once."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from services.common import config, errors
from services.provisioner import kube, kube_objects, local, manager
from services.provisioner import zones as zone_config

# The core's defaults are the settings' defaults: stated once, in manager.Options.
_CORE = manager.Options()


@dataclasses.dataclass(frozen=True)
class Settings:
    """Provisioner settings; env REPLICAPLANE_PROVISIONER_<FIELD> overrides each."""

    listen_addr: str = config.PROVISIONER_ADDR
    """host:port to serve on; port 0 picks a free port."""
    shutdown_grace_s: float = 3.0
    """Seconds in-flight RPCs get on SIGTERM."""
    port_file: str = ""
    """If set, the bound port is written here once serving (tests and scripts use port 0)."""
    metrics_addr: str = config.PROVISIONER_METRICS_ADDR
    """host:port of the Prometheus `/metrics` endpoint; port 0 picks a free port; empty turns
    metrics off."""
    metrics_port_file: str = ""
    """If set, the bound metrics port is written here once serving."""
    state_dir: str = "~/.replicaplane/provisioner"
    """Where records, logs and replica working directories live; replicas are re-found from it."""
    backend: str = "local"
    """Which backend runs replicas: "local" (process groups on this machine) or "kubernetes" (Pods)."""
    max_in_flight: float = _CORE.max_in_flight
    """Launches in flight at once; a teardown counts 1/2. More wait in FIFO order."""
    launch_attempts: int = _CORE.launch_attempts
    """Launch attempts before a launch fails."""
    launch_backoff_initial_s: float = _CORE.launch_backoff_initial_s
    """Gap after the first failed launch attempt (jittered +-40 %)."""
    launch_backoff_multiplier: float = _CORE.launch_backoff_multiplier
    """Growth of the launch backoff per attempt."""
    launch_backoff_max_s: float = _CORE.launch_backoff_max_s
    """Cap of the launch backoff."""
    teardown_attempts: int = _CORE.teardown_attempts
    """Teardown attempts before a teardown fails."""
    teardown_backoff_initial_s: float = _CORE.teardown_backoff_initial_s
    """Gap after the first failed teardown attempt (x1.6 per attempt, jittered)."""
    teardown_backoff_max_s: float = _CORE.teardown_backoff_max_s
    """Cap of the teardown backoff."""
    cancel_timeout_s: float = _CORE.cancel_timeout_s
    """How long cancelling an in-flight launch may take before teardown goes ahead anyway."""
    kill_grace_s: float = _CORE.kill_grace_s
    """Seconds between SIGTERM and SIGKILL when a replica is torn down."""
    zones: str = zone_config.DEFAULT_ZONES
    """Simulated zones of the local backend, as name:price_per_hour pairs."""
    watch_history: int = _CORE.watch_history
    """Watch events kept for resuming; an older resume point gets a new snapshot."""
    sweep_interval_s: float = _CORE.sweep_interval_s
    """How often the level-triggered pass restarts operations whose task died."""
    replica_host: str = "127.0.0.1"
    """Address local replicas bind to (given to them as $HOST); 0.0.0.0 in containers."""
    advertise_host: str = ""
    """Host put in replica endpoints; default replica_host (127.0.0.1 when that is a wildcard)."""
    replica_network: str = "auto"
    """How local replicas share the machine: `address` gives each its own loopback address
    (127.77.x.y) with the spec's ports unchanged, so apps that bind a fixed port run side by
    side; `port` maps each declared port to a free one on replica_host. `auto` is `address`
    on loopback where the system supports it (Linux), else `port` (containers, replica_host
    0.0.0.0)."""
    local_accelerators: str = ""
    """Accelerators the local backend pretends to have, as "A100:8,H100:8" (tests and demos);
    a spec asking for others is refused at create. Empty: none, so GPU specs are refused."""
    local_copy_max_mb: float = local.DEFAULT_COPY_LIMITS.max_bytes / (1 << 20)
    """The most a local replica's workdir and file mounts may hold together, in MB (2**20 bytes);
    a spec over it is refused at create and a launch over it fails, naming this setting."""
    local_copy_max_files: int = local.DEFAULT_COPY_LIMITS.max_entries
    """The most files and directories a local replica's workdir and file mounts may hold together."""
    local_venv: bool = True
    """Give each service version's local replicas one Python venv of their own (made once, shared
    by them, removed with the last), active in setup and run, so `pip install` never writes
    into the host's Python. False: replicas run in the provisioner's environment."""
    local_venv_system_site_packages: bool = True
    """Let those venvs see the base interpreter's installed packages (nothing is installed twice).
    False: bare venvs (pip is still lent from the provisioner's environment)."""
    kubernetes_kubeconfig: str = ""
    """Kubeconfig file of the kubernetes backend; empty: $KUBECONFIG, then ~/.kube/config."""
    kubernetes_context: str = ""
    """Kubeconfig context; empty: the file's current context."""
    kubernetes_in_cluster: bool = False
    """Use the Pod's service account (the provisioner runs inside the cluster) instead of a kubeconfig."""
    kubernetes_namespace: str = "default"
    """Namespace of every replica object; it must exist unless kubernetes_create_namespace is set."""
    kubernetes_create_namespace: bool = False
    """Create the namespace at start when it is missing (needs cluster-wide namespace rights)."""
    kubernetes_instance: str = "replicaplane"
    """Label value that tells this provisioner's Pods apart from another's in the same namespace."""
    kubernetes_image: str = "python:3.11-slim"
    """Container image of replicas whose spec has no image_id."""
    kubernetes_service_type: str = ""
    """Service per replica: "" (none), ClusterIP, NodePort or LoadBalancer."""
    kubernetes_endpoint: str = "pod"
    """Reported endpoint: "pod" (Pod IP and port) or "service" (the Service's cluster DNS name)."""
    kubernetes_cluster_domain: str = "cluster.local"
    """Cluster DNS domain, for "service" endpoints."""
    kubernetes_labels: str = ""
    """Extra labels on replica objects, as k=v,k=v."""
    kubernetes_annotations: str = ""
    """Extra annotations on replica objects, as k=v,k=v."""
    kubernetes_spot_node_selector: str = ""
    """Node selector of spot replicas, as k=v,k=v (for example cloud.google.com/gke-spot=true)."""
    kubernetes_spot_tolerations: str = ""
    """Tolerations of spot replicas, as key[=value]:Effect,..."""
    kubernetes_accelerator_label: str = "replicaplane.dev/accelerator"
    """Node label matched to the lowercased accelerator name; empty: no accelerator node selector."""
    kubernetes_accelerator_label_values: str = ""
    """Values of kubernetes_accelerator_label per accelerator where they are not its lowercased
    name, as NAME=value,... (GKE: A100=nvidia-tesla-a100,H100=nvidia-h100-80gb)."""
    kubernetes_gpu_resource: str = "nvidia.com/gpu"
    """Extended resource that accelerator counts are requested as."""
    kubernetes_schedule_timeout_s: float = 600.0
    """How long a Pod may stay unschedulable before the launch attempt fails."""
    kubernetes_alternative_timeout_s: float = 45.0
    """With several resources alternatives (any_of, ordered, a list of accelerators): how long one
    alternative's Pod may stay unschedulable before the next is tried (at most
    kubernetes_schedule_timeout_s)."""
    kubernetes_alternative_retry_s: float = 300.0
    """With any_of: for how long an alternative that found no capacity is tried after the others."""
    kubernetes_start_timeout_s: float = 900.0
    """How long a Pod may take to start its container (image pull included)."""
    kubernetes_setup_timeout_s: float = 3600.0
    """How long setup may run inside the container (its startup probe's budget)."""
    kubernetes_delete_timeout_s: float = 60.0
    """How long past its grace period a deleted Pod may stay terminating before teardown fails."""
    kubernetes_watch_timeout_s: float = 300.0
    """Server-side timeout of one Pod watch; it is then resumed from the last resourceVersion."""
    kubernetes_watch_idle_s: float = 330.0
    """A watch silent this long is treated as broken and reopened from the last resourceVersion."""
    kubernetes_api_attempts: int = 5
    """Tries of one Kubernetes API call that fails transiently (no answer, 429, 5xx); 1: no retry."""
    kubernetes_api_backoff_s: float = 0.5
    """First wait between tries of a failed API call; doubled each time, jittered, unless the
    server sent Retry-After."""
    kubernetes_api_backoff_max_s: float = 10.0
    """Longest wait between tries of a failed API call (a longer Retry-After is cut to it)."""
    kubernetes_node_address: str = ""
    """Host of `node_port` endpoints; empty: the IP of the node the replica's Pod runs on."""
    kubernetes_load_balancer_timeout_s: float = 600.0
    """A LoadBalancer Service with no address this long after its Pod started fails the attempt."""
    kubernetes_follow_logs: bool = True
    """Copy each replica Pod's log into the provisioner's logs (StreamLogs, `replicactl logs`); one
    log stream per running Pod (needs `get` on `pods/log`)."""
    kubernetes_port_annotation: str = ""
    """Pod annotation that overrides the endpoint port (node-local emulators only; leave empty)."""
    tls_cert_file: str = ""
    """This server's certificate (PEM). Setting the three tls_* files turns mTLS on: callers
    must show a certificate signed by tls_ca_file."""
    tls_key_file: str = ""
    """Private key of tls_cert_file (PEM)."""
    tls_ca_file: str = ""
    """CA (PEM) that signed the callers' certificates."""
    tls_allowed_clients: str = "controller"
    """With mTLS, the certificate names (CN or SAN) allowed to call; others get PERMISSION_DENIED."""


def load_settings(**overrides: Any) -> Settings:
    """Settings from defaults, the config file and the environment."""
    return config.load(Settings, "provisioner", **overrides)


def kube_options(settings: Settings) -> kube.Options:
    """The kubernetes backend's options from the settings.

    Raises:
        errors.ValidationError: every malformed `kubernetes_*` setting, each named.
    """
    violations = []

    def field(name: str) -> str:
        return f"provisioner.kubernetes_{name}"

    def parsed(name: str, parse: Any, default: Any) -> Any:
        try:
            return parse(getattr(settings, f"kubernetes_{name}"), field(name))
        except ValueError as exc:
            violations.append(errors.FieldViolation(field(name), str(exc).split(": ", 1)[-1]))
            return default

    labels = parsed("labels", kube_objects.parse_pairs, {})
    try:
        kube_objects.check_label_values(labels, field("labels"))
    except ValueError as exc:
        violations.append(errors.FieldViolation(field("labels"), str(exc).split(": ", 1)[-1]))
    annotations = parsed("annotations", kube_objects.parse_pairs, {})
    label_values = parsed("accelerator_label_values", kube_objects.parse_pairs, {})
    try:
        kube_objects.check_label_values(label_values, field("accelerator_label_values"))
    except ValueError as exc:
        violations.append(errors.FieldViolation(field("accelerator_label_values"), str(exc).split(": ", 1)[-1]))
    label = settings.kubernetes_accelerator_label
    if label and not kube_objects.is_label_key(label):
        violations.append(errors.FieldViolation(field("accelerator_label"), "must be empty or a label key"))
    if not kube_objects.is_resource_name(settings.kubernetes_gpu_resource):
        violations.append(
            errors.FieldViolation(field("gpu_resource"), "must be an extended resource name such as nvidia.com/gpu")
        )
    spot_selector = parsed("spot_node_selector", kube_objects.parse_pairs, {})
    tolerations = parsed("spot_tolerations", kube_objects.parse_tolerations, ())
    ns = settings.kubernetes_namespace
    if len(ns) > 63 or not kube_objects.is_dns_label(ns):
        violations.append(errors.FieldViolation(field("namespace"), "must be a DNS label (a-z, 0-9, '-'), at most 63"))
    instance = settings.kubernetes_instance
    if not instance or len(instance) > 63 or not kube_objects.is_label_value(instance):
        violations.append(errors.FieldViolation(field("instance"), "must be a non-empty label value, at most 63"))
    if settings.kubernetes_service_type not in kube_objects.SERVICE_TYPES:
        violations.append(
            errors.FieldViolation(field("service_type"), "must be empty, ClusterIP, NodePort or LoadBalancer")
        )
    if settings.kubernetes_endpoint not in kube_objects.ENDPOINT_MODES:
        violations.append(errors.FieldViolation(field("endpoint"), "must be pod or service"))
    elif (
        settings.kubernetes_endpoint in kube_objects.ENDPOINT_SERVICE_TYPES
        and settings.kubernetes_service_type not in kube_objects.ENDPOINT_SERVICE_TYPES[settings.kubernetes_endpoint]
    ):
        types = " or ".join(kube_objects.ENDPOINT_SERVICE_TYPES[settings.kubernetes_endpoint])
        violations.append(
            errors.FieldViolation(
                field("endpoint"), f"{settings.kubernetes_endpoint} endpoints need kubernetes_service_type {types}"
            )
        )
    if not settings.kubernetes_image:
        violations.append(errors.FieldViolation(field("image"), "must not be empty"))
    for name in (
        "schedule_timeout_s",
        "alternative_timeout_s",
        "alternative_retry_s",
        "start_timeout_s",
        "setup_timeout_s",
        "delete_timeout_s",
    ):
        if getattr(settings, f"kubernetes_{name}") < 0:
            violations.append(errors.FieldViolation(field(name), "must not be negative"))
    for name in ("watch_timeout_s", "watch_idle_s", "api_attempts"):
        if getattr(settings, f"kubernetes_{name}") < 1:
            violations.append(errors.FieldViolation(field(name), "must be at least 1"))
    for name in ("api_backoff_s", "api_backoff_max_s"):
        if getattr(settings, f"kubernetes_{name}") < 0:
            violations.append(errors.FieldViolation(field(name), "must not be negative"))
    errors.require(violations, subject="provisioner settings")
    return kube.Options(
        pods=kube_objects.PodConfig(
            namespace=ns,
            instance=instance,
            default_image=settings.kubernetes_image,
            service_type=settings.kubernetes_service_type,
            labels=labels,
            annotations=annotations,
            spot_node_selector=spot_selector,
            spot_tolerations=tolerations,
            accelerator_label=settings.kubernetes_accelerator_label,
            accelerator_label_values={k.lower(): v for k, v in label_values.items()},
            gpu_resource=settings.kubernetes_gpu_resource,
            setup_timeout_s=settings.kubernetes_setup_timeout_s,
        ),
        kubeconfig=os.path.expanduser(settings.kubernetes_kubeconfig) if settings.kubernetes_kubeconfig else "",
        context=settings.kubernetes_context,
        in_cluster=settings.kubernetes_in_cluster,
        create_namespace=settings.kubernetes_create_namespace,
        endpoint=settings.kubernetes_endpoint,
        cluster_domain=settings.kubernetes_cluster_domain,
        port_annotation=settings.kubernetes_port_annotation,
        follow_logs=settings.kubernetes_follow_logs,
        node_address=settings.kubernetes_node_address,
        load_balancer_timeout_s=settings.kubernetes_load_balancer_timeout_s,
        schedule_timeout_s=settings.kubernetes_schedule_timeout_s,
        alternative_timeout_s=settings.kubernetes_alternative_timeout_s,
        alternative_retry_s=settings.kubernetes_alternative_retry_s,
        start_timeout_s=settings.kubernetes_start_timeout_s,
        delete_timeout_s=settings.kubernetes_delete_timeout_s,
        watch_timeout_s=settings.kubernetes_watch_timeout_s,
        watch_idle_s=settings.kubernetes_watch_idle_s,
        api_attempts=settings.kubernetes_api_attempts,
        api_backoff_s=settings.kubernetes_api_backoff_s,
        api_backoff_max_s=settings.kubernetes_api_backoff_max_s,
    )


def options(settings: Settings) -> manager.Options:
    """The core's options from the settings.

    Raises:
        errors.ValidationError: a value out of range, naming each.
    """
    violations = []
    if settings.max_in_flight < 0.5:
        violations.append(errors.FieldViolation("provisioner.max_in_flight", "must be at least 0.5"))
    for name in ("launch_attempts", "teardown_attempts", "watch_history"):
        if getattr(settings, name) < 1:
            violations.append(errors.FieldViolation(f"provisioner.{name}", "must be at least 1"))
    for name in (
        "launch_backoff_initial_s",
        "launch_backoff_max_s",
        "teardown_backoff_initial_s",
        "teardown_backoff_max_s",
        "cancel_timeout_s",
        "kill_grace_s",
    ):
        if getattr(settings, name) < 0:
            violations.append(errors.FieldViolation(f"provisioner.{name}", "must not be negative"))
    if settings.sweep_interval_s <= 0:
        violations.append(errors.FieldViolation("provisioner.sweep_interval_s", "must be positive"))
    if settings.launch_backoff_multiplier < 1:
        violations.append(errors.FieldViolation("provisioner.launch_backoff_multiplier", "must be at least 1"))
    errors.require(violations, subject="provisioner settings")
    shared = {f.name for f in dataclasses.fields(manager.Options)} & {f.name for f in dataclasses.fields(Settings)}
    return manager.Options(**{name: getattr(settings, name) for name in shared})

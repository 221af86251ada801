"""deploy/kubernetes: what `kubectl apply -k` would create, checked without a cluster.

Each kustomization is built with the real kustomize (`kubectl kustomize`). Every object must
deserialize into the official client's model for its kind without losing a field (a misspelt
key is dropped by the models, so the round trip must give back the same object), and its API
group/version must be one the official client serves that kind under. Then what the design
asks: probes, resources, non-root and read-only root filesystems, the controller's HA
settings, the provisioner's minimal Role (the one docs/kubernetes.md shows), the probers' HPA,
and NetworkPolicies that allow exactly the connections the services make.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common import config
from services.controller import server as controller_server
from services.loadbalancer import server as loadbalancer_server
from services.prober import server as prober_server
from services.provisioner import server as provisioner_server
from tests.helpers import kube_manifests

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
BASE = DEPLOY / "base"
SINGLE = DEPLOY / "overlays" / "single-controller"
CONTROL_NS, REPLICAS_NS = "replicaplane", "replicaplane-replicas"

COMPONENTS = {
    "controller": (controller_server, 50051),
    "provisioner": (provisioner_server, 50052),
    "prober": (prober_server, 50053),
    "loadbalancer": (loadbalancer_server, 50054),
}
SHARED_SETTINGS = {"REPLICAPLANE_LOG_LEVEL"}


@functools.cache
def build(path: Path) -> tuple[dict[str, Any], ...]:
    """The objects `kubectl kustomize path` prints."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl (with its built-in kustomize) is needed to build deploy/kubernetes in CI")
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def find(objs: tuple[dict[str, Any], ...], kind: str, name: str = "", namespace: str = "") -> dict[str, Any]:
    """The one object of `kind` whose name starts with `name` (generated names carry a hash)."""
    found = [
        o
        for o in objs
        if o["kind"] == kind
        and o["metadata"]["name"].startswith(name)
        and (not namespace or o["metadata"].get("namespace") == namespace)
    ]
    assert len(found) == 1, f"{kind} {name}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def deployment(objs: tuple[dict[str, Any], ...], component: str) -> dict[str, Any]:
    return find(objs, "Deployment", f"replicaplane-{component}", CONTROL_NS)


def container(objs: tuple[dict[str, Any], ...], component: str) -> dict[str, Any]:
    containers = deployment(objs, component)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def settings_env(objs: tuple[dict[str, Any], ...], component: str) -> dict[str, str]:
    """The environment a component's container gets from its ConfigMap."""
    refs = [e["configMapRef"]["name"] for e in container(objs, component).get("envFrom", [])]
    assert len(refs) == 1
    return dict(find(objs, "ConfigMap", refs[0], CONTROL_NS)["data"])


def without_nones(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nones(v) for v in value]
    return value


# ---- every object ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", [BASE, SINGLE], ids=["base", "single-controller"])
def test_every_object_is_served_by_its_group_version_and_deserializes_without_losing_a_field(path: Path) -> None:
    from kubernetes import client

    api = client.ApiClient()
    objs = build(path)
    assert objs
    for obj in objs:
        group_version, kind = obj["apiVersion"], obj["kind"]
        group, _, version = group_version.rpartition("/")
        what = f"{group_version} {kind} {obj['metadata']['name']}"
        # The API class of that group/version (CoreV1Api, AppsV1Api, AutoscalingV2Api,
        # RbacAuthorizationV1Api, NetworkingV1Api, PolicyV1Api) must be able to create the kind.
        words = re.split(r"[.\-]", group.removesuffix(".k8s.io")) if group else ["core"]
        api_class = getattr(client, "".join(w.capitalize() for w in words) + version.capitalize() + "Api", None)
        assert api_class is not None, f"{what}: the official client serves no {group_version}"
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", kind).lower()
        scoped = "namespaced_" if obj["metadata"].get("namespace") else ""
        assert hasattr(api_class, f"create_{scoped}{snake}"), f"{what}: {api_class.__name__} has no {kind}"
        model = getattr(client, f"{version.capitalize()}{kind}", None)
        assert model is not None, f"{what}: no model {version.capitalize()}{kind}"
        parsed = model.from_dict(obj)  # raises on a missing required field or a wrong type
        assert without_nones(api.sanitize_for_serialization(parsed)) == obj, f"{what}: a field is unknown"


def test_the_base_has_each_part_the_design_names() -> None:
    objs = build(BASE)
    kinds = {
        (o["kind"], o["metadata"]["name"].rsplit("-", 1)[0] if o["kind"] == "ConfigMap" else o["metadata"]["name"])
        for o in objs
    }
    for component in COMPONENTS:
        assert ("Deployment", f"replicaplane-{component}") in kinds
        assert ("ConfigMap", f"replicaplane-{component}") in kinds
    for name in (
        "replicaplane-controller",
        "replicaplane-provisioner",
        "replicaplane-prober",
        "replicaplane-loadbalancer",
    ):
        assert ("Service", name) in kinds
    assert ("HorizontalPodAutoscaler", "replicaplane-prober") in kinds
    assert ("ServiceAccount", "replicaplane-provisioner") in kinds
    assert {("Namespace", CONTROL_NS), ("Namespace", REPLICAS_NS)} <= kinds
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding", "Secret")]


# ---- Pods ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [BASE, SINGLE], ids=["base", "single-controller"])
@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_each_service_runs_non_root_read_only_with_probes_and_resources(path: Path, component: str) -> None:
    objs = build(path)
    pod = deployment(objs, component)["spec"]["template"]["spec"]
    c = container(objs, component)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    # Writable paths are volumes: /tmp, and the state directory the settings name.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert "/tmp" in mounts
    assert all("emptyDir" in volumes[n] or "persistentVolumeClaim" in volumes[n] for n in mounts.values())
    section = component.upper()
    state_dir = settings_env(objs, component).get(f"REPLICAPLANE_{section}_STATE_DIR")
    if state_dir is not None:
        assert state_dir in mounts
    # Only the provisioner speaks to the API server.
    assert pod["automountServiceAccountToken"] is (component == "provisioner")
    # Native gRPC health probes on the service's own port: liveness on the server, readiness
    # on the service itself.
    module, port = COMPONENTS[component]
    assert c["livenessProbe"]["grpc"] == {"port": port}
    assert c["readinessProbe"]["grpc"] == {"port": port, "service": module.SERVICE_NAME}
    assert port in [p["containerPort"] for p in c["ports"]]
    listen = settings_env(objs, component)[f"REPLICAPLANE_{section}_LISTEN_ADDR"]
    assert listen == f"0.0.0.0:{port}"
    for kind in ("requests", "limits"):
        assert set(c["resources"][kind]) == {"cpu", "memory"}, f"{component} {kind}"
    assert c["image"].startswith("replicaplane:")
    assert c["command"] == ["python", "-m", f"services.{component}"]


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_configmaps_hold_only_settings_the_service_has_and_values_it_accepts(component: str) -> None:
    objs = build(BASE)
    module, _ = COMPONENTS[component]
    env = settings_env(objs, component)
    known = {config.env_name(component, f.name) for f in dataclasses.fields(module.Settings)}
    unknown = set(env) - known - SHARED_SETTINGS
    assert not unknown, f"{component}: no such settings: {sorted(unknown)}"
    config.load(module.Settings, component, environ=env)  # every value converts


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_the_built_configmaps_are_the_env_files_the_e2e_suite_runs_with(component: str) -> None:
    assert settings_env(build(BASE), component) == kube_manifests.service_env(component)


def test_controller_runs_two_with_leader_election_its_store_url_from_a_secret_and_its_pod_address() -> None:
    objs = build(BASE)
    dep = deployment(objs, "controller")
    assert dep["spec"]["replicas"] == 2
    env = settings_env(objs, "controller")
    assert env["REPLICAPLANE_CONTROLLER_LEADER_ELECTION"] == "true"
    assert env["REPLICAPLANE_CONTROLLER_LEASE_DURATION_S"] == "5"
    # Both controllers own the same replicas, so they share one id.
    assert env["REPLICAPLANE_CONTROLLER_CONTROLLER_ID"]
    items = {e["name"]: e for e in container(objs, "controller")["env"]}
    store = items["REPLICAPLANE_CONTROLLER_STORE_URL"]["valueFrom"]["secretKeyRef"]
    assert store == {"name": "replicaplane-controller-store", "key": "url"}
    assert not any("STORE_URL" in k for k in env)  # never in a ConfigMap
    assert items["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert items["REPLICAPLANE_CONTROLLER_ADVERTISE_ADDR"]["value"] == "$(POD_IP):50051"
    names = list(items)
    assert names.index("POD_IP") < names.index("REPLICAPLANE_CONTROLLER_ADVERTISE_ADDR")  # $(..) needs it first
    pdb = find(objs, "PodDisruptionBudget", "replicaplane-controller")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_single_controller_overlay_runs_one_controller_on_sqlite_that_outlives_its_pod() -> None:
    objs = build(SINGLE)
    dep = deployment(objs, "controller")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert "REPLICAPLANE_CONTROLLER_STORE_URL" not in {e["name"] for e in container(objs, "controller")["env"]}
    assert settings_env(objs, "controller")["REPLICAPLANE_CONTROLLER_LEADER_ELECTION"] == "false"
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    claim = volumes["state"]["persistentVolumeClaim"]["claimName"]
    assert find(objs, "PersistentVolumeClaim", claim, CONTROL_NS)
    assert not [o for o in objs if o["kind"] == "PodDisruptionBudget"]


@pytest.mark.parametrize("path", [BASE, SINGLE], ids=["base", "single-controller"])
def test_services_reach_the_pods_and_ports_the_settings_name(path: Path) -> None:
    objs = build(path)
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}

    def target(addr: str) -> tuple[dict[str, Any], int]:
        host, _, port = addr.removeprefix("dns:///").rpartition(":")
        name, namespace, *_ = host.split(".")
        svc = services[name]
        assert svc["metadata"]["namespace"] == namespace
        (entry,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
        return svc, entry

    controller_env = settings_env(objs, "controller")
    for addr, component in [
        (controller_env["REPLICAPLANE_CONTROLLER_PROVISIONER_ADDR"], "provisioner"),
        (controller_env["REPLICAPLANE_CONTROLLER_PROBER_ADDRS"], "prober"),
        (settings_env(objs, "loadbalancer")["REPLICAPLANE_LOADBALANCER_CONTROLLER_ADDR"], "controller"),
    ]:
        svc, entry = target(addr)
        labels = deployment(objs, component)["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()), addr
        named = {p["name"]: p["containerPort"] for p in container(objs, component)["ports"]}
        assert named[entry["targetPort"]] == COMPONENTS[component][1]
    # dns:/// resolves every prober only through a headless Service.
    assert services["replicaplane-prober"]["spec"]["clusterIP"] == "None"
    # The balancer fleet: a port per service from the first to FLEET_PORT_MAX, each published
    # on the same port by the Service whose name the URLs carry.
    lb = services["replicaplane-loadbalancer"]
    lb_env = settings_env(objs, "loadbalancer")
    assert lb_env["REPLICAPLANE_LOADBALANCER_FLEET"] == "true"
    assert "REPLICAPLANE_LOADBALANCER_SERVICE_NAME" not in lb_env
    first = int(lb_env["REPLICAPLANE_LOADBALANCER_HTTP_ADDR"].rpartition(":")[2])
    last = int(lb_env["REPLICAPLANE_LOADBALANCER_FLEET_PORT_MAX"])
    assert (first, last) == (30001, 30020)
    assert [(p["port"], p["targetPort"]) for p in lb["spec"]["ports"]] == [(p, p) for p in range(first, last + 1)]
    assert lb_env["REPLICAPLANE_LOADBALANCER_ADVERTISE_HOST"] == "replicaplane-loadbalancer.replicaplane.svc"
    assert lb_env["REPLICAPLANE_LOADBALANCER_FLEET_PORTS_FILE"].startswith("/tmp/")  # a writable volume
    assert loadbalancer_server.load_settings(environ=lb_env).fleet


def test_probers_scale_with_cpu_through_an_hpa() -> None:
    objs = build(BASE)
    hpa = find(objs, "HorizontalPodAutoscaler", "replicaplane-prober")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", "replicaplane-prober")
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert "cpu" in container(objs, "prober")["resources"]["requests"]  # utilization needs a request


def test_provisioner_has_the_minimal_role_of_the_docs_in_the_replicas_namespace_only() -> None:
    objs = build(BASE)
    env = settings_env(objs, "provisioner")
    assert env["REPLICAPLANE_PROVISIONER_BACKEND"] == "kubernetes"
    assert env["REPLICAPLANE_PROVISIONER_KUBERNETES_IN_CLUSTER"] == "true"
    namespace = env["REPLICAPLANE_PROVISIONER_KUBERNETES_NAMESPACE"]
    assert namespace == REPLICAS_NS
    roles = [o for o in objs if o["kind"] in ("Role", "RoleBinding")]
    assert {o["metadata"]["namespace"] for o in roles} == {namespace}
    role = find(objs, "Role", "replicaplane-provisioner", namespace)
    docs_text = (ROOT / "docs" / "kubernetes.md").read_text()
    block = re.search(r"## Minimal RBAC\n.*?```yaml\n(.*?)```", docs_text, re.S)
    assert block is not None
    (documented,) = [d for d in yaml.safe_load_all(block.group(1)) if d["kind"] == "Role"]
    assert role["rules"] == documented["rules"]
    binding = find(objs, "RoleBinding", "replicaplane-provisioner", namespace)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    pod = deployment(objs, "provisioner")["spec"]["template"]["spec"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": CONTROL_NS}
    ]
    # One provisioner at a time (two would adopt each other's Pods), its records on a volume.
    dep = deployment(objs, "provisioner")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "persistentVolumeClaim" in volumes["state"]


# ---- NetworkPolicies ---------------------------------------------------------------------------

EXTERNAL = "external"


@dataclasses.dataclass(frozen=True)
class Peer:
    """A Pod (namespace and labels) or, with namespace EXTERNAL, an address outside the cluster."""

    name: str
    namespace: str
    labels: tuple[tuple[str, str], ...] = ()

    def label_map(self) -> dict[str, str]:
        return dict(self.labels)


def _selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    assert not (selector or {}).get("matchExpressions"), "this checker reads matchLabels only"
    return all(labels.get(k) == v for k, v in ((selector or {}).get("matchLabels") or {}).items())


def _peer_matches(entry: dict[str, Any], peer: Peer, policy_ns: str) -> bool:
    if "ipBlock" in entry:
        return peer.namespace == EXTERNAL
    if peer.namespace == EXTERNAL:
        return False
    ns_labels = {"kubernetes.io/metadata.name": peer.namespace}
    if "namespaceSelector" in entry:
        if not _selects(entry["namespaceSelector"], ns_labels):
            return False
    elif peer.namespace != policy_ns:
        return False
    return _selects(entry.get("podSelector"), peer.label_map())


def _port_matches(rule: dict[str, Any], port: tuple[str, int]) -> bool:
    entries = rule.get("ports") or []
    return not entries or any(
        e.get("protocol", "TCP") == port[0] and e.get("port", 0) <= port[1] <= e.get("endPort", e.get("port", 0))
        for e in entries
    )


def _allowed(policies: list[dict[str, Any]], pod: Peer, peer: Peer, port: tuple[str, int], direction: str) -> bool:
    """Kubernetes semantics: isolated in `direction` by any policy selecting the Pod, then
    allowed when any rule of those policies admits the peer and port."""
    if pod.namespace == EXTERNAL:
        return True  # outside the cluster: no policy applies
    mine = [
        p
        for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and _selects(p["spec"]["podSelector"], pod.label_map())
        and direction in p["spec"]["policyTypes"]
    ]
    if not mine:
        return True
    key, side = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for policy in mine:
        for rule in policy["spec"].get(key) or []:
            peers = rule.get(side)
            if (not peers or any(_peer_matches(e, peer, policy["metadata"]["namespace"]) for e in peers)) and (
                _port_matches(rule, port)
            ):
                return True
    return False


def _component(name: str) -> Peer:
    return Peer(name, CONTROL_NS, (("app.kubernetes.io/name", "replicaplane"), ("app.kubernetes.io/component", name)))


PEERS = {
    "controller": _component("controller"),
    "provisioner": _component("provisioner"),
    "prober": _component("prober"),
    "loadbalancer": _component("loadbalancer"),
    "replica": Peer("replica", REPLICAS_NS, (("app.kubernetes.io/managed-by", "replicaplane"),)),
    "api-client": Peer("api-client", "team-a", (("replicaplane.dev/api-client", "true"),)),
    "other-pod": Peer("other-pod", "team-a", (("app", "web"),)),
    "kube-dns": Peer("kube-dns", "kube-system", (("k8s-app", "kube-dns"),)),
    "internet": Peer("internet", EXTERNAL),
}
# Where each destination listens (port, protocol); external addresses as the design needs them.
LISTENS = {
    "controller": [("TCP", 50051)],
    "provisioner": [("TCP", 50052)],
    "prober": [("TCP", 50053)],
    "loadbalancer": [("TCP", 30001), ("TCP", 30020), ("TCP", 30021), ("TCP", 50054)],
    "replica": [("TCP", 8080)],
    "api-client": [("TCP", 8080)],
    "other-pod": [("TCP", 8080)],
    "kube-dns": [("UDP", 53), ("TCP", 53)],
    "internet": [("TCP", 443), ("TCP", 6443), ("TCP", 5432), ("TCP", 80)],
}
# Every connection the design makes; nothing else may pass.
DESIGNED = {
    ("loadbalancer", "controller", 50051),
    ("api-client", "controller", 50051),
    ("controller", "provisioner", 50052),
    ("controller", "prober", 50053),
    ("controller", "internet", 5432),  # PostgreSQL
    ("provisioner", "internet", 443),  # the API server
    ("provisioner", "internet", 6443),
    ("prober", "replica", 8080),
    ("loadbalancer", "replica", 8080),
    *{(c, "loadbalancer", p) for c in ("internet", "api-client", "other-pod", "replica") for p in (30001, 30020)},
    *{(c, "kube-dns", 53) for c in ("controller", "provisioner", "prober", "loadbalancer")},
}
# Pods no policy here governs (other namespaces, the replicas' own egress) are free to dial out.
UNGOVERNED_SOURCES = {"api-client", "other-pod", "kube-dns", "internet", "replica"}
# The service's URL is public: anyone whose own egress allows it may connect.
PUBLIC = {("loadbalancer", 30001), ("loadbalancer", 30020)}  # the fleet's ports (30021: none)


def test_network_policies_allow_exactly_the_connections_the_design_makes() -> None:
    objs = build(BASE)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    allowed, missing = set(), []
    for src_name, src in PEERS.items():
        for dst_name, dst in PEERS.items():
            if src_name == dst_name:
                continue
            for port in LISTENS[dst_name]:
                ok = _allowed(policies, src, dst, port, "Egress") and _allowed(policies, dst, src, port, "Ingress")
                edge = (src_name, dst_name, port[1])
                if ok:
                    allowed.add(edge)
                elif edge in DESIGNED:
                    missing.append(edge)
    assert not missing, f"designed connections blocked: {missing}"
    extra = {
        e
        for e in allowed - DESIGNED
        if not (e[0] in UNGOVERNED_SOURCES and e[1] in UNGOVERNED_SOURCES) and e[1:] not in PUBLIC
    }
    assert not extra, f"connections the design does not make are allowed: {sorted(extra)}"
    # Each control-plane namespace Pod is isolated both ways by a default deny.
    deny = find(objs, "NetworkPolicy", "default-deny", CONTROL_NS)
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}

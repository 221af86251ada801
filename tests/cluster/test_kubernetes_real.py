"""Opt-in: the kubernetes backend against a real cluster (skipped unless KUBECONFIG is set).

Checks what the test API server only imitates: server-side label selectors, 410 Gone on an
expired watch, graceful deletion, unschedulable and image-pull failures, reachability of Pod
IPs from where the tests run, garbage collection of a Pod's Secret and Service, and that the
Role in docs/kubernetes.md is enough.

Each run makes its own namespace `rcp-test-<random>` (labelled `replicaplane.dev/test=true`)
with the KUBECONFIG's credentials, and deletes it at the end. Replicas run `python:3.11-slim`
(override with RCP_TEST_IMAGE); the cluster must be able to pull it.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml

from services.provisioner import backend, kube, kube_client, kube_objects, model

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs a real cluster: set KUBECONFIG"),
    pytest.mark.timeout(600),
]

IMAGE = os.environ.get("RCP_TEST_IMAGE", "python:3.11-slim")
KUBECONFIG = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
ROLE_RULES = [  # keep in step with docs/kubernetes.md
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "create", "delete"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "create", "delete", "patch"]},
]


class _Admin:
    """The KUBECONFIG's own credentials, for setting up namespaces and RBAC."""

    def __init__(self) -> None:
        self.api: Any = None
        self.core: Any = None
        self.cfg: Any = None

    async def open(self) -> None:
        from kubernetes.aio import client, config

        self.cfg = client.Configuration()
        await config.load_kube_config(config_file=KUBECONFIG, client_configuration=self.cfg)
        self.api = client.ApiClient(self.cfg)
        self.core = client.CoreV1Api(self.api)
        self.rbac = client.RbacAuthorizationV1Api(self.api)

    async def close(self) -> None:
        await self.api.close()


@pytest.fixture
async def admin() -> AsyncIterator[_Admin]:
    a = _Admin()
    await a.open()
    try:
        yield a
    finally:
        await a.close()


@pytest.fixture
async def namespace(admin: _Admin) -> AsyncIterator[str]:
    name = f"rcp-test-{uuid.uuid4().hex[:8]}"
    body = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {"replicaplane.dev/test": "true"}},
    }
    await admin.core.create_namespace_without_preload_content(body)
    try:
        yield name
    finally:
        await admin.core.delete_namespace_without_preload_content(name)


def _options(namespace: str, kubeconfig: str = KUBECONFIG, **fields: Any) -> kube.Options:
    pods = kube_objects.PodConfig(namespace=namespace, instance=f"t-{uuid.uuid4().hex[:6]}", default_image=IMAGE)
    values: dict[str, Any] = {
        "pods": pods,
        "kubeconfig": kubeconfig,
        "schedule_timeout_s": 20.0,
        "start_timeout_s": 300.0,
        "delete_timeout_s": 60.0,
        "watch_timeout_s": 30.0,
        "watch_idle_s": 60.0,
    }
    values.update(fields)
    return kube.Options(**values)


def _request(tmp_path, replica_id: int, **spec_fields: Any) -> backend.CreateRequest:
    values: dict[str, Any] = {"run": "python3 -m http.server 8080", "ports": (8080,), "serving_port": 8080}
    values.update(spec_fields)
    launch = model.LaunchRequest(
        name=f"web-{replica_id}-{uuid.uuid4().hex[:8]}",
        service="web",
        replica_id=replica_id,
        version=1,
        spec=model.ReplicaSpec(**values),
    )
    return backend.CreateRequest(
        launch=launch, attempt=1, launch_log=str(tmp_path / "launch.log"), app_log=str(tmp_path / "app.log")
    )


async def _get_pod(admin: _Admin, namespace: str, name: str) -> dict[str, Any] | None:
    resp = await admin.core.read_namespaced_pod_without_preload_content(name, namespace)
    try:
        return None if resp.status == 404 else dict(json.loads(await resp.read()))
    finally:
        resp.release()


async def test_serve_reach_pod_ip_and_graceful_teardown(tmp_path, admin, namespace) -> None:
    b = kube.KubernetesBackend(_options(namespace))
    await b.start()
    try:
        request = _request(tmp_path, 1, setup="echo preparing")
        replica = await b.create(request)
        assert replica.endpoint.startswith("http://")
        body = b""
        for _ in range(100):  # bounded: the app may still be binding
            try:
                body = await asyncio.to_thread(lambda: urllib.request.urlopen(replica.endpoint + "/", timeout=3).read())
                break
            except OSError:
                await asyncio.sleep(0.5)
        assert body, f"Pod IP endpoint {replica.endpoint} not reachable from here (see docs/kubernetes.md)"
        obj = kube_objects.object_name(request.launch.name)
        deletion = asyncio.create_task(b.delete(request.launch.name, grace_s=5))
        seen_terminating = False
        while not deletion.done():
            pod = await _get_pod(admin, namespace, obj)
            seen_terminating = seen_terminating or bool(pod and pod["metadata"].get("deletionTimestamp"))
            await asyncio.sleep(0.2)
        await deletion
        assert seen_terminating  # graceful: the Pod was Terminating before it went
        assert await _get_pod(admin, namespace, obj) is None
    finally:
        await b.close()


async def test_server_side_selectors_and_410_on_an_expired_watch(tmp_path, admin, namespace) -> None:
    opts = _options(namespace)
    b = kube.KubernetesBackend(opts)
    await b.start()
    try:
        foreign = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "foreign", "namespace": namespace, "labels": {"app": "other"}},
            "spec": {"containers": [{"name": "c", "image": IMAGE, "command": ["sleep", "600"]}]},
        }
        await admin.core.create_namespaced_pod_without_preload_content(namespace, foreign)
        request = _request(tmp_path, 1)
        await b.create(request)
        api = kube_client.Api(opts)
        await api.open()
        try:
            items, version = await api.list(
                "pod", namespace, kube_objects.selector_text(kube_objects.selector(opts.pods.instance))
            )
            assert [i["metadata"]["name"] for i in items] == [kube_objects.object_name(request.launch.name)]
            assert version
            with pytest.raises(kube_client.Gone):
                async for _ in api.watch_pods(namespace, "", "1"):
                    pass
        finally:
            await api.close()
        await b.delete(request.launch.name, grace_s=0)
    finally:
        await b.close()


async def test_secret_and_service_go_with_their_pod(tmp_path, admin, namespace) -> None:
    opts = _options(namespace)
    opts = kube.Options(
        **{**opts.__dict__, "pods": kube_objects.PodConfig(**{**opts.pods.__dict__, "service_type": "ClusterIP"})}
    )
    b = kube.KubernetesBackend(opts)
    await b.start()
    try:
        request = _request(tmp_path, 1, secrets={"TOKEN": "x"})
        await b.create(request)
    finally:
        await b.close()
    obj = kube_objects.object_name(request.launch.name)
    await admin.core.delete_namespaced_pod_without_preload_content(obj, namespace, grace_period_seconds=0)
    for _ in range(120):  # bounded: the garbage collector works in the background
        left = []
        for kind in ("secret", "service"):
            resp = await getattr(admin.core, f"read_namespaced_{kind}_without_preload_content")(obj, namespace)
            if resp.status != 404:
                left.append(kind)
            resp.release()
        if not left:
            break
        await asyncio.sleep(0.5)
    assert not left, f"{left} outlived their Pod"


async def test_unschedulable_and_image_pull_errors_fail_the_attempt(tmp_path, namespace) -> None:
    b = kube.KubernetesBackend(_options(namespace, schedule_timeout_s=10.0))
    await b.start()
    try:
        huge = _request(tmp_path, 1, resources={"cpus": "100000"})
        with pytest.raises(backend.LaunchError) as caught:
            await b.create(huge)
        assert "could not be scheduled" in caught.value.message and caught.value.capacity_unavailable
        await b.delete(huge.launch.name, grace_s=0)
        bad = _request(tmp_path, 2, resources={"image_id": "docker:registry.invalid/replicaplane/nope:1"})
        with pytest.raises(backend.LaunchError) as caught:
            await b.create(bad)
        assert "could not be pulled" in caught.value.message
        await b.delete(bad.launch.name, grace_s=0)
    finally:
        await b.close()


async def test_the_documented_role_is_enough(tmp_path, admin, namespace) -> None:
    sa = "replicaplane-provisioner"
    await admin.core.create_namespaced_service_account_without_preload_content(
        namespace, {"metadata": {"name": sa, "namespace": namespace}}
    )
    await admin.rbac.create_namespaced_role_without_preload_content(
        namespace, {"metadata": {"name": sa, "namespace": namespace}, "rules": ROLE_RULES}
    )
    await admin.rbac.create_namespaced_role_binding_without_preload_content(
        namespace,
        {
            "metadata": {"name": sa, "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}],
        },
    )
    resp = await admin.core.create_namespaced_service_account_token_without_preload_content(
        sa, namespace, {"spec": {"expirationSeconds": 3600}}
    )
    token = json.loads(await resp.read())["status"]["token"]
    resp.release()
    cluster: dict[str, Any] = {"server": admin.cfg.host}
    if admin.cfg.ssl_ca_cert:
        cluster["certificate-authority"] = admin.cfg.ssl_ca_cert
    else:
        cluster["insecure-skip-tls-verify"] = True
    path = tmp_path / "sa-kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": {"token": token}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": namespace}}],
                "current-context": "x",
            }
        )
    )
    opts = _options(namespace, kubeconfig=str(path))
    opts = kube.Options(
        **{**opts.__dict__, "pods": kube_objects.PodConfig(**{**opts.pods.__dict__, "service_type": "ClusterIP"})}
    )
    b = kube.KubernetesBackend(opts)
    await b.start()
    try:
        request = _request(tmp_path, 1, setup="true", secrets={"TOKEN": "x"})
        await b.create(request)
        await b.delete(request.launch.name, grace_s=1)
    finally:
        await b.close()

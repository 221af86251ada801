"""Pure parts of the kubernetes backend: names, manifests, settings parsing, Pod status reading."""

from __future__ import annotations

import dataclasses
import re

import pytest

from services.common import errors
from services.provisioner import kube_manifests as km
from services.provisioner import kube_objects as ko
from services.provisioner import kube_status as ks
from services.provisioner import model, server
from services.provisioner import settings as provisioner_settings

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _launch(name: str = "web-1", **spec_fields: object) -> model.LaunchRequest:
    values: dict[str, object] = {"run": "python3 -m http.server 8080", "ports": (8080,), "serving_port": 8080}
    values.update(spec_fields)
    return model.LaunchRequest(name=name, service="web", replica_id=1, version=2, spec=model.ReplicaSpec(**values))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "replica",
    ["web-1", "web-12-0a1b2c3d", "Web_1", "a" * 63 + "-7-deadbeef", "9lives-1", "x" * 70],
)
def test_object_names_are_dns_labels_and_deterministic(replica: str) -> None:
    name = ko.object_name(replica)
    assert len(name) <= 63 and DNS_1035.match(name), name
    assert ko.object_name(replica) == name


def test_short_valid_names_are_kept_and_long_ones_get_distinct_hashes() -> None:
    assert ko.object_name("web-1-0a1b2c3d") == "web-1-0a1b2c3d"
    long_a, long_b = "s" * 60 + "-1-aaaaaaaa", "s" * 60 + "-1-bbbbbbbb"
    assert ko.object_name(long_a) != ko.object_name(long_b)
    assert ko.object_name("Web_1") != "web-1"  # changed names always carry the hash


def test_pod_manifest_carries_labels_env_command_and_ports() -> None:
    pod, _ = km.pod_manifest(_launch(setup="pip install x", envs={"A": "b"}), ko.PodConfig(), token="t", created_at=1.0)
    labels = pod["metadata"]["labels"]
    assert labels[ko.LABEL_SERVICE] == "web" and labels[ko.LABEL_VERSION] == "2" and labels[ko.LABEL_REPLICA_ID] == "1"
    assert labels[ko.MANAGED_BY] == "replicaplane" and labels[ko.LABEL_INSTANCE] == "replicaplane"
    assert pod["metadata"]["annotations"][ko.ANNOTATION_REPLICA] == "web-1"
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "python:3.11-slim"
    assert container["command"][-2:] == ["pip install x", "python3 -m http.server 8080"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PORT"] == "8080" and env["A"] == "b" and env["REPLICA_ID"] == "1"
    assert container["ports"] == [{"containerPort": 8080, "protocol": "TCP", "name": "serve"}]
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 3600


def test_a_pool_workers_pod_opens_no_port_and_runs_the_holder_after_setup() -> None:
    launch = _launch("pool-1", run="", ports=(), serving_port=0, setup="pip install x", worker=True)
    pod, _ = km.pod_manifest(launch, ko.PodConfig(), token="t", created_at=1.0)
    (container,) = pod["spec"]["containers"]
    assert container["command"][-2:] == ["pip install x", ko.HOLDER]
    assert container["ports"] == [] and "startupProbe" in container  # ready once setup is done
    env = {e["name"]: e["value"] for e in container["env"]}
    assert "PORT" not in env and env[ko.JOBS_DIR_ENV] == ko.JOBS_DIR_PATH
    assert pod["metadata"]["annotations"][ko.ANNOTATION_WORKER] == "true"
    assert km.serving_port(launch.spec) == 0
    service, _ = km.pod_manifest(_launch(), ko.PodConfig(), token="t", created_at=1.0)
    assert ko.ANNOTATION_WORKER not in service["metadata"]["annotations"]


def test_no_setup_means_no_startup_probe() -> None:
    pod, _ = km.pod_manifest(_launch(), ko.PodConfig(), token="t", created_at=1.0)
    assert "startupProbe" not in pod["spec"]["containers"][0]


def test_resources_become_requests_limits_and_node_selectors() -> None:
    spec = _launch(resources={"cpus": "2+", "memory": "16", "accelerators": "A100:2", "image_id": "docker:img:1"})
    cfg = ko.PodConfig(spot_node_selector={"spot": "yes"}, spot_tolerations=(ko.Toleration("spot", "", "NoSchedule"),))
    pod, notes = km.pod_manifest(spec, cfg, token="t", created_at=1.0)
    container = pod["spec"]["containers"][0]
    assert container["image"] == "img:1"
    assert container["resources"] == {
        "requests": {"cpu": "2", "memory": "16Gi"},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": "2"},
    }
    assert pod["spec"]["nodeSelector"] == {"replicaplane.dev/accelerator": "a100"}  # not spot
    assert "tolerations" not in pod["spec"]
    assert notes == []

    spot = model.LaunchRequest(**{**_launch().__dict__, "use_spot": True, "zone": "z1"})
    pod, _ = km.pod_manifest(spot, cfg, token="t", created_at=1.0)
    assert pod["spec"]["nodeSelector"] == {"spot": "yes", ko.ZONE_LABEL: "z1"}
    assert pod["spec"]["tolerations"] == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["metadata"]["labels"][ko.LABEL_SPOT] == "true"


def test_requests_kubernetes_cannot_express_are_errors_or_notes() -> None:
    with pytest.raises(ko.ManifestError):
        km.pod_manifest(_launch(resources={"accelerators": "T4:0.5"}), ko.PodConfig(), token="t", created_at=1)
    with pytest.raises(ko.ManifestError):
        km.pod_manifest(_launch(num_nodes=2), ko.PodConfig(), token="t", created_at=1)
    launch = _launch(resources={"memory": "4x", "cloud": "gcp"})
    _, notes = km.pod_manifest(launch, ko.PodConfig(), token="t", created_at=1)
    assert any("memory 4x" in n for n in notes) and any("cloud=gcp" in n for n in notes)


def test_secrets_are_referenced_from_a_secret_never_inlined() -> None:
    launch = _launch(secrets={"TOKEN": "hunter2"})
    pod, _ = km.pod_manifest(launch, ko.PodConfig(), token="t", created_at=1.0)
    assert "hunter2" not in repr(pod)
    ref = next(e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "TOKEN")
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "web-1", "key": "TOKEN"}
    secret = km.secret_manifest(launch, ko.PodConfig(), token="t")
    assert secret["data"] == {"TOKEN": "aHVudGVyMg=="}
    assert secret["metadata"]["annotations"][ko.ANNOTATION_TOKEN] == "t"


def test_service_selects_exactly_its_pod_and_is_owned_by_it() -> None:
    pod = {"metadata": {"name": "web-1", "uid": "u-1", "namespace": "ns"}}
    owner = km.owner_reference(pod)
    assert owner == {"apiVersion": "v1", "kind": "Pod", "name": "web-1", "uid": "u-1"}
    svc = km.service_manifest(_launch(), ko.PodConfig(service_type="ClusterIP", instance="i1"), token="t", owner=owner)
    assert svc["spec"]["selector"] == {ko.MANAGED_BY: "replicaplane", ko.LABEL_INSTANCE: "i1", ko.LABEL_POD: "web-1"}
    assert svc["spec"]["ports"][0]["port"] == 8080
    assert svc["metadata"]["ownerReferences"] == [owner]
    assert km.owner_reference({"metadata": {"name": "web-1"}}) is None  # no uid: nothing to own it by


def test_status_reading() -> None:
    pending = {
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "no gpu"}],
        }
    }
    assert ks.read_status(pending).unschedulable == "no gpu"
    pulling = {
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {"name": "replica", "state": {"waiting": {"reason": "ErrImagePull", "message": "m"}}}
            ],
        }
    }
    assert ks.read_status(pulling).waiting_reason == "ErrImagePull"
    setup = {"status": {"phase": "Running", "containerStatuses": [{"state": {"running": {}}, "started": False}]}}
    assert ks.read_status(setup).running and not ks.read_status(setup).started
    evicted = {"status": {"phase": "Failed", "reason": "Evicted", "message": "low memory"}}
    assert ks.read_status(evicted).disruption == "evicted: low memory"
    target = {
        "status": {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]}
    }
    assert ks.read_status(target).disruption == "PreemptionByScheduler"
    oom = {
        "metadata": {"deletionTimestamp": "x"},
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}],
        },
    }
    status = ks.read_status(oom)
    assert status.deleting and status.finished and status.exit_code == 137
    assert ks.exit_message(status) == "app exited with code 137 (OOMKilled)"
    assert ks.endpoint("fd00::1", 80) == "http://[fd00::1]:80"


def test_kubernetes_settings_are_validated_with_every_field_named() -> None:
    settings = provisioner_settings.Settings(
        backend="kubernetes",
        kubernetes_labels="team=a b",
        kubernetes_annotations="no-equals",
        kubernetes_spot_node_selector="=x",
        kubernetes_spot_tolerations="k=v:Never",
        kubernetes_namespace="UPPER",
        kubernetes_instance="",
        kubernetes_endpoint="service",
        kubernetes_watch_idle_s=0,
        kubernetes_api_attempts=0,
        kubernetes_api_backoff_s=-1,
    )
    with pytest.raises(errors.ValidationError) as caught:
        server.make_backend(settings)
    fields = {v.field for v in caught.value.violations}
    assert fields == {
        f"provisioner.kubernetes_{f}"
        for f in (
            "labels",
            "annotations",
            "spot_node_selector",
            "spot_tolerations",
            "namespace",
            "instance",
            "endpoint",
            "watch_idle_s",
            "api_attempts",
            "api_backoff_s",
        )
    }


def test_parsed_settings_reach_the_pod_config() -> None:
    opts = provisioner_settings.kube_options(
        provisioner_settings.Settings(
            kubernetes_labels="team=ml",
            kubernetes_spot_node_selector="cloud.google.com/gke-spot=true",
            kubernetes_spot_tolerations="cloud.google.com/gke-spot=true:NoSchedule",
        )
    )
    assert opts.pods.labels == {"team": "ml"}
    assert opts.pods.spot_node_selector == {"cloud.google.com/gke-spot": "true"}
    assert opts.pods.spot_tolerations[0].to_dict() == {
        "key": "cloud.google.com/gke-spot",
        "operator": "Equal",
        "value": "true",
        "effect": "NoSchedule",
    }


def test_pod_carries_its_owner_in_an_annotation() -> None:
    launch = dataclasses.replace(_launch(), owner="ctl-a")
    pod, _ = km.pod_manifest(launch, ko.PodConfig(), token="t", created_at=1.0)
    assert pod["metadata"]["annotations"][ko.ANNOTATION_OWNER] == "ctl-a"


def test_log_times_are_read_to_the_nanosecond_whatever_their_precision() -> None:
    assert ks.log_time_ns("2026-01-02T03:04:05.000000007Z") == 1767323045_000000007
    assert ks.log_time_ns("2026-01-02T03:04:05.1Z") == 1767323045_100000000
    assert ks.log_time_ns("2026-01-02T03:04:05Z") == 1767323045_000000000
    assert ks.log_time_ns("not a time") is None


def test_log_position_copies_each_line_once_across_reads_even_lines_sharing_a_time() -> None:
    t1, t2 = "2026-01-02T03:04:05.1Z", "2026-01-02T03:04:05.2Z"
    lines = [f"{t1} a\n".encode(), f"{t2} b\n".encode(), f"{t2} c\n".encode()]
    position = ks.LogPosition(token="x")
    assert [position.take(line) for line in lines[:2]] == [b"a\n", b"b\n"]
    # The stream was cut after b; the next read starts earlier and sees a, b again, then c.
    position.restart()
    assert [position.take(line) for line in lines] == [None, None, b"c\n"]
    # Kept across a provisioner restart.
    again = ks.LogPosition.from_dict(position.to_dict())
    again.restart()
    assert [again.take(line) for line in [*lines, f"{t2} d\n".encode()]] == [None, None, None, b"d\n"]
    assert again.take(b"unstamped\n") == b"unstamped\n"  # never dropped

"""Resources alternatives: which there are, the order they are tried in, what their failures add up
to, and how one becomes a Pod (the kubernetes backend's mapping)."""

from __future__ import annotations

import pytest

from replicaplane.provisioner.v1 import provisioner_service_pb2 as pb
from services.common import errors, spec
from services.provisioner import alternatives as alt
from services.provisioner import convert, model
from services.provisioner import kube_manifests as km
from services.provisioner import kube_objects as ko
from services.provisioner import settings as provisioner_settings

USER = model.FailureCause.USER
INFRA = model.FailureCause.INFRASTRUCTURE


def _spec(resources: str) -> model.ReplicaSpec:
    text = f"service:\n  readiness_probe: /\nresources:\n  ports: 8080\n{resources}run: serve\n"
    return convert.replica_spec(spec.parse(text, name="web"))


def _launch(replica: model.ReplicaSpec, **fields: object) -> model.LaunchRequest:
    return model.LaunchRequest(name="web-1", service="web", replica_id=1, version=1, spec=replica, **fields)  # type: ignore[arg-type]


def test_entries_reach_the_provisioner_whole_and_survive_its_records() -> None:
    replica = _spec("  cpus: 4+\n  any_of:\n    - accelerators: A100\n    - accelerators: H100:2\n      cpus: 8\n")
    assert replica.alternatives_kind == "any_of"
    # Each entry carries the top-level fields it did not set (the spec merged them).
    assert replica.alternatives == ({"cpus": "4+", "accelerators": "A100:1"}, {"cpus": "8", "accelerators": "H100:2"})
    assert replica.resources["any_of"] == "2"  # the local backend's launch log names them
    assert model.ReplicaSpec.from_dict(replica.to_dict()) == replica
    # Records written before alternatives existed still load.
    old = {k: v for k, v in replica.to_dict().items() if k not in ("alternatives", "alternatives_kind")}
    assert model.ReplicaSpec.from_dict(old).alternatives == ()
    request = pb.LaunchRequest(name="web-1", service="web", replica_id=1, version=1)
    request.spec.CopyFrom(spec.parse("service:\n  readiness_probe: /\nresources:\n  ports: 8080\nrun: x\n", name="web"))
    assert convert.launch_request(request).spec.alternatives == ()


def test_every_entry_and_every_accelerator_choice_is_an_alternative_in_written_order() -> None:
    replica = _spec("  ordered:\n    - accelerators: [L4, T4]\n    - cpus: 2\n      memory: 8\n")
    listed = alt.of_spec(replica)
    assert [(a.path, a.accelerator) for a in listed] == [
        ("resources.ordered[0]", "L4:1"),
        ("resources.ordered[0]", "T4:1"),
        ("resources.ordered[1]", ""),
    ]
    assert [a.label for a in listed] == [
        "resources.ordered[0] (accelerators L4:1)",
        "resources.ordered[0] (accelerators T4:1)",
        "resources.ordered[1] (cpus 2, memory 8)",
    ]
    top = alt.of_spec(_spec("  accelerators: {A100: 1}\n"))
    assert [(a.path, a.accelerator) for a in top] == [("resources", "A100:1")]
    assert [a.label for a in alt.of_spec(_spec(""))] == ["resources"]


def test_any_of_tries_what_recently_found_no_capacity_last_and_ordered_never_reorders() -> None:
    any_of = _spec("  any_of:\n    - accelerators: A100\n    - accelerators: H100\n    - accelerators: L4\n")
    assert alt.order(any_of, set()) == [0, 1, 2]
    assert alt.order(any_of, {0}) == [1, 2, 0]
    assert alt.order(any_of, {0, 1}) == [2, 0, 1]
    assert alt.order(any_of, {0, 1, 2}) == [0, 1, 2]
    ordered = _spec("  ordered:\n    - accelerators: A100\n    - accelerators: H100\n")
    assert alt.order(ordered, {0}) == [0, 1]
    listed = _spec("  accelerators: [A100, H100]\n")  # a list is an order of preference
    assert alt.order(listed, {0}) == [0, 1]


def _failure(label: str, cause: model.FailureCause, *, permanent: bool = False, capacity: bool = False) -> alt.Failure:
    return alt.Failure(alt.Alternative(label, {}), f"{label} failed.", cause, permanent, capacity)


@pytest.mark.parametrize(
    ("failures", "cause", "permanent", "capacity"),
    [
        # Every alternative found no capacity: the infrastructure's, capacity may come.
        ([_failure("a", INFRA, capacity=True), _failure("b", INFRA, capacity=True)], INFRA, False, True),
        # Every alternative refused for what it asks (a LimitRange, an invalid quantity): the user's.
        ([_failure("a", USER, permanent=True), _failure("b", USER, permanent=True)], USER, True, False),
        # One refused, one without capacity: capacity may come and the second would run.
        ([_failure("a", USER, permanent=True), _failure("b", INFRA, capacity=True)], INFRA, False, True),
        # A zone mismatch (neither capacity nor the user's) beside a refusal.
        ([_failure("a", INFRA), _failure("b", USER, permanent=True)], INFRA, False, False),
    ],
)
def test_an_attempt_where_every_alternative_failed_is_the_users_only_if_each_was(
    failures: list[alt.Failure], cause: model.FailureCause, permanent: bool, capacity: bool
) -> None:
    error = alt.combined(failures)
    assert (error.cause, error.permanent, error.capacity_unavailable) == (cause, permanent, capacity)
    assert error.message == "no resources alternative could be placed: a: a failed; b: b failed"


def test_an_alternative_becomes_pod_resources_a_node_selector_and_annotations() -> None:
    replica = _spec(
        "  image_id: docker:base:1\n  any_of:\n    - accelerators: A100:2\n      cpus: 4\n"
        "    - cpus: 2+\n      memory: 8\n      image_id: docker:cpu:1\n      zone: zone-b\n"
    )
    gpu, cpu = alt.of_spec(replica)
    cfg = ko.PodConfig(
        accelerator_label="cloud.google.com/gke-accelerator", accelerator_label_values={"a100": "nvidia-tesla-a100"}
    )
    pod, _ = km.pod_manifest(_launch(replica), cfg, token="t", created_at=1.0, alternative=gpu)
    container = pod["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "4"}, "limits": {"cpu": "4", "nvidia.com/gpu": "2"}}
    assert pod["spec"]["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"}
    assert container["image"] == "base:1"
    annotations = pod["metadata"]["annotations"]
    assert (annotations[ko.ANNOTATION_RESOURCES], annotations[ko.ANNOTATION_ACCELERATOR]) == (
        "resources.any_of[0]",
        "A100:2",
    )

    pod, _ = km.pod_manifest(_launch(replica), cfg, token="t", created_at=1.0, alternative=cpu)
    container = pod["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}
    assert container["image"] == "cpu:1"  # each alternative's own image
    assert pod["spec"]["nodeSelector"] == {ko.ZONE_LABEL: "zone-b"}  # its own zone, unless the launch has one
    assert pod["metadata"]["annotations"][ko.ANNOTATION_ZONE] == "zone-b"
    pod, _ = km.pod_manifest(_launch(replica, zone="zone-a"), cfg, token="t", created_at=1.0, alternative=gpu)
    assert pod["spec"]["nodeSelector"][ko.ZONE_LABEL] == "zone-a"
    # Without an alternative, the first one of the spec.
    pod, _ = km.pod_manifest(_launch(replica), cfg, token="t", created_at=1.0)
    assert pod["metadata"]["annotations"][ko.ANNOTATION_RESOURCES] == "resources.any_of[0]"


def test_the_placement_key_tells_apart_what_the_scheduler_would_place_differently() -> None:
    replica = _spec(
        "  any_of:\n    - accelerators: A100\n    - accelerators: A100\n      image_id: docker:x\n"
        "    - accelerators: H100\n"
    )
    cfg = ko.PodConfig()
    a, same, other = (km.placement(_launch(replica), a, cfg).key for a in alt.of_spec(replica))
    assert a == same  # another image schedules alike
    assert a != other
    spot = km.placement(
        _launch(replica, use_spot=True), alt.of_spec(replica)[0], ko.PodConfig(spot_node_selector={"s": "1"})
    )
    assert spot.key != a


def test_accelerator_settings_are_checked_and_reach_the_pod_config() -> None:
    opts = provisioner_settings.kube_options(
        provisioner_settings.Settings(kubernetes_accelerator_label_values="A100=nvidia-tesla-a100")
    )
    assert opts.pods.accelerator_label_values == {"a100": "nvidia-tesla-a100"}
    assert (opts.alternative_timeout_s, opts.alternative_retry_s) == (45.0, 300.0)
    bad = provisioner_settings.Settings(
        kubernetes_accelerator_label="not a label",
        kubernetes_accelerator_label_values="A100=not a value",
        kubernetes_gpu_resource="gpu",
        kubernetes_alternative_timeout_s=-1,
        kubernetes_alternative_retry_s=-1,
    )
    with pytest.raises(errors.ValidationError) as caught:
        provisioner_settings.kube_options(bad)
    assert {v.field for v in caught.value.violations} == {
        f"provisioner.kubernetes_{f}"
        for f in (
            "accelerator_label",
            "accelerator_label_values",
            "gpu_resource",
            "alternative_timeout_s",
            "alternative_retry_s",
        )
    }
    # An empty label means no node selector for accelerators at all.
    assert (
        provisioner_settings.kube_options(
            provisioner_settings.Settings(kubernetes_accelerator_label="")
        ).pods.accelerator_label
        == ""
    )
    assert not ko.is_resource_name("kubernetes.io/gpu")
    assert ko.is_resource_name("amd.com/gpu") and ko.is_resource_name("google.com/tpu")

"""Which specs a backend can run: offered accelerators, alternatives, local paths."""

from __future__ import annotations

import pytest

from replicaplane.common.v1 import spec_pb2
from services.provisioner import capability, convert

OFFERED = capability.parse_offered("H100:2, l4")


def _fields(spec: spec_pb2.ServiceSpec, offered: dict[str, float] | None = OFFERED) -> list[str]:
    return [v.field for v in capability.accelerator_problems(convert.needs(spec), offered)]


def test_the_setting_reads_names_and_counts_case_insensitively() -> None:
    assert OFFERED == {"h100": 2.0, "l4": 1.0}
    assert capability.parse_offered("") == {}
    with pytest.raises(ValueError, match="NAME:COUNT"):
        capability.parse_offered("H100:two")


@pytest.mark.parametrize(
    ("accelerators", "fields"),
    [
        ("", []),
        ("H100:1", []),
        ("h100:2", []),
        ("H100:4", ["resources.accelerators"]),
        ("A100:1", ["resources.accelerators"]),
        ("A100:1,L4:1", []),  # the set form: any one of them will do
    ],
)
def test_top_level_accelerators(accelerators: str, fields: list[str]) -> None:
    spec = spec_pb2.ServiceSpec(resources=spec_pb2.Resources(accelerators=accelerators))
    assert _fields(spec) == fields


def test_any_of_runs_when_one_entry_is_offered_and_names_every_entry_when_none_is() -> None:
    spec = spec_pb2.ServiceSpec(
        resources=spec_pb2.Resources(
            any_of=[spec_pb2.Resources(accelerators="A100:1"), spec_pb2.Resources(accelerators="L4:1")]
        )
    )
    assert _fields(spec) == []
    del spec.resources.any_of[1]
    spec.resources.any_of.add(accelerators="V100:1")
    assert _fields(spec) == ["resources.any_of[0].accelerators", "resources.any_of[1].accelerators"]
    # An entry asking for no accelerator at all can always run.
    spec.resources.any_of.add(cpus="2")
    assert _fields(spec) == []


def test_no_limit_and_no_offer() -> None:
    spec = spec_pb2.ServiceSpec(resources=spec_pb2.Resources(accelerators="A100:1"))
    assert _fields(spec, None) == []
    assert _fields(spec, {}) == ["resources.accelerators"]
    problem = capability.accelerator_problems(convert.needs(spec), {})[0]
    assert "offers: none" in problem.description


def test_missing_workdir_and_file_mount_sources(tmp_path) -> None:
    present = tmp_path / "data.txt"
    present.write_text("x")
    spec = spec_pb2.ServiceSpec(
        workdir=str(tmp_path / "gone"),
        file_mounts={"/a": str(present), "/b": str(tmp_path / "nope"), "/c": "s3://bucket/x", "/d": '{"name": "b"}'},
    )
    assert [v.field for v in capability.path_problems(convert.needs(spec))] == ["workdir", "file_mounts./b"]
    spec.workdir = str(tmp_path)
    assert [v.field for v in capability.path_problems(convert.needs(spec))] == ["file_mounts./b"]


def test_a_refusal_says_how_to_run_the_first_choice_here() -> None:
    spec = spec_pb2.ServiceSpec(resources=spec_pb2.Resources(accelerators="l4:8,A100:4"))
    problem = capability.accelerator_problems(convert.needs(spec), {}, hint=lambda wanted: f"try {wanted}")[0]
    assert problem.description == "this provisioner's backend does not offer l4:8,A100:4 (it offers: none); try L4:8"

"""Env and secret overrides (`--env`, `--secret`) put into a task YAML before it is validated."""

from __future__ import annotations

import pytest
import yaml

from services.common import errors, overrides, spec

BASE = (
    "name: web\n"
    "service:\n"
    "  readiness_probe: /\n"
    "  replicas: 1\n"
    "resources:\n"
    "  ports: 8080\n"
    "run: python3 -m http.server 8080\n"
)


def test_empty_values_in_the_yaml_are_filled() -> None:
    text = BASE + "envs:\n  MODEL:\n  KEEP: as-is\nsecrets:\n  HF_TOKEN:\n"
    with pytest.raises(errors.ValidationError) as refused:
        spec.parse(text)
    assert {v.field for v in refused.value.violations} == {"envs.MODEL", "secrets.HF_TOKEN"}

    filled = overrides.apply(text, envs={"MODEL": "llama"}, secrets={"HF_TOKEN": "hf_abc"})
    parsed = spec.parse(filled)
    assert dict(parsed.envs) == {"MODEL": "llama", "KEEP": "as-is"}
    assert dict(parsed.secrets) == {"HF_TOKEN": "hf_abc"}


def test_values_given_replace_the_yaml_and_new_keys_are_added() -> None:
    text = BASE + "envs:\n  MODEL: small\n"
    parsed = spec.parse(overrides.apply(text, envs={"MODEL": "big", "EXTRA": "1"}, secrets={"NEW": "s"}))
    assert dict(parsed.envs) == {"MODEL": "big", "EXTRA": "1"}
    assert dict(parsed.secrets) == {"NEW": "s"}


def test_an_empty_section_is_filled() -> None:
    parsed = spec.parse(overrides.apply(BASE + "envs:\nsecrets: {}\n", envs={"A": "1"}, secrets={"B": "2"}))
    assert (dict(parsed.envs), dict(parsed.secrets)) == ({"A": "1"}, {"B": "2"})


def test_without_overrides_the_text_is_unchanged() -> None:
    text = "# a comment\n" + BASE + "envs:\n  A: 'quoted'\n"
    assert overrides.apply(text, envs={}, secrets={}) is text


@pytest.mark.parametrize(
    "value",
    ["", "with space", "line\nbreak", "quote ' and \" both", "colon: hash # x", "${OTHER}", "12", "true", "ünï"],
)
def test_any_value_arrives_exactly_as_given(value: str) -> None:
    parsed = spec.parse(overrides.apply(BASE, envs={"A": value}, secrets={"S": value}))
    assert parsed.envs["A"] == value
    assert parsed.secrets["S"] == value


def test_a_bad_key_names_the_field_and_never_the_value() -> None:
    with pytest.raises(errors.ValidationError) as refused:
        overrides.apply(BASE, envs={"1BAD": "x"}, secrets={"bad-key": "s3cr3t-value"})
    fields = {v.field: v.description for v in refused.value.violations}
    assert set(fields) == {"env_overrides.1BAD", "secret_overrides.bad-key"}
    assert "s3cr3t-value" not in str(refused.value) + "".join(fields.values())


def test_the_rest_of_the_document_is_kept_with_its_checks() -> None:
    anchored = BASE.replace("run: python3", "setup: &cmd echo hi\nrun: python3") + "envs:\n  A: *cmd\n"
    parsed = spec.parse(overrides.apply(anchored, envs={"B": "2"}, secrets={}))
    assert dict(parsed.envs) == {"A": "echo hi", "B": "2"}
    assert parsed.setup == "echo hi"
    # A duplicate key is still refused by the parser, with or without overrides.
    duplicated = BASE + "envs:\n  A: 1\nenvs:\n  B: 2\n"
    with pytest.raises(errors.ValidationError) as refused:
        spec.parse(overrides.apply(duplicated, envs={"C": "3"}, secrets={}))
    assert [v.field for v in refused.value.violations] == ["yaml"]


@pytest.mark.parametrize("text", ["service: [\n", "- a list\n", "a: 1\n---\nb: 2\n", BASE + "envs: [A]\n"])
def test_a_document_that_cannot_take_them_is_left_for_the_parser_to_refuse(text: str) -> None:
    assert overrides.apply(text, envs={"A": "1"}, secrets={}) == text
    with pytest.raises(errors.ValidationError):
        spec.parse(overrides.apply(text, envs={"A": "1"}, secrets={}))


def test_the_result_is_one_yaml_document() -> None:
    out = overrides.apply(BASE, envs={"A": "1"}, secrets={"S": "x"})
    doc = yaml.safe_load(out)
    assert doc["envs"] == {"A": "1"} and doc["secrets"] == {"S": "x"} and doc["name"] == "web"
